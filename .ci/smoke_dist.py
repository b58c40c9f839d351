"""Smoke test of an installed gbn-jax distribution, run by .ci/smoke_dist.sh.

Run it from outside the checkout, so that ``gbn_jax`` is the installed copy:
``python -I smoke_dist.py --native`` (the wheel: the C++ kernel must load) or
``--no-native`` (an sdist installed without a compiler: pure JAX). The
library is normalization only: no convolution module or kernel is installed
(the training suite's, ``train/native/convolution.py``, runs from a checkout).
"""

import argparse
import importlib.metadata
import importlib.util
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import gbn_jax
from gbn_jax._selection import native
import gbn_jax.nnx


def sqd2_reference(x: np.ndarray, epsilon: float = 1e-5) -> np.ndarray:
  """GBN with sqd2 from the definitions: median, superquantile minus mean."""
  n = x.shape[0]
  q = np.sort(x, axis=0)[-(-n // 2) - 1]  # the ceil(N/2)-th smallest
  qbar = q + np.maximum(x - q, 0).mean(axis=0) / 0.5
  d = qbar - x.mean(axis=0)
  return (x - q) / np.sqrt(d**2 + epsilon)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument(
      "--native", action=argparse.BooleanOptionalAction, required=True
  )
  args = parser.parse_args()

  package = pathlib.Path(gbn_jax.__file__).resolve().parent
  assert (
      "site-packages" in package.parts
  ), f"gbn_jax imported from {package}, not an install"
  assert (
      importlib.util.find_spec("train") is None
  ), "installing gbn-jax added a top-level train"
  assert gbn_jax.__version__ == importlib.metadata.version(
      "gbn-jax"
  ), gbn_jax.__version__
  assert (package / "py.typed").is_file(), "py.typed missing"
  kernels = sorted(package.glob("_kth_cpu*.so"))
  if args.native:
    assert (
        kernels and native.available()
    ), f"the compiled kernel did not load: {kernels}"
  else:
    assert (
        not kernels and not native.available()
    ), f"a kernel was built: {kernels}"
  convolution_files = [
      path
      for path in package.rglob("*")
      if path.name.startswith(("convolution", "_conv_cpu", "conv_"))
  ]
  assert not convolution_files, convolution_files
  assert importlib.util.find_spec("gbn_jax.convolution") is None

  # Both of the kernel's paths (radix select; sampled bracket over 16384 rows);
  # pure JAX's large-batch path is the test suite's (slow to compile here).
  for shape in [(64, 5), (20000, 3)] if args.native else [(64, 5)]:
    x = jax.random.normal(jax.random.key(0), shape)
    layer = gbn_jax.GBatchNorm(use_running_average=False, measure="sqd2")
    variables = layer.init(jax.random.key(1), x)
    y, _ = layer.apply(variables, x, mutable=["batch_stats"])
    want = sqd2_reference(np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    grad = jax.grad(
        lambda v: layer.apply(variables, v, mutable=["batch_stats"])[0].sum()
    )(x)
    assert bool(jnp.isfinite(grad).all()), "non-finite gradient"

  norm = gbn_jax.nnx.GBatchNorm(5, measure="sqd2", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (64, 5))
  np.testing.assert_allclose(
      np.asarray(norm(x)),
      sqd2_reference(np.asarray(x, np.float64)),
      rtol=1e-4,
      atol=1e-4,
  )
  kind = "the C++ kernel" if args.native else "pure JAX"
  print(f"gbn-jax {gbn_jax.__version__} from {package}: sqd2 OK with {kind}")


if __name__ == "__main__":
  main()
