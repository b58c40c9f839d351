"""The datasets: their facts (`info`), file formats (`formats`), where copies
are found (`locate`), tensorflow-datasets (`tfds`), the download (`download`),
the loader (`datasets`), a run's training subset (`subset`) and the input
pipeline (`input_pipeline`)."""
