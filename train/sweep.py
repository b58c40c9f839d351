"""``python -m train.sweep --sweep-dir DIR [train flags]``: a grid of runs.

Every flag of ``python -m train.cifar`` is accepted, and any flag that takes
a value may be a comma-separated list; the sweep runs the cross product::

  python -m train.sweep --sweep-dir results/fmnist --defaults mnist \\
      --dataset fashion_mnist --norm bn,sqd1,rsd --lr 0.01,0.1 --seed 0,1,2

``--defaults`` picks the CLI whose defaults fill the flags left out; without
it the dataset decides: ``--dataset mnist`` or ``fashion_mnist`` takes the
``train.mnist`` defaults (LeNet, batch 1000, lr 0.01), any other dataset or
none the ``train.cifar`` ones (ResNet20); a ``--dataset`` list of both kinds
is an error that asks for ``--defaults``.

Each run is a ``python -m train.cifar`` (or ``train.mnist`` with
``--defaults mnist``) subprocess in its own run directory under
``--sweep-dir``, named after its config (:func:`run_name`): ``config.json``,
``metrics.jsonl`` and ``checkpoints/`` as the CLI writes them, plus
``sweep.log`` (the run's output) and, after a failure, ``sweep_status.json``.

Resuming: a run whose ``metrics.jsonl`` already lists all its epochs is
skipped without starting a process, and an unfinished one resumes from its
last checkpoint (the CLI's own resume). Killing the sweep, even with
``kill -9``, and rerunning the same command continues where it stopped: the
runs die with the sweep (Linux ``PR_SET_PDEATHSIG``), each epoch is on disk
once its row is in ``metrics.jsonl``, and a lock per run directory keeps
two sweeps sharing a folder from running the same run twice.

Using the machine: on a CPU the default is one run at a time over all cores
(one XLA host device per core, as the CLI makes). Two single-core runs at
once were measured no faster in total on the 2-core development machine
(Fashion-MNIST LeNet, 2 runs x 2 epochs: 1m56s against 1m59s), and one run
at a time keeps each run's seconds free of the other's load, which the
wall-clock comparisons need. ``--jobs N --devices-per-run M`` runs N at once,
each pinned to its own M cores. On a GPU the default is one run at a time;
``--jobs N`` shares the card between N runs, each limited to ``0.9 / N`` of
its memory.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import ctypes
import dataclasses
import fcntl
import itertools
import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import time
from typing import Any, TextIO

from train import checkpointing
from train import configs
from train import main as train_main

_PROG = "python -m train.sweep"
_REPO_ROOT = Path(__file__).resolve().parents[1]
#: The CLI module of each ``--defaults`` choice.
DEFAULTS = {
    "cifar": (configs.CIFAR, "train.cifar"),
    "mnist": (configs.MNIST, "train.mnist"),
}
#: Flags the sweep owns: every run gets its own workdir and no progress bar.
_RESERVED = ("--workdir", "--overwrite", "--no-progress")
LOG_FILE = "sweep.log"
STATUS_FILE = "sweep_status.json"
_LOCK_FILE = ".sweep.lock"


@dataclasses.dataclass(frozen=True)
class Run:
  """One point of the grid.

  Attributes:
    name: Its directory name under the sweep dir.
    argv: The CLI flags of the run (without ``--workdir``).
    config: The config those flags give, ``augment`` resolved.
  """

  name: str
  argv: tuple[str, ...]
  config: configs.Config


def _format_value(value: Any) -> str:
  return repr(value) if isinstance(value, float) else str(value)


def run_name(config: configs.Config, defaults: configs.Config) -> str:
  """A directory name that says the config.

  Dataset, model, norm, batch size, learning rate and seed always appear;
  other fields only where they differ from ``defaults`` (``epochs`` never:
  raising it extends a run), so a run keeps its name whichever grid it is
  part of.

  >>> run_name(configs.MNIST.replace(norm="sqd:0.3", seed=2), configs.MNIST)
  'mnist-lenet-sqd_0.3-b1000-lr0.01-seed2'
  >>> run_name(configs.MNIST.replace(momentum=0.9, augment=True,
  ...                                renorm=True), configs.MNIST)
  'mnist-lenet-bn-b1000-lr0.01-m0.9-renorm-aug-seed0'
  >>> run_name(configs.MNIST.replace(norm="mad", calibration="normal"),
  ...          configs.MNIST)
  'mnist-lenet-mad-b1000-lr0.01-cal_normal-seed0'
  """
  # Dataset and model lead (unprefixed), epochs never shows (raising it
  # extends a run), augment is spelled aug/noaug just before the seed, which
  # comes last; the other fields follow train.configs.FIELDS.
  parts = [config.dataset, config.model]
  always = {"norm", "batch_size", "learning_rate", "seed"}
  named = [
      (name, spec.run_name)
      for name, spec in configs.FIELDS.items()
      if spec.run_name is not None and name != "seed"
  ]
  for field, prefix in named + [("seed", configs.FIELDS["seed"].run_name)]:
    value = getattr(config, field)
    if field == "seed" and config.augment != defaults.augment:
      parts.append("aug" if config.augment else "noaug")
    if field in always or value != getattr(defaults, field):
      text = prefix + ("" if isinstance(value, bool) else _format_value(value))
      parts.append(text.replace(":", "_"))
  return "-".join(parts)


def _split_grid(argv: Sequence[str]) -> list[list[tuple[str, ...]]]:
  """Splits the train flags into axes: one list of flag tuples per flag."""
  axes: list[list[tuple[str, ...]]] = []
  i = 0
  while i < len(argv):
    token = argv[i]
    flag, eq, inline = token.partition("=")
    if flag in _RESERVED:
      raise ValueError(f"{flag} is set by the sweep for each run; leave it out")
    takes_value = train_main.flag_takes_value(flag)
    if takes_value is None:
      raise ValueError(f"unrecognized argument {token!r} (see --help)")
    if not takes_value:
      axes.append([(flag,)])
      i += 1
      continue
    if eq:
      values = inline
    elif i + 1 < len(argv):
      values = argv[i + 1]
      i += 1
    else:
      raise ValueError(f"{flag} needs a value")
    items = [v.strip() for v in values.split(",")]
    if any(not v for v in items):
      raise ValueError(f"{flag} {values!r}: empty item in the list")
    axes.append([(flag, v) for v in items])
    i += 1
  return axes


def expand(argv: Sequence[str], defaults_name: str = "cifar") -> list[Run]:
  """The runs of a grid, in order, duplicates removed.

  Args:
    argv: Train flags, each value possibly a comma-separated list.
    defaults_name: A key of :data:`DEFAULTS`.

  Returns:
    One :class:`Run` per point of the cross product. The last flag varies
    fastest, so ``--seed 0,1 --norm bn,sqd1`` runs every norm of seed 0
    before seed 1.

  Raises:
    ValueError: On an unknown or reserved flag, or an invalid value (the
      message is the CLI's own).
  """
  defaults, module = DEFAULTS[defaults_name]
  parser = train_main.build_parser(defaults, f"python -m {module}")
  parser.exit_on_error = False
  axes = _split_grid(argv)
  runs, seen = [], set()
  for combo in itertools.product(*axes):
    flags = tuple(part for pair in combo for part in pair)
    try:
      args = parser.parse_args(flags)
    except argparse.ArgumentError as e:
      raise ValueError(str(e)) from None
    config = configs.validate(train_main.config_from_args(args, defaults))
    config = _resolve_augment(config)
    name = run_name(
        config, _resolve_augment(defaults.replace(dataset=config.dataset))
    )
    if name in seen:
      continue
    seen.add(name)
    runs.append(Run(name=name, argv=flags, config=config))
  return runs


#: The ``--defaults`` that each dataset implies when the flag is left out.
_DATASET_DEFAULTS = {"mnist": "mnist", "fashion_mnist": "mnist"}


def implied_defaults(argv: Sequence[str]) -> str:
  """The ``--defaults`` that the train flags' ``--dataset`` values imply.

  mnist and fashion_mnist imply ``mnist`` (LeNet, as ``train.mnist``), the
  others and no ``--dataset`` ``cifar``: the CIFAR defaults' ResNet20 on
  28x28 digits is never what a sweep without ``--defaults`` means.

  Raises:
    ValueError: If the datasets imply different defaults (then
      ``--defaults`` must say which).
  """
  datasets = []
  for i, token in enumerate(argv):
    flag, eq, inline = token.partition("=")
    if flag == "--dataset":
      values = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
      datasets += [v.strip() for v in values.split(",") if v.strip()]
  implied = sorted({_DATASET_DEFAULTS.get(d, "cifar") for d in datasets})
  if len(implied) > 1:
    raise ValueError(
        f"--dataset {','.join(datasets)} mixes datasets whose defaults "
        "differ (mnist/fashion_mnist: --defaults mnist, the others: "
        "--defaults cifar); pass --defaults, or sweep them apart"
    )
  return implied[0] if implied else "cifar"


def _resolve_augment(config: configs.Config) -> configs.Config:
  if config.augment is not None:
    return config
  from train import input_pipeline  # pylint: disable=g-import-not-at-top

  info = input_pipeline.dataset_info(config.dataset)
  return config.replace(augment=bool(info.augment_by_default))


def epochs_done(run_dir: Path) -> int:
  """Epochs recorded in a run directory's ``metrics.jsonl`` (0 if none)."""
  try:
    rows = checkpointing.read_metrics(run_dir)
  except (OSError, ValueError):
    return 0
  return max((row.get("epoch", 0) for row in rows), default=0)


def is_finished(run: Run, run_dir: Path) -> bool:
  """Whether ``run_dir`` holds ``run`` with all its epochs."""
  try:
    stored = checkpointing.read_config(run_dir)
  except checkpointing.RunDirError:
    return False
  return (
      not configs.differences(stored, run.config)
      and epochs_done(run_dir) >= run.config.epochs
  )


def _accelerator_backend() -> str:
  """JAX's default backend, asked of a subprocess (this one keeps no device)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]
  except (subprocess.SubprocessError, IndexError):
    return "cpu"


def plan_slots(
    jobs: str, devices_per_run: str, cores: int, backend: str
) -> tuple[int, int]:
  """``(jobs, devices per run)`` from the flags (``auto`` or a number).

  >>> plan_slots("auto", "auto", 2, "cpu")
  (1, 2)
  >>> plan_slots("auto", "1", 2, "cpu")
  (2, 1)
  >>> plan_slots("auto", "auto", 16, "gpu")
  (1, 1)
  """
  if devices_per_run != "auto":
    per_run = int(devices_per_run)
  else:
    per_run = cores if backend == "cpu" else 1
  if jobs != "auto":
    return int(jobs), per_run
  if backend != "cpu":
    return 1, per_run
  return max(1, cores // per_run), per_run


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


def _format_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return (
      f"{hours}h{rest // 60:02d}m"
      if hours
      else f"{rest // 60}m{rest % 60:02d}s"
  )


def eta_seconds(
    epochs_left: int,
    new_epochs: int,
    at_last_epoch: float,
    elapsed: float,
) -> float | None:
  """Seconds left, from the time per epoch this sweep has finished.

  The rate is measured when the last epoch finished (``at_last_epoch``
  seconds into the sweep, after ``new_epochs`` epochs), and the estimate then
  made counts down with the clock until the next one finishes: it never
  rises while nothing finishes, and holds at 0 once overdue.

  Args:
    epochs_left: Epochs still to train.
    new_epochs: Epochs this sweep has trained so far (resumed ones excluded).
    at_last_epoch: Seconds from the sweep's start to the last of them.
    elapsed: Seconds from the sweep's start to now.

  Returns:
    The estimate, or ``None`` before the first epoch has finished.
  """
  if not new_epochs:
    return None
  estimate = epochs_left * at_last_epoch / new_epochs
  return max(0.0, estimate - (elapsed - at_last_epoch))


class _Progress:
  """One status line: runs done/total, epochs done/total, ETA."""

  def __init__(
      self,
      stream: TextIO,
      total_runs: int,
      total_epochs: int,
      clock: Callable[[], float] = time.monotonic,
  ):
    self.stream = stream
    self.tty = stream.isatty()
    self.total_runs, self.total_epochs = total_runs, total_epochs
    self.clock = clock
    self.started = clock()
    self.last_text, self.last_print = "", 0.0
    # When the count of new epochs last changed: the ETA's rate is from then.
    self.new_epochs, self.at_last_epoch = 0, 0.0

  def update(
      self,
      runs_done: int,
      epochs_done: int,
      new_epochs: int,
      failed: int,
      force: bool = False,
  ) -> None:
    now = self.clock()
    elapsed = now - self.started
    if new_epochs != self.new_epochs:
      self.new_epochs, self.at_last_epoch = new_epochs, elapsed
    left = self.total_epochs - epochs_done
    seconds = eta_seconds(left, new_epochs, self.at_last_epoch, elapsed)
    eta = (
        "done"
        if not left
        else "ETA ?"
        if seconds is None
        else "ETA " + _format_duration(seconds)
    )
    text = (
        f"sweep: runs {runs_done}/{self.total_runs}, epochs "
        f"{epochs_done}/{self.total_epochs}"
        + (f", {failed} failed" if failed else "")
        + f", {_format_duration(elapsed)} elapsed, {eta}"
    )
    if self.tty:
      self.stream.write("\r" + text.ljust(len(self.last_text)))
      self.stream.flush()
    elif force or (text != self.last_text and now - self.last_print > 60):
      self.stream.write(text + "\n")
      self.stream.flush()
      self.last_print = now
    self.last_text = text

  def message(self, line: str) -> None:
    if self.tty:
      self.stream.write("\r" + " " * len(self.last_text) + "\r")
    self.stream.write(line + "\n")
    self.stream.flush()
    if self.tty:
      self.stream.write(self.last_text)


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
  total_epochs = sum(r.config.epochs for r in runs)
  progress = _Progress(stream, len(runs), total_epochs)
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
        min(epochs_done(sweep_dir / r.name), r.config.epochs) for r in runs
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


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=_PROG,
      description=(
          "Run the cross product of train flags, each value possibly a "
          "comma-separated list, one run directory per point under "
          "--sweep-dir. Rerunning the same command skips finished runs and "
          "resumes interrupted ones."
      ),
      epilog="Train flags (any value may be a comma-separated list): see "
      "`python -m train.cifar --help`. Example: "
      + __doc__.split("::")[1].strip().replace("\\\n", "").replace("  ", " "),
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add = parser.add_argument
  add(
      "--sweep-dir",
      required=True,
      help="folder of the sweep's run directories (created if missing)",
  )
  add(
      "--defaults",
      choices=tuple(DEFAULTS),
      default=None,
      help="the CLI whose defaults apply to flags left out: train.cifar "
      "(ResNet20 CIFAR-10) or train.mnist (LeNet MNIST) (default: from "
      "--dataset: mnist for mnist and fashion_mnist, cifar otherwise or "
      "without --dataset; datasets of both kinds need --defaults)",
  )
  add(
      "--jobs",
      default="auto",
      help="runs at once (default auto: one per --devices-per-run cores on a "
      "CPU, one on an accelerator)",
  )
  add(
      "--devices-per-run",
      default="auto",
      help="XLA host devices (and cores) per run on a CPU (default auto: "
      "all cores)",
  )
  add(
      "--dry-run",
      action="store_true",
      help="list the runs and whether each is done, then exit",
  )
  return parser


def _check_count(name: str, value: str) -> None:
  if value != "auto" and not (value.isdigit() and int(value) >= 1):
    raise ValueError(
        f"{name} must be 'auto' or a positive integer, got " f"{value!r}"
    )


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args, train_argv = parser.parse_known_args(argv)
  try:
    _check_count("--jobs", args.jobs)
    _check_count("--devices-per-run", args.devices_per_run)
    if args.defaults is None:
      args.defaults = implied_defaults(train_argv)
    runs = expand(train_argv, args.defaults)
  except ValueError as e:
    parser.error(str(e))
  sweep_dir = Path(args.sweep_dir)
  if sweep_dir.exists() and not sweep_dir.is_dir():
    parser.error(f"--sweep-dir {sweep_dir} exists and is not a folder")
  if args.dry_run:
    for run in runs:
      done = epochs_done(sweep_dir / run.name)
      print(
          f"{run.name}: {min(done, run.config.epochs)}/{run.config.epochs} "
          "epochs"
      )
    return 0
  cores = (
      len(os.sched_getaffinity(0))
      if hasattr(os, "sched_getaffinity")
      else (os.cpu_count() or 1)
  )
  backend = "cpu" if args.jobs != "auto" else _accelerator_backend()
  jobs, per_run = plan_slots(args.jobs, args.devices_per_run, cores, backend)
  print(
      f"{_PROG}: {len(runs)} runs in {sweep_dir}, {jobs} at a time, "
      f"{per_run} device(s) each",
      file=sys.stderr,
  )
  try:
    failed = run_sweep(
        runs,
        sweep_dir,
        module=DEFAULTS[args.defaults][1],
        jobs=jobs,
        devices_per_run=per_run,
    )
  except KeyboardInterrupt:
    return 130
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
