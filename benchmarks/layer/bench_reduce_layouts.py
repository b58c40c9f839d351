"""How fast this backend sums an elementwise function, per reduction layout.

``mad`` and ``rsd`` sum ``|x - E x|`` (or ``x - E x + |x - E x|``) as ``abs``
over the batch and as a select where the reduction keeps the leading axis
(``gbn_jax.deviations``): XLA:CPU fuses an elementwise op with the sum it
feeds into its library kernel, fast over the leading axis and slow where the
leading and the last axis are kept; a select it writes out first and sums
plainly. This times one jit'ed sum per (layout, form), interleaved in one
process, so that a new JAX or backend can be checked against that choice:

  python -m benchmarks.layer.bench_reduce_layouts --runs 15 \\
      --out results/benchmarks/bench_cpu_reduce_layouts.json

Layouts: ``per_feature`` reduces every axis but the last (BatchNorm's),
``per_example`` every axis but the first and the last (InstanceNorm's).
Forms: ``sum`` (the plain sum, the floor), ``square`` (``x * x``), ``abs``,
``select`` (``where(x > 0, x, 0 - x)``, the same values).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from benchmarks.timing import add_timing_args
from benchmarks.timing import command_line
from benchmarks.timing import time_interleaved
from benchmarks.timing import write_result

FORMS = {
    "sum": lambda x: x,
    "square": lambda x: x * x,
    "abs": jnp.abs,
    "select": lambda x: jnp.where(x > 0, x, 0 - x),
}


def layout_axes(layout: str, ndim: int) -> tuple[int, ...]:
  """The reduced axes of ``layout`` for an input of rank ``ndim``."""
  if layout == "per_feature":
    return tuple(range(ndim - 1))
  if layout == "per_example":
    return tuple(range(1, ndim - 1))
  raise ValueError(f"unknown layout {layout!r}")


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--shape", default="256x32x32x64", help="input shape, features last"
  )
  add_timing_args(parser, runs=15)
  args = parser.parse_args(argv)
  shape = tuple(int(n) for n in args.shape.split("x"))
  if len(shape) < 3:
    parser.error("--shape needs at least 3 axes (a first, middle and last)")
  x = jax.random.normal(jax.random.key(0), shape)
  steps = {}
  for layout in ("per_feature", "per_example"):
    axes = layout_axes(layout, len(shape))
    for form, fn in FORMS.items():
      step = jax.jit(lambda v, fn=fn, axes=axes: jnp.sum(fn(v), axes))
      steps[layout, form] = lambda step=step: step(x)
  medians = time_interleaved(steps, args.runs, args.warmup, args.inner)
  rows = []
  for (layout, form), seconds in medians.items():
    rows.append({"layout": layout, "form": form, "ms": 1e3 * seconds})
    print(f"{layout:>12} {form:>7} {1e3 * seconds:9.2f} ms")
  run = {
      "shape": args.shape,
      "runs": args.runs,
      "command": command_line("benchmarks.layer.bench_reduce_layouts", argv),
  }
  return write_result(args.out, run, complete=True, rows=rows)


if __name__ == "__main__":
  main()
