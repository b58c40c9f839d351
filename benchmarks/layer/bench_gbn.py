"""GBatchNorm's speed as a ratio to flax.linen.BatchNorm, measured in one process.

1. Forward+backward of one normalization layer, for every measure and shape.
2. The same for the per-example family against flax's own layer: GGroupNorm
   against GroupNorm and GLayerNorm against LayerNorm (GInstanceNorm against
   InstanceNorm on request), for every ``--family`` case and
   ``--family-measures`` measure; a case is ``kind:shape[:groups]``, e.g.
   ``group:256x32x32x64:32`` or ``layer:64x128x768``. These rows are the
   JSON's ``family`` (``layer`` names the kind; ``flax_ms`` is flax's layer).
3. A whole SGD train step with sqd2 against the same model with BatchNorm:
   LeNet at batch 1000 on 28x28x1 and ResNet20 at batch 256 on 32x32x3.

Every pair is timed interleaved, run by run, after warm-up; the ratio is of the
medians. Timings on a shared machine are noisy: read the ratios, not the ms.
A list flag given with no values (``--measures``, ``--family``,
``--train-steps``) skips its part.

  python -m benchmarks.layer.bench_gbn --runs 20 \\
      --out results/benchmarks/bench_cpu.json
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from benchmarks.layer.cases import DEFAULT_FAMILY
from benchmarks.layer.cases import DEFAULT_SHAPES
from benchmarks.layer.cases import layer_step
from benchmarks.layer.cases import make_family_module
from benchmarks.layer.cases import make_module
from benchmarks.layer.cases import parse_family
from benchmarks.layer.cases import parse_shape
from benchmarks.timing import add_timing_args
from benchmarks.timing import command_line
from benchmarks.timing import time_interleaved
from benchmarks.timing import write_result
import gbn_jax
from gbn_jax._selection import dispatch

DEFAULT_MEASURES = (
    "sd",
    "mad",
    "rsd",
    "bpoe",
    "rbd",
    "wcd",
    "sqd1",
    "sqd2",
    "sqd3",
    "sqd:0.05",
    "sqd:0.99",
)
TARGETS = {
    "sd": 1.05,
    "mad": 1.3,
    "rsd": 1.3,
    "bpoe": 1.3,
    "rbd": 1.3,
    "wcd": 1.3,
}
SQD_TARGET = 1.5
DEFAULT_FAMILY_MEASURES = ("sd", "mad", "rsd", "sqd2")
TRAIN_STEPS = {"lenet": (1000, (28, 28, 1)), "resnet20": (256, (32, 32, 3))}
TRAIN_STEP_TARGET = 1.15


def train_step(model_name: str, norm: str, batch: int, image_shape) -> callable:
  """jit'ed SGD step (forward, backward, update) of a training-suite model."""
  from train.model import (
      models,  # the training suite's models, norm swapped by name
  )

  model = models.create_model(
      model_name, num_classes=10, norm=models.make_norm(norm)
  )
  x = jax.random.normal(jax.random.key(3), (batch, *image_shape))
  y = jax.random.randint(jax.random.key(4), (batch,), 0, 10)
  variables = model.init(jax.random.key(0), x, train=False)
  tx = optax.sgd(0.01)
  opt_state = tx.init(variables["params"])

  def step(params, batch_stats, opt_state):
    def loss_fn(p):
      logits, updates = model.apply(
          {"params": p, "batch_stats": batch_stats},
          x,
          train=True,
          mutable=["batch_stats"],
      )
      return (
          optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
          updates,
      )

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    changes, opt_state = tx.update(grads, opt_state, params)
    return (
        optax.apply_updates(params, changes),
        updates["batch_stats"],
        opt_state,
        loss,
    )

  step = jax.jit(step)
  args = (variables["params"], variables["batch_stats"], opt_state)
  return lambda: step(*args)


def target_for(norm: str) -> float:
  return SQD_TARGET if norm.startswith("sqd") else TARGETS[norm]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  for flag, nargs, default, text in (
      ("--shapes", "+", DEFAULT_SHAPES, "input shapes like 256x32x32x16 (features last)"),
      ("--measures", "*", DEFAULT_MEASURES, "measure names, or sqd:<alpha>; none to skip the BatchNorm rows"),
      ("--family", "*", DEFAULT_FAMILY, "per-example cases kind:shape[:groups] (group, layer, instance); none to skip"),
      ("--family-measures", "*", DEFAULT_FAMILY_MEASURES, "measures of the --family rows"),
      ("--train-steps", "*", TRAIN_STEPS, "models whose whole train step to time (lenet, resnet20); none to skip"),
  ):  # fmt: skip
    parser.add_argument(flag, nargs=nargs, default=list(default), help=text)
  add_timing_args(parser, runs=20)
  parser.add_argument(
      "--train-norm",
      default="sqd2",
      help="norm to compare with bn in train steps",
  )
  parser.add_argument(
      "--train-batch",
      type=int,
      default=None,
      help="batch of every train step (default: LeNet 1000, ResNet20 256); "
      "for rehearsals",
  )
  parser.add_argument(
      "--select-method",
      choices=dispatch.METHODS,
      help="force this k-th smallest method (default: by size)",
  )
  args = parser.parse_args(argv)
  # In scope for every call, traces and timed runs alike: the method is part
  # of jit's cache key.
  with gbn_jax.selection.selection_config(method=args.select_method):
    return _run(args, argv)


def _run(args, argv) -> dict:
  """The timings of :func:`main` for parsed ``args``."""
  run = dict(
      runs=args.runs,
      inner=args.inner,
      select_method=args.select_method,
      command=command_line("benchmarks.layer.bench_gbn", argv),
  )

  rows = []
  for shape_text in args.shapes:
    shape = parse_shape(shape_text)
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    for norm in args.measures:
      fns = {
          "bn": layer_step(make_module("bn"), x),
          norm: layer_step(make_module(norm), x),
      }
      med = time_interleaved(fns, args.runs, args.warmup, args.inner)
      row = {
          "shape": shape_text,
          "measure": norm,
          "bn_ms": med["bn"] * 1e3,
          "gbn_ms": med[norm] * 1e3,
          "ratio": med[norm] / med["bn"],
          "target": target_for(norm),
      }
      rows.append(row)
      write_result(args.out, run, layers=rows, family=[], train_steps=[])
      print(
          f"{shape_text:>16} {norm:>9} bn {row['bn_ms']:8.2f} ms  gbn {row['gbn_ms']:8.2f} ms"
          f"  x{row['ratio']:.2f} (target <= {row['target']})",
          flush=True,
      )
  family = []
  for case in args.family:
    kind, shape, groups = parse_family(case)
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    flax_step = layer_step(make_family_module(kind, "flax", groups), x)
    for norm in args.family_measures:
      fns = {
          "flax": flax_step,
          norm: layer_step(make_family_module(kind, norm, groups), x),
      }
      med = time_interleaved(fns, args.runs, args.warmup, args.inner)
      row = {
          "layer": kind,
          "shape": "x".join(map(str, shape)),
          "groups": groups,
          "measure": norm,
          "flax_ms": med["flax"] * 1e3,
          "gbn_ms": med[norm] * 1e3,
          "ratio": med[norm] / med["flax"],
          "target": target_for(norm),
      }
      family.append(row)
      write_result(args.out, run, layers=rows, family=family, train_steps=[])
      print(
          f"{kind:>6} {row['shape']:>16} {norm:>9} flax {row['flax_ms']:8.2f} ms"
          f"  gbn {row['gbn_ms']:8.2f} ms  x{row['ratio']:.2f} (target <= {row['target']})",
          flush=True,
      )
  steps = []
  for model_name in args.train_steps:
    batch, image_shape = TRAIN_STEPS[model_name]
    batch = args.train_batch or batch
    norm = args.train_norm
    fns = {
        "bn": train_step(model_name, "bn", batch, image_shape),
        norm: train_step(model_name, norm, batch, image_shape),
    }
    med = time_interleaved(fns, args.runs, args.warmup, args.inner)
    row = {
        "model": model_name,
        "batch": batch,
        "measure": norm,
        "bn_ms": med["bn"] * 1e3,
        "gbn_ms": med[norm] * 1e3,
        "ratio": med[norm] / med["bn"],
        "target": TRAIN_STEP_TARGET,
    }
    steps.append(row)
    write_result(args.out, run, layers=rows, family=family, train_steps=steps)
    print(
        f"train step {model_name:>9} b{batch:<5} {norm:>5} bn {row['bn_ms']:8.1f} ms"
        f"  gbn {row['gbn_ms']:8.1f} ms  x{row['ratio']:.2f} (target <= {TRAIN_STEP_TARGET})",
        flush=True,
    )
  return write_result(
      args.out,
      run,
      complete=True,
      layers=rows,
      family=family,
      train_steps=steps,
  )


if __name__ == "__main__":
  main()
