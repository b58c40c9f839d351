"""Activation recording (``--record-activations``), the paper's Figure 1 data.

The recorded percentiles are checked against numpy percentiles (the
``ceil(p/100 * N)``-th smallest value) of the layer's input and output,
computed independently with flax's ``capture_intermediates``.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from train.data import input_pipeline
from train.loop import train_state
from train.loop import train_steps
from train.loop import trainer as train
from train.model import activations
from train.report import cli as report

from tests.helpers.training import TINY
from tests.helpers.training import exact
from tests.helpers.training import run_quiet
from tests.helpers.training import small_dataset


def _lower_percentile(values: np.ndarray, p: float) -> float:
  ordered = np.sort(values.reshape(-1))
  k = max(1, math.ceil(round(p / 100 * ordered.size, 9)))
  return float(ordered[k - 1])


@pytest.mark.parametrize("norm", ["bn", "sqd1"])
@pytest.mark.slow
def test_recorded_percentiles_equal_numpy(tmp_path, norm):
  ds = small_dataset()
  config = train.resolve(TINY.replace(norm=norm, epochs=2))
  record = activations.ActivationRecording(every=2, layer="norm2", feature=3)
  history = run_quiet(config, tmp_path / "run", dataset=ds, record=record)
  rows = [
      json.loads(line)
      for line in (
          (tmp_path / "run" / activations.ACTIVATIONS_FILE)
          .read_text()
          .splitlines()
      )
  ]
  steps = len(ds.train_images) // config.batch_size
  assert [r["step"] for r in rows] == list(range(0, 2 * steps, 2))
  assert [r["epoch"] for r in rows] == [
      s // steps + 1 for s in range(0, 2 * steps, 2)
  ]

  # Step 0 sees the initial state and the first batch of epoch 1.
  model = train_state.create_model(config, ds.num_classes)
  state = train_state.create_train_state(
      train_steps.init_key(config.seed),
      model,
      ds.train_images.shape[1:],
      train_state.create_optimizer(config),
  )
  images, _ = train_steps.prepare_epoch(
      jax.numpy.asarray(ds.train_images),
      jax.numpy.asarray(ds.train_labels),
      train_steps.epoch_key(config.seed, 1),
      steps=steps,
      batch_size=config.batch_size,
      augment=False,
  )
  x = input_pipeline.normalize_images(images[0], config.dataset)
  _, variables = model.apply(
      {"params": state.params, "batch_stats": state.batch_stats},
      x,
      train=True,
      mutable=["batch_stats", "intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name in ("conv2", "norm2"),
  )
  inter = variables["intermediates"]
  before = np.asarray(inter["conv2"]["__call__"][0])[..., 3]
  after = np.asarray(inter["norm2"]["__call__"][0])[..., 3]
  for key, values in (("before", before), ("after", after)):
    expected = [_lower_percentile(values, p) for p in record.percentiles]
    np.testing.assert_allclose(rows[0][key], expected, rtol=1e-5, atol=1e-6)
  assert rows[0]["after"] != rows[0]["before"]

  # Recording does not change training.
  plain = run_quiet(config, tmp_path / "plain", dataset=ds)
  assert exact(plain) == exact(history)


def test_resume_keeps_rows_of_saved_epochs_only(tmp_path):
  ds = small_dataset()
  config = train.resolve(TINY.replace(epochs=2))
  record = activations.ActivationRecording(every=1)
  run_quiet(config, tmp_path / "run", dataset=ds, record=record)
  path = tmp_path / "run" / activations.ACTIVATIONS_FILE
  full = path.read_text()
  # Rows of an epoch whose checkpoint was lost to a kill are dropped on resume.
  stale = json.loads(full.splitlines()[-1])
  stale["epoch"] = 3
  path.write_text(full + json.dumps(stale) + "\n")
  run_quiet(
      config.replace(epochs=3), tmp_path / "run", dataset=ds, record=record
  )
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  steps = len(ds.train_images) // config.batch_size
  assert [r["step"] for r in rows] == list(range(3 * steps))


def test_unknown_layer_is_a_clear_error(tmp_path):
  with pytest.raises(
      ValueError, match="not a layer of the model; norm " "layers: norm1, norm2"
  ):
    run_quiet(
        train.resolve(TINY),
        tmp_path / "run",
        dataset=small_dataset(),
        record=activations.ActivationRecording(every=1, layer="norm7"),
    )


def test_report_draws_activations(tmp_path):
  ds = small_dataset()
  for norm in ("sqd1", "bn"):
    run_quiet(
        train.resolve(TINY.replace(norm=norm, epochs=1)),
        tmp_path / "runs" / norm,
        dataset=ds,
        record=activations.ActivationRecording(every=1),
    )
  report.write_report([tmp_path / "runs"], tmp_path / "out")
  text = (tmp_path / "out" / "report.md").read_text()
  assert "## Activations" in text and "bn seed 0, sqd1 seed 0" in text
  png = (tmp_path / "out" / "activations_01.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10000
