"""One example per device with axis_name: statistics pool the devices.

flax's BatchNorm accepts an input whose only axis is the feature axis; with
``axis_name`` its statistics are those of all elements across the named
axis. GBatchNorm does the same for every measure, quantiles included.
References: flax's BatchNorm for ``sd``, numpy from the
definitions for the rest.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4
(tests/gbn_jax/test_multidevice.py does this in a subprocess).
"""

import functools

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from gbn_jax import GBatchNorm

from tests.helpers import multidevice as md
from tests.helpers.flax_compat import MOMENTUM
from tests.helpers.flax_compat import assert_close
from tests.helpers.flax_compat import assert_nnx_step_matches_references
from tests.helpers.flax_compat import reference_step
from tests.helpers.flax_compat import scale_and_bias
from tests.helpers.measures import COMPLETE_MEASURES
from tests.helpers.multidevice import NDEV

pytestmark = pytest.mark.multidevice

md.require_devices()


def _x(f=3, seed=0):
  # One example per device, distinct values so every measure is non-degenerate.
  return jnp.asarray(
      np.random.default_rng(seed).normal(size=(NDEV, f)), jnp.float32
  )


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_linen_pmap_one_example_per_device(measure):
  x, params = _x(), scale_and_bias(3)
  variables = {
      "params": params,
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }

  def run(module):
    return jax.pmap(
        lambda v: module.apply(variables, v, mutable=["batch_stats"]),
        axis_name="i",
    )(x)

  kw = dict(use_running_average=False, axis_name="i", momentum=MOMENTUM)
  y, upd = run(GBatchNorm(measure=measure, **kw))
  y_ref, mean_ref, var_ref = reference_step(measure, x, params)
  assert_close(y, y_ref)
  for dev in range(NDEV):  # every device holds the pooled statistics
    assert_close(upd["batch_stats"]["mean"][dev], mean_ref)
    assert_close(upd["batch_stats"]["var"][dev], var_ref)
  if measure == "sd":
    yf, updf = run(nn.BatchNorm(**kw))
    assert_close(y, yf)
    jax.tree.map(assert_close, upd, updf)


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_nnx_shard_map_one_example_per_device(measure):
  x, params = _x(), scale_and_bias(3)
  mesh = md.mesh()

  def run(layer):
    layer.scale[...], layer.bias[...] = params["scale"], params["bias"]
    graphdef, state = nnx.split(layer)

    def local(state, v):
      m = nnx.merge(graphdef, state)
      y = m(v[0])  # this device's example: only the feature axis is left
      return y[None], nnx.state(m, nnx.BatchStat)

    y, stats = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=(P("batch"), P()),
        )
    )(state, x)
    return y, stats["mean"][...], stats["var"][...]

  assert_nnx_step_matches_references(run, measure, x, params)


@pytest.mark.parametrize("measure", ["sd", "sqd2", "wcd"])
def test_pmap_one_example_gradient_equals_batched(measure):
  # pmap differentiates each device's loss; summed over devices, the input
  # gradient is that of the single-device batched call on the same loss.
  x, params = _x(), scale_and_bias(3)
  w = jax.random.normal(jax.random.key(4), x.shape)
  variables = {
      "params": params,
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }

  def loss(module, p, v, wl):
    y, _ = module.apply({**variables, "params": p}, v, mutable=["batch_stats"])
    return jnp.sum(jnp.sin(y) * wl)

  per_device = GBatchNorm(
      use_running_average=False, axis_name="i", measure=measure
  )
  gp, gx = jax.pmap(
      lambda v, wl: jax.grad(
          functools.partial(loss, per_device), argnums=(0, 1)
      )(params, v, wl),
      axis_name="i",
  )(x, w)
  batched = GBatchNorm(use_running_average=False, measure=measure)
  gp_ref, gx_ref = jax.grad(functools.partial(loss, batched), argnums=(0, 1))(
      params, x, w
  )
  tol = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5)
  tol(gx, gx_ref)
  jax.tree.map(lambda a, b: tol(a.sum(0), b), gp, gp_ref)
