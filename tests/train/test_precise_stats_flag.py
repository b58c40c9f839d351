"""The training suite's --precise-stats: the loop's precise evaluation, the CLI.

The reference is numpy: every norm layer's input captured
(``flax.linen.intercept_methods``) and its statistics computed from the
definitions. ``gbn_jax.precise_batch_stats`` itself is tested in
tests/gbn_jax/test_precise.py.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import configs
from train import main as train_main
from train.data import input_pipeline
from train.loop import checkpointing
from train.loop import sharding
from train.loop import train_state
from train.loop import train_steps
from train.loop import trainer as train

from tests.helpers.precise_programs import compile_precise_run
from tests.helpers.precise_programs import precise_evaluation
from tests.helpers.training import TINY
from tests.helpers.training import small_dataset
from tests.helpers.training import write_tiny_mnist


def test_train_loop_precise_evaluation_equals_numpy_statistics():
  """Program.precise after one epoch vs statistics computed in numpy."""
  ds = small_dataset()
  config = train.resolve(TINY)  # norm 'mad'
  run = compile_precise_run(config, ds, sharding.make_mesh())
  program, images, test_data = run.program, run.images, run.test_data
  for step in range(program.steps):
    run.step(step)
  state = run.state
  ema = jax.tree.map(np.array, state.batch_stats)
  got = precise_evaluation(run)
  jax.tree.map(np.testing.assert_array_equal, state.batch_stats, ema)

  model = train_state.create_model(config, ds.num_classes)
  variables = {"params": state.params, "batch_stats": state.batch_stats}
  sums = {}
  for batch in np.asarray(images)[:2]:
    x = input_pipeline.normalize_images(jnp.asarray(batch), config.dataset)
    captured = {}

    def capture(next_fun, args, kwargs, context):
      if isinstance(context.module, nn.BatchNorm):
        captured[context.module.name] = np.asarray(args[0], np.float64)
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(capture):
      model.apply(variables, x, train=True, mutable=["batch_stats"])
    for name, v in captured.items():
      mean = v.mean((0, 1, 2))
      mad = np.abs(v - mean).mean((0, 1, 2))
      total = sums.setdefault(name, {"mean": 0.0, "var": 0.0})
      total["mean"] = total["mean"] + mean / 2
      total["var"] = total["var"] + mad**2 / 2
  stats = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), sums)
  want = jax.device_get(
      jax.jit(
          lambda s: train_steps.eval_model(
              s,
              test_data.images,
              test_data.labels,
              test_data.mask,
              dataset=config.dataset,
          )
      )(state.replace(batch_stats=stats))
  )
  np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-4)
  assert abs(int(got["errors"]) - int(want["errors"])) <= 1  # argmax near-ties
  assert int(got["count"]) == 37
  # The EMA statistics give a different evaluation.
  ema_eval = jax.device_get(
      program.evaluate(
          state, test_data.images, test_data.labels, test_data.mask
      )
  )
  assert float(ema_eval["loss_sum"]) != pytest.approx(
      float(got["loss_sum"]), rel=1e-3
  )


@pytest.mark.slow
def test_cli_flag_end_to_end(tmp_path, capsys):
  data = write_tiny_mnist(tmp_path / "data")
  # Alike tests/train/sweep/test_sweep_report.py::_sweep_args: the same tiny-MNIST flags,
  # here for train.mnist (with --epochs, --norm), there for train.sweep.
  common = [
      "--data-dir",
      str(data),
      "--batch-size",
      "16",
      "--lr",
      "0.05",
      "--epochs",
      "2",
      "--norm",
      "mad",
      "--no-progress",
  ]
  run = lambda *flags: train_main.run(
      [*common, *flags], configs.MNIST, prog="train.mnist"
  )
  assert run("--workdir", str(tmp_path / "plain")) == 0
  assert (
      run("--workdir", str(tmp_path / "precise"), "--precise-stats", "3") == 0
  )
  out = capsys.readouterr()
  assert "precise stats" in out.err
  plain = checkpointing.read_metrics(tmp_path / "plain")
  precise = checkpointing.read_metrics(tmp_path / "precise")
  assert [r["epoch"] for r in precise] == [1, 2]
  for a, b in zip(plain, precise, strict=True):
    assert "test_error_precise" not in a
    for key in (
        "train_loss",
        "train_error",
        "test_loss",
        "test_error",
        "best_test_error",
    ):
      assert a[key] == b[key], key
    assert 0 <= b["test_error_precise"] <= 1 and b["test_loss_precise"] > 0
    assert b["precise_seconds"] > 0
  rows = [
      json.loads(line)
      for line in (
          (tmp_path / "precise" / "metrics.jsonl").read_text().splitlines()
      )
  ]
  assert rows[-1]["test_error_precise"] == precise[-1]["test_error_precise"]
  # 64 training images make 4 batches of 16.
  assert run("--workdir", str(tmp_path / "x"), "--precise-stats", "5") == 1
  assert (
      "--precise-stats 5 is more than the 4 batches" in capsys.readouterr().err
  )
  with pytest.raises(SystemExit):
    run("--precise-stats", "-1")
  assert "must be >= 0" in capsys.readouterr().err


def test_precise_stats_rows_on_eval_epochs_only(tmp_path):
  ds = small_dataset()
  history = train.train_and_evaluate(
      TINY.replace(epochs=3, eval_every=2),
      tmp_path,
      dataset=ds,
      progress=False,
      log=lambda line: None,
      precise_stats=1,
  )
  assert [r["test_error_precise"] is None for r in history] == [
      True,
      False,
      False,
  ]
  assert all(
      r["test_loss_precise"] is None or r["test_loss_precise"] > 0
      for r in history
  )
