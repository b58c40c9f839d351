"""The extremes pooled over 4 host devices: each device counts its elements
equal to the global extreme, and the cotangent is split among the ties of
every device, on a layout whose tie count sums in int32 (many positions,
the leading axis kept) and on one that does not.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/gbn_jax/test_multidevice.py
does this in a subprocess).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import gbn_jax

from tests.helpers import multidevice as md
from tests.helpers.multidevice import NDEV

pytestmark = pytest.mark.multidevice

md.require_devices()

# Global shapes, split over the devices along axis 1, reduced over (1, 2).
SHAPES = [(1024, NDEV, 8), (6, NDEV * 4, 5)]


def _reference(x, largest, mask):
  """Per position (axis 0): the extreme over axes 1 and 2 and each
  element's share of its cotangent."""
  values = np.empty(x.shape[0])
  share = np.zeros(x.shape)
  for j in range(x.shape[0]):
    chosen = x[j][mask[j]]
    if chosen.size == 0:
      values[j] = np.nan
      continue
    values[j] = chosen.max() if largest else chosen.min()
    tied = mask[j] & (x[j] == values[j])
    share[j][tied] = 1.0 / tied.sum()
  return values, share


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("largest", [True, False])
def test_shard_map_ties_are_counted_over_devices(shape, largest):
  rng = np.random.default_rng(31)
  x = rng.integers(-3, 4, shape).astype(np.float32)
  mask = rng.random(shape) < 0.7
  # A position with nothing masked in on any device: NaN, no cotangent.
  mask[-1] = False
  values, share = _reference(x.astype(np.float64), largest, mask)

  def local(a, m):
    return gbn_jax.reductions.extreme(
        a, (1, 2), largest=largest, where=m, axis_name="batch"
    )

  fn = jax.shard_map(
      local,
      mesh=md.mesh(),
      in_specs=(P(None, "batch"), P(None, "batch")),
      out_specs=P(),
  )
  xj, mj = jnp.asarray(x), jnp.asarray(mask)
  np.testing.assert_array_equal(fn(xj, mj), values)
  cotangent = jnp.asarray(rng.standard_normal(values.shape), jnp.float32)
  grad = jax.grad(lambda a: jnp.vdot(fn(a, mj), cotangent))(xj)
  want = share * np.asarray(cotangent)[:, None, None]
  np.testing.assert_allclose(grad, want, rtol=1e-6, atol=0)
