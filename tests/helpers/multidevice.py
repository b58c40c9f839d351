"""What the multidevice tests share: devices, a mesh, a batch, a training step.

Every ``test_*_multidevice.py`` runs in a process with XLA_FLAGS=
--xla_force_host_platform_device_count=4 (tests/gbn_jax/test_multidevice.py and
tests/train/test_multidevice.py start it); :func:`require_devices` makes a
run without that fail clearly instead of testing fewer devices.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from tests.helpers import reference as ref

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


def training_step(module, variables, x, w, mask=None):
  """Output, running statistics and gradients (params, input) of one step.

  The loss ``sum(sin(y) * w)`` weighs every output differently, so that a
  gradient summed or scaled in the wrong place shows.
  """

  def loss(params, inp):
    y, upd = module.apply(
        {**variables, "params": params},
        inp,
        False,
        mask=mask,
        mutable=["batch_stats"],
    )
    return jnp.sum(jnp.sin(y) * w), (y, upd)

  (_, (y, upd)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      variables["params"], x
  )
  return y, upd, grads


def sharded_training_step(module, variables, x, w, mask=None):
  """:func:`training_step` under ``shard_map``, the batch split along 'batch'.

  Replicated params: shard_map's transpose already sums their cotangents, so
  the result compares with the single-device step's as it is.
  """
  masks = () if mask is None else (mask,)
  fn = jax.jit(
      jax.shard_map(
          lambda p, s, v, wl, *m: training_step(
              module, {"params": p, "batch_stats": s}, v, wl, *(m or (None,))
          ),
          mesh=mesh(),
          in_specs=(P(), P(), P("batch"), P("batch"))
          + (P("batch"),) * len(masks),
          out_specs=(P("batch"), P(), (P(), P("batch"))),
      )
  )
  return fn(variables["params"], variables["batch_stats"], x, w, *masks)
