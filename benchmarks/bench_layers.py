"""Forward+backward time of one GBatchNorm layer vs flax.linen.BatchNorm.

Each measure is timed against flax's BatchNorm on the same input, in the same
process, interleaved run by run, and reported as the ratio of medians.

  python -m benchmarks.bench_layers --runs 20 --out results/bench_layers.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gbn_jax

DEFAULT_SHAPES = ("256x32x32x16", "1024x32x32x16", "1000x8x8x50", "512x256")
DEFAULT_MEASURES = ("sd", "mad", "rsd", "bpoe", "rbd", "wcd", "sqd1", "sqd2", "sqd3", "sqd:0.05", "sqd:0.99")
TARGETS = {"sd": 1.05, "mad": 1.3, "rsd": 1.3, "bpoe": 1.3, "rbd": 1.3, "wcd": 1.3}
SQD_TARGET = 1.5


def parse_shape(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.lower().split("x"))


def make_module(norm: str) -> nn.Module:
  if norm == "bn":
    return nn.BatchNorm(use_running_average=False)
  if norm.startswith("sqd:"):
    return gbn_jax.GBatchNorm(use_running_average=False, measure="sqd", alpha=float(norm[4:]))
  return gbn_jax.GBatchNorm(use_running_average=False, measure=norm)


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
  return lambda: jax.block_until_ready(step(variables["params"], x))


def time_interleaved(fns: dict, runs: int, warmup: int = 3) -> dict[str, float]:
  """Median seconds per call of each fn, calling them round-robin."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  samples = {name: [] for name in fns}
  for _ in range(runs):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      samples[name].append(time.perf_counter() - start)
  return {name: statistics.median(s) for name, s in samples.items()}


def target_for(norm: str) -> float:
  return SQD_TARGET if norm.startswith("sqd") else TARGETS[norm]


def machine_info() -> dict:
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": __import__("os").cpu_count(),
      "devices": [str(d) for d in jax.devices()],
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "flax": flax.__version__,
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                      help="input shapes like 256x32x32x16 (features last)")
  parser.add_argument("--measures", nargs="+", default=list(DEFAULT_MEASURES),
                      help="measure names, or sqd:<alpha>")
  parser.add_argument("--runs", type=int, default=20, help="timed runs per layer (median)")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--out", help="write the results as JSON here")
  args = parser.parse_args(argv)

  rows = []
  for shape_text in args.shapes:
    shape = parse_shape(shape_text)
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    for norm in args.measures:
      fns = {"bn": layer_step(make_module("bn"), x), norm: layer_step(make_module(norm), x)}
      med = time_interleaved(fns, args.runs, args.warmup)
      row = {
          "shape": shape_text, "measure": norm,
          "bn_ms": med["bn"] * 1e3, "gbn_ms": med[norm] * 1e3,
          "ratio": med[norm] / med["bn"], "target": target_for(norm),
      }
      rows.append(row)
      print(f"{shape_text:>16} {norm:>9} bn {row['bn_ms']:8.2f} ms  gbn {row['gbn_ms']:8.2f} ms"
            f"  x{row['ratio']:.2f} (target <= {row['target']})", flush=True)
  result = {"machine": machine_info(), "runs": args.runs, "layers": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
