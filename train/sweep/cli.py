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
``--sweep-dir``, named after its config (:func:`train.sweep.grid.run_name`):
``config.json``, ``metrics.jsonl`` and ``checkpoints/`` as the CLI writes
them, plus ``sweep.log`` (the run's output) and, after a failure,
``sweep_status.json``.

Resuming: a run whose ``metrics.jsonl`` already lists all its epochs (with
``--steps``, all its steps) is skipped without starting a process, and an
unfinished one resumes from its last checkpoint (the CLI's own resume). Killing the sweep, even with
``kill -9``, and rerunning the same command continues where it stopped: the
runs die with the sweep (Linux ``PR_SET_PDEATHSIG``), each epoch is on disk
once its row is in ``metrics.jsonl``, and a lock per run directory keeps
two sweeps sharing a folder from running the same run twice.

Using the machine: on a CPU the default is one run at a time over all cores
(one XLA host device per core, as the CLI makes): such a run already keeps
every core busy, and its seconds stay free of another run's load, which the
wall-clock comparisons need. ``--jobs N --devices-per-run M`` runs N at once,
each pinned to its own M cores. On a GPU the default is one run at a time;
``--jobs N`` shares the card between N runs, each limited to ``0.9 / N`` of
its memory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import os
from pathlib import Path
import subprocess
import sys

from train import cli_flags
from train.sweep import grid as sweep_grid
from train.sweep import runs as sweep_runs

_PROG = "python -m train.sweep"


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


def build_parser() -> argparse.ArgumentParser:
  # The training CLI's parser: a bad flag prints one usage line, the error
  # and where the help is, not the whole usage block that buries the error.
  parser = cli_flags._ArgumentParser(  # pylint: disable=protected-access
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
      choices=tuple(sweep_grid.DEFAULTS),
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
      args.defaults = sweep_grid.implied_defaults(train_argv)
    runs = sweep_grid.expand(train_argv, args.defaults)
  except ValueError as e:
    parser.error(str(e))
  sweep_dir = Path(args.sweep_dir)
  if sweep_dir.exists() and not sweep_dir.is_dir():
    parser.error(f"--sweep-dir {sweep_dir} exists and is not a folder")
  if args.dry_run:
    for run in runs:
      run_dir = sweep_dir / run.name
      if run.config.steps is not None:
        done = sweep_runs.steps_done(run_dir)
        print(
            f"{run.name}: {min(done, run.config.steps)}/{run.config.steps} steps"
        )
        continue
      done = sweep_runs.epochs_done(run_dir)
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
    failed = sweep_runs.run_sweep(
        runs,
        sweep_dir,
        module=sweep_grid.DEFAULTS[args.defaults][1],
        jobs=jobs,
        devices_per_run=per_run,
    )
  except KeyboardInterrupt:
    return 130
  return 1 if failed else 0
