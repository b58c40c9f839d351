"""Radix select (fixed 4 passes, no while loop) against the existing selections.

On whatever backend is present (a GPU when one is lent), for the four layer
shapes of benchmarks/bench_gbn.py (features last, reduce over the rest), times
in one process, interleaved run by run, median after warm-up (bench_gbn's
``time_interleaved``):

* ``bn``: a jitted mean + variance (BatchNorm's statistics, the yardstick);
* ``radix``: ``_radix_select.kth_smallest_accelerator`` (scatter histograms);
* ``radix_sums``: the same plus E[x] and E[(x - q)^+] (what sqd needs);
* ``radix_cmp4``/``radix_cmp8``: compare-and-sum histograms, 4-bit digits (8
  passes) and 8-bit digits (on a CPU only with ``--variants``: XLA:CPU may
  materialise an N x 16/256 x F temporary);
* ``adaptive``, ``sort``, ``default``: ``_select.kth_smallest`` with
  ``method="adaptive"``, ``"sort"``, and its default for this backend.

Before timing, every selection is checked bit for bit against the sort
reference (on normal data and on ReLU-like data with ties), and each
compiled program is searched for ``while`` loops. Results go to ``--out``.

  python -m benchmarks.device_check_radix --runs 20 --inner 10 --out /tmp/radix.json
  python -m benchmarks.device_check_radix --runs 2 --warmup 1 --shapes 64x8x8x16 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_gbn import DEFAULT_SHAPES, machine_info, parse_shape, time_interleaved
from gbn_jax import _radix_select, _select
from gbn_jax.quantiles import quantile_rank

ACCELERATOR_VARIANTS = ("bn", "radix", "radix_sums", "radix_cmp4", "radix_cmp8", "adaptive",
                        "sort", "default")
CPU_VARIANTS = ("bn", "radix", "radix_sums", "adaptive", "sort", "default")


def make_fns(variant: str, axes: tuple[int, ...], k: int):
  """``(timed, selection)``: jitted callables of ``x``; ``selection`` returns
  the selected value for the exactness check (``None`` for ``bn``)."""
  radix = _radix_select.kth_smallest_accelerator
  select = {
      "radix": functools.partial(radix, k=k, axis=axes),
      "radix_cmp4": functools.partial(radix, k=k, axis=axes, histogram="compare", digit_bits=4),
      "radix_cmp8": functools.partial(radix, k=k, axis=axes, histogram="compare", digit_bits=8),
      "adaptive": functools.partial(_select.kth_smallest, k=k, axis=axes, method="adaptive"),
      "sort": functools.partial(_select.kth_smallest, k=k, axis=axes, method="sort"),
      "default": functools.partial(_select.kth_smallest, k=k, axis=axes),
  }
  if variant == "bn":
    fn = jax.jit(lambda x: (jnp.mean(x, axes), jnp.var(x, axes)))
    return fn, None
  if variant == "radix_sums":
    fn = jax.jit(functools.partial(
        _radix_select.kth_smallest_with_sums_accelerator, k=k, axis=axes))
    return fn, jax.jit(lambda x: fn(x)[0])
  fn = jax.jit(select[variant])
  return fn, fn


def has_while(fn, x) -> bool:
  return "while" in fn.lower(x).compile().as_text()


def bitwise_equal(a, b) -> bool:
  a = np.asarray(a, np.float32).view(np.int32)
  b = np.asarray(b, np.float32).view(np.int32)
  return bool(np.array_equal(a, b))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
  parser.add_argument("--alpha", type=float, default=0.5, help="k = ceil(alpha * n)")
  parser.add_argument("--variants", nargs="+", help="default: by backend (see docstring)")
  parser.add_argument("--runs", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--inner", type=int, default=1, help="dispatches per sample (~10 on GPU)")
  parser.add_argument("--out", help="write the results as JSON here")
  args = parser.parse_args(argv)
  on_cpu = jax.default_backend() == "cpu"
  variants = args.variants or list(CPU_VARIANTS if on_cpu else ACCELERATOR_VARIANTS)
  result = {
      "machine": machine_info(), "alpha": args.alpha, "runs": args.runs, "inner": args.inner,
      "warmup": args.warmup, "variants": variants,
      "command": " ".join(["python -m benchmarks.device_check_radix", *(argv or sys.argv[1:])]),
      "rows": [], "complete": False,
  }

  def write():
    if args.out:
      with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

  for shape_text in args.shapes:
    shape = parse_shape(shape_text)
    axes = tuple(range(len(shape) - 1))
    n = int(np.prod(shape[:-1]))
    k = quantile_rank(args.alpha, n)
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    relu = jnp.maximum(jax.random.normal(jax.random.key(3), shape, jnp.float32), 0.0)
    want = {name: _select.kth_smallest_reference(v, k, axes) for name, v in
            (("normal", x), ("relu", relu))}
    row = {"shape": shape_text, "n": n, "k": k, "exact": {}, "while_loop": {}, "errors": {}}
    fns = {}
    for variant in variants:
      try:
        fn, selection = make_fns(variant, axes, k)
        jax.block_until_ready(fn(x))
        if selection is not None:
          row["exact"][variant] = all(
              bitwise_equal(selection(v), want[name])
              for name, v in (("normal", x), ("relu", relu)))
          row["while_loop"][variant] = has_while(fn, x)
        fns[variant] = functools.partial(fn, x)
      except Exception as e:  # keep going: one failing variant must not lose the rest
        row["errors"][variant] = f"{type(e).__name__}: {e}"[:500]
    med = time_interleaved(fns, args.runs, args.warmup, args.inner)
    row["ms"] = {name: t * 1e3 for name, t in med.items()}
    if "bn" in med:
      row["ratio_to_bn"] = {name: t / med["bn"] for name, t in med.items()}
    result["rows"].append(row)
    write()
    timings = "  ".join(f"{name} {t * 1e3:.3f}" for name, t in med.items())
    print(f"{shape_text:>14} ms: {timings}", flush=True)
    print(f"{'':>14} exact: {row['exact']}  while: {row['while_loop']}"
          + (f"  errors: {row['errors']}" if row["errors"] else ""), flush=True)
  result["complete"] = True
  write()
  return result


if __name__ == "__main__":
  main()
