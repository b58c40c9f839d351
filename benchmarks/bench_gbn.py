"""GBatchNorm's speed as a ratio to flax.linen.BatchNorm, measured in one process.

1. Forward+backward of one normalization layer, for every measure and shape.
2. A whole SGD train step with sqd2 against the same model with BatchNorm:
   LeNet at batch 1000 on 28x28x1 and ResNet20 at batch 256 on 32x32x3.

Every pair is timed interleaved, run by run, after warm-up; the ratio is of the
medians. Timings on a shared machine are noisy: read the ratios, not the ms.

  python -m benchmarks.bench_gbn --runs 20 \\
      --out results/benchmarks/bench_cpu.json
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.machine import machine_info
import gbn_jax
from gbn_jax._selection import dispatch

DEFAULT_SHAPES = ("256x32x32x16", "1024x32x32x16", "1000x8x8x50", "512x256")
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


def parse_shape(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.lower().split("x"))


def make_module(norm: str) -> nn.Module:
  if norm == "bn":
    return nn.BatchNorm(use_running_average=False)
  name, params = gbn_jax.parse_measure_name(norm)  # "sqd:0.05" too
  return gbn_jax.GBatchNorm(use_running_average=False, measure=name, **params)


def layer_step(module: nn.Module, x: jax.Array):
  """jit'ed forward+backward (input and parameter gradients) of one layer."""
  variables = module.init(jax.random.key(0), x)
  cotangent = jax.random.normal(jax.random.key(1), x.shape, x.dtype)

  def loss(params, inp):
    y, updates = module.apply(
        {**variables, "params": params}, inp, mutable=["batch_stats"]
    )
    return jnp.vdot(y, cotangent), updates

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return lambda: step(variables["params"], x)


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


def time_interleaved(
    fns: dict, runs: int, warmup: int = 3, inner: int = 1
) -> dict[str, float]:
  """Median seconds per call of each fn (:func:`interleaved_samples`)."""
  samples = interleaved_samples(fns, runs, warmup, inner)
  return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_samples(
    fns: dict, runs: int, warmup: int = 3, inner: int = 1
) -> dict[str, list[float]]:
  """Seconds per call of each fn, ``runs`` samples each, called round-robin.

  Each fn dispatches one step and returns its (unblocked) result. A sample
  times ``inner`` back-to-back dispatches and blocks on the last: on an
  accelerator, where one step can take less than its dispatch, ``inner > 1``
  keeps the device busy and measures device time rather than Python overhead.
  """
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for _ in range(runs):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(inner):
        out = fn()
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - start) / inner)
  return samples


def target_for(norm: str) -> float:
  return SQD_TARGET if norm.startswith("sqd") else TARGETS[norm]


def add_timing_args(parser: argparse.ArgumentParser, runs: int) -> None:
  """``--runs`` (default ``runs``), ``--warmup``, ``--inner`` and ``--out``.

  The timing flags every layer benchmark (this one, ``bench_methods``,
  ``device_check_radix``) takes, read by :func:`interleaved_samples`.
  """
  parser.add_argument(
      "--runs", type=int, default=runs, help="timed samples per case (median)"
  )
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument(
      "--inner", type=int, default=1, help="dispatches per sample (~10 on GPU)"
  )
  parser.add_argument("--out", help="write the results as JSON here")


def command_line(module: str, argv: Sequence[str] | None) -> str:
  """``python -m module argv...``, as a result's ``command`` records it."""
  return " ".join([f"python -m {module}", *(argv or sys.argv[1:])])


def write_json(path: str | None, result: dict) -> dict:
  """Writes ``result`` to ``path`` (if any); returns it."""
  if path:
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
  return result


def write_result(path, run: dict, complete: bool = False, **fields) -> dict:
  """The results so far (written after every row, so a cut-off run keeps them).

  The machine, ``run``'s settings, whether the run is ``complete``, then
  ``fields`` (the rows).
  """
  result = {"machine": machine_info(), **run, "complete": complete, **fields}
  return write_json(path, result)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  for flag, nargs, default, text in (
      ("--shapes", "+", DEFAULT_SHAPES, "input shapes like 256x32x32x16 (features last)"),
      ("--measures", "*", DEFAULT_MEASURES, "measure names, or sqd:<alpha>; none to time only train steps"),
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
      command=command_line("benchmarks.bench_gbn", argv),
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
      write_result(args.out, run, layers=rows, train_steps=[])
      print(
          f"{shape_text:>16} {norm:>9} bn {row['bn_ms']:8.2f} ms  gbn {row['gbn_ms']:8.2f} ms"
          f"  x{row['ratio']:.2f} (target <= {row['target']})",
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
    write_result(args.out, run, layers=rows, train_steps=steps)
    print(
        f"train step {model_name:>9} b{batch:<5} {norm:>5} bn {row['bn_ms']:8.1f} ms"
        f"  gbn {row['gbn_ms']:8.1f} ms  x{row['ratio']:.2f} (target <= {TRAIN_STEP_TARGET})",
        flush=True,
    )
  return write_result(
      args.out, run, complete=True, layers=rows, train_steps=steps
  )


if __name__ == "__main__":
  main()
