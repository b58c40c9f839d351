"""``python -m train.curvature RUN_DIR...``: the training loss's curvature.

For each of a run's checkpoints this measures, on one fixed sample of
training batches, the curvature of the loss the optimizer minimises:

* the top ``--eigenvalues`` eigenvalues of its Hessian with respect to the
  parameters (Lanczos, ``--iterations`` steps with full reorthogonalization,
  restarted on an invariant subspace; the Ritz values, each with its residual
  bound ``|beta_m s_mi|``, which says how far it may be from an eigenvalue),
* its trace, Hutchinson's estimate ``mean z^T H z`` over ``--probes``
  Rademacher vectors ``z``, with the standard error of that mean,
* the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et
  al., 2018, appendix A): the unbiased estimates of ``|G|^2`` and of the
  per-example gradient covariance's trace ``tr(Sigma)`` from the sample's
  per-batch gradients and their mean, ``null`` where the ``|G|^2`` estimate
  is not positive (gradient below its noise).

The loss is the training step's: the batch's mean cross-entropy with the
network in training mode (each norm layer normalizes by the batch's own
statistics and reads the checkpoint's running averages only where training
does, batch renormalization; their updates are discarded), averaged over the
sample's batches, plus ``weight_decay / 2 * |w|^2`` over every parameter:
the optimizer's coupled weight decay adds ``weight_decay * w`` to the
gradient, so this is the loss it descends. The decay adds exactly
``weight_decay`` to every eigenvalue and ``weight_decay * parameters`` to the
trace; each line records both, so that it can be taken off. No augmentation:
the sample is the first ``--batches * --batch-size`` images of a seeded
permutation of the training set the run trained on (its ``--train-subset``
when it had one), the same for every checkpoint and for every run of the
same dataset, subset and seed. The products are forward-over-reverse
(``jax.jvp`` of ``jax.grad``), on one device, through every norm layer;
the suite's compiled CPU convolutions have reverse-mode rules only, so the
model is built with XLA's (``train.model.models.with_forward_mode``: the
same parameters and function).

Each measured checkpoint adds one JSON line to ``RUN_DIR/curvature.jsonl``,
beside ``metrics.jsonl``::

  {"epoch": 20, "step": 3900, "loss": 0.41, "eigenvalues": [52.1, ...],
   "eigenvalue_residuals": [0.003, ...], "trace": 810.0, "trace_stderr": 35.2,
   "noise_scale": 95.3, "gradient_norm_sq": 0.021,
   "gradient_variance_trace": 2.0, "parameters": 272474,
   "weight_decay": 0.0001, "batch_hvps": 120, "seconds": 12.0,
   "settings": {"batches": 4, "batch_size": 256, "eigenvalues": 5,
                "iterations": 20, "probes": 10, "seed": 0}}

A checkpoint that already has a line with the same settings is skipped, so a
command that was stopped resumes where it was; other settings add their own
lines. Epoch 0 stands for the parameters the run started from.

Cost: one Hessian-vector product over the sample is ``--batches``
forward-over-reverse passes, each roughly the work of a few training steps
on that batch (more on a CPU, whose training runs compiled convolutions); a checkpoint takes ``--iterations + --probes`` of them (the
noise scale's per-batch gradients come with the first), so
``batches * (iterations + probes)`` batch products in all, which is what the
progress bar counts. The Lanczos bookkeeping (``iterations^2 * parameters``
host operations) and restoring the checkpoint are small beside them; the
products are compiled once per run directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import dataclasses
import functools
import json
import math
from pathlib import Path
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from train.curvature import hessian as hessian_lib
from train.data import input_pipeline
from train.data import subset as data_subset
from train.loop import checkpointing
from train.loop import step_progress
from train.loop import train_state
from train.loop import train_steps
from train.loop import trainer as train_lib

_PROG = "python -m train.curvature"
CURVATURE_FILE = checkpointing.CURVATURE_FILE


def training_loss(
    model: flax.linen.Module, weight_decay: float
) -> hessian_lib.BatchLoss:
  """The train step's loss of one batch (normalized images) in training
  mode, plus the optimizer's weight decay as a penalty."""

  def loss(params, batch_stats, images, labels):
    logits, _ = model.apply(
        {"params": params, "batch_stats": batch_stats},
        images,
        train=True,
        mutable=["batch_stats"],
    )
    squares = sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
    return (
        jnp.mean(train_steps.cross_entropy(logits, labels))
        + 0.5 * weight_decay * squares
    )

  return loss


@functools.lru_cache(maxsize=4)
def _model_and_loss(
    config: Any, num_classes: int
) -> tuple[flax.linen.Module, hessian_lib.BatchLoss]:
  """The model and loss of a run's (resolved) config, one object per
  config: the products compile once per loss object, so that a process
  measuring a config again reuses them."""
  model = train_state.create_model(config, num_classes, forward_mode=True)
  return model, training_loss(model, config.weight_decay)


def sample_batches(
    dataset: input_pipeline.Dataset, batches: int, batch_size: int, seed: int
) -> tuple[jax.Array, jax.Array]:
  """The seeded sample: normalized images ``(batches, batch_size, ...)``
  and their labels.

  Raises:
    ValueError: The training set holds fewer than ``batches * batch_size``
      images.
  """
  count = batches * batch_size
  if count > len(dataset.train_images):
    raise ValueError(
        f"--batches {batches} of --batch-size {batch_size} is more than the "
        f"{len(dataset.train_images)} training images"
    )
  order = np.random.default_rng([seed, hessian_lib.SAMPLE]).permutation(
      len(dataset.train_images)
  )[:count]
  order = order.reshape(batches, batch_size)
  images = input_pipeline.normalize_images(
      jnp.asarray(dataset.train_images[order]), dataset.name
  )
  return images, jnp.asarray(dataset.train_labels[order])


def read_lines(workdir: str | Path) -> list[dict[str, Any]]:
  """The lines of ``curvature.jsonl`` (none if it is missing)."""
  path = Path(workdir) / CURVATURE_FILE
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def select_epochs(
    which: str | Sequence[int], saved: Sequence[int], workdir: Path
) -> list[int]:
  """The epochs ``--checkpoints`` names among the ``saved`` ones.

  Raises:
    checkpointing.RunDirError: No checkpoint to measure, or a named one is
      not saved.
  """
  if which in ("all", "last"):
    if not saved:
      raise checkpointing.RunDirError(
          f"{workdir} has no checkpoints ({checkpointing.CHECKPOINT_DIR}/ is "
          "missing or empty): train the run first, or pass --checkpoints 0 "
          "for its initial parameters"
      )
    return list(saved) if which == "all" else [saved[-1]]
  missing = [epoch for epoch in which if epoch and epoch not in saved]
  if missing:
    raise checkpointing.RunDirError(
        f"{workdir} has no checkpoint of epoch "
        + ", ".join(map(str, missing))
        + "; its checkpoints: "
        + (", ".join(map(str, saved)) or "none")
    )
  return sorted(set(which))


def run_curvature(
    workdir: str | Path,
    settings: hessian_lib.Settings = hessian_lib.Settings(),
    *,
    checkpoints: str | Sequence[int] = "all",
    data_dir: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
  """Measures a run's checkpoints into ``curvature.jsonl``.

  Args:
    workdir: A run directory.
    settings: The measurement's settings.
    checkpoints: ``"all"``, ``"last"`` or a list of epochs (0: the run's
      initial parameters).
    data_dir: Where the dataset's files are (as the training CLI's).
    progress: Show a progress bar per checkpoint on stderr.
    log: Receives one line per checkpoint measured.

  Returns:
    The lines added (checkpoints already measured with these settings are
    skipped).

  Raises:
    checkpointing.RunDirError: No readable ``config.json``, no checkpoint or
      a named one missing.
    checkpointing.CheckpointError: A checkpoint is unreadable.
    ValueError: Bad settings, a sample larger than the training set, or a
      non-finite loss.
  """
  workdir = Path(workdir)
  config = train_lib.resolve(checkpointing.read_config(workdir))
  settings = dataclasses.replace(
      settings.validate(), batch_size=settings.batch_size or config.batch_size
  )
  # A Checkpointer would create checkpoints/ in a run directory without one.
  checkpointer = None
  if (workdir / checkpointing.CHECKPOINT_DIR).is_dir():
    checkpointer = checkpointing.Checkpointer(workdir)
  try:
    saved = checkpointer.epochs() if checkpointer else []
    lines = read_lines(workdir)
    done = {
        line["epoch"]
        for line in lines
        if line["settings"] == dataclasses.asdict(settings)
    }
    todo = [
        epoch
        for epoch in select_epochs(checkpoints, saved, workdir)
        if epoch not in done
    ]
    if not todo:
      return []
    dataset = data_subset.for_config(
        input_pipeline.load_dataset(config.dataset, data_dir=data_dir), config
    )
    images, labels = sample_batches(
        dataset, settings.batches, settings.batch_size, settings.seed
    )
    model, loss = _model_and_loss(config, dataset.num_classes)

    def initial_state():
      return train_state.create_train_state(
          train_steps.init_key(config.seed),
          model,
          tuple(dataset.train_images.shape[1:]),
          train_state.create_optimizer(config),
      )

    # Shapes only: a checkpoint's restore needs no initialization.
    target = jax.eval_shape(initial_state)
    steps = len(dataset.train_images) // config.batch_size
    added = []
    for epoch in todo:
      if epoch:
        restored, _ = checkpointer.restore(
            epoch, train_state.state_dict(target)
        )
        state = flax.serialization.from_state_dict(target, restored)
      else:
        state = jax.tree.map(jnp.asarray, initial_state())
      line = _measure_state(
          loss, state, images, labels, settings, epoch, progress
      )
      line = {
          "epoch": epoch,
          "step": epoch * steps,
          **line,
          "weight_decay": config.weight_decay,
          "settings": dataclasses.asdict(settings),
      }
      lines.append(line)
      added.append(line)
      checkpointing.atomic_write_text(
          workdir / CURVATURE_FILE,
          "".join(json.dumps(row) + "\n" for row in lines),
      )
      log(_summary(workdir, line))
  finally:
    if checkpointer:
      checkpointer.close()
  return added


def _measure_state(loss, state, images, labels, settings, epoch, progress):
  """:func:`measure` of one train state, behind a progress bar."""
  products = settings.batches * (settings.iterations + settings.probes)
  bar = tqdm.tqdm(
      total=products,
      desc=f"epoch {epoch}",
      file=sys.stderr,
      leave=False,
      disable=not progress,
      dynamic_ncols=True,
  )

  def check(value: float) -> None:
    if not math.isfinite(value):
      raise ValueError(f"the training loss at epoch {epoch} is {value}")

  start = time.perf_counter()
  with bar:
    completed = step_progress.StepProgress(bar, check)
    hessian = hessian_lib.SampleHessian(
        loss,
        state.params,
        state.batch_stats,
        images,
        labels,
        completed.dispatched,
    )
    result = hessian_lib.measure(hessian, settings, settings.batch_size)
    completed.finish()
  return {
      **result,
      "batch_hvps": products,
      "seconds": time.perf_counter() - start,
  }


def _summary(workdir: Path, line: dict[str, Any]) -> str:
  noise = line["noise_scale"]
  return (
      f"{workdir} epoch {line['epoch']}: top eigenvalue "
      f"{line['eigenvalues'][0]:.4g}, trace {line['trace']:.4g} +- "
      f"{line['trace_stderr']:.2g}, noise scale "
      + ("n/a" if noise is None else f"{noise:.4g}")
  )


def _checkpoints(text: str) -> str | list[int]:
  if text in ("all", "last"):
    return text
  try:
    epochs = [int(part) for part in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not 'all', 'last' or a comma-separated list of epochs"
    ) from None
  if any(epoch < 0 for epoch in epochs):
    raise argparse.ArgumentTypeError(f"epochs must be >= 0, got {text!r}")
  return epochs


def main(argv: Sequence[str] | None = None) -> int:
  intro, cost = __doc__.split("\n\n")[0], __doc__.split("Cost: ")[1]
  parser = argparse.ArgumentParser(
      prog=_PROG,
      description=intro.split(": ", 1)[1]
      + f" Writes RUN_DIR/{CURVATURE_FILE}, one JSON line per checkpoint "
      "(see the module's documentation).",
      epilog="Cost: " + cost,
  )
  defaults = hessian_lib.Settings()
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument(
      "--data-dir", default=None, help="the dataset's folder, as for training"
  )
  parser.add_argument(
      "--checkpoints",
      type=_checkpoints,
      default="all",
      help="'all' (the saved ones), 'last' or epochs such as 10,20 (0: the "
      "initial parameters); default: all",
  )
  flags = {
      "batches": "training batches in the fixed sample",
      "batch-size": "images per batch (default: the run's)",
      "eigenvalues": "how many of the largest Hessian eigenvalues",
      "iterations": "Lanczos iterations (at least --eigenvalues)",
      "probes": "Hutchinson probes for the trace",
      "seed": "seeds the sample, the Lanczos start and the probes",
  }
  for flag, text in flags.items():
    default = getattr(defaults, flag.replace("-", "_"))
    parser.add_argument(
        f"--{flag}",
        type=int,
        default=default,
        help=text + ("" if default is None else f"; default: {default}"),
    )
  parser.add_argument(
      "--no-progress", action="store_true", help="no progress bars"
  )
  args = parser.parse_args(argv)
  settings = hessian_lib.Settings(
      batches=args.batches,
      batch_size=args.batch_size,
      eigenvalues=args.eigenvalues,
      iterations=args.iterations,
      probes=args.probes,
      seed=args.seed,
  )
  try:
    settings.validate()
    for run_dir in args.run_dirs:
      run_curvature(
          run_dir,
          settings,
          checkpoints=args.checkpoints,
          data_dir=args.data_dir,
          progress=not args.no_progress,
          log=lambda line: tqdm.tqdm.write(line),
      )
  except (
      ValueError,
      checkpointing.RunDirError,
      checkpointing.CheckpointError,
      input_pipeline.DataNotFoundError,
  ) as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
