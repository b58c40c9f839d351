"""gbn_jax.nnx across 4 host devices equals one device with the whole batch.

The nnx twins of test_linen_multidevice's cases: shard_map with
``axis_name`` (plain, masked, batch-renormalized), jit over a batch-sharded
array, and precise batch statistics over sharded batches. The reference is
the same layer on one device.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4
(tests/gbn_jax/test_multidevice.py does this in a subprocess).
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import gbn_jax.nnx as gnnx

from tests.helpers import multidevice as md
from tests.helpers.measures import COMPLETE_MEASURES

FEATURES = 5
RENORM = {"renorm": True, "renorm_clipping": {"rmax": 1.5, "dmax": 0.5}}

pytestmark = pytest.mark.multidevice

md.require_devices()

_batch = functools.partial(md.relu_batch, (16, 3, 3, FEATURES))
_mesh = md.mesh
_close = md.assert_trees_close


def _layer(measure, **kwargs):
  layer = gnnx.GBatchNorm(
      FEATURES, measure=measure, momentum=0.8, rngs=nnx.Rngs(0), **kwargs
  )
  keys = jax.random.split(jax.random.key(1), 4)
  layer.scale[...] += 0.2 * jax.random.normal(keys[0], (FEATURES,))
  layer.bias[...] += 0.2 * jax.random.normal(keys[1], (FEATURES,))
  # Running statistics away from (0, 1): renorm's r and d are non-trivial.
  layer.mean[...] += 0.3
  layer.var[...] += 0.5
  return layer


def _step(layer, x, w, mask=None):
  """Loss, gradients (params, input), output and the updated statistics."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(p, v):
    m = nnx.merge(graphdef, p, rest, copy=True)
    y = m(v, mask=mask)
    return jnp.sum(jnp.sin(y) * w), (y, nnx.state(m, nnx.BatchStat))

  (_, (y, stats)), (gp, gx) = jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True
  )(params, x)
  return y, stats, gp, gx


def _shard_map_step(layer, x, w, mask=None):
  graphdef, state = nnx.split(layer)

  def local(state, v, wl, ml):
    return _step(nnx.merge(graphdef, state), v, wl, ml)

  masked = mask is not None
  return jax.jit(
      jax.shard_map(
          local,
          mesh=_mesh(),
          in_specs=(P(), P("batch"), P("batch"), P("batch") if masked else P()),
          out_specs=(P("batch"), P(), P(), P("batch")),
      )
  )(state, x, w, mask)


# sqd2 is sqd1's and sqd3's code at another level: it has the masked case.
@pytest.mark.parametrize(
    "measure", [m for m in COMPLETE_MEASURES if m != "sqd2"]
)
def test_shard_map_axis_name_equals_single_device(measure):
  x = _batch()
  w = jax.random.normal(jax.random.key(2), x.shape)
  want = _step(_layer(measure), x, w)
  got = _shard_map_step(_layer(measure, axis_name="batch"), x, w)
  _close(got, want)


@pytest.mark.parametrize("measure", ["sd", "sqd2", "wcd"])
def test_shard_map_with_mask_equals_single_device(measure):
  x = _batch(seed=3)
  w = jax.random.normal(jax.random.key(4), x.shape)
  mask = jax.random.bernoulli(jax.random.key(5), 0.7, x.shape)
  want = _step(_layer(measure), x, w, mask)
  got = _shard_map_step(_layer(measure, axis_name="batch"), x, w, mask)
  _close(got, want)
  # and the mask matters here
  unmasked = _step(_layer(measure), x, w)[1]
  assert not np.allclose(want[1]["var"][...], unmasked["var"][...])


@pytest.mark.parametrize("measure", ["sd", "mad", "sqd1", "rbd"])
def test_renorm_shard_map_equals_single_device(measure):
  x = _batch(seed=6)
  w = jax.random.normal(jax.random.key(7), x.shape)
  want = _step(_layer(measure, **RENORM), x, w)
  got = _shard_map_step(_layer(measure, axis_name="batch", **RENORM), x, w)
  _close(got, want)
  plain = _step(_layer(measure), x, w)
  assert not np.allclose(want[0], plain[0], atol=1e-3)


@pytest.mark.parametrize("renorm", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("measure", ["sd", "sqd2", "bpoe"])
def test_nnx_jit_over_batch_sharded_array_is_exact(measure, renorm):
  kwargs = RENORM if renorm else {}
  x = _batch(seed=8)
  w = jax.random.normal(jax.random.key(9), x.shape)
  want = _step(_layer(measure, **kwargs), x, w)
  sharding = NamedSharding(_mesh(), P("batch"))
  layer = _layer(measure, **kwargs)
  got = nnx.jit(_step)(
      layer, jax.device_put(x, sharding), jax.device_put(w, sharding)
  )
  _close(got, want)


class _Net(nnx.Module):

  def __init__(self, measure, axis_name=None):
    rngs = nnx.Rngs(0)
    self.lin = nnx.Linear(FEATURES, 4, rngs=rngs)
    self.gbn = gnnx.GBatchNorm(
        4, measure=measure, momentum=0.99, axis_name=axis_name, rngs=rngs
    )
    self.bn = nnx.BatchNorm(4, momentum=0.9, axis_name=axis_name, rngs=rngs)

  def __call__(self, x):
    return self.bn(nnx.relu(self.gbn(self.lin(x)))).mean((1, 2))


def _stats(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))


@pytest.mark.parametrize("measure", ["sd", "sqd1", "rbd", "wcd"])
def test_precise_batch_stats_over_sharded_batches_equal_one_device(measure):
  batches = jnp.stack([_batch(seed=20 + i) for i in range(3)])
  model = _Net(measure)
  gnnx.precise_batch_stats(model, list(batches))
  want = _stats(model)

  # jit over batches sharded along their batch axis.
  model = _Net(measure)
  sharded = jax.device_put(batches, NamedSharding(_mesh(), P(None, "batch")))
  nnx.jit(gnnx.precise_batch_stats)(model, sharded)
  _close(_stats(model), want)

  # shard_map with axis_name: each device holds a quarter of every batch.
  model = _Net(measure, axis_name="batch")
  graphdef, state = nnx.split(model)

  def local(state, b):
    m = nnx.merge(graphdef, state)
    gnnx.precise_batch_stats(m, b, stacked=True)
    return nnx.state(m, nnx.BatchStat)

  stats = jax.jit(
      jax.shard_map(
          local, mesh=_mesh(), in_specs=(P(), P(None, "batch")), out_specs=P()
      )
  )(state, batches)
  nnx.update(model, stats)
  _close(_stats(model), want)
