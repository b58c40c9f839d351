"""``python -m train.gain``: the gain sigma/D each norm layer meets.

The norm layers' inputs are taken independently with flax's
``capture_intermediates`` (the outputs of the convolutions that feed them),
and the gains recomputed with numpy from the measures' definitions.
"""

from __future__ import annotations

import json
import math

import flax
import jax
import numpy as np
import pytest

from train import gain
from train.data import input_pipeline
from train.loop import capture
from train.loop import checkpointing
from train.loop import train_state
from train.loop import train_steps
from train.loop import trainer as train

from tests.helpers.training import TINY
from tests.helpers.training import run_quiet
from tests.helpers.training import write_tiny_mnist


def _training_intermediates(model, variables, x) -> dict:
  """Every layer's outputs in a training-mode pass, as flax's
  ``capture_intermediates`` records them."""
  _, state = model.apply(
      variables,
      x,
      train=True,
      mutable=["batch_stats", "intermediates"],
      capture_intermediates=True,
  )
  return state["intermediates"]


def _conv_outputs(config, variables, data_dir):
  """norm{i}'s input is conv{i}'s output in LeNet, in training mode."""
  config = train.resolve(config)
  ds = input_pipeline.load_dataset(config.dataset, data_dir=data_dir)
  x = input_pipeline.normalize_images(
      ds.train_images[: config.batch_size], config.dataset
  )
  model = train_state.create_model(config, ds.num_classes)
  inter = _training_intermediates(model, variables, x)
  return {
      f"norm{i}": np.asarray(inter[f"conv{i}"]["__call__"][0], np.float64)
      for i in (1, 2)
  }


def _median_gain(x: np.ndarray, deviation) -> float:
  flat = x.reshape(-1, x.shape[-1])
  sigma = flat.std(axis=0)
  return float(np.median(sigma / deviation(flat)))


def _mad(flat):
  return np.mean(np.abs(flat - flat.mean(axis=0)), axis=0)


def _rsd(flat):
  return np.mean(np.maximum(flat - flat.mean(axis=0), 0), axis=0)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  folder = tmp_path_factory.mktemp("gain")
  data_dir = write_tiny_mnist(folder / "data")
  config = TINY.replace(dataset="mnist", norm="mad", epochs=1)
  run_quiet(config, folder / "run", data_dir=str(data_dir))
  return config, folder / "run", str(data_dir)


def test_gains_equal_numpy_at_init_and_after_training(trained_run):
  config, workdir, data_dir = trained_run
  result = gain.run_gains(workdir, data_dir=data_dir)
  assert result["norm"] == "mad" and result["images"] == config.batch_size

  model = train_state.create_model(train.resolve(config), 10)
  state = train_state.create_train_state(
      train_steps.init_key(config.seed),
      model,
      (28, 28, 1),
      train_state.create_optimizer(config),
  )
  state = jax.tree.map(np.asarray, state)
  init_inputs = _conv_outputs(
      config,
      {"params": state.params, "batch_stats": state.batch_stats},
      data_dir,
  )
  checkpointer = checkpointing.Checkpointer(workdir)
  restored, _ = checkpointer.restore(1, train_state.state_dict(state))
  checkpointer.close()
  final_state = flax.serialization.from_state_dict(state, restored)
  final_inputs = _conv_outputs(
      config,
      {"params": final_state.params, "batch_stats": final_state.batch_stats},
      data_dir,
  )
  # Training moved the parameters, so the two stages are different checks.
  assert not np.allclose(init_inputs["norm2"], final_inputs["norm2"])

  assert result["final"]["epoch"] == 1
  for stage, inputs in (("init", init_inputs), ("final", final_inputs)):
    layers = result[stage]["layers"]
    assert list(layers) == ["norm1", "norm2"]
    for name, x in inputs.items():
      np.testing.assert_allclose(
          layers[name]["median"], _median_gain(x, _mad), rtol=1e-4
      )
      assert (
          layers[name]["q25"] <= layers[name]["median"] <= layers[name]["q75"]
      )
      assert layers[name]["n"] == x.size // x.shape[-1]
      # mad's Gaussian gain: sigma / E|Z| = sqrt(pi / 2).
      np.testing.assert_allclose(
          layers[name]["gaussian"], math.sqrt(math.pi / 2), rtol=1e-6
      )
    raw = result[stage]["measures"]
    np.testing.assert_allclose(raw["sd"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        raw["rsd"],
        np.median([_median_gain(x, _rsd) for x in inputs.values()]),
        rtol=1e-4,
    )
    np.testing.assert_allclose(
        result[stage]["overall"],
        np.median([layers[n]["median"] for n in layers]),
        rtol=1e-12,
    )


def test_calibrated_gain_is_raw_gain_times_constant(tmp_path, trained_run):
  config, workdir, data_dir = trained_run
  calibrated = tmp_path / "calibrated"
  checkpointing.write_config(
      calibrated, train.resolve(config.replace(calibration="normal"))
  )
  result = gain.run_gains(calibrated, data_dir=data_dir)
  raw = gain.run_gains(workdir, data_dir=data_dir)["init"]["layers"]
  for name, entry in result["init"]["layers"].items():
    # D / sqrt(2/pi) divides the gain by sqrt(pi/2), Gaussian or not.
    np.testing.assert_allclose(
        entry["median"] * math.sqrt(math.pi / 2), raw[name]["median"], rtol=1e-5
    )
    assert entry["gaussian"] == 1.0


def test_without_checkpoint_only_init_and_cli_writes_file(
    tmp_path, capsys, trained_run
):
  config, _, data_dir = trained_run
  fresh = tmp_path / "fresh"
  checkpointing.write_config(fresh, train.resolve(config.replace(norm="bn")))
  assert gain.main([str(fresh), "--data-dir", data_dir, "--images", "8"]) == 0
  written = json.loads((fresh / gain.GAIN_FILE).read_text())
  assert written["final"] is None and "no checkpoint" in written["note"]
  assert not (fresh / "checkpoints").exists()  # nothing created there
  assert written["images"] == 8
  # flax's BatchNorm divides by sigma itself: gain 1.
  for entry in written["init"]["layers"].values():
    np.testing.assert_allclose(entry["median"], 1.0, rtol=1e-4)
  assert "gain 1.000 at init (no checkpoint)" in capsys.readouterr().out


def test_bad_images_count_is_an_error(tmp_path, trained_run):
  _, workdir, data_dir = trained_run
  with pytest.raises(ValueError, match="--images"):
    gain.run_gains(workdir, data_dir=data_dir, images=0)
  with pytest.raises(ValueError, match="more than the"):
    gain.run_gains(workdir, data_dir=data_dir, images=10**6)


def test_training_records_each_norm_layers_n_and_gaussian_gain(
    tmp_path, capsys, trained_run
):
  config, workdir, data_dir = trained_run
  record = json.loads((workdir / capture.NORM_LAYERS_FILE).read_text())
  inputs = _conv_outputs(
      config,
      train_state.create_model(train.resolve(config), 10).init(
          jax.random.key(0), np.zeros((1, 28, 28, 1), np.float32), train=True
      ),
      data_dir,
  )
  assert list(record["layers"]) == ["norm1", "norm2"]
  for name, x in inputs.items():  # n: batch x spatial positions
    assert record["layers"][name]["n"] == x.size // x.shape[-1]
    np.testing.assert_allclose(  # mad: sigma / E|Z| = sqrt(pi / 2)
        record["layers"][name]["gaussian"], math.sqrt(math.pi / 2), rtol=1e-6
    )
  assert (record["norm"], record["batch_size"]) == ("mad", config.batch_size)
  # Runs trained before training recorded it get the same file, without data.
  old = tmp_path / "old"
  checkpointing.write_config(old, train.resolve(config))
  assert gain.main(["--norm-layers", str(old)]) == 0
  assert json.loads((old / capture.NORM_LAYERS_FILE).read_text()) == record
  assert str(old / capture.NORM_LAYERS_FILE) in capsys.readouterr().out


def test_capture_calls_sees_inputs_and_outputs_in_call_order(trained_run):
  config, _, data_dir = trained_run
  model = train_state.create_model(train.resolve(config), 10)
  x = np.random.default_rng(0).normal(size=(4, 28, 28, 1)).astype(np.float32)
  variables = model.init(jax.random.key(1), x, train=True)
  inter = _training_intermediates(model, variables, x)
  with capture.capture_calls() as calls:
    model.apply(variables, x, train=True, mutable=["batch_stats"])
  assert list(calls) == ["norm1", "norm2"]
  for i in (1, 2):
    call = calls[f"norm{i}"]
    np.testing.assert_array_equal(call.input, inter[f"conv{i}"]["__call__"][0])
    np.testing.assert_array_equal(call.output, inter[f"norm{i}"]["__call__"][0])
  with capture.capture_calls(lambda m: m.name == "conv2") as calls:
    model.apply(variables, x, train=True, mutable=["batch_stats"])
  assert list(calls) == ["conv2"]
