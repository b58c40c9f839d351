"""The training loop: data-parallel SGD with per-epoch checkpoints.

Data parallelism: one 1-D mesh ``('data',)`` over all devices (of all hosts).
The train state is replicated, every batch is sharded along its batch axis,
and the steps are plain ``jax.jit`` functions. XLA's SPMD partitioner then
reduces over the whole batch wherever the model does, so the GBN statistics
(means, quantiles, maxima...) are those of the GLOBAL batch, exactly as on
one device; no ``axis_name`` is needed. The mesh is built with
``AxisType.Auto``: ``jax.make_mesh`` defaults to ``Explicit`` axes,
under which the sort of the quantile measures (``sqd*``) over the sharded
batch axis is rejected ("Arguments to sort must be unsharded over the
sorting dimension"), while with ``Auto`` XLA inserts the communication.

Data stays on the devices: the uint8 training set is replicated on each
device once, and each epoch one jitted call shuffles it (a permutation drawn
from ``(seed, epoch)``), drops the last partial batch, applies augmentation
(keys from ``(seed, epoch, step)``) and returns the epoch's batches, sharded.
That call is timed on its own (``data_seconds``); normalization to float is
fused into the train step. The test set is padded to whole batches and
evaluated with a mask, with the norms' running averages, so the test error
is over exactly all test images. On several hosts every host loads the same
files and supplies only its own devices' parts of each array
(``jax.make_array_from_callback``), and each device holds only its shard
of each batch.

Rows of ``metrics.jsonl``: ``epoch``, ``step`` (optimizer steps trained so
far, this epoch's included), ``train_loss`` (mean over the epoch's
steps, in training mode), ``train_error``, ``test_loss``, ``test_error``
(``None`` on epochs without evaluation), ``best_test_error`` (so far),
``seconds`` (data + training + evaluation; compilation happens before the
first epoch and checkpointing after the timing), ``train_seconds`` (data +
training), ``data_seconds``, ``eval_seconds``, ``images_per_sec`` (training
images / ``train_seconds``) and ``elapsed_seconds`` (cumulative ``seconds``,
across resumptions).

Precise statistics (``--precise-stats N``): before each evaluation, the
norms' statistics are also recomputed as equal-weight averages over the
first ``N`` batches of the epoch just trained, with the parameters frozen
(:func:`gbn_jax.precise_batch_stats`, PreciseBN), inside one jitted call, and
the test set is evaluated with them too: ``test_loss_precise``,
``test_error_precise`` and ``precise_seconds`` (not part of ``seconds``) join
the row. The train state's running averages are not changed, and
``test_error`` is still the running-average one.

Activation recording (``--record-activations K``, the paper's Figure 1): every
``K`` steps the train step also returns a few percentiles of one feature
(channel) of one norm layer's input and output over the batch, captured with
``flax.linen.intercept_methods`` inside the jitted step, so any model and any
norm can be recorded without changing the model. Rows go to
``activations.jsonl``; recording does not change training.

With ``--steps N`` the run is ``ceil(N / steps per epoch)`` epochs
(:func:`planned_epochs`), the last one stopped after step ``N``: epochs stay
the unit of data order, evaluation and checkpoints, so a resume ends at ``N``.

Every random number is a function of ``(seed, epoch, step)``, and
checkpoints hold the whole train state plus the metrics history, so a run
resumed after a kill ends with the same metrics as an uninterrupted one.

This module is the loop (:func:`train_and_evaluate`); its parts live in
:mod:`train.loop.train_state` (model, optimizer, initial state),
:mod:`train.loop.train_steps` (the jitted functions and the random keys),
:mod:`train.loop.sharding` (mesh and data placement), :mod:`train.loop.programs`
(compiling them, cached in-process), :mod:`train.model.activations` (recording)
and :mod:`train.loop.step_progress` (the progress bar, which counts the steps
that completed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from pathlib import Path
import sys
import time
from typing import Any

import flax
import jax
import numpy as np
import tqdm

from train import configs
from train.data import input_pipeline
from train.data import subset as data_subset
from train.loop import capture
from train.loop import checkpointing
from train.loop import health
from train.loop import programs
from train.loop import sharding
from train.loop import step_progress
from train.loop import train_state
from train.loop import train_steps
from train.model import activations


class NonFiniteLossError(RuntimeError):
  """The training loss became NaN or infinite."""


def resolve(config: configs.Config) -> configs.Config:
  """Fills ``augment=None`` with the dataset's default, then validates."""
  configs.validate(config)
  if config.augment is None:
    info = input_pipeline.dataset_info(config.dataset)
    config = config.replace(augment=bool(info.augment_by_default))
  return configs.validate(config)


def planned_epochs(config: configs.Config, steps_per_epoch: int) -> int:
  """The epochs ``config`` trains: ``epochs``, or enough for ``steps``.

  >>> planned_epochs(configs.MNIST.replace(steps=7), 3)
  3
  >>> planned_epochs(configs.MNIST.replace(epochs=4), 3)
  4
  """
  if config.steps is None:
    return config.epochs
  return math.ceil(config.steps / steps_per_epoch)


def _raise_nonfinite(
    losses: Sequence[jax.Array],
    epoch: int,
    last_good: int | None,
    workdir: Path,
) -> None:
  """Raises NonFiniteLossError naming the first bad step of ``losses``."""
  values = np.asarray(jax.device_get(list(losses)), np.float64)
  step = int(np.flatnonzero(~np.isfinite(values))[0])
  kept = (
      f"the last good checkpoint (epoch {last_good}) is kept in "
      f"{workdir / checkpointing.CHECKPOINT_DIR}"
      if last_good
      else "no checkpoint was written"
  )
  raise NonFiniteLossError(
      f"training loss became {values[step]} at epoch {epoch}, step {step}: "
      f"the run diverged; {kept}. Try a smaller --lr."
  )


def _validate_sizes(
    config: configs.Config, dataset: input_pipeline.Dataset, num_devices: int
) -> None:
  if dataset.name != config.dataset:
    raise ValueError(
        f"the dataset given is {dataset.name!r}, but the config "
        f"asks for {config.dataset!r}"
    )
  n_train = len(dataset.train_images)
  if config.batch_size > n_train:
    raise ValueError(
        f"--batch-size {config.batch_size} is larger than the training set "
        f"of {config.dataset} ({n_train} images)"
    )
  if config.batch_size % num_devices:
    raise ValueError(
        f"--batch-size {config.batch_size} is not divisible by the "
        f"{num_devices} devices the batch is split over"
    )
  if len(dataset.test_images) == 0:
    raise ValueError(f"the test set of {config.dataset} is empty")


def _validate_precise_stats(batches: int, steps: int) -> None:
  if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
    raise ValueError(
        f"--precise-stats must be a whole number >= 0, got " f"{batches!r}"
    )
  if batches > steps:
    raise ValueError(
        f"--precise-stats {batches} is more than the {steps} "
        "batches of an epoch"
    )


def _summary_line(row: dict[str, Any], epochs: int) -> str:
  test = (
      ""
      if row["test_error"] is None
      else f" test loss {row['test_loss']:.4f} error "
      f"{100 * row['test_error']:.2f}%"
  )
  if row.get("test_error_precise") is not None:
    test += f" (precise stats {100 * row['test_error_precise']:.2f}%)"
  return (
      f"epoch {row['epoch']}/{epochs}: train loss "
      f"{row['train_loss']:.4f} error {100 * row['train_error']:.2f}%"
      f"{test} | {row['seconds']:.1f}s, "
      f"{row['images_per_sec']:.0f} img/s, data "
      f"{100 * row['data_seconds'] / row['seconds']:.1f}%"
  )


def train_and_evaluate(
    config: configs.Config,
    workdir: str | Path,
    *,
    dataset: input_pipeline.Dataset | None = None,
    data_dir: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    record: activations.ActivationRecording | None = None,
    on_first_epoch: Callable[..., Sequence[str]] | None = None,
    precise_stats: int = 0,
    checkpoint_every: int = 1,
    keep_checkpoints_every: int | None = None,
) -> list[dict[str, Any]]:
  """Trains ``config`` in ``workdir``, resuming from its last checkpoint.

  Args:
    config: The run's config (``augment=None`` picks the dataset default).
    workdir: Run directory (see :mod:`train.loop.checkpointing`).
    dataset: Use this dataset instead of loading ``config.dataset``.
    data_dir: Where ``input_pipeline.load_dataset`` looks for files.
    overwrite: Start over, deleting an existing run in ``workdir``.
    progress: Show a tqdm progress bar on stderr.
    log: Receives one line per epoch (default: stderr).
    record: Record percentiles of one norm layer's activations every
      ``record.every`` steps into ``workdir/activations.jsonl``.
    on_first_epoch: Called as ``on_first_epoch(config, seconds, devices,
      epoch=epoch)`` after the first epoch this call trains (``epoch``: its
      number, past 1 after a resume); the lines it returns are logged (the
      CLI's time estimate).
    precise_stats: Also evaluate with the norms' statistics recomputed over
      this many of the epoch's training batches (0: off); adds
      ``test_loss_precise``, ``test_error_precise`` and ``precise_seconds``
      to the rows.
    checkpoint_every: Save a checkpoint every this many epochs (and after
      the last). ``metrics.jsonl`` still gets every epoch's row; a resume
      restarts from the last checkpoint, rewrites the rows after it and
      retrains those epochs (with the same results). On an accelerator,
      where an epoch can take less than a save, this keeps long runs from
      spending their time in orbax.
    keep_checkpoints_every: Also save, and keep for good, every epoch that
      is a multiple of this (``None``: none).

  Returns:
    The metrics history: one dict per epoch (what ``metrics.jsonl`` holds).

  Raises:
    ValueError: Bad config or sizes.
    checkpointing.RunDirError: ``workdir`` holds an incompatible run.
    checkpointing.CheckpointError: The latest checkpoint is unreadable.
    NonFiniteLossError: The loss became NaN/inf (earlier checkpoints kept).
    input_pipeline.DataNotFoundError: The dataset files are missing.
  """
  config = resolve(config)
  checkpointing.check_every("checkpoint_every", checkpoint_every)
  if keep_checkpoints_every is not None:
    checkpointing.check_every("keep_checkpoints_every", keep_checkpoints_every)
  workdir = Path(workdir)
  primary = jax.process_index() == 0
  if not primary:  # one host reports for all
    log, progress = (lambda line: None), False
  elif log is None:
    log = lambda line: tqdm.tqdm.write(line, file=sys.stderr)
  # Refuse an incompatible workdir before spending time on data.
  checkpointing.prepare_workdir(
      workdir, config, overwrite=overwrite, is_primary=primary
  )
  if dataset is None:
    # No data folder given: what no source has is downloaded
    # (train.data.download).
    dataset = input_pipeline.load_dataset(
        config.dataset, data_dir=data_dir, fetch=True
    )
  dataset = data_subset.for_config(dataset, config)
  mesh = sharding.make_mesh(sharding.data_parallel_devices(config.batch_size))
  _validate_sizes(config, dataset, mesh.size)
  _validate_precise_stats(
      precise_stats, len(dataset.train_images) // config.batch_size
  )
  train_data = sharding.place_train(dataset, mesh)
  test_data = sharding.place_test(dataset, mesh, config.batch_size)
  t0 = time.perf_counter()
  program, cached = programs.compile_program(
      config,
      mesh,
      train_data,
      test_data,
      dataset.num_classes,
      record,
      precise_stats,
  )
  n_train = len(dataset.train_images)
  dropped = n_train - program.steps * config.batch_size
  batches = f"{program.steps} batches of {config.batch_size}" + (
      f", the last {dropped} dropped" if dropped else ""
  )
  log(
      f"{config.model}/{config.norm} on {config.dataset}: {n_train} train "
      f"images ({batches}), "
      f"{len(dataset.test_images)} test images, {mesh.size} device(s); "
      + (
          "compiled program reused"
          if cached
          else f"compiled in {time.perf_counter() - t0:.1f}s"
      )
  )
  log(f"data: {dataset.source}")
  state = program.init(train_steps.init_key(config.seed))
  # What the loop trains, while config.json keeps the config as asked.
  planned = config.replace(epochs=planned_epochs(config, program.steps))

  checkpointer = checkpointing.Checkpointer(workdir, keep_checkpoints_every)
  try:
    last = checkpointer.latest_epoch()
    history: list[dict[str, Any]] = []
    if last is not None:
      restored, history = checkpointer.restore(
          last, train_state.state_dict(state)
      )
      state = flax.serialization.from_state_dict(state, restored)
    if primary:
      checkpointing.write_config(workdir, config)
      checkpointing.write_metrics(workdir, history)
      # The report reads each norm layer's n from here: it imports no jax.
      capture.write_norm_layers(
          workdir,
          config,
          train_state.create_model(config, dataset.num_classes),
          (config.batch_size, *dataset.train_images.shape[1:]),
      )
    if last is not None:
      log(f"resumed from {checkpointer.directory / str(last)}")
    if primary and record is not None:
      activations.keep_activations(workdir, last or 0)
    if primary and (last or 0) < planned.epochs:
      checkpointing.append_data_source(workdir, (last or 0) + 1, dataset.source)
    _train_epochs(
        planned,
        workdir,
        program,
        train_data,
        test_data,
        state,
        history,
        checkpointer,
        start=(last or 0) + 1,
        progress=progress,
        log=log,
        primary=primary,
        record=record,
        on_first_epoch=on_first_epoch,
        devices=list(mesh.devices.flat),
        checkpoint_every=checkpoint_every,
    )
  finally:
    checkpointer.close()
  return history


def _train_epochs(
    config: configs.Config,
    workdir: Path,
    program: programs.Program,
    train_data: sharding.Placed,
    test_data: sharding.Placed,
    state: train_state.TrainState,
    history: list[dict[str, Any]],
    checkpointer: checkpointing.Checkpointer,
    *,
    start: int,
    progress: bool,
    log: Callable[[str], None],
    primary: bool,
    record: activations.ActivationRecording | None = None,
    on_first_epoch: Callable[..., Sequence[str]] | None = None,
    devices: Sequence[jax.Device] = (),
    checkpoint_every: int = 1,
) -> None:
  """Runs epochs ``start..config.epochs``, appending rows to ``history``.

  ``config.epochs`` is :func:`planned_epochs`'; with ``config.steps`` the
  last epoch stops after that step.
  """
  elapsed = history[-1]["elapsed_seconds"] if history else 0.0
  best = history[-1]["best_test_error"] if history else None
  last_good = start - 1 if start > 1 else None
  watch = health.DeadTrainingWatch(config)
  for epoch in range(start, config.epochs + 1):
    t_start = time.perf_counter()
    images, labels = program.prepare(
        train_data.images,
        train_data.labels,
        train_steps.epoch_key(config.seed, epoch),
    )
    jax.block_until_ready((images, labels))
    data_seconds = time.perf_counter() - t_start

    done = (epoch - 1) * program.steps
    steps = program.steps
    if config.steps is not None:
      steps = min(steps, config.steps - done)
    losses, errors, recorded = [], [], []
    bar = tqdm.tqdm(
        total=steps,
        desc=f"epoch {epoch}/{config.epochs}",
        file=sys.stderr,
        leave=False,
        disable=not progress,
        dynamic_ncols=True,
        smoothing=0.1,
    )

    def check(loss: float) -> None:
      if not math.isfinite(loss):
        _raise_nonfinite(losses, epoch, last_good, workdir)

    with bar:
      completed = step_progress.StepProgress(bar, check)
      for step in range(steps):
        state, metrics = program.step(state, images, labels, np.int32(step))
        losses.append(metrics["loss"])
        errors.append(metrics["errors"])
        global_step = done + step
        if record is not None and global_step % record.every == 0:
          recorded.append((global_step, metrics["before"], metrics["after"]))
        completed.dispatched(metrics["loss"])
      completed.finish()
    losses_np = np.asarray(jax.device_get(losses), np.float64)
    errors_np = np.asarray(jax.device_get(errors), np.int64)
    train_seconds = time.perf_counter() - t_start
    if not np.isfinite(losses_np).all():
      _raise_nonfinite(losses, epoch, last_good, workdir)

    test_loss = test_error = None
    t_eval = time.perf_counter()
    if epoch % config.eval_every == 0 or epoch == config.epochs:
      result = jax.device_get(
          program.evaluate(
              state, test_data.images, test_data.labels, test_data.mask
          )
      )
      count = int(result["count"])
      test_loss = float(result["loss_sum"]) / count
      test_error = int(result["errors"]) / count
      best = test_error if best is None else min(best, test_error)
    eval_seconds = time.perf_counter() - t_eval
    seconds = time.perf_counter() - t_start
    elapsed += seconds
    precise = {}
    if program.precise is not None:
      # Timed apart, so that `seconds` means the same with or without it.
      t_precise = time.perf_counter()
      precise = {"test_loss_precise": None, "test_error_precise": None}
      if test_error is not None:
        result = jax.device_get(
            program.precise(
                state,
                images,
                test_data.images,
                test_data.labels,
                test_data.mask,
            )
        )
        count = int(result["count"])
        precise = {
            "test_loss_precise": float(result["loss_sum"]) / count,
            "test_error_precise": int(result["errors"]) / count,
        }
      precise["precise_seconds"] = time.perf_counter() - t_precise
    row = {
        "epoch": epoch,
        "step": done + steps,
        "train_loss": float(losses_np.mean()),
        "train_error": float(errors_np.sum() / (steps * config.batch_size)),
        "test_loss": test_loss,
        "test_error": test_error,
        "best_test_error": best,
        "seconds": seconds,
        "train_seconds": train_seconds,
        "data_seconds": data_seconds,
        "eval_seconds": eval_seconds,
        "images_per_sec": steps * config.batch_size / train_seconds,
        "elapsed_seconds": elapsed,
        **precise,
    }
    history.append(row)
    # Before the save: see activations.keep_activations.
    if primary and record is not None:
      activations.append_activations(workdir, record, epoch, recorded)
    if checkpointer.due(epoch, checkpoint_every, config.epochs):
      checkpointer.save(epoch, train_state.state_dict(state), history)
      last_good = epoch
    if primary:
      checkpointing.write_metrics(workdir, history)
    log(_summary_line(row, config.epochs))
    if on_first_epoch is not None and epoch == start:
      for line in on_first_epoch(config, seconds, list(devices), epoch=epoch):
        log(line)
    note = watch.after_epoch(epoch, losses_np)  # once: loss at chance level
    if note:
      log(note)
