"""Radix select pooled over 4 host devices equals the single-device result.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/gbn_jax/test_multidevice.py
does this in a subprocess).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from gbn_jax._selection import radix
from gbn_jax._selection import sort

from tests.helpers import multidevice as md
from tests.helpers.multidevice import NDEV

pytestmark = pytest.mark.multidevice

md.require_devices()


def _mesh():
  return md.mesh("b")


def _check(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def _data(kind, shape, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "halves":
    x = np.round(x * 2) / 2
  elif kind == "relu":
    x = np.maximum(x, 0)
    x[rng.random(shape) < 0.1] = -0.0
  return x


K = np.array(
    [
        [1, 900, 1680],
        [2, 1000, 3000],
        [1500, 700, 4],
        [1, 2, 3],
        [3360, 17, 8],
        [5, 6, 7],
    ],
    np.int32,
)


@pytest.mark.parametrize("kind", ["normal", "halves", "relu"])
def test_shard_map_axis_name_equals_single_device(kind):
  x = _data(kind, (NDEV * 700, 6, 3), seed=len(kind))
  where = np.random.default_rng(1).random(x.shape) < 0.8
  k = K // 2 + 1

  def local(xs, ws):
    a = radix.kth_smallest_accelerator(xs, 1000, (0,), axis_name="b")
    b, ties = radix.kth_smallest_accelerator(
        xs, jnp.asarray(k), (0,), where=ws, axis_name="b", return_ties=True
    )
    sums = radix.kth_smallest_with_sums_accelerator(
        xs, jnp.asarray(k), (0,), where=ws, axis_name="b"
    )
    return a, b, ties[None], sums

  fn = jax.jit(
      jax.shard_map(
          local,
          mesh=_mesh(),
          in_specs=(P("b"), P("b")),
          out_specs=(P(), P(), P("b"), P()),
      )
  )
  a, b, ties, sums = fn(x, where)
  assert "while" not in str(jax.make_jaxpr(fn)(x, where))
  _check(a, sort.kth_smallest_reference(x, 1000, (0,)))
  want_b = sort.kth_smallest_reference(x, k, (0,), where=where)
  _check(b, want_b)
  # Local tie counts: each device's own rows (the quantile JVP psums them).
  parts = np.split(x, NDEV), np.split(where, NDEV)
  for d, (xd, wd) in enumerate(zip(*parts)):
    np.testing.assert_array_equal(
        ties[d], ((xd == np.asarray(want_b)[None]) & wd).sum(0)
    )
  # The sums entry point, pooled, against one device on the whole batch.
  single = jax.jit(
      lambda v, w: radix.kth_smallest_with_sums_accelerator(
          v, jnp.asarray(k), (0,), where=w
      )
  )(x, where)
  _check(sums[0], single[0])
  for got, want in zip(sums[1:], single[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(sums[1], np.asarray(ties).sum(0))


def test_pmap_axis_index_groups():
  x = _data("halves", (NDEV * 700, 6, 3), seed=3)
  groups = [[0, 1], [2, 3]]
  g = jax.pmap(
      lambda xs: radix.kth_smallest_accelerator(
          xs, 700, (0,), axis_name="b", axis_index_groups=groups
      ),
      axis_name="b",
  )(x.reshape(NDEV, 700, 6, 3))
  _check(g[0], sort.kth_smallest_reference(x[:1400], 700, (0,)))
  _check(g[1], g[0])
  _check(g[2], sort.kth_smallest_reference(x[1400:], 700, (0,)))
  _check(g[3], g[2])


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_jit_over_batch_sharded_array(explicit):
  mesh = jax.make_mesh((NDEV,), ("b",)) if explicit else _mesh()
  x = _data("relu", (256, 4, 4, 5), seed=4)
  where = np.random.default_rng(4).random(x.shape) < 0.9
  sharding = NamedSharding(mesh, P("b"))
  xs, ws = jax.device_put(x, sharding), jax.device_put(where, sharding)
  fn = jax.jit(
      functools.partial(radix.kth_smallest_accelerator, k=1500, axis=(0, 1, 2))
  )
  _check(fn(xs), sort.kth_smallest_reference(x, 1500, (0, 1, 2)))
  fn = jax.jit(
      lambda v, w: radix.kth_smallest_with_sums_accelerator(
          v, 1000, (0, 1, 2), where=w
      )
  )
  got = fn(xs, ws)
  want = fn(x, where)
  _check(got[0], sort.kth_smallest_reference(x, 1000, (0, 1, 2), where=where))
  _check(got[0], want[0])
  for a, b in zip(got[1:], want[1:]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
