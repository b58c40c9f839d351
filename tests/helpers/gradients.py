"""Gradient checks that more than one test module makes.

A gradient against central differences of the function itself (an
independent reference), and the input gradient of a half-precision layer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def assert_matches_central_differences(
    f: Callable[[jax.Array], jax.Array],
    grad: np.ndarray,
    x: np.ndarray,
    rng: np.random.Generator,
    directions: int,
) -> None:
  """``<grad, d>`` equals ``(f(x + eps d) - f(x - eps d)) / (2 eps)``.

  For ``directions`` standard normal directions ``d`` drawn from ``rng``,
  with ``eps = 1e-3`` and ``f`` evaluated in float32: tolerances 5e-3
  relative and absolute, what float32 central differences allow.
  """
  eps = 1e-3
  for _ in range(directions):
    d = rng.standard_normal(x.shape)
    fd = (
        float(f(jnp.asarray(x + eps * d, jnp.float32)))
        - float(f(jnp.asarray(x - eps * d, jnp.float32)))
    ) / (2 * eps)
    np.testing.assert_allclose(np.sum(grad * d), fd, rtol=5e-3, atol=5e-3)


def assert_bfloat16_input_gradient_is_finite(layer, variables, x) -> None:
  """A linen layer's gradient with respect to a bfloat16 input ``x`` (of the
  float32 sum of its training-mode output) is bfloat16 and finite."""
  g = jax.grad(
      lambda v: layer.apply(variables, v, False, mutable=["batch_stats"])[0]
      .astype(jnp.float32)
      .sum()
  )(x)
  assert (
      g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all()
  )
