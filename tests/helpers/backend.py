"""Assertions whose strength depends on the backend that runs them."""

from __future__ import annotations

import jax
import numpy as np


def assert_flax_bits(got, want, *, rtol: float = 1e-5, atol: float = 1e-5):
  """``got`` is ``want`` bit for bit on the CPU, within float32 rounding elsewhere.

  A gbn_jax layer runs its normalization as one compiled program even when
  called eagerly. XLA:CPU gives it the bits of flax's operation-by-operation
  result; XLA:GPU's fusions may contract multiply-adds, a few ulps apart.
  """
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
