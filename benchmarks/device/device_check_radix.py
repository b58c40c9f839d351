"""Radix select (fixed 4 passes, no while loop) against the existing selections.

On whatever backend is present (a GPU when one is lent), for the four layer
shapes of benchmarks/layer/bench_gbn.py (features last, reduce over the rest), times
in one process, interleaved run by run, median after warm-up (bench_gbn's
``time_interleaved``):

* ``bn``: a jitted mean + variance (BatchNorm's statistics, the yardstick);
* ``radix``: ``_selection.radix.kth_smallest_accelerator`` (scatter histograms);
* ``bracket``: ``_selection.bracket.kth_smallest_bracket`` (sampled bracket, one
  counting-and-compaction pass, small sorts; radix inside a ``cond`` on a
  miss); each row's ``bracket_missed`` says whether its bracket missed on
  the normal and the ReLU data (then that call ran radix as well);
* ``radix_sums``: the same plus E[x] and E[(x - q)^+] (what sqd needs);
* ``radix_cmp4``/``radix_cmp8``: compare-and-sum histograms, 4-bit digits (8
  passes) and 8-bit digits (on a CPU only with ``--variants``: XLA:CPU may
  materialise an N x 16/256 x F temporary);
* ``pass_hist``, ``pass_hist_cmp4``, ``pass_sums``: one pass alone, to say
  which pass costs what: radix's first 256-bin scatter histogram, one 16-bin
  compare-and-sum histogram, and the pass of E[x] and E[(x - q)^+] given q
  (radix is four ``pass_hist``-like passes; ``radix_sums`` adds a
  ``pass_sums``);
* ``adaptive``, ``sort``, ``default``: ``_selection.dispatch.kth_smallest`` with
  ``method="adaptive"``, ``"sort"``, and its default for this backend.

Before timing, every selection is checked bit for bit against the sort
reference (on normal data and on ReLU-like data with ties), and each
compiled program is searched for ``while`` loops. Results go to ``--out``.

  python -m benchmarks.device.device_check_radix --runs 20 --inner 10 --out /tmp/radix.json
  python -m benchmarks.device.device_check_radix --runs 2 --warmup 1 --shapes 64x8x8x16 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.layer.cases import DEFAULT_SHAPES
from benchmarks.layer.cases import parse_shape
from benchmarks.timing import add_timing_args
from benchmarks.timing import command_line
from benchmarks.timing import machine_info
from benchmarks.timing import time_interleaved
from benchmarks.timing import write_json
from gbn_jax import quantile_rank
from gbn_jax._selection import bracket
from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import radix
from gbn_jax._selection import sort

ACCELERATOR_VARIANTS = (
    "bn",
    "radix",
    "bracket",
    "radix_sums",
    "radix_cmp4",
    "radix_cmp8",
    "pass_hist",
    "pass_hist_cmp4",
    "pass_sums",
    "adaptive",
    "sort",
    "default",
)
CPU_VARIANTS = (
    "bn",
    "radix",
    "bracket",
    "radix_sums",
    "pass_hist",
    "pass_sums",
    "adaptive",
    "sort",
    "default",
)
#: Variants that time part of a selection: no value to check, no while loop.
PASSES = ("pass_hist", "pass_hist_cmp4", "pass_sums")


def one_pass(variant: str, axes: tuple[int, ...]):
  """A jitted single pass of the radix select over ``x``'s rows (see the docstring)."""

  def rows_of(x):
    rows, _, _ = common.to_rows(x, axes, None)
    return rows

  def hist(x, bits, histogram):
    rows = rows_of(x)
    u = common.merged_keys(rows) ^ radix._SIGN  # pylint: disable=protected-access
    digit = jax.lax.shift_right_logical(u, jnp.int32(32 - bits)) & jnp.int32(
        (1 << bits) - 1
    )
    fn = radix._HISTOGRAM_FNS[histogram]  # pylint: disable=protected-access
    return fn(digit, jnp.ones(rows.shape, bool), 1 << bits)

  if variant == "pass_hist":
    return jax.jit(lambda x: hist(x, 8, "scatter"))
  if variant == "pass_hist_cmp4":
    return jax.jit(lambda x: hist(x, 4, "compare"))

  def sums(x):
    rows = rows_of(x)
    keys = common.float_to_key(jnp.median(rows[:64], axis=0))
    n = jnp.full(rows.shape[1:], rows.shape[0], jnp.int32)
    return radix.radix_sums(rows, None, keys, n, common.Comm(None, None))

  return jax.jit(sums)


def make_fns(variant: str, axes: tuple[int, ...], k: int):
  """``(timed, selection)``: jitted callables of ``x``; ``selection`` returns
  the selected value for the exactness check (``None`` for ``bn``)."""
  radix_select = radix.kth_smallest_accelerator
  select = {
      "radix": functools.partial(radix_select, k=k, axis=axes),
      "bracket": functools.partial(
          bracket.kth_smallest_bracket, k=k, axis=axes
      ),
      "radix_cmp4": functools.partial(
          radix_select, k=k, axis=axes, histogram="compare", digit_bits=4
      ),
      "radix_cmp8": functools.partial(
          radix_select, k=k, axis=axes, histogram="compare", digit_bits=8
      ),
      "adaptive": functools.partial(
          dispatch.kth_smallest, k=k, axis=axes, method="adaptive"
      ),
      "sort": functools.partial(
          dispatch.kth_smallest, k=k, axis=axes, method="sort"
      ),
      "default": functools.partial(dispatch.kth_smallest, k=k, axis=axes),
  }
  if variant == "bn":
    fn = jax.jit(lambda x: (jnp.mean(x, axes), jnp.var(x, axes)))
    return fn, None
  if variant in PASSES:
    return one_pass(variant, axes), None
  if variant == "radix_sums":
    fn = jax.jit(
        functools.partial(
            radix.kth_smallest_with_sums_accelerator, k=k, axis=axes
        )
    )
    return fn, jax.jit(lambda x: fn(x)[0])
  fn = jax.jit(select[variant])
  return fn, fn


def bracket_missed(x, axes: tuple[int, ...], k: int) -> bool:
  """Whether the bracket select falls back to radix on ``x`` (the ``cond`` taken)."""
  rows, _, kept_shape = common.to_rows(x, axes, None)
  ks = jnp.full((int(np.prod(kept_shape)),), k, jnp.int32)
  sel = jax.jit(
      lambda r, k: bracket.bracket_kth_smallest(
          r, None, k, common.Comm(None, None)
      )
  )(rows, ks)
  return bool(sel.missed)


def has_while(fn, x) -> bool:
  return "while" in fn.lower(x).compile().as_text()


def bitwise_equal(a, b) -> bool:
  a = np.asarray(a, np.float32).view(np.int32)
  b = np.asarray(b, np.float32).view(np.int32)
  return bool(np.array_equal(a, b))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
  parser.add_argument(
      "--alpha", type=float, default=0.5, help="k = ceil(alpha * n)"
  )
  parser.add_argument(
      "--variants", nargs="+", help="default: by backend (see docstring)"
  )
  add_timing_args(parser, runs=20)
  args = parser.parse_args(argv)
  on_cpu = jax.default_backend() == "cpu"
  variants = args.variants or list(
      CPU_VARIANTS if on_cpu else ACCELERATOR_VARIANTS
  )
  result = {
      "machine": machine_info(),
      "alpha": args.alpha,
      "runs": args.runs,
      "inner": args.inner,
      "warmup": args.warmup,
      "variants": variants,
      "command": command_line("benchmarks.device.device_check_radix", argv),
      "rows": [],
      "complete": False,
  }

  for shape_text in args.shapes:
    shape = parse_shape(shape_text)
    axes = tuple(range(len(shape) - 1))
    n = int(np.prod(shape[:-1]))
    k = quantile_rank(args.alpha, n)
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    relu = jnp.maximum(
        jax.random.normal(jax.random.key(3), shape, jnp.float32), 0.0
    )
    want = {
        name: sort.kth_smallest_reference(v, k, axes)
        for name, v in (("normal", x), ("relu", relu))
    }
    row = {
        "shape": shape_text,
        "n": n,
        "k": k,
        "exact": {},
        "while_loop": {},
        "errors": {},
    }
    fns = {}
    for variant in variants:
      try:
        fn, selection = make_fns(variant, axes, k)
        jax.block_until_ready(fn(x))
        if selection is not None:
          row["exact"][variant] = all(
              bitwise_equal(selection(v), want[name])
              for name, v in (("normal", x), ("relu", relu))
          )
          row["while_loop"][variant] = has_while(fn, x)
        fns[variant] = functools.partial(fn, x)
      except (
          Exception
      ) as e:  # keep going: one failing variant must not lose the rest
        row["errors"][variant] = f"{type(e).__name__}: {e}"[:500]
    if "bracket" in variants:
      try:
        row["bracket_missed"] = {
            name: bracket_missed(v, axes, k)
            for name, v in (("normal", x), ("relu", relu))
        }
      except Exception as e:  # report, keep timing
        row["errors"]["bracket_missed"] = f"{type(e).__name__}: {e}"[:500]
    med = time_interleaved(fns, args.runs, args.warmup, args.inner)
    row["ms"] = {name: t * 1e3 for name, t in med.items()}
    if "bn" in med:
      row["ratio_to_bn"] = {name: t / med["bn"] for name, t in med.items()}
    result["rows"].append(row)
    write_json(args.out, result)
    timings = "  ".join(f"{name} {t * 1e3:.3f}" for name, t in med.items())
    print(f"{shape_text:>14} ms: {timings}", flush=True)
    print(
        f"{'':>14} exact: {row['exact']}  while: {row['while_loop']}"
        + (
            f"  bracket missed: {row['bracket_missed']}"
            if "bracket_missed" in row
            else ""
        )
        + (f"  errors: {row['errors']}" if row["errors"] else ""),
        flush=True,
    )
  result["complete"] = True
  write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
