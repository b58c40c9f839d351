"""Tests of the training suite: loop, resume, errors, CLI, multi-device, plots.

Everything runs on tiny synthetic data. The CLI tests write a tiny MNIST in
its canonical IDX format to a temporary --data-dir. The multi-device test
runs subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from train import compile_cache
from train import configs
from train import main as train_main
from train.data import input_pipeline
from train.loop import checkpointing
from train.loop import programs
from train.loop import sharding
from train.loop import train_state
from train.loop import train_steps
from train.loop import trainer as train
from train.report import plot

from tests.helpers.process import run_module
from tests.helpers.process import run_python_result
from tests.helpers.process import start_module
from tests.helpers.process import unoptimized_codegen
from tests.helpers.run_folders import write_random_run
from tests.helpers.training import TINY
from tests.helpers.training import exact
from tests.helpers.training import kill_after_epochs
from tests.helpers.training import run_quiet
from tests.helpers.training import small_dataset
from tests.helpers.training import synthetic_dataset
from tests.helpers.training import tiny_cli_args
from tests.helpers.training import write_tiny_mnist


def tree_digest(folder: Path) -> dict[str, str]:
  """Content hash of every file under ``folder``."""
  return {
      str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
      for p in sorted(folder.rglob("*"))
      if p.is_file()
  }


# --- steps ----------------------------------------------------------------------


def test_train_step_decreases_loss():
  ds = small_dataset()
  mesh = sharding.make_mesh()
  train_data = sharding.place_train(ds, mesh)
  program, _ = programs.compile_program(
      train.resolve(TINY),
      mesh,
      train_data,
      sharding.place_test(ds, mesh, TINY.batch_size),
      ds.num_classes,
  )
  state = program.init(jax.random.key(0))
  batched = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, sharding.DATA_AXIS)
  )
  images = jax.device_put(
      ds.train_images[:48].reshape(3, 16, 28, 28, 1), batched
  )
  labels = jax.device_put(ds.train_labels[:48].reshape(3, 16), batched)
  losses = []
  for _ in range(15):
    state, metrics = program.step(state, images, labels, np.int32(0))
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.3 * losses[0], losses
  # The norms' running averages moved away from their initial values.
  stats = state.batch_stats["norm1"]
  assert not np.allclose(stats["mean"], 0) and not np.allclose(stats["var"], 1)


def test_program_cache_is_keyed_by_the_selection_config_in_scope():
  # The selection method is chosen while tracing; a program compiled under
  # the default must not serve a run under selection_config(method="sort").
  ds = small_dataset()
  mesh = sharding.make_mesh()
  # sqd's superquantile needs the batch's quantile: a selection.
  config = train.resolve(TINY.replace(norm="sqd1"))
  args = (
      config,
      mesh,
      sharding.place_train(ds, mesh),
      sharding.place_test(ds, mesh, config.batch_size),
      ds.num_classes,
  )
  default, _ = programs.compile_program(*args)
  assert programs.compile_program(*args) == (default, True)
  with gbn_jax.selection.selection_config(method="sort"):
    sort, cached = programs.compile_program(*args)
    assert not cached and sort is not default
    assert programs.compile_program(*args) == (sort, True)
  assert programs.compile_program(*args) == (default, True)
  default_text, sort_text = default.step.as_text(), sort.step.as_text()
  assert default_text != sort_text
  # Only the forced method sorts the median's rows; the default selects
  # without sorting (docs: a float sort is ~60x slower on XLA:CPU).
  assert " sort(" in sort_text and " sort(" not in default_text


def test_make_mesh_is_auto_over_all_devices():
  mesh = sharding.make_mesh()
  assert mesh.axis_names == (sharding.DATA_AXIS,)
  assert mesh.size == jax.device_count()
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_eval_covers_every_test_image():
  """Padded, masked evaluation equals a direct pass over all test images."""
  ds = small_dataset()
  config = train.resolve(TINY.replace(norm="rbd"))
  model = train_state.create_model(config, 10)
  state = train_state.create_train_state(
      jax.random.key(1),
      model,
      (28, 28, 1),
      train_state.create_optimizer(config),
  )
  # Non-trivial running statistics, so that train/eval modes differ.
  state = state.replace(
      batch_stats=jax.tree.map(lambda x: x + 0.3, state.batch_stats)
  )
  mesh = sharding.make_mesh()
  placed = sharding.place_test(ds, mesh, batch_size=16)
  assert placed.images.shape[:2] == (3, 16)
  result = jax.jit(
      lambda s: train_steps.eval_model(
          s, placed.images, placed.labels, placed.mask, dataset="mnist"
      )
  )(state)
  logits = model.apply(
      {"params": state.params, "batch_stats": state.batch_stats},
      input_pipeline.normalize_images(ds.test_images, "mnist"),
      train=False,
  )
  logits = np.asarray(logits, np.float64)
  log_probs = (
      logits
      - np.log(
          np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)
      )
      - logits.max(1, keepdims=True)
  )
  expected_loss = -log_probs[np.arange(37), ds.test_labels].sum()
  expected_errors = int((logits.argmax(1) != ds.test_labels).sum())
  assert int(result["count"]) == 37
  assert int(result["errors"]) == expected_errors
  np.testing.assert_allclose(
      float(result["loss_sum"]), expected_loss, rtol=1e-5
  )


def _rows_in(haystack: np.ndarray, needles: np.ndarray) -> np.ndarray:
  """Index of each needle row in haystack (asserts each is found once)."""
  flat_h = haystack.reshape(len(haystack), -1)
  index = []
  for row in needles.reshape(len(needles), -1):
    hits = np.flatnonzero((flat_h == row).all(1))
    assert len(hits) == 1
    index.append(hits[0])
  return np.array(index)


def test_prepare_epoch_shuffles_and_drops_remainder():
  ds = synthetic_dataset(70, 5)
  images, labels = jnp.asarray(ds.train_images), jnp.asarray(ds.train_labels)
  out = []
  for epoch in (1, 2, 1):
    x, y = train_steps.prepare_epoch(
        images,
        labels,
        train_steps.epoch_key(3, epoch),
        steps=4,
        batch_size=16,
        augment=False,
    )
    assert x.shape == (4, 16, 28, 28, 1) and x.dtype == jnp.uint8
    index = _rows_in(ds.train_images, np.asarray(x).reshape(64, 28, 28, 1))
    assert len(set(index)) == 64  # a permutation, the last 6 dropped
    np.testing.assert_array_equal(
        ds.train_labels[index], np.asarray(y).reshape(64)
    )
    out.append(index)
  assert not np.array_equal(out[0], out[1])  # reshuffled every epoch
  np.testing.assert_array_equal(out[0], out[2])  # a function of the epoch


def test_prepare_epoch_augments_with_crops_and_flips():
  ds = synthetic_dataset(32, 5, name="cifar10")
  images, labels = jnp.asarray(ds.train_images), jnp.asarray(ds.train_labels)
  key = train_steps.epoch_key(0, 1)
  plain, _ = train_steps.prepare_epoch(
      images, labels, key, steps=2, batch_size=16, augment=False
  )
  augmented, y = train_steps.prepare_epoch(
      images, labels, key, steps=2, batch_size=16, augment=True
  )
  plain = np.asarray(plain).reshape(32, 32, 32, 3)
  augmented = np.asarray(augmented).reshape(32, 32, 32, 3)
  changed = 0
  for original, new in zip(plain, augmented):
    padded = np.pad(original, ((4, 4), (4, 4), (0, 0)))
    candidates = [
        padded[r : r + 32, c : c + 32] for r in range(9) for c in range(9)
    ]
    candidates += [c[:, ::-1] for c in candidates]
    assert any(np.array_equal(new, c) for c in candidates)
    changed += not np.array_equal(new, original)
  assert changed > 16


# --- whole runs -----------------------------------------------------------------


def test_run_writes_outputs_and_is_deterministic(tmp_path):
  ds = small_dataset()
  history = run_quiet(TINY, tmp_path / "a", dataset=ds)
  assert [r["epoch"] for r in history] == [1, 2, 3]
  assert checkpointing.read_metrics(tmp_path / "a") == history
  stored = checkpointing.read_config(tmp_path / "a")
  assert stored == TINY.replace(augment=False)  # mnist: no augmentation
  for row in history:
    # 52 // 16 = 3 batches: 48 images per epoch, the remainder dropped.
    assert (row["train_error"] * 48) == pytest.approx(
        round(row["train_error"] * 48)
    )
    assert (row["test_error"] * 37) == pytest.approx(
        round(row["test_error"] * 37)
    )
    assert 0 < row["data_seconds"] < row["train_seconds"] <= row["seconds"]
    assert row["images_per_sec"] == pytest.approx(48 / row["train_seconds"])
  assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
  assert history[-1]["best_test_error"] == min(r["test_error"] for r in history)
  elapsed = np.cumsum([r["seconds"] for r in history])
  np.testing.assert_allclose([r["elapsed_seconds"] for r in history], elapsed)
  assert sorted(
      int(p.name) for p in (tmp_path / "a/checkpoints").iterdir()
  ) == [1, 2, 3]

  again = run_quiet(TINY, tmp_path / "b", dataset=ds)
  assert exact(again) == exact(history)
  other = run_quiet(TINY.replace(seed=1, epochs=1), tmp_path / "c", dataset=ds)
  assert exact(other)[0] != exact(history)[0]


def test_resume_equals_uninterrupted(tmp_path):
  ds = small_dataset()
  config = TINY.replace(epochs=4)
  full = run_quiet(config, tmp_path / "full", dataset=ds)
  part = run_quiet(config.replace(epochs=2), tmp_path / "part", dataset=ds)
  assert exact(part) == exact(full)[:2]
  resumed = run_quiet(config, tmp_path / "part", dataset=ds)
  assert exact(resumed) == exact(full)
  assert exact(checkpointing.read_metrics(tmp_path / "part")) == exact(full)
  assert checkpointing.read_config(tmp_path / "part").epochs == 4
  # Asking again for what is done trains nothing and keeps the history.
  assert exact(run_quiet(config, tmp_path / "part", dataset=ds)) == exact(full)


def test_checkpoint_every_keeps_every_metric_and_resumes_exactly(tmp_path):
  ds = small_dataset()
  config = TINY.replace(epochs=4)
  full = run_quiet(config, tmp_path / "full", dataset=ds)
  part = run_quiet(
      config.replace(epochs=3),
      tmp_path / "part",
      dataset=ds,
      checkpoint_every=2,
  )
  assert exact(part) == exact(full)[:3]
  assert [
      r["epoch"] for r in checkpointing.read_metrics(tmp_path / "part")
  ] == [1, 2, 3]
  # Every 2nd epoch and the last one.
  assert sorted(
      int(p.name) for p in (tmp_path / "part/checkpoints").iterdir()
  ) == [2, 3]
  # A kill after epoch 3's row but before its save: epoch 3 is trained again.
  shutil.rmtree(tmp_path / "part/checkpoints/3")
  resumed = run_quiet(config, tmp_path / "part", dataset=ds, checkpoint_every=2)
  assert exact(resumed) == exact(full)
  assert exact(checkpointing.read_metrics(tmp_path / "part")) == exact(full)


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_checkpoint_every_must_be_a_positive_integer(tmp_path, every):
  with pytest.raises(ValueError, match="checkpoint_every must be a positive"):
    run_quiet(TINY, tmp_path, dataset=small_dataset(), checkpoint_every=every)


def test_eval_every(tmp_path):
  ds = small_dataset()
  history = run_quiet(
      TINY.replace(epochs=5, eval_every=2), tmp_path, dataset=ds
  )
  evaluated = [r["epoch"] for r in history if r["test_error"] is not None]
  assert evaluated == [2, 4, 5]
  assert history[0]["best_test_error"] is None


def _optimizer_steps(config, workdir) -> int:
  """The optimizer's step count in ``workdir``'s latest checkpoint."""
  config = train.resolve(config)
  state = train_state.create_train_state(
      jax.random.key(0),
      train_state.create_model(config, 10),
      (28, 28, 1),
      train_state.create_optimizer(config),
  )
  checkpointer = checkpointing.Checkpointer(workdir)
  try:
    restored, _ = checkpointer.restore(
        checkpointer.latest_epoch(),
        jax.tree.map(jnp.asarray, train_state.state_dict(state)),
    )
  finally:
    checkpointer.close()
  return int(restored["step"])


class _Stop(Exception):
  """Stops a run after its first epoch (and that epoch's checkpoint)."""


def _stop(*args, **kwargs):
  raise _Stop


@pytest.mark.parametrize("norm", ["mad", "gn"])
def test_steps_trains_exactly_n_steps_and_resumes_to_n(tmp_path, norm):
  ds = small_dataset()  # 52 // 16 = 3 steps per epoch
  # --epochs is ignored once --steps is given.
  config = TINY.replace(norm=norm, steps=7, epochs=1)
  full = run_quiet(config, tmp_path / "full", dataset=ds)
  assert [r["epoch"] for r in full] == [1, 2, 3]
  assert [r["step"] for r in full] == [3, 6, 7]
  assert all(r["test_error"] is not None for r in full)
  assert full[-1]["images_per_sec"] == pytest.approx(
      16 / full[-1]["train_seconds"]
  )
  # One step of 16 images: its errors are whole counts of 16.
  assert full[-1]["train_error"] * 16 == pytest.approx(
      round(full[-1]["train_error"] * 16)
  )
  assert _optimizer_steps(config, tmp_path / "full") == 7
  assert checkpointing.read_config(tmp_path / "full").steps == 7
  # The first two epochs are those of a run of two epochs.
  two = run_quiet(
      config.replace(steps=None, epochs=2), tmp_path / "two", dataset=ds
  )
  assert exact(two) == exact(full)[:2] and [r["step"] for r in two] == [3, 6]

  with pytest.raises(_Stop):
    run_quiet(config, tmp_path / "part", dataset=ds, on_first_epoch=_stop)
  assert _optimizer_steps(config, tmp_path / "part") == 3
  resumed = run_quiet(config, tmp_path / "part", dataset=ds)
  assert exact(resumed) == exact(full)
  assert [r["step"] for r in resumed] == [3, 6, 7]
  assert _optimizer_steps(config, tmp_path / "part") == 7
  # Asking again for what is done trains nothing.
  assert exact(run_quiet(config, tmp_path / "part", dataset=ds)) == exact(full)
  assert _optimizer_steps(config, tmp_path / "part") == 7


def test_steps_within_one_epoch(tmp_path):
  history = run_quiet(TINY.replace(steps=2), tmp_path, dataset=small_dataset())
  assert [(r["epoch"], r["step"]) for r in history] == [(1, 2)]
  assert _optimizer_steps(TINY.replace(steps=2), tmp_path) == 2


def test_steps_is_part_of_the_run(tmp_path):
  ds = small_dataset()
  run_quiet(TINY.replace(steps=4), tmp_path, dataset=ds)
  with pytest.raises(checkpointing.RunDirError, match="steps: 4 -> 5"):
    run_quiet(TINY.replace(steps=5), tmp_path, dataset=ds)
  assert train.planned_epochs(TINY.replace(steps=4), 3) == 2
  assert train.planned_epochs(TINY.replace(steps=6), 3) == 2
  assert train.planned_epochs(TINY, 3) == TINY.epochs


# --- clear errors ----------------------------------------------------------------


def test_different_config_is_refused_and_nothing_changes(tmp_path):
  ds = small_dataset()
  run_quiet(TINY.replace(epochs=1), tmp_path, dataset=ds)
  before = tree_digest(tmp_path)
  for change in (
      dict(norm="bn"),
      dict(model="resnet20"),
      dict(seed=5),
      dict(learning_rate=0.1),
  ):
    with pytest.raises(
        checkpointing.RunDirError,
        match=f"different config(.|\n)*{next(iter(change))}"
        "(.|\n)*--overwrite",
    ):
      run_quiet(TINY.replace(epochs=1, **change), tmp_path, dataset=ds)
    assert tree_digest(tmp_path) == before
  # --overwrite starts over with the new config.
  history = run_quiet(
      TINY.replace(epochs=1, norm="bn"), tmp_path, dataset=ds, overwrite=True
  )
  assert [r["epoch"] for r in history] == [1]
  assert checkpointing.read_config(tmp_path).norm == "bn"


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
  ds = small_dataset()
  run_quiet(TINY.replace(epochs=2), tmp_path, dataset=ds)
  for path in (tmp_path / "checkpoints/2").rglob("*"):
    if path.is_file():
      path.write_bytes(b"garbage")
  before = tree_digest(tmp_path)
  with pytest.raises(
      checkpointing.CheckpointError, match=r"checkpoints/2: it is corrupt"
  ):
    run_quiet(TINY.replace(epochs=3), tmp_path, dataset=ds)
  assert tree_digest(tmp_path) == before


def test_foreign_checkpoint_is_a_clear_error(tmp_path):
  """Checkpoints of another optimizer under a config.json edited to match."""
  run_quiet(TINY.replace(epochs=1), tmp_path, dataset=small_dataset())
  edited = TINY.replace(epochs=1, momentum=0.0, augment=False)  # no trace
  (tmp_path / "config.json").write_text(json.dumps(edited.to_json()))
  with pytest.raises(
      checkpointing.CheckpointError,
      match="corrupt or was " "written by a different model",
  ):
    run_quiet(edited.replace(epochs=2), tmp_path, dataset=small_dataset())


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "not a valid gbn-jax training config"),
        ('{"norm": "bn"}', "missing fields"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_corrupt_config_json_is_a_clear_error(tmp_path, content, match):
  (tmp_path / "config.json").write_text(content)
  with pytest.raises(checkpointing.RunDirError, match=match):
    run_quiet(TINY, tmp_path, dataset=small_dataset())
  assert (tmp_path / "config.json").read_text() == content
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_checkpoints_without_config_are_refused(tmp_path):
  (tmp_path / "checkpoints/1").mkdir(parents=True)
  with pytest.raises(checkpointing.RunDirError, match="no config.json"):
    run_quiet(TINY, tmp_path, dataset=small_dataset())


def test_batch_larger_than_dataset(tmp_path):
  with pytest.raises(
      ValueError,
      match="--batch-size 64 is larger than the "
      "training set of mnist .52 images",
  ):
    run_quiet(TINY.replace(batch_size=64), tmp_path, dataset=small_dataset())


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  """A loss that turns NaN at step 7 (epoch 3 of 3-step epochs)."""
  original = train_steps.train_step

  def diverging_step(state, *args, **kwargs):
    new_state, metrics = original(state, *args, **kwargs)
    loss = jnp.where(state.step >= 7, jnp.nan, metrics["loss"])
    return new_state, {**metrics, "loss": loss}

  monkeypatch.setattr(train_steps, "train_step", diverging_step)
  ds = small_dataset()
  with pytest.raises(
      train.NonFiniteLossError,
      match=r"became nan at epoch 3, step 1(.|\n)*last good "
      r"checkpoint \(epoch 2\)",
  ):
    run_quiet(TINY.replace(epochs=5), tmp_path, dataset=ds)
  assert checkpointing.Checkpointer(tmp_path).latest_epoch() == 2
  assert [r["epoch"] for r in checkpointing.read_metrics(tmp_path)] == [1, 2]


# --- the progress bar follows completed steps ---------------------------------


class _LaggingDevice:
  """Runs the dispatched steps in order, ``lag`` steps behind the host,
  or at once up to a step the host waits for (``waits`` counts those)."""

  def __init__(self, lag):
    self.lag, self.dispatched, self.completed, self.waits = lag, 0, 0, 0

  def dispatch(self):
    self.dispatched += 1
    self.completed = max(self.completed, self.dispatched - self.lag)

  def wait(self, step):
    if step >= self.completed:
      self.waits += 1
      self.completed = step + 1


class _FutureLoss:
  """A step's loss as the loop sees it: ready once the step completed."""

  def __init__(self, device, step):
    self.device, self.step = device, step

  def is_ready(self):
    return self.step < self.device.completed

  def block_until_ready(self):
    self.device.wait(self.step)
    return self

  def __float__(self):
    self.block_until_ready()
    return 0.5

  def __array__(self, dtype=None, copy=None):
    return np.asarray(float(self), dtype)


class _FakeProgram:
  """``programs.Program``'s interface over a :class:`_LaggingDevice`."""

  precise = None

  def __init__(self, device, steps):
    self.device, self.steps = device, steps

  def prepare(self, images, labels, key):
    return images, labels

  def step(self, state, images, labels, step):
    loss = _FutureLoss(self.device, self.device.dispatched)
    self.device.dispatch()
    return state, {"loss": loss, "errors": 0}

  def evaluate(self, state, images, labels, mask):
    return {"count": 1, "loss_sum": 0.5, "errors": 0}


class _FakeCheckpointer:

  def due(self, epoch, every, last):
    return True

  def save(self, epoch, state, history):
    pass


@pytest.mark.parametrize("lag", [2, 6])
def test_progress_bar_counts_completed_steps(tmp_path, monkeypatch, lag):
  """The bar advances as steps complete on the device, not as the loop
  dispatches them, lags them by a few steps at most, and makes the loop
  wait only when the device is that far behind."""
  import tqdm  # pylint: disable=g-import-not-at-top

  device, steps, epochs = _LaggingDevice(lag), 25, 2
  updates = []  # (bar, its count, steps dispatched, steps completed)

  class Bar(tqdm.tqdm):

    def update(self, n=1):
      shown = super().update(n)
      updates.append((self, self.n, device.dispatched, device.completed))
      return shown

  monkeypatch.setattr(tqdm, "tqdm", Bar)
  monkeypatch.setattr(train_state, "state_dict", lambda state: {})
  placed = sharding.Placed(np.zeros(1), np.zeros(1), np.ones(1, bool))
  history = []
  train._train_epochs(
      TINY.replace(epochs=epochs, eval_every=1),
      tmp_path,
      _FakeProgram(device, steps),
      placed,
      placed,
      None,
      history,
      _FakeCheckpointer(),
      start=1,
      progress=True,
      log=lambda line: None,
      primary=False,
  )
  assert [r["epoch"] for r in history] == [1, 2]
  bars = list(dict.fromkeys(u[0] for u in updates))
  assert len(bars) == epochs
  for epoch, bar in enumerate(bars):
    done_before = epoch * steps
    for _, shown, dispatched, completed in (u for u in updates if u[0] is bar):
      assert shown == completed - done_before  # no step counted before done
      assert dispatched - done_before - shown <= 4  # a few behind at most
    assert bar.n == steps
  # The device ran behind unhindered: the loop waited for it only where it
  # was more than a few steps behind, and at each epoch's end.
  assert device.waits == epochs if lag <= 3 else device.waits > epochs


# Alike tests/benchmarks/compile/test_bench_compile.py::test_bad_flags_name_the_flag: another
# CLI, with its own flags and messages.
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--norm", "layernorm"], "unknown norm 'layernorm'"),
        (["--norm", "sqd"], "needs a quantile level"),
        (["--norm", "sqd:1.2"], "strictly between 0 and 1"),
        (["--norm", "sqd:0"], "strictly between 0 and 1"),
        (["--batch-size", "0"], "must be >= 1"),
        (["--epochs", "two"], "not an integer"),
        (["--momentum", "1.5"], "--momentum must be in"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--lr", "nan"], "--lr must be a positive number"),
        (["--dataset", "imagenet"], "invalid choice"),
        (["--model", "vgg"], "invalid choice"),
        (["--steps", "0"], "must be >= 1"),
        (["--norm-groups", "0"], "must be >= 1"),
        (["--norm", "gn:bn"], "a group norm takes a GBN measure"),
        (
            ["--norm", "gn", "--renorm"],
            "--norm gn: --renorm is batch renormalization",
        ),
        (
            ["--norm", "gn:sqd2", "--renorm"],
            "--norm gn:sqd2: --renorm is batch renormalization",
        ),
    ],
)
def test_cli_flag_errors(capsys, flags, message):
  with pytest.raises(SystemExit) as exit_info:
    train_main.run(flags, configs.MNIST, prog="train.mnist")
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_cli_help_explains_every_flag(capsys):
  with pytest.raises(SystemExit):
    train_main.run(["--help"], configs.CIFAR, prog="python -m train.cifar")
  text = capsys.readouterr().out
  for flag in (
      "--norm",
      "--dataset",
      "--model",
      "--epochs",
      "--batch-size",
      "--lr",
      "--momentum",
      "--weight-decay",
      "--augment",
      "--no-augment",
      "--seed",
      "--data-dir",
      "--workdir",
      "--eval-every",
      "--overwrite",
  ):
    assert flag in text
  assert "sqd:<alpha>" in text and "default: 0.1" in text
  text = " ".join(text.split())
  assert "gn, gn:<measure>" in text and "gn:sqd:0.9" in text
  assert "--steps STEPS train exactly N optimizer steps" in text
  assert "--norm-groups NORM_GROUPS channel groups of gn" in text
  assert "(default: 5)" in text


# --- CLI end to end (subprocesses) ---------------------------------------------


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
  """Lets the subprocesses share compiled programs (JAX's persistent cache).

  A cache of this module's own, not the suite's (tests/conftest.py): a run
  killed below may leave a half-written entry (jax writes entries in place),
  which the other workers' processes should not read.
  """
  return unoptimized_codegen(
      {
          "JAX_COMPILATION_CACHE_DIR": str(
              tmp_path_factory.mktemp("jax_cache")
          ),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      }
  )


def test_cli_end_to_end(tmp_path, cache_env, capsys):
  data = write_tiny_mnist(tmp_path / "data")
  workdir = tmp_path / "run"
  common = tiny_cli_args(data, workdir, "--lr", "0.05")
  result = run_module(
      "train.mnist", *common, "--epochs", "2", "--norm", "mad", env=cache_env
  )
  assert result.returncode == 0, result.stderr
  assert "mnist lenet norm=mad seed=0: 2 epochs" in result.stdout
  assert len(result.stdout.strip().splitlines()) == 1
  assert "epoch 2/2" in result.stderr
  rows = checkpointing.read_metrics(workdir)
  assert [r["epoch"] for r in rows] == [1, 2]
  assert checkpointing.read_config(workdir) == configs.MNIST.replace(
      norm="mad", epochs=2, batch_size=16, learning_rate=0.05, augment=False
  )

  # The refusals stop before the first step: the subprocess above covers
  # the module's entry point, so these go through the same ``run`` in this
  # process (a new interpreter per refusal would only add its start-up).
  def refused(*argv):
    code = train_main.run(list(argv), configs.MNIST, prog="train.mnist")
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    return err

  err = refused(*common, "--epochs", "2", "--norm", "bn")
  assert "different config" in err and "norm" in err
  err = refused(
      *common, "--epochs", "2", "--norm", "bn", "--batch-size", "128",
      "--overwrite",
  )  # fmt: skip
  assert "larger than the training set" in err
  err = refused(
      "--data-dir", str(tmp_path / "nowhere"), "--dataset", "mnist",
      "--workdir", str(tmp_path / "x"), "--no-progress",
  )  # fmt: skip
  assert "could not find the mnist dataset" in err


@pytest.mark.slow
def test_cli_real_nan(tmp_path, cache_env):
  data = write_tiny_mnist(tmp_path / "data")
  args = tiny_cli_args(data, tmp_path / "run", "--epochs", "2", "--lr", "1e30")
  result = run_module("train.mnist", *args, env=cache_env)
  assert result.returncode == 1, result.stderr
  assert "training loss became nan" in result.stderr
  assert "smaller --lr" in result.stderr
  assert "Traceback" not in result.stderr


# --- the CLI's persistent compilation cache (train/compile_cache.py) -------------


def test_compile_cache_dir_follows_xdg_then_home(tmp_path):
  assert compile_cache.default_dir({"XDG_CACHE_HOME": str(tmp_path)}) == (
      tmp_path / "gbn_jax" / "jax_cache"
  )
  home = Path(os.path.expanduser("~"))
  for env in ({}, {"XDG_CACHE_HOME": ""}):
    assert compile_cache.default_dir(env) == (
        home / ".cache" / "gbn_jax" / "jax_cache"
    )
  env = {"XDG_CACHE_HOME": str(tmp_path)}
  assert compile_cache.choose_dir(False, env) == (
      tmp_path / "gbn_jax" / "jax_cache"
  )


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_compile_cache_is_turned_off_by_the_environment(tmp_path, value):
  env = {"XDG_CACHE_HOME": str(tmp_path), "GBN_COMPILE_CACHE": value}
  assert not compile_cache.enabled_by_env(env)
  assert compile_cache.choose_dir(False, env) is None


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes", ""])
def test_compile_cache_stays_on_for_on_values(tmp_path, value):
  env = {"XDG_CACHE_HOME": str(tmp_path), "GBN_COMPILE_CACHE": value}
  assert compile_cache.enabled_by_env(env)
  assert compile_cache.choose_dir(False, env) == (
      tmp_path / "gbn_jax" / "jax_cache"
  )


def test_compile_cache_is_turned_off_by_the_flag(tmp_path):
  env = {"XDG_CACHE_HOME": str(tmp_path), "GBN_COMPILE_CACHE": "1"}
  assert compile_cache.choose_dir(True, env) is None


def test_compile_cache_leaves_a_user_set_folder_alone(tmp_path):
  env = {"XDG_CACHE_HOME": str(tmp_path)}
  mine = {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}
  assert compile_cache.choose_dir(False, mine) is None
  assert compile_cache.choose_dir(False, env, configured="/else") is None


def test_compile_cache_bad_environment_value_is_a_clear_error(
    tmp_path, monkeypatch, capsys
):
  with pytest.raises(ValueError, match="GBN_COMPILE_CACHE must be one of"):
    compile_cache.enabled_by_env({"GBN_COMPILE_CACHE": "maybe"})
  monkeypatch.setenv("GBN_COMPILE_CACHE", "maybe")
  code = train_main.run(
      ["--workdir", str(tmp_path / "run")], configs.MNIST, prog="train.mnist"
  )
  assert code == 1
  err = capsys.readouterr().err
  assert "train.mnist: error: GBN_COMPILE_CACHE must be one of" in err
  assert "'maybe'" in err and not (tmp_path / "run").exists()


#: The programs train.loop.programs.Program compiles, by their jit names.
CLI_PROGRAMS = frozenset(f"jit_{name}" for name in programs.PROGRAM_FUNCTIONS)


def _cache_entries(folder: Path) -> set[str]:
  return {p.name for p in folder.rglob("*-cache")} if folder.exists() else set()


def _program_name(entry: str) -> str:
  """``jit_train_step`` of a cache entry ``jit_train_step-<key>-cache``."""
  return entry.rsplit("-", 2)[0]


@pytest.mark.slow
def test_cli_keeps_compiled_programs_in_the_user_cache(tmp_path):
  """The first run writes the cache, the second reads it back."""
  data = write_tiny_mnist(tmp_path / "data")
  args = ["--data-dir", str(data), "--batch-size", "16", "--epochs", "1"]
  args += ["--no-progress", "--overwrite", "--workdir", str(tmp_path / "run")]
  # The suite's own cache folder (tests/conftest.py) would win.
  drop = (
      "JAX_COMPILATION_CACHE_DIR",
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
      "GBN_COMPILE_CACHE",
  )

  def run(xdg: Path, *extra: str):
    result = run_module(
        "train.mnist",
        *args,
        *extra,
        env={"XDG_CACHE_HOME": str(xdg)},
        drop=drop,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return xdg / "gbn_jax" / "jax_cache"

  folder = run(tmp_path / "xdg")
  entries = _cache_entries(folder)
  # At least the train step, the evaluation and the epoch's batches.
  assert len(entries) >= 3, sorted(p.name for p in folder.rglob("*"))
  # The same programs again: the CLI's own are read back under the same
  # keys (a key that changed from run to run would add an entry of the same
  # name). Small helper programs (a key's fold_in, slices of several shapes
  # under one name) enter the cache only when their compile happens to pass
  # the minimum time: timing decides that, so they are not checked.
  again = _cache_entries(run(tmp_path / "xdg"))
  assert entries <= again
  main_names = {_program_name(e) for e in entries} & CLI_PROGRAMS
  assert {"jit_train_step", "jit_eval_model"} <= main_names, sorted(entries)
  rekeyed = {e for e in again - entries if _program_name(e) in main_names}
  assert rekeyed == set(), sorted(again)
  assert not run(tmp_path / "off", "--no-compile-cache").exists()


@pytest.mark.slow
def test_cli_killed_mid_run_resumes_exactly(tmp_path, cache_env):
  """SIGKILL a real run after its 2nd checkpoint; rerunning finishes it."""
  data = write_tiny_mnist(tmp_path / "data", n_train=96)
  args = tiny_cli_args(
      data, None, "--epochs", "12", "--lr", "0.05", "--norm", "sqd1"
  )
  killed_dir, full_dir = tmp_path / "killed", tmp_path / "full"
  process = start_module(
      "train.mnist", *args, "--workdir", str(killed_dir), env=cache_env
  )
  done = kill_after_epochs(process, killed_dir, 2)
  assert process.returncode == -signal.SIGKILL and 2 <= done < 12
  result = run_module(
      "train.mnist", *args, "--workdir", str(killed_dir), env=cache_env
  )
  assert result.returncode == 0, result.stderr
  assert "resumed from" in result.stderr
  result = run_module(
      "train.mnist", *args, "--workdir", str(full_dir), env=cache_env
  )
  assert result.returncode == 0, result.stderr
  assert exact(checkpointing.read_metrics(killed_dir)) == exact(
      checkpointing.read_metrics(full_dir)
  )


# --- multi-device ----------------------------------------------------------------

_MULTI_DEVICE_SCRIPT = """
import json
import jax
from tests.helpers.training import TINY, small_dataset, run_quiet
from train.loop import sharding
ds = small_dataset()
out = {{"devices": jax.device_count()}}
for norm in ("sqd1",):
  history = run_quiet(TINY.replace(norm=norm, epochs=2, learning_rate=0.01),
                      {workdir!r} + norm, dataset=ds)
  out[norm] = history
# 18 is not divisible by 4: one host then trains on the 3 devices that divide it.
out["odd_batch_devices"] = len(sharding.data_parallel_devices(18))
out["odd"] = run_quiet(TINY.replace(batch_size=18), {workdir!r} + "odd", dataset=ds)
print(json.dumps(out))
"""


def _run_devices(count: int, workdir: Path):
  script = _MULTI_DEVICE_SCRIPT.format(workdir=str(workdir) + "/")
  # This process's XLA_FLAGS replaced: the device count is this one.
  env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}
  result = run_python_result(script, env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_four_devices_equal_one(tmp_path):
  """Global-batch statistics: 4 devices train exactly like 1 device."""
  one = _run_devices(1, tmp_path / "one")
  four = _run_devices(4, tmp_path / "four")
  assert (one["devices"], four["devices"]) == (1, 4)
  # A quantile: its selection pools over the devices (the other measures'
  # pooling is the library's multi-device tests').
  for norm in ("sqd1",):
    for a, b in zip(one[norm], four[norm], strict=True):
      assert a["epoch"] == b["epoch"]
      for key in ("train_loss", "test_loss"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-4, err_msg=norm)
      # Rounding may flip the argmax of a near-tie: at most one image.
      assert abs(a["train_error"] - b["train_error"]) <= 1 / 48 + 1e-9
      assert abs(a["test_error"] - b["test_error"]) <= 1 / 37 + 1e-9
  assert (one["odd_batch_devices"], four["odd_batch_devices"]) == (1, 3)
  for a, b in zip(one["odd"], four["odd"], strict=True):
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)


# --- plots -----------------------------------------------------------------------


def test_plot_writes_pngs(tmp_path, capsys):
  runs = [
      write_random_run(tmp_path / n, n, i) for i, n in enumerate(("bn", "mad"))
  ]
  assert (
      plot.main([str(r) for r in runs] + ["--out", str(tmp_path / "out")]) == 0
  )
  names = sorted(p.name for p in (tmp_path / "out").iterdir())
  assert names == sorted(
      [
          "train_loss_vs_epoch.png",
          "test_error_vs_epoch.png",
          "train_loss_vs_seconds.png",
          "test_error_vs_seconds.png",
      ]
  )
  for name in names:
    data = (tmp_path / "out" / name).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
  assert capsys.readouterr().out.splitlines() == [
      f"wrote {tmp_path / 'out' / name}"
      for name in (
          "train_loss_vs_epoch.png",
          "test_error_vs_epoch.png",
          "train_loss_vs_seconds.png",
          "test_error_vs_seconds.png",
      )
  ]
  assert plot.run_labels(
      [{"norm": "bn", "seed": 0}, {"norm": "bn", "seed": 1}]
  ) == ["bn seed0", "bn seed1"]


def test_plot_errors(tmp_path, capsys):
  assert plot.main([str(tmp_path / "missing")]) == 1
  assert "not a readable run directory" in capsys.readouterr().err
