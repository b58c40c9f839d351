"""What the multidevice tests share: their devices, a mesh, a batch with ties.

Every file here runs in a process with XLA_FLAGS=
--xla_force_host_platform_device_count=4 (tests/test_multidevice.py starts
it); :func:`require_devices` makes a run without that fail clearly instead
of testing fewer devices.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import pytest

import reference as ref

NDEV = 4


def require_devices() -> None:
  """Fails the module's collection unless ``NDEV`` devices are there."""
  if jax.device_count() < NDEV:
    pytest.fail(
        f"needs {NDEV} devices; set XLA_FLAGS before importing jax",
        pytrace=False,
    )


def mesh(axis_name: str = "batch") -> Mesh:
  """A one-axis mesh over the first ``NDEV`` devices."""
  return Mesh(np.array(jax.devices()[:NDEV]), (axis_name,))


def relu_batch(shape: tuple[int, ...] = (16, 3, 3, 5), seed: int = 0):
  """ReLU-like values with ties, shifted so every measure is non-degenerate."""
  return jnp.asarray(ref.relu_like(np.random.default_rng(seed), shape) - 0.25)


def assert_trees_close(a, b, rtol: float = 2e-4, atol: float = 1e-3) -> None:
  """Leaf by leaf ``assert_allclose``: the same selected elements, float32
  sums in another order (``D = qbar - E[x]`` cancels, which amplifies that
  rounding a little for the quantile measures)."""
  jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol), a, b
  )
