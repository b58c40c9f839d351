"""Command-line entry shared by ``python -m train.cifar`` and ``train.mnist``.

The two CLI modules differ only in their defaults (:data:`train.configs.CIFAR`
and :data:`train.configs.MNIST`); every flag overrides one field of
:class:`train.configs.Config` (the flags: :mod:`train.cli_flags`).

Multi-host: when the environment variable ``JAX_COORDINATOR_ADDRESS`` is set
(with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, or on a cluster that
``jax.distributed`` detects: SLURM, Open MPI, Cloud TPU), or when
``GBN_JAX_DISTRIBUTED=1`` requests cluster auto-detection, the process calls
``jax.distributed.initialize`` before anything else and the batch is split
over the devices of all hosts. Launch the same command on every host; only
process 0 writes ``config.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import json
import os
import shutil
import sys
import time

from train import cli_flags
from train import compile_cache
from train import configs
from train.sweep import grid as sweep_grid

_EXIT_ERROR = 1
_EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
_HEARTBEAT_ENV = "GBN_DISTRIBUTED_HEARTBEAT_SECONDS"


#: The fields a CLI run's folder names whatever their value; the others
#: appear where they differ from the command's defaults.
_WORKDIR_NAMED = ("norm", "seed")


def default_workdir(
    config: configs.Config, defaults: configs.Config | None = None
) -> str:
  """The run folder of ``config`` when no ``--workdir`` is given.

  ``workdir/`` and the config's name (``train.sweep.grid.run_name``):
  dataset, model, norm, each setting that differs from ``defaults``, then
  the seed, so that a changed setting gets a folder of its own rather than
  a refusal to resume the run in the other one; ``epochs`` never appears
  (raising it extends a run), nor do flags that leave the results alone
  (progress, checkpoints, data folder). With the defaults it is
  ``workdir/DATASET-MODEL-NORM-seedSEED``.

  Args:
    config: The run's config.
    defaults: The config the command starts from (default: the one its
      dataset implies, ``train.sweep.grid.dataset_defaults``).
  """
  if defaults is None:
    defaults = sweep_grid.dataset_defaults(config.dataset)
  name = sweep_grid.run_name(config, defaults, always=_WORKDIR_NAMED)
  return os.path.join("workdir", name)


def _workdir(config: configs.Config, defaults: configs.Config) -> str:
  """:func:`default_workdir`, unless a run of this same config is in the
  folder named after its dataset, model, norm, calibration and seed alone.

  Rerunning the command that trained such a run resumes it there instead
  of starting over in a folder of its own.
  """
  workdir = default_workdir(config, defaults)
  short = default_workdir(config, config.replace(calibration="none"))
  if workdir == short or os.path.lexists(workdir):
    return workdir
  try:
    with open(os.path.join(short, "config.json"), encoding="utf-8") as f:
      stored = configs.Config.from_json(json.load(f))
  except (OSError, ValueError, TypeError):
    return workdir
  requested = sweep_grid.resolve_augment(config)
  return workdir if configs.differences(stored, requested) else short


def maybe_initialize_distributed() -> bool:
  """Calls ``jax.distributed.initialize`` when the environment asks for it.

  ``GBN_DISTRIBUTED_HEARTBEAT_SECONDS`` (default: JAX's 100) bounds how long
  a process waits for a silent peer before it stops.

  Returns:
    Whether it was called.
  """
  if not (
      os.environ.get("JAX_COORDINATOR_ADDRESS")
      or os.environ.get("GBN_JAX_DISTRIBUTED") == "1"
  ):
    return False
  import jax  # pylint: disable=g-import-not-at-top

  env_int = lambda name: (
      int(os.environ[name]) if os.environ.get(name) else None
  )
  timeouts = {}
  if env_int(_HEARTBEAT_ENV):
    timeouts["heartbeat_timeout_seconds"] = env_int(_HEARTBEAT_ENV)
  jax.distributed.initialize(
      num_processes=env_int("JAX_NUM_PROCESSES"),
      process_id=env_int("JAX_PROCESS_ID"),
      **timeouts,
  )
  return True


def _missing_folders(path: str) -> list[str]:
  """``path`` and those of its parent folders that do not exist yet,
  deepest first: what a run in ``path`` creates."""
  missing = []
  path = os.path.abspath(path)
  while not os.path.lexists(path):
    missing.append(path)
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return missing


def _remove_unstarted(created: Sequence[str]) -> None:
  """Removes a workdir this command created if nothing in it was trained.

  ``created`` is from :func:`_missing_folders` before the run: a workdir that
  existed before is never touched (it may hold another run's checkpoints),
  nor one with a metrics row or a checkpoint. Its parent folders go only if
  empty: another run may have made its own folder there meanwhile.
  """
  if not created or not os.path.isdir(created[0]):
    return
  # Deferred (load time): checkpointing loads JAX and orbax.
  from train.loop import checkpointing  # pylint: disable=g-import-not-at-top

  workdir = created[0]
  checkpoints = os.path.join(workdir, checkpointing.CHECKPOINT_DIR)
  if checkpointing.read_metrics(workdir) or (
      os.path.isdir(checkpoints) and os.listdir(checkpoints)
  ):
    return
  shutil.rmtree(workdir, ignore_errors=True)
  for parent in created[1:]:
    try:
      os.rmdir(parent)
    except OSError:
      break


def _fail(
    prog: str,
    message: str,
    distributed: bool,
    created: Sequence[str] = (),
) -> int:
  """Prints the error; a multi-process run then exits at once.

  A normal exit would wait in ``jax.distributed``'s shutdown barrier for
  peers that may be gone, until the heartbeat timeout, then abort.
  A single-process run first removes the workdir it ``created`` (see
  :func:`_remove_unstarted`), so that a failure before the first step (no
  data, say) leaves nothing behind; a multi-process run leaves it, since
  its peers may still be writing there.
  """
  if not distributed:
    _remove_unstarted(created)
  print(f"{prog}: error: {message}", file=sys.stderr)
  if distributed:
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(_EXIT_ERROR)  # pylint: disable=protected-access
  return _EXIT_ERROR


def run(
    argv: Sequence[str] | None,
    defaults: configs.Config,
    prog: str,
    about: str = "",
) -> int:
  """Parses ``argv``, trains, prints a one-line summary; returns the exit code."""
  parser = cli_flags.build_parser(defaults, prog, about)
  args = parser.parse_args(argv)
  config = cli_flags.config_from_args(args, defaults)
  try:
    configs.validate(config)
  except ValueError as e:
    parser.error(str(e))
  workdir = args.workdir or _workdir(config, defaults)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    print(
        f"{prog}: error: --workdir {workdir} exists and is not a folder",
        file=sys.stderr,
    )
    return _EXIT_ERROR
  created = _missing_folders(workdir)

  distributed = maybe_initialize_distributed()
  import jax  # pylint: disable=g-import-not-at-top

  try:  # before the first compilation
    compile_cache.configure(args.no_compile_cache)
  except ValueError as e:
    return _fail(prog, str(e), distributed)

  # Imported here for load time: `--help` and flag errors stay fast.
  from train.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from train.loop import checkpointing  # pylint: disable=g-import-not-at-top
  from train.loop import trainer as train  # pylint: disable=g-import-not-at-top
  from train.model import activations  # pylint: disable=g-import-not-at-top

  record = None
  if args.record_activations:
    record = activations.ActivationRecording(
        every=args.record_activations,
        layer=args.record_layer,
        feature=args.record_feature,
    )
  start = time.perf_counter()
  try:
    history = train.train_and_evaluate(
        config,
        workdir,
        data_dir=args.data_dir,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        record=record,
        on_first_epoch=functools.partial(_first_epoch_notes, prog=prog),
        precise_stats=args.precise_stats,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints_every=args.keep_checkpoints_every,
    )
  except (
      ValueError,
      checkpointing.RunDirError,
      checkpointing.CheckpointError,
      train.NonFiniteLossError,
      input_pipeline.DataNotFoundError,
  ) as e:
    return _fail(prog, str(e), distributed, created)
  except OSError as e:  # e.g. a --workdir that can't be created or written
    return _fail(
        prog,
        f"{e.strerror or e}: {e.filename or workdir}",
        distributed,
        created,
    )
  except jax.errors.JaxRuntimeError as e:
    if not distributed:
      raise
    return _fail(
        prog,
        f"{e}\nAnother process of this multi-process run "
        "stopped or lost contact. Rerun every process with the same "
        "command to resume from the last checkpoint.",
        distributed,
    )
  except KeyboardInterrupt:
    print(f"\n{prog}: interrupted; {_resume_hint(workdir)}", file=sys.stderr)
    return _EXIT_INTERRUPTED
  seconds = time.perf_counter() - start
  if train.jax.process_index() == 0:
    print(summary(history, config, workdir, seconds))
  return 0


def _resume_hint(workdir: str) -> str:
  """What rerunning the command will do, given the checkpoints on disk."""
  # Deferred (load time): checkpointing loads JAX and orbax.
  from train.loop import checkpointing  # pylint: disable=g-import-not-at-top

  rows = checkpointing.read_metrics(workdir) if os.path.isdir(workdir) else []
  if not rows:
    return (
        "no epoch had finished, so nothing was saved; rerunning the same "
        "command starts the run from the beginning"
    )
  last = rows[-1]["epoch"]
  saved = "epoch 1 is" if last == 1 else f"epochs 1-{last} are"
  return (
      f"{saved} saved in {workdir}; rerun the same command to resume "
      "after the last one"
  )


def _first_epoch_notes(
    config: configs.Config,
    seconds: float,
    devices: list,
    *,
    prog: str,
    epoch: int = 1,
) -> list[str]:
  """Lines printed once after the first epoch: ETA, CPU advice.

  Args:
    config: The run's config.
    seconds: How long that epoch took.
    devices: The devices it ran on.
    prog: Program name for the lines.
    epoch: The epoch it was: after a resume, the first one this command
      trained, so only the epochs after it are estimated.
  """
  remaining = max(config.epochs - epoch, 0)
  which = (
      "the first epoch"
      if epoch == 1
      else f"epoch {epoch} (the first this command trained)"
  )
  lines = []
  if remaining:
    lines.append(
        f"{prog}: {which} took {seconds:.0f}s; the "
        f"remaining {remaining} epoch{'s' if remaining > 1 else ''} "
        f"should take about {_duration(seconds * remaining)}"
    )
  if (
      all(d.platform == "cpu" for d in devices)
      and config.model == "resnet20"
      and remaining >= 5
  ):
    lines.append(
        f"{prog}: note: this runs on the CPU; ResNet20 is meant for a GPU "
        "(CPU step and epoch times: docs/performance.md). For a quicker CPU "
        "run, use --model lenet."
    )
  return lines


def _duration(seconds: float) -> str:
  minutes = seconds / 60
  if minutes < 2:
    return f"{seconds:.0f}s"
  return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def summary(
    history: Sequence[dict],
    config: configs.Config,
    workdir: str,
    seconds: float,
) -> str:
  """The one-line summary printed at the end of a run."""
  head = (
      f"{config.dataset} {config.model} norm={config.norm} seed={config.seed}"
  )
  if not history:
    return f"{head}: no epochs trained ({workdir})"
  last = history[-1]
  evaluated = [r for r in history if r["test_error"] is not None]
  best = min(evaluated, key=lambda r: r["test_error"]) if evaluated else None
  test = (
      f"test error {100 * last['test_error']:.2f}%"
      if last["test_error"] is not None
      else "not evaluated"
  )
  best_text = (
      f", best {100 * best['test_error']:.2f}% (epoch " f"{best['epoch']})"
      if best
      else ""
  )
  epochs = f"{last['epoch']} epoch{'s' if last['epoch'] != 1 else ''}"
  return (
      f"{head}: {epochs}, train loss "
      f"{last['train_loss']:.4f}, {test}{best_text}; "
      f"{last['elapsed_seconds']:.1f}s training in total, this command "
      f"{seconds:.1f}s; {workdir}"
  )
