"""Counts the passes of the pure-JAX adaptive selection, a device-independent cost.

On a GPU/TPU each pass of ``gbn_jax._selection.loop``'s loop costs a kernel launch and
a host sync, so the pass count predicts its time there; ``--accelerator``
forces the accelerator code paths (eight thresholds per pass, one-kernel fold)
on the CPU to count them without a device. Prints, per ``(first_eps, eps)``
setting of the interpolation margins, the mean and worst pass count over data
kinds x shapes x alpha levels.

  python -m benchmarks.layer.select_passes --accelerator
  python -m benchmarks.layer.select_passes --eps 5,1 5,2
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import loop

KINDS = ("normal", "relu", "halves", "lognormal", "jax_normal")
SHAPES = ((64, 32, 32, 16), (1000, 8, 8, 50))
ALPHAS = (0.01, 0.25, 0.5, 0.75, 0.99)


def make_data(kind: str, shape, rng) -> np.ndarray:
  if kind == "jax_normal":  # float32 values repeat: chance ties in samples
    return np.asarray(jax.random.normal(jax.random.key(2), shape))
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "relu":
    return np.maximum(x, 0)
  if kind == "halves":
    return np.round(x * 2) / 2
  if kind == "lognormal":
    return np.exp(3 * x).astype(np.float32)
  return x


def count_passes(x: np.ndarray, k: int) -> int:
  """Passes the loop ran for ``k`` over the leading axes of ``x``."""
  seen = []
  narrow = loop._narrow  # pylint: disable=protected-access

  def counting_narrow(state, *args):
    state = narrow(state, *args)
    jax.debug.callback(lambda p: seen.append(int(p)), state["passes"])
    return state

  loop._narrow = counting_narrow  # pylint: disable=protected-access
  try:
    axes = tuple(range(x.ndim - 1))
    jax.block_until_ready(
        jax.jit(lambda v: dispatch.kth_smallest(v, k, axes, method="adaptive"))(
            x
        )
    )
    jax.effects_barrier()
  finally:
    loop._narrow = narrow  # pylint: disable=protected-access
  return max(seen, default=0)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--accelerator",
      action="store_true",
      help="force the GPU/TPU code paths on the CPU",
  )
  parser.add_argument(
      "--eps",
      nargs="+",
      default=["5,1", "5,2", "5,3", "8,3"],
      help="first_eps,eps pairs (_FIRST_INTERP_EPS, _INTERP_EPS)",
  )
  args = parser.parse_args(argv)
  if args.accelerator:
    common.on_cpu = lambda: False  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  data = [make_data(kind, shape, rng) for kind in KINDS for shape in SHAPES]
  for pair in args.eps:
    first_eps, eps = (float(v) for v in pair.split(","))
    loop._FIRST_INTERP_EPS, loop._INTERP_EPS = first_eps, eps  # pylint: disable=protected-access
    passes = []
    for x in data:
      n = int(np.prod(x.shape[:-1]))
      passes += [count_passes(x, int(np.ceil(a * n))) for a in ALPHAS]
    print(
        f"{'accelerator' if args.accelerator else 'cpu'} paths, first_eps {first_eps:g}, "
        f"eps {eps:g}: mean passes {np.mean(passes):.2f}, worst {max(passes)}",
        flush=True,
    )


if __name__ == "__main__":
  main()
