"""Tests of the Pallas radix select's passes as one loop over one kernel.

``pallas_kth_smallest`` traces its first pass, then the passes after it as one
``lax.fori_loop`` body calling one kernel whose shift is a traced operand
(with ``sums`` the last pass, which also sums, on its own): a CUDA program
holds 2 or 3 Triton kernels per selection, not one per pass. Checked here in
the jaxpr and in the CUDA export (no GPU needed to export), and the values,
tie and "above" counts and sums against numpy written from the definitions
on ties, infinities, signed zeros, denormals, tiny rows and extreme ranks, for
every digit width (interpret mode on this CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax._selection import common
from gbn_jax._selection import pallas

from tests.helpers.selection import TRITON_TARGET
from tests.helpers.selection import cuda_text
from tests.helpers.selection import data
from tests.helpers.selection import eqns_in
from tests.helpers.selection import numpy_kth

# Columns of ties, infinities, signed zeros, denormals, one value, huge ones.
_COLUMN_KINDS = (
    "tiny_set",
    "inf",
    "signed_zero",
    "denormal",
    "constant",
    "huge",
)


def kernels_by_loop(jaxpr) -> list[int | None]:
  """Per ``pallas_call`` in ``jaxpr``, the length of the scan it runs in."""
  return [
      length
      for eqn, length in eqns_in(jaxpr)
      if eqn.primitive.name == "pallas_call"
  ]


@pytest.mark.parametrize("digit_bits", pallas.DIGIT_BITS)
@pytest.mark.parametrize("sums", [False, True])
def test_middle_passes_are_one_kernel_in_a_static_loop(digit_bits, sums):
  rows = jnp.zeros((50, 3), jnp.float32)
  select = lambda x: pallas.pallas_kth_smallest(
      x,
      None,
      jnp.ones(3, jnp.int32),
      common.Comm(None, None),
      digit_bits=digit_bits,
      interpret=True,
      sums=sums,
  )
  found = kernels_by_loop(jax.make_jaxpr(select)(rows).jaxpr)
  n_passes = 32 // digit_bits
  if sums:  # first pass, the middle ones in one loop, the summing last pass
    assert found == [None, n_passes - 2, None]
  else:
    assert found == [None, n_passes - 1]


def _cuda_kernels(fn, *specs) -> int:
  """Triton kernel calls in ``fn``'s StableHLO lowered for CUDA."""
  return cuda_text(fn, *specs).count(f"@{TRITON_TARGET}")


@pytest.mark.parametrize("digit_bits", pallas.DIGIT_BITS)
def test_cuda_export_holds_fewer_kernels_than_passes(digit_bits):
  spec = jax.ShapeDtypeStruct((300, 20), jnp.float32)
  mask = jax.ShapeDtypeStruct((300, 20), jnp.bool_)
  select = lambda x: pallas.kth_smallest_pallas(
      x, 30, (0,), digit_bits=digit_bits
  )
  with_sums = lambda x, m: pallas.kth_smallest_with_sums_pallas(
      x, 30, (0,), where=m, digit_bits=digit_bits
  )
  # 32 // digit_bits passes (16, 8 or 4), whatever the width 2 or 3 kernels.
  assert _cuda_kernels(select, spec) == 2
  assert _cuda_kernels(with_sums, spec, mask) == 3


def sums_from_definition(cols, mask, value):
  """Per column: the mean of the kept values and ``E[(x - value)+]``, in
  float64 (NaN where ``value`` is)."""
  out = np.full((2, cols.shape[1]), np.nan)
  for f in np.flatnonzero(~np.isnan(value)):
    kept = cols[mask[:, f], f].astype(np.float64)
    v = np.float64(value[f])
    with np.errstate(invalid="ignore"):  # inf - inf: not compared
      excess = np.where(kept > v, kept - v, 0.0).sum() / kept.size
    out[:, f] = kept.mean(), excess
  return out


@functools.partial(jax.jit, static_argnames=("digit_bits",))
def _select_with_sums(x, k, where, digit_bits):
  return pallas.kth_smallest_with_sums_pallas(
      x, k, (0,), where=where, digit_bits=digit_bits, block_rows=4, block_cols=4
  )


@pytest.mark.parametrize("digit_bits", pallas.DIGIT_BITS)
@pytest.mark.parametrize("n_rows", [1, 2, 3, 37])
@pytest.mark.parametrize("masked", [False, True])
def test_values_counts_and_sums_equal_the_definition(
    digit_bits, n_rows, masked
):
  x = np.concatenate(
      [data(kind, (n_rows, 1), seed=n_rows) for kind in _COLUMN_KINDS], axis=1
  )
  rng = np.random.default_rng(n_rows)
  mask = rng.random(x.shape) < 0.7 if masked else np.ones(x.shape, bool)
  mask[0] = True  # every column keeps an element
  n = mask.sum(axis=0)
  # Extreme ranks, the middle, and out of range (NaN) on either side.
  for k in (np.ones_like(n), n, (n + 1) // 2, n - 1, n + 1):
    k = k.astype(np.int32)
    got = _select_with_sums(x, k, mask if masked else None, digit_bits)
    value, ties, mean, excess, above = (np.asarray(a) for a in got)
    want_value, want_ties, want_above = numpy_kth(x, k, (0,), where=mask)
    np.testing.assert_array_equal(
        value.view(np.int32), want_value.view(np.int32)
    )
    valid = ~np.isnan(want_value)
    np.testing.assert_array_equal(ties[valid], want_ties[valid])
    np.testing.assert_array_equal(above[valid], want_above[valid])
    want_sums = sums_from_definition(x, mask, want_value)
    scale = np.where(mask, np.abs(x.astype(np.float64)), 0.0).sum(axis=0)
    finite = valid & (scale < np.finfo(np.float32).max)  # float32 sums
    for got_sum, want_sum in zip((mean, excess), want_sums):
      np.testing.assert_allclose(
          got_sum[finite], want_sum[finite], rtol=1e-5, atol=1e-30
      )
