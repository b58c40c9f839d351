"""Run directories: config.json, metrics.jsonl and orbax checkpoints.

A run directory (``--workdir``) holds:

* ``config.json``: the run's :class:`train.configs.Config`. A later command
  with a different config (apart from ``epochs``) is refused rather than
  resumed into, and nothing in the directory is changed; unless the earlier
  run never finished an epoch (no metrics, no checkpoint), whose config is
  then replaced.
* ``checkpoints/<epoch>/``: orbax checkpoints after each epoch, or every
  ``--checkpoint-every`` epochs and after the last (the last
  :data:`MAX_TO_KEEP` are kept, and with ``--keep-checkpoints-every K``
  also every one whose epoch is a multiple of ``K``), each with the train
  state and the metrics history up to that epoch.
* ``metrics.jsonl``: one JSON row per epoch. It is rewritten from the
  checkpoint's history on resume, so after a resume it never lists an epoch
  that no checkpoint holds (those epochs are trained again, with the same
  results).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import json
import os
from pathlib import Path
import shutil
import signal
import tempfile
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from train import configs

# Re-exported: the reader of metrics.jsonl is jax-free, for the report.
from train.run_files import CURVATURE_FILE as CURVATURE_FILE
from train.run_files import METRICS_FILE as METRICS_FILE
from train.run_files import read_metrics as read_metrics

CONFIG_FILE = "config.json"
# One line per command that trained in the run: the first epoch it trained
# and where its data came from. Not a Config field: configs name runs, and
# the same run may be resumed from another copy of the same data.
DATA_SOURCE_FILE = "data_source.txt"
CHECKPOINT_DIR = "checkpoints"
MAX_TO_KEEP = 3


def check_every(name: str, every: Any) -> None:
  """Raises ValueError naming ``name`` unless ``every`` is a positive int."""
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise ValueError(f"{name} must be a positive integer, got {every!r}")


class RunDirError(RuntimeError):
  """The workdir holds a different, unreadable or foreign run."""


class CheckpointError(RuntimeError):
  """A checkpoint can't be restored (corrupt, or from another model)."""


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def atomic_write_text(path: Path, text: str) -> None:
  """Writes via a temporary file + rename, so a kill leaves old or new."""
  fd, tmp = tempfile.mkstemp(
      dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
  )
  try:
    # mkstemp makes the file 0600; a run's outputs are meant to be shared.
    os.fchmod(fd, 0o666 & ~_umask())
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def read_config(workdir: str | os.PathLike[str]) -> configs.Config:
  """Reads ``config.json`` of a run directory.

  Raises:
    RunDirError: If the file is missing or not a valid config.
  """
  path = Path(workdir) / CONFIG_FILE
  try:
    return configs.Config.from_json(json.loads(path.read_text()))
  except FileNotFoundError:
    raise RunDirError(f"{path} does not exist") from None
  except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
    raise RunDirError(
        f"{path} is not a valid gbn-jax training config ({e}); choose a "
        "new --workdir, or pass --overwrite to delete this run"
    ) from None


def write_metrics(
    workdir: str | os.PathLike[str], history: Sequence[dict[str, Any]]
) -> None:
  """Atomically replaces ``metrics.jsonl`` with ``history``."""
  text = "".join(json.dumps(row) + "\n" for row in history)
  atomic_write_text(Path(workdir) / METRICS_FILE, text)


def prepare_workdir(
    workdir: str | os.PathLike[str],
    config: configs.Config,
    *,
    overwrite: bool = False,
    is_primary: bool = True,
) -> None:
  """Checks that ``config`` may run in ``workdir``; records a new run's.

  An existing, compatible ``config.json`` is left alone here; the caller
  rewrites it (:func:`write_config`, to record a raised ``epochs``) once the
  checkpoint has been restored.

  Args:
    workdir: The run directory (created if missing).
    config: The fully resolved config of this run.
    overwrite: Delete an existing run's files (``config.json``,
      ``metrics.jsonl``, ``data_source.txt``, ``checkpoints/``) instead of
      refusing.
    is_primary: Only the primary process writes files.

  Raises:
    RunDirError: If the workdir holds a run with a different config, an
      unreadable ``config.json``, or checkpoints/metrics without one.
  """
  workdir = Path(workdir)
  config_path = workdir / CONFIG_FILE
  ours = [
      workdir / CONFIG_FILE,
      workdir / METRICS_FILE,
      workdir / CHECKPOINT_DIR,
  ]
  if overwrite:
    if is_primary:
      for path in [*ours, workdir / DATA_SOURCE_FILE]:
        if path.is_dir():
          shutil.rmtree(path)
        elif path.exists():
          path.unlink()
  elif config_path.exists():
    stored = read_config(workdir)
    diff = configs.differences(stored, config)
    started = read_metrics(workdir) or any((workdir / CHECKPOINT_DIR).glob("*"))
    if diff and not started:  # the earlier run failed before its first epoch
      if is_primary:
        write_config(workdir, config)
    elif diff:
      raise RunDirError(
          f"{workdir} holds a run with a different config, so it can't be "
          "resumed:\n  " + "\n  ".join(diff) + "\nChoose a new --workdir, or "
          "pass --overwrite to delete the existing run."
      )
  elif any(path.exists() for path in ours[1:]):
    raise RunDirError(
        f"{workdir} has {METRICS_FILE} or {CHECKPOINT_DIR}/ but no "
        f"{CONFIG_FILE}, so it can't be checked against this run; choose a "
        "new --workdir, or pass --overwrite to delete them."
    )
  if is_primary and not config_path.exists():
    write_config(workdir, config)


def append_data_source(
    workdir: str | os.PathLike[str], epoch: int, source: str
) -> None:
  """Appends ``from epoch EPOCH: SOURCE`` to ``data_source.txt``."""
  with open(Path(workdir) / DATA_SOURCE_FILE, "a") as f:
    f.write(f"from epoch {epoch}: {source}\n")


def write_config(
    workdir: str | os.PathLike[str], config: configs.Config
) -> None:
  """Atomically writes ``config.json`` (creating ``workdir``)."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  atomic_write_text(
      workdir / CONFIG_FILE, json.dumps(config.to_json(), indent=2) + "\n"
  )


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
  """Holds back Ctrl-C until the block is done (a save is never cut short)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  received = []
  previous = signal.signal(
      signal.SIGINT, lambda signum, frame: received.append(signum)
  )
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    if received:
      raise KeyboardInterrupt


class Checkpointer:
  """Saves and restores (train state, metrics history) per epoch.

  Checkpoints are numbered by epoch.

  Args:
    workdir: The run directory; checkpoints go to ``workdir/checkpoints``.
    keep_every: Also keep, for good, every checkpoint whose epoch is a
      multiple of this (``None``: none). A later save by a Checkpointer
      without it deletes those beyond the latest ``max_to_keep``.
    max_to_keep: How many of the latest checkpoints to keep.
  """

  def __init__(
      self,
      workdir: str | os.PathLike[str],
      keep_every: int | None = None,
      max_to_keep: int = MAX_TO_KEEP,
  ):
    self.directory = Path(workdir).absolute() / CHECKPOINT_DIR
    self.keep_every = keep_every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        keep_period=keep_every,
        create=True,
        # Saves are small and synchronous: once save() returns, the epoch is
        # on disk, and a kill mid-save leaves only a tmp dir that is removed.
        enable_async_checkpointing=False,
        cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def due(self, epoch: int, every: int, last: int) -> bool:
    """Whether to save ``epoch``: one of ``every``'s epochs, a kept one
    (``keep_every``) or the ``last``."""
    kept = self.keep_every is not None and epoch % self.keep_every == 0
    return epoch % every == 0 or kept or epoch == last

  def latest_epoch(self) -> int | None:
    """The latest saved epoch, or ``None``."""
    return self._manager.latest_step()

  def epochs(self) -> list[int]:
    """Every saved epoch, ascending."""
    return sorted(self._manager.all_steps())

  def save(
      self, epoch: int, state: Any, history: Sequence[dict[str, Any]]
  ) -> None:
    """Saves ``state`` (a pytree of arrays) and ``history`` for ``epoch``."""
    with _sigint_deferred():
      self._manager.save(
          epoch,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              history=ocp.args.JsonSave(list(history)),
          ),
      )
      self._manager.wait_until_finished()

  def restore(
      self, epoch: int, target: Any
  ) -> tuple[Any, list[dict[str, Any]]]:
    """Restores the checkpoint of ``epoch``.

    Args:
      epoch: Which checkpoint.
      target: A pytree like the saved state (arrays or
        ``jax.ShapeDtypeStruct``) giving structure, shapes, dtypes and where
        to place the restored arrays: a leaf's sharding, or the default
        device for a leaf without one, whatever devices wrote the checkpoint.

    Returns:
      The restored state and metrics history.

    Raises:
      CheckpointError: If the checkpoint is unreadable or doesn't match.
    """
    # Orbax refuses a leaf without a sharding when the checkpoint was written
    # from other devices (a run trained on several, measured on one).
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default
        ),
        target,
    )
    try:
      restored = self._manager.restore(
          epoch,
          args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract),
              history=ocp.args.JsonRestore(),
          ),
      )
      history = restored["history"]
      if (
          not isinstance(history, list)
          or len(history) != epoch
          or any(row.get("epoch") != i + 1 for i, row in enumerate(history))
      ):
        raise ValueError(
            "its metrics history does not list epochs " f"1..{epoch}"
        )
    except Exception as e:  # orbax raises many types for bad files
      raise CheckpointError(
          f"can't restore checkpoint {self.directory / str(epoch)}: it is "
          f"corrupt or was written by a different model/version "
          f"({type(e).__name__}: {e}). Nothing was changed; delete that "
          "checkpoint directory to resume from an earlier one, or pass "
          "--overwrite (or a new --workdir) to start over."
      ) from e
    return restored["state"], history

  def close(self) -> None:
    self._manager.close()
