"""What the tests of GBatchNorm on flax's unusual inputs share.

Used by tests/gbn_jax/test_layer_flax_compat.py (one device: the per-example ``vmap``),
tests/gbn_jax/test_layer_flax_compat_multidevice.py (one example per device)
and tests/gbn_jax/test_layer_transforms.py (the per-example ``vmap`` under transforms).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

from flax import nnx
import flax.linen as nn
import jax
import numpy as np

import gbn_jax.nnx

from tests.helpers import reference as ref

MOMENTUM = 0.9

#: The float32 tolerance of one layer against its float64 reference.
assert_close = functools.partial(
    np.testing.assert_allclose, rtol=2e-5, atol=2e-5
)


def scale_and_bias(features: int, seed: int = 3) -> dict[str, jax.Array]:
  """A layer's ``params``, far from the initial ones so both are tested."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "scale": 1 + 0.5 * jax.random.normal(k1, (features,)),
      "bias": jax.random.normal(k2, (features,)),
  }


def per_example(cls: type[nn.Module], **fields: Any) -> nn.Module:
  """``cls`` in training mode applied to one example at a time by ``vmap``.

  The vmapped axis is named ``'batch'`` and the layer's ``axis_name`` is that
  name, so its statistics pool the whole batch; the variables are shared by
  every example.

  Args:
    cls: A linen normalization layer (GBatchNorm or flax's BatchNorm).
    **fields: The layer's other fields (``measure``, ``momentum``, ...).

  Returns:
    The vmapped layer; its ``apply`` takes the whole batch.
  """
  return nn.vmap(
      cls,
      in_axes=0,
      out_axes=0,
      axis_name="batch",
      variable_axes={"params": None, "batch_stats": None},
      split_rngs={"params": False},
  )(use_running_average=False, axis_name="batch", **fields)


def reference_step(
    measure: str, x: Any, params: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One training step over axis 0, in numpy from the definitions.

  Args:
    measure: A built-in measure's name.
    x: The batch, features last.
    params: The layer's ``scale`` and ``bias``.

  Returns:
    ``(y, mean, var)``: the output and the running statistics after one
    step from ``mean = 0``, ``var = 1`` with momentum :data:`MOMENTUM`.
  """
  x = np.asarray(x)
  s, d = ref.per_feature(lambda v: ref.measure_1d(measure, v), x, (0,))
  y = ref.normalize(x, s, d, (0,), params["scale"], params["bias"])
  return y, (1 - MOMENTUM) * s, MOMENTUM + (1 - MOMENTUM) * d**2


def assert_nnx_step_matches_references(
    run: Callable[[nnx.Module], tuple[Any, ...]],
    measure: str,
    x: Any,
    params: dict[str, Any],
) -> None:
  """gbn_jax.nnx.GBatchNorm's step against numpy (and flax, for ``'sd'``).

  Args:
    run: Applies an nnx layer with ``axis_name='batch'`` to ``x`` (with
      ``params`` as its scale and bias) and returns ``(y, mean, var)``: its
      output and running statistics.
    measure: The measure's name.
    x: The batch ``run`` applies the layer to.
    params: The ``scale`` and ``bias`` ``run`` sets.
  """
  fields = dict(axis_name="batch", momentum=MOMENTUM, rngs=nnx.Rngs(0))
  features = len(params["scale"])
  outputs = run(gbn_jax.nnx.GBatchNorm(features, measure=measure, **fields))
  jax.tree.map(assert_close, outputs, reference_step(measure, x, params))
  if measure == "sd":
    expected = run(nnx.BatchNorm(features, **fields))
    jax.tree.map(assert_close, outputs, expected)
