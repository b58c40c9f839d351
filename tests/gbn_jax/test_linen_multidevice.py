"""Global-batch statistics across 4 host devices equal the single-device result.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/gbn_jax/test_multidevice.py
does this in a subprocess).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm

from tests.helpers import multidevice as md
from tests.helpers.measures import COMPLETE_MEASURES
from tests.helpers.multidevice import NDEV

pytestmark = pytest.mark.multidevice

md.require_devices()

_batch = md.relu_batch
_auto_mesh = md.mesh
_close = md.assert_trees_close


def _reference_step(measure, variables, x, w, **options):
  """Single device, whole batch: output, new stats, and gradients."""
  return md.training_step(
      GBatchNorm(measure=measure, **options), variables, x, w
  )


def _pmap_step(module, variables, x, w):
  """Output, new stats and input gradient, the batch split over ``NDEV``
  pmapped devices; the stats as device 0 has them."""
  split = lambda a: a.reshape((NDEV, -1) + a.shape[1:])
  y, upd, (_, gx) = jax.pmap(
      lambda inp, wl: md.training_step(module, variables, inp, wl),
      axis_name="i",
  )(split(x), split(w))
  return (
      y.reshape(x.shape),
      jax.tree.map(lambda a: a[0], upd),
      gx.reshape(x.shape),
  )


def _init(measure, x):
  variables = GBatchNorm(measure=measure).init(jax.random.key(0), x, False)
  keys = iter(jax.random.split(jax.random.key(1), 8))
  return jax.tree.map(
      lambda a: a + 0.2 * jax.random.normal(next(keys), a.shape), variables
  )


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_shard_map_axis_name_equals_single_device(measure):
  x = _batch()
  w = jax.random.normal(jax.random.key(2), x.shape)
  variables = _init(measure, x)
  want = _reference_step(measure, variables, x, w)
  module = GBatchNorm(measure=measure, axis_name="batch")
  _close(md.sharded_training_step(module, variables, x, w), want)


@pytest.mark.parametrize("measure", ["sd", "sqd1", "rbd", "bpoe"])
def test_pmap_axis_name_equals_single_device(measure):
  x = _batch(seed=3)
  w = jax.random.normal(jax.random.key(4), x.shape)
  variables = _init(measure, x)
  y_ref, upd_ref, g_ref = _reference_step(measure, variables, x, w)
  module = GBatchNorm(measure=measure, axis_name="i")
  # pmap differentiates each device's loss with psum transposes, i.e. the sum
  # of the NDEV per-device losses, each of which is the reference loss share.
  _close(_pmap_step(module, variables, x, w), (y_ref, upd_ref, g_ref[1]))


def test_pmap_axis_index_groups():
  x = _batch(seed=5)
  module = GBatchNorm(
      measure="sqd2", axis_name="i", axis_index_groups=[[0, 1], [2, 3]]
  )
  variables = _init("sqd2", x)
  y, _ = jax.pmap(
      lambda v: module.apply(variables, v, False, mutable=["batch_stats"]),
      axis_name="i",
  )(x.reshape((NDEV, -1) + x.shape[1:]))
  y = y.reshape(x.shape)
  half = x.shape[0] // 2
  for part in (slice(0, half), slice(half, None)):
    want, _ = GBatchNorm(measure="sqd2").apply(
        variables, x[part], False, mutable=["batch_stats"]
    )
    _close(y[part], want)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("measure", ["sd", "sqd2", "wcd"])
def test_jit_over_batch_sharded_array_is_exact(measure, explicit):
  if explicit:  # jax.make_mesh's default axis types are Explicit
    mesh = jax.make_mesh((NDEV,), ("batch",))
  else:
    mesh = _auto_mesh()
  x = _batch(seed=6)
  w = jax.random.normal(jax.random.key(7), x.shape)
  variables = _init(measure, x)
  y_ref, upd_ref, g_ref = _reference_step(measure, variables, x, w)
  xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
  ws = jax.device_put(w, NamedSharding(mesh, P("batch")))
  y, upd, grads = jax.jit(functools.partial(_reference_step, measure))(
      variables, xs, ws
  )
  _close(y, y_ref)
  _close(upd, upd_ref)
  _close(grads, g_ref)


def test_quantile_functions_with_axis_name_and_mask():
  x = _batch((32, 6), seed=8)
  mask = jax.random.bernoulli(jax.random.key(9), 0.7, x.shape)

  def local(v, m):
    q = gbn_jax.quantile(v, 0.3, 0, where=m, axis_name="batch")
    sq = gbn_jax.superquantile(v, 0.8, 0, where=m, axis_name="batch")
    return q, sq

  q, sq = jax.shard_map(
      local,
      mesh=_auto_mesh(),
      in_specs=(P("batch"), P("batch")),
      out_specs=(P(), P()),
  )(x, mask)
  np.testing.assert_array_equal(q, gbn_jax.quantile(x, 0.3, 0, where=mask))
  _close(sq, gbn_jax.superquantile(x, 0.8, 0, where=mask))


def test_custom_measure_without_axis_name_sees_the_global_batch():
  def spread(x, axis):  # knows nothing about devices
    return gbn_jax.quantile(x, 0.5, axis), jnp.max(x, axis) - jnp.min(x, axis)

  x = _batch(seed=10)
  variables = GBatchNorm(measure=spread).init(jax.random.key(0), x, False)
  want, _ = GBatchNorm(measure=spread).apply(
      variables, x, False, mutable=["batch_stats"]
  )
  module = GBatchNorm(measure=spread, axis_name="batch")
  y = jax.shard_map(
      lambda v: module.apply(variables, v, False, mutable=["batch_stats"])[0],
      mesh=_auto_mesh(),
      in_specs=P("batch"),
      out_specs=P("batch"),
  )(x)
  _close(y, want)


def test_flax_batchnorm_and_sd_agree_across_devices():
  x = _batch(seed=11)
  variables = nn.BatchNorm().init(jax.random.key(0), x, False)

  def run(module):
    return jax.shard_map(
        lambda v: module.apply(variables, v, False, mutable=["batch_stats"]),
        mesh=_auto_mesh(),
        in_specs=P("batch"),
        out_specs=(P("batch"), P()),
    )(x)

  _close(
      run(GBatchNorm(axis_name="batch")), run(nn.BatchNorm(axis_name="batch"))
  )


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_large_sharded_batch_quantiles_are_exact(explicit):
  # >= 16384 rows: the sampled (adaptive) selection path, not bisection.
  mesh = jax.make_mesh((NDEV,), ("batch",)) if explicit else _auto_mesh()
  x = _batch((2048, 4, 4, 2), seed=12)
  xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
  f = jax.jit(lambda v: gbn_jax.superquantile(v, 0.3, (0, 1, 2)))
  g = jax.jit(
      jax.grad(lambda v: gbn_jax.superquantile(v, 0.3, (0, 1, 2)).sum())
  )
  q = jax.jit(lambda v: gbn_jax.quantile(v, 0.7, (0, 1, 2)))
  np.testing.assert_array_equal(q(xs), q(x))
  _close(f(xs), f(x))
  _close(g(xs), g(x))


# --- batch renormalization and precise statistics ---------------------------------

RENORM = {"renorm": True, "renorm_clipping": {"rmax": 1.5, "dmax": 0.5}}


def _renorm_init(measure, x):
  # Running statistics away from (0, 1), so that r and d are non-trivial.
  variables = _init(measure, x)
  return {
      **variables,
      "batch_stats": {
          "mean": variables["batch_stats"]["mean"] + 0.3,
          "var": jnp.abs(variables["batch_stats"]["var"]) + 0.5,
      },
  }


_renorm_reference = functools.partial(_reference_step, **RENORM)


@pytest.mark.parametrize("measure", ["sd", "mad", "sqd1", "rbd", "bpoe"])
def test_renorm_shard_map_axis_name_equals_single_device(measure):
  x = _batch(seed=13)
  w = jax.random.normal(jax.random.key(14), x.shape)
  variables = _renorm_init(measure, x)
  want = _renorm_reference(measure, variables, x, w)
  module = GBatchNorm(measure=measure, axis_name="batch", **RENORM)
  _close(md.sharded_training_step(module, variables, x, w), want)
  # and the renormalized layer is not the plain one here
  y_plain, _, _ = _reference_step(measure, variables, x, w)
  assert not np.allclose(want[0], y_plain, atol=1e-3)


@pytest.mark.parametrize("measure", ["sd", "sqd2"])
def test_renorm_jit_over_batch_sharded_array_is_exact(measure):
  x = _batch(seed=15)
  w = jax.random.normal(jax.random.key(16), x.shape)
  variables = _renorm_init(measure, x)
  want = _renorm_reference(measure, variables, x, w)
  sharding = NamedSharding(_auto_mesh(), P("batch"))
  got = jax.jit(functools.partial(_renorm_reference, measure))(
      variables, jax.device_put(x, sharding), jax.device_put(w, sharding)
  )
  _close(got, want)


def test_renorm_pmap_equals_single_device():
  x = _batch(seed=17)
  w = jax.random.normal(jax.random.key(18), x.shape)
  variables = _renorm_init("sqd1", x)
  y_ref, upd_ref, g_ref = _renorm_reference("sqd1", variables, x, w)
  module = GBatchNorm(measure="sqd1", axis_name="i", **RENORM)
  _close(_pmap_step(module, variables, x, w), (y_ref, upd_ref, g_ref[1]))


class _PreciseNet(nn.Module):
  """Conv, GBatchNorm, conv, BatchNorm; ``axis_name`` in both norms."""

  measure: str
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (2, 2))(x)
    x = nn.relu(
        GBatchNorm(
            use_running_average=False,
            measure=self.measure,
            momentum=0.99,
            axis_name=self.axis_name,
        )(x)
    )
    x = nn.BatchNorm(
        use_running_average=False, momentum=0.9, axis_name=self.axis_name
    )(nn.Conv(3, (2, 2))(x))
    return x.mean((1, 2))


@pytest.mark.parametrize("measure", ["sd", "sqd1", "rbd", "wcd"])
def test_precise_batch_stats_over_sharded_batches_equal_one_device(measure):
  model = _PreciseNet(measure)
  batches = jnp.stack([_batch(seed=20 + i) for i in range(3)])
  variables = model.init(jax.random.key(0), batches[0])
  apply = lambda v, b: model.apply(v, b, mutable=["batch_stats"])
  want = gbn_jax.precise_batch_stats(apply, variables, list(batches))
  sharded = jax.device_put(
      batches, NamedSharding(_auto_mesh(), P(None, "batch"))
  )
  got = jax.jit(lambda v, b: gbn_jax.precise_batch_stats(apply, v, b))(
      variables, sharded
  )
  _close(got, want)

  # shard_map with axis_name: each device holds a quarter of every batch.
  def local(v, b):
    return gbn_jax.precise_batch_stats(
        lambda vv, bb: _PreciseNet(measure, "batch").apply(
            vv, bb, mutable=["batch_stats"]
        ),
        v,
        b,
        stacked=True,
    )

  got = jax.jit(
      jax.shard_map(
          local,
          mesh=_auto_mesh(),
          in_specs=(P(), P(None, "batch")),
          out_specs=P(),
      )
  )(variables, batches)
  _close(got, want)
