"""Benchmarks exact k-th smallest selection (gbn_jax._selection) against a sort.

Times, under ``jax.jit``, every method of ``gbn_jax._selection.dispatch.kth_smallest``,
the sort-based reference and a plain mean+var reduction (a "one pass"
yardstick) on the same float32 input. Methods are interleaved within each
repetition so that load from other processes hits all of them alike; the table
reports medians after warm-up and ratios to the mean+var yardstick.

Example::

  python benchmarks/layer/bench_select.py --reps 15 --out /tmp/select.json
  python benchmarks/layer/bench_select.py --shapes 256x32x32x16:0,1,2 --alpha 0.25
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection import dispatch
from gbn_jax._selection import sort

DEFAULT_SHAPES = (
    "256x32x32x16:0,1,2",
    "1024x32x32x16:0,1,2",
    "1000x8x8x50:0,1,2",
    "512x256:0",
)


def parse_shape(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``'256x32x32x16:0,1,2'`` -> ``((256, 32, 32, 16), (0, 1, 2))``."""
  dims, _, axes = spec.partition(":")
  shape = tuple(int(d) for d in dims.split("x"))
  axis = tuple(int(a) for a in axes.split(",")) if axes else (0,)
  return shape, axis


def make_input(shape, kind: str, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "relu":
    x = np.maximum(x, 0)
  elif kind == "rounded":
    x = np.round(x * 2) / 2
  return jnp.asarray(x)


def time_all(fns: dict, x, reps: int, warmup: int) -> dict[str, list[float]]:
  """Interleaved wall times (ms) of every function, after warm-up."""
  for f in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(f(x))
  times = {name: [] for name in fns}
  names = list(fns)
  for r in range(reps):
    order = names[r % len(names) :] + names[: r % len(names)]
    for name in order:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name](x))
      times[name].append((time.perf_counter() - t0) * 1e3)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--shapes",
      nargs="+",
      default=list(DEFAULT_SHAPES),
      help="shape:axes specs, e.g. 256x32x32x16:0,1,2",
  )
  parser.add_argument(
      "--alpha",
      type=float,
      default=0.5,
      help="selects the ceil(alpha*n)-th smallest",
  )
  parser.add_argument(
      "--data", default="normal", choices=["normal", "relu", "rounded"]
  )
  parser.add_argument("--reps", type=int, default=11)
  # Alike benchmarks/step/bench_lenet_step.py::parse_args: argparse calls, each
  # benchmark's own flags.
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument(
      "--sort-reps",
      type=int,
      default=3,
      help="repetitions of the (slow) sort reference",
  )
  parser.add_argument(
      "--methods",
      nargs="+",
      default=["default"] + [m for m in dispatch.METHODS if m != "sort"],
      help='"default" is kth_smallest without method= (its own choice)',
  )
  parser.add_argument("--out", default=None, help="write results as JSON here")
  args = parser.parse_args()

  results = []
  print(
      f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()})"
  )
  print(
      f"{'shape':>22} {'axis':>9} {'method':>10} {'median ms':>10} {'x meanvar':>10} {'x sort':>8}"
  )
  for spec in args.shapes:
    shape, axis = parse_shape(spec)
    x = make_input(shape, args.data)
    n = int(np.prod([shape[a] for a in axis]))
    k = max(1, int(np.ceil(args.alpha * n)))
    fns = {
        "meanvar": jax.jit(lambda x: (jnp.mean(x, axis), jnp.var(x, axis))),
    }
    for m in args.methods:
      method = None if m == "default" else m
      fns[m] = jax.jit(
          lambda x, method=method: dispatch.kth_smallest(
              x, k, axis, method=method
          )
      )
    sort_fn = {
        "sort": jax.jit(lambda x: sort.kth_smallest_reference(x, k, axis))
    }
    expected = np.asarray(sort_fn["sort"](x))
    for m in args.methods:
      got = np.asarray(fns[m](x))
      if not np.array_equal(got, expected):
        raise AssertionError(f"{m} disagrees with the sort on {spec}")
    times = time_all(fns, x, args.reps, args.warmup)
    times.update(time_all(sort_fn, x, args.sort_reps, 1))
    med = {name: float(np.median(t)) for name, t in times.items()}
    for name, t in med.items():
      print(
          f"{str(shape):>22} {str(axis):>9} {name:>10} {t:10.2f} "
          f"{t / med['meanvar']:10.2f} {t / med['sort']:8.3f}"
      )
      results.append(
          dict(
              shape=shape,
              axis=axis,
              k=k,
              method=name,
              median_ms=t,
              ratio_meanvar=t / med["meanvar"],
              ratio_sort=t / med["sort"],
              times_ms=times[name],
          )
      )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
          dict(
              jax=jax.__version__,
              backend=jax.default_backend(),
              alpha=args.alpha,
              data=args.data,
              reps=args.reps,
              results=results,
          ),
          f,
          indent=1,
      )


if __name__ == "__main__":
  main()
