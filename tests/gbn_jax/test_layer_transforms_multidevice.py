"""Forward and reverse mode through statistics pooled over four devices.

The layer with ``axis_name`` under ``shard_map`` and ``pmap``, its batch
split over the devices, is the same function of ``x`` as the plain layer on
the whole batch: its ``jvp``, ``jacfwd``, gradient and Hessian-vector
product must be the plain layer's (one device in
tests/gbn_jax/test_layer_transforms.py), for every measure's program
(``PROGRAM_MEASURES``). Measure names come from the registry.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4
(tests/gbn_jax/test_multidevice.py does this in a subprocess).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm

from tests.helpers import multidevice as md
from tests.helpers.measures import PROGRAM_MEASURES
from tests.helpers.multidevice import NDEV

pytestmark = pytest.mark.multidevice

md.require_devices()


def _close(a, b, rtol=1e-4):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


@pytest.mark.parametrize("measure", PROGRAM_MEASURES)
def test_pooled_derivatives_equal_the_whole_batch(measure):
  # Distinct values: every order statistic untied, the layer smooth at x.
  rng = np.random.default_rng(0)
  n, f = 4 * NDEV, 3
  x = jnp.asarray(rng.permutation(n * f).reshape(n, f) / 10.0, jnp.float32)
  variables = {
      "params": {"scale": jnp.array([1.0, 0.5, 2.0]), "bias": jnp.ones(f)},
      "batch_stats": {"mean": jnp.zeros(f), "var": jnp.ones(f)},
  }

  # 'sqd' takes its alpha as a field.
  fields = (
      {"alpha": 0.3} if "alpha" in gbn_jax.MEASURES[measure].required else {}
  )

  def layer(axis_name=None):
    module = GBatchNorm(
        use_running_average=False,
        measure=measure,
        axis_name=axis_name,
        **fields,
    )
    return lambda a: module.apply(variables, a, mutable=["batch_stats"])[0]

  plain = layer()
  sharded = jax.jit(
      jax.shard_map(
          layer("batch"),
          mesh=md.mesh(),
          in_specs=P("batch"),
          out_specs=P("batch"),
      )
  )
  per_device = jax.pmap(layer("batch"), axis_name="batch")
  pmapped = lambda a: per_device(a.reshape(NDEV, -1, f)).reshape(n, f)
  v = jnp.asarray(rng.standard_normal((n, f)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((n, f)), jnp.float32)
  loss = lambda g: lambda a: jnp.sum(jnp.sin(g(a)) * w)
  jvp = lambda h: lambda a: jax.jvp(h, (a,), (v,))[1]
  hvp = lambda h: jvp(jax.grad(loss(h)))

  # Forward mode on the pooled side against reverse mode on the whole batch.
  def outputs(g, jacobian):
    return lambda a: [
        t(a) for t in (g, jvp(g), jacobian(g), jax.grad(loss(g)), hvp(g))
    ]

  # The whole-batch side under one jit, and the sharded side too (pmap runs
  # compiled anyway): eager dispatch of the tiny ops is the cost otherwise,
  # and each compilation has its overhead.
  want = jax.jit(outputs(plain, jax.jacrev))(x)
  for got in (
      jax.jit(outputs(sharded, jax.jacfwd))(x),
      outputs(pmapped, jax.jacfwd)(x),
  ):
    for a, b in zip(got, want, strict=True):
      _close(a, b)
