"""Which k-th smallest method makes the fastest exact ``sqd`` layer here.

For each layer shape and quantile level, one process times, interleaved run by
run (``bench_gbn.interleaved_samples``), median after warm-up:

* ``bn``: ``flax.linen.BatchNorm``'s forward+backward (the yardstick);
* one ``sqd:<alpha>`` GBatchNorm forward+backward per selection method, each
  run under ``gbn_jax.selection.selection_config(method=...)`` for that method.

Before timing, each method's ``gbn_jax.quantile`` of the layer's input is
compared bit for bit with the sort reference (``sort.kth_smallest_reference``)
on the benchmark's normal input and on a ReLU'd copy (half zeros: heavy
ties). The method with the smallest total layer time over every (shape,
alpha) that it got exactly right everywhere is ``fastest_exact`` in the JSON
(``benchmarks/device/device_check.sh`` then runs the full table with it). The JSON is
rewritten after every row, so a run cut off keeps what it finished.

  python -m benchmarks.layer.bench_methods --inner 10 --runs 15 --out /tmp/methods.json
  python -m benchmarks.layer.bench_methods --shapes 64x8x8x16 --alphas 0.5 --runs 2 --out /tmp/m.json
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.layer.cases import DEFAULT_SHAPES
from benchmarks.layer.cases import layer_step
from benchmarks.layer.cases import make_module
from benchmarks.layer.cases import parse_shape
from benchmarks.timing import add_timing_args
from benchmarks.timing import command_line
from benchmarks.timing import interleaved_samples
from benchmarks.timing import write_result
import gbn_jax
from gbn_jax._selection import dispatch
from gbn_jax._selection import sort

DEFAULT_ALPHAS = (0.25, 0.5, 0.75, 0.99)


def with_method(method: str, fn):
  """``fn`` whose every call runs under ``gbn_jax.selection.selection_config(method=method)``.

  The method is part of jit's cache key, so each call must be in scope to hit
  the program traced for it (entering the scope costs microseconds).
  """

  def call():
    with gbn_jax.selection.selection_config(method=method):
      return fn()

  return call


def exact_everywhere(
    method: str, x: jax.Array, alpha: float, axes: tuple[int, ...]
) -> bool:
  """The method's quantile equals the sort reference bit for bit, on ``x`` and relu(x)."""
  n = int(np.prod([x.shape[a] for a in axes]))
  k = gbn_jax.quantile_rank(alpha, n)
  for data in (x, jnp.maximum(x, 0.0)):
    with gbn_jax.selection.selection_config(method=method):
      got = jax.jit(
          functools.partial(gbn_jax.quantile, alpha=alpha, axis=axes)
      )(data)
    want = sort.kth_smallest_reference(data, k, axes)
    got = np.asarray(got, np.float32).view(np.int32)
    want = np.asarray(want, np.float32).view(np.int32)
    if not np.array_equal(got, want):
      return False
  return True


def fastest_exact(rows: list[dict]) -> str | None:
  """The method with the smallest total ``gbn_ms``, among those exact on every row.

  Only methods measured on every (shape, alpha) seen are candidates, so a run
  cut off mid-shape cannot favour a method that missed the large shapes.
  """
  points = {(r["shape"], r["alpha"]) for r in rows}
  totals, exact = {}, {}
  for r in rows:
    m = r["method"]
    totals.setdefault(m, {})[(r["shape"], r["alpha"])] = r["gbn_ms"]
    exact[m] = exact.get(m, True) and r["exact"]
  complete = {
      m: sum(t.values())
      for m, t in totals.items()
      if set(t) == points and exact[m]
  }
  return min(complete, key=complete.get) if complete else None


def write(path, run: dict, rows: list[dict], complete: bool) -> dict:
  """The rows so far and the fastest exact method among them."""
  return write_result(
      path, run, complete, layers=rows, fastest_exact=fastest_exact(rows)
  )


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
  parser.add_argument(
      "--alphas", nargs="+", type=float, default=list(DEFAULT_ALPHAS)
  )
  parser.add_argument(
      "--methods",
      nargs="+",
      default=None,
      help="default: every method of dispatch.METHODS without a "
      "data-dependent loop ('adaptive' and 'bisect' loop, which costs a "
      "host sync per pass on a GPU; name them to include them) and "
      "without 'native' (CPU only)",
  )
  add_timing_args(parser, runs=15)
  args = parser.parse_args(argv)
  methods = args.methods or [
      m for m in dispatch.METHODS if m not in ("native", "adaptive", "bisect")
  ]
  unknown = sorted(set(methods) - set(dispatch.METHODS))
  if unknown:
    parser.error(f"unknown methods {unknown}; choose from {dispatch.METHODS}")
  run = dict(
      runs=args.runs,
      inner=args.inner,
      methods=methods,
      command=command_line("benchmarks.layer.bench_methods", argv),
  )
  rows: list[dict] = []
  for shape_text in args.shapes:
    shape = parse_shape(shape_text)
    axes = tuple(range(len(shape) - 1))
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    for alpha in args.alphas:
      norm = f"sqd:{alpha}"
      fns = {"bn": layer_step(make_module("bn"), x)}
      for method in methods:
        fns[method] = with_method(method, layer_step(make_module(norm), x))
      samples = interleaved_samples(fns, args.runs, args.warmup, args.inner)
      bn_ms = statistics.median(samples["bn"]) * 1e3
      for method in methods:
        ms = statistics.median(samples[method]) * 1e3
        rows.append(
            {
                "shape": shape_text,
                "alpha": alpha,
                "method": method,
                "bn_ms": bn_ms,
                "gbn_ms": ms,
                "ratio": ms / bn_ms,
                "exact": exact_everywhere(method, x, alpha, axes),
            }
        )
        r = rows[-1]
        print(
            f"{shape_text:>16} a={alpha:<5} {method:>12} bn {bn_ms:8.3f} ms  sqd {ms:8.3f} ms"
            f"  x{r['ratio']:.2f}  exact={r['exact']}",
            flush=True,
        )
      write(args.out, run, rows, complete=False)
  result = write(args.out, run, rows, complete=True)
  print(f"fastest exact method: {result['fastest_exact']}", flush=True)
  return result


if __name__ == "__main__":
  main()
