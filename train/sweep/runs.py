"""Running and resuming a sweep's runs, each a CLI subprocess in its folder.

A run is finished when its folder's ``config.json`` matches it and its
``metrics.jsonl`` lists all its epochs, or with ``--steps`` all its steps
(:func:`is_finished`); the others are
started, or resumed by the CLI from their last checkpoint, a few at a time
(:func:`run_sweep`). Each run dies with the sweep and holds a lock on its
folder, so that two sweeps sharing a folder never run the same run twice.
"""

from __future__ import annotations

from collections.abc import Sequence
import ctypes
import dataclasses
import fcntl
import json
import math
import os
from pathlib import Path
import signal
import subprocess
import sys
import time
from typing import TextIO

from train import configs
from train import run_files
from train.data import info as data_info
from train.loop import checkpointing
from train.sweep.grid import Run
from train.sweep.progress import Progress

_REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_FILE = "sweep.log"
STATUS_FILE = "sweep_status.json"
_LOCK_FILE = ".sweep.lock"


def _rows(run_dir: Path) -> list[dict]:
  """``metrics.jsonl``'s rows; none where it is missing or unreadable."""
  try:
    return run_files.read_metrics(run_dir)
  except (OSError, ValueError):
    return []


def epochs_done(run_dir: Path) -> int:
  """Epochs recorded in a run directory's ``metrics.jsonl`` (0 if none)."""
  return max((row.get("epoch", 0) for row in _rows(run_dir)), default=0)


def steps_done(run_dir: Path) -> int:
  """Optimizer steps recorded in ``metrics.jsonl`` (0 if none)."""
  return max((row.get("step", 0) for row in _rows(run_dir)), default=0)


def planned_epochs(run: Run, run_dir: Path) -> int:
  """The epochs ``run`` trains: ``epochs``, or those its ``steps`` take.

  A ``--steps`` run's first row says its steps per epoch; before it has
  one, the dataset's canonical training set does (a smaller ``--data-dir``
  copy then runs more epochs than this counts).
  """
  config = run.config
  if config.steps is None:
    return config.epochs
  first = [row for row in _rows(run_dir) if row.get("epoch") == 1]
  if first and first[0].get("step"):
    per_epoch = first[0]["step"]
  else:
    images = config.train_subset or data_info.TRAIN_IMAGES[config.dataset]
    per_epoch = max(1, images // config.batch_size)
  return math.ceil(config.steps / per_epoch)


def is_finished(run: Run, run_dir: Path) -> bool:
  """Whether ``run_dir`` holds ``run`` with all its epochs (or steps)."""
  try:
    stored = checkpointing.read_config(run_dir)
  except checkpointing.RunDirError:
    return False
  if configs.differences(stored, run.config):
    return False
  if run.config.steps is not None:
    return steps_done(run_dir) >= run.config.steps
  return epochs_done(run_dir) >= run.config.epochs


def _child_setup(cores: Sequence[int] | None) -> None:
  """Runs in the child before exec: dies with the sweep, pinned to cores."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass
  if cores:
    try:
      os.sched_setaffinity(0, cores)
    except (OSError, AttributeError):
      pass
  os.setpgrp()  # Ctrl-C reaches the sweep, which then stops its runs


@dataclasses.dataclass
class _Active:
  run: Run
  process: subprocess.Popen
  log: TextIO
  lock: TextIO
  slot: int
  started: float
  start_epochs: int


def _try_lock(run_dir: Path) -> TextIO | None:
  run_dir.mkdir(parents=True, exist_ok=True)
  handle = open(run_dir / _LOCK_FILE, "w")  # pylint: disable=consider-using-with
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    handle.close()
    return None
  return handle


def _last_error_line(log_path: Path) -> str:
  try:
    lines = log_path.read_text(errors="replace").splitlines()
  except OSError:
    return ""
  errors = [line for line in lines if ": error: " in line]
  return (errors or [line for line in lines if line.strip()] or [""])[-1]


def run_sweep(
    runs: Sequence[Run],
    sweep_dir: Path,
    *,
    module: str,
    jobs: int,
    devices_per_run: int,
    stream: TextIO = sys.stderr,
    poll_seconds: float = 1.0,
) -> int:
  """Runs (or resumes) every run; returns the number that failed."""
  sweep_dir.mkdir(parents=True, exist_ok=True)
  planned = {r.name: planned_epochs(r, sweep_dir / r.name) for r in runs}
  total_epochs = sum(planned.values())
  progress = Progress(stream, len(runs), total_epochs)
  pending = []
  done_runs = 0
  for run in runs:
    if is_finished(run, sweep_dir / run.name):
      done_runs += 1
    else:
      pending.append(run)
  cores = (
      sorted(os.sched_getaffinity(0))
      if hasattr(os, "sched_getaffinity")
      else list(range(os.cpu_count() or 1))
  )
  pin = jobs * devices_per_run <= len(cores)
  free_slots = list(range(jobs))
  active: list[_Active] = []
  busy_elsewhere: list[Run] = []
  failed = 0
  new_epochs = 0

  def epochs_now() -> int:
    return sum(
        min(epochs_done(sweep_dir / r.name), planned[r.name]) for r in runs
    )

  env = dict(os.environ)
  env["GBN_HOST_DEVICES"] = str(devices_per_run)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(_REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
  )
  if jobs > 1:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / jobs:.3f}")

  def start(run: Run, slot: int) -> bool:
    run_dir = sweep_dir / run.name
    lock = _try_lock(run_dir)
    if lock is None:
      return False
    (run_dir / STATUS_FILE).unlink(missing_ok=True)
    log = open(run_dir / LOG_FILE, "a")  # pylint: disable=consider-using-with
    command = [
        sys.executable,
        "-m",
        module,
        *run.argv,
        "--workdir",
        str(run_dir),
        "--no-progress",
    ]
    log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
    log.flush()
    slot_cores = (
        cores[slot * devices_per_run : (slot + 1) * devices_per_run]
        if pin
        else None
    )
    process = subprocess.Popen(  # pylint: disable=consider-using-with
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=lambda: _child_setup(slot_cores),
    )
    active.append(
        _Active(
            run,
            process,
            log,
            lock,
            slot,
            time.monotonic(),
            epochs_done(run_dir),
        )
    )
    return True

  def finish(item: _Active, returncode: int) -> None:
    nonlocal done_runs, failed
    run_dir = sweep_dir / item.run.name
    item.log.close()
    if returncode == 0 and is_finished(item.run, run_dir):
      done_runs += 1
    else:
      failed += 1
      status = {
          "status": "failed",
          "returncode": returncode,
          "error": _last_error_line(run_dir / LOG_FILE),
          "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
      }
      checkpointing.atomic_write_text(
          run_dir / STATUS_FILE, json.dumps(status, indent=2) + "\n"
      )
      progress.message(
          f"sweep: {item.run.name} failed (exit {returncode}): "
          f"{status['error']} [{run_dir / LOG_FILE}]"
      )
    fcntl.flock(item.lock, fcntl.LOCK_UN)
    item.lock.close()
    free_slots.append(item.slot)
    free_slots.sort()

  progress.update(done_runs, epochs_now(), 0, failed, force=True)
  try:
    while pending or active:
      while pending and free_slots:
        run = pending.pop(0)
        if start(run, free_slots[0]):
          free_slots.pop(0)
        else:
          busy_elsewhere.append(run)
      for item in list(active):
        code = item.process.poll()
        if code is not None:
          active.remove(item)
          new_epochs += max(
              0, epochs_done(sweep_dir / item.run.name) - item.start_epochs
          )
          finish(item, code)
      running_new = sum(
          max(0, epochs_done(sweep_dir / a.run.name) - a.start_epochs)
          for a in active
      )
      progress.update(done_runs, epochs_now(), new_epochs + running_new, failed)
      if pending or active:
        time.sleep(poll_seconds)
  except KeyboardInterrupt:
    for item in active:
      item.process.send_signal(signal.SIGINT)  # the CLI saves, then exits
    for item in active:
      try:
        item.process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        item.process.kill()
        item.process.wait()
      item.log.close()
    progress.message(
        "\nsweep: interrupted; finished epochs are kept, rerun the same "
        "command to continue"
    )
    raise
  progress.update(done_runs, epochs_now(), new_epochs, failed, force=True)
  if progress.tty:
    stream.write("\n")
  for run in busy_elsewhere:
    progress.message(
        f"sweep: {run.name} was skipped: another sweep is " "running it"
    )
  return failed + len(busy_elsewhere)
