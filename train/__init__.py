"""gbn-jax training suite: datasets, input pipeline, models, training loop."""
