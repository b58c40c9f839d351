"""Reductions the quantiles and measures share: ranks, counts and means over
masked elements, pooled over a named device axis (no-ops without one)."""

from __future__ import annotations

from collections.abc import Sequence
import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection.common import AxisIndexGroups
from gbn_jax._selection.common import axis_size
from gbn_jax._selection.common import global_sum
from gbn_jax._selection.common import reduction_axes
from gbn_jax._selection.common import surely

Array = jax.Array
Axis = int | Sequence[int] | None


def prepare_reduction(
    x: Array, axis: Axis, where: Array | None, *, allow_complex: bool = False
) -> tuple[Array, tuple[int, ...], Array | None]:
  """``(x, axes, where)`` ready to reduce: floating ``x``, canonical axes, full mask.

  Integer and boolean ``x`` become float32. Complex ``x`` is kept as it is
  with ``allow_complex``, and is otherwise a ``TypeError``: casting it to a
  real dtype would silently drop the imaginary part.
  """
  x = jnp.asarray(x)
  if jnp.iscomplexobj(x):
    if not allow_complex:
      raise TypeError(
          f"got complex input ({x.dtype}), for a reduction defined on real"
          " numbers only (it orders values, and complex numbers have no"
          " order); reduce the real and imaginary parts (or the modulus)"
          " separately."
      )
  elif not jnp.issubdtype(x.dtype, jnp.floating):
    x = x.astype(jnp.float32)
  axes = reduction_axes(x.ndim, axis)
  if where is not None:
    where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
  return x, axes, where


def _decimal_fraction(alpha: float) -> fractions.Fraction:
  # repr() gives the shortest decimal that round-trips, i.e. what the user typed.
  return fractions.Fraction(repr(float(alpha)))


def quantile_rank(alpha: float, n: int | Array) -> int | Array:
  """The 1-based rank ``k = ceil(alpha * n)`` of ``q_alpha`` among ``n`` values.

  ``alpha * n`` is computed exactly for the decimal value of ``alpha``. ``n``
  may be a Python int (the result is an int), an integer array (masked
  batches) or a symbolic size (``jax.export``); for the latter two the rank
  is computed in the program, an int32 array, exact when alpha's reduced
  decimal fraction ``p/q`` has ``p*q < 2**31``, e.g. any alpha with four
  decimals, and rounded in float32 otherwise. The rank is clipped to
  ``[1, n]`` (to 1 when ``n == 0``).

  Args:
    alpha: the quantile level, strictly between 0 and 1.
    n: the number of values: a Python int, an integer array of counts or a
      symbolic dimension.

  Returns:
    ``ceil(alpha * n)`` clipped to ``[1, max(n, 1)]``: an int for an int
    ``n``, else an int32 array.

  >>> quantile_rank(0.3, 10), quantile_rank(0.25, 7), quantile_rank(0.999, 4)
  (3, 2, 4)
  """
  frac = _decimal_fraction(alpha)
  p, q = frac.numerator, frac.denominator
  if isinstance(n, int):
    return min(max(-(-p * n // q), 1), max(n, 1))
  n = jnp.asarray(n, jnp.int32)
  if p * q < 2**31:
    # ceil(p*n/q) = p*(n//q) + ceil(p*(n%q)/q): no intermediate exceeds p*q,
    # and p*(n//q) <= n because p < q.
    k = p * (n // q) + (p * (n % q) + q - 1) // q
  else:
    # alpha with very many decimal digits: float32, documented rounding.
    k = jnp.ceil(jnp.float32(alpha) * n.astype(jnp.float32)).astype(jnp.int32)
  return jnp.clip(k, 1, jnp.maximum(n, 1))


def _counts_exact_in_float32(
    shape: Sequence[int], axes: tuple[int, ...]
) -> bool:
  """Whether float32 holds every count over ``axes`` exactly: fewer than
  2**24 reduced elements, for any size a symbolic shape may take."""
  return surely(lambda: math.prod(shape[a] for a in axes) < 2**24)


def count_true(flags: Array, axes: tuple[int, ...]) -> Array:
  """Number of true flags over ``axes``.

  Summed in float32 while that is exact (:func:`_counts_exact_in_float32`),
  else in int32: XLA:CPU vectorizes float reductions but runs int32 ones
  through a slow generic loop.
  """
  if _counts_exact_in_float32(flags.shape, axes):
    return jnp.sum(flags, axes, dtype=jnp.float32)
  return jnp.sum(flags, axes, dtype=jnp.int32)


#: From this many reduced positions on, :func:`count_equal` sums in int32
#: where the leading axis is kept.
_MANY_POSITIONS = 1024


def count_equal(
    x: Array, value: Array, axes: tuple[int, ...], where: Array | None
) -> Array:
  """How many masked-in ``x`` equal ``value`` (reduced over ``axes``).

  :func:`count_true`'s result (float32 below 2**24 elements, else int32),
  summed the way XLA:CPU does fastest for the layout. XLA:CPU hands float
  sums to a library kernel that cannot take the compare, so the flags are
  first written out as a float array as large as ``x``; int32 sums stay in
  XLA's own loop, fused with the compare, which is slow down long columns
  (the leading, batch, axis reduced). Many reductions that keep the leading
  axis (group, layer and instance statistics: per example) are where the
  written-out flags cost the most, so those count in int32; statistics per
  feature, over the batch, keep the float sum.

  Args:
    x: the reduced array.
    value: the value to count, of the reduced shape.
    axes: the reduced axes.
    where: optional mask of ``x``'s shape; only masked-in elements count.

  Returns:
    The counts, of the reduced shape.
  """
  flags = x == expand(value, axes)
  if where is not None:
    flags = flags & where
  if _flags_sum_in_int32(x.shape, axes):
    return jnp.sum(flags, axes, dtype=jnp.int32).astype(jnp.float32)
  return count_true(flags, axes)


def _flags_sum_in_int32(shape: Sequence[int], axes: tuple[int, ...]) -> bool:
  """Whether :func:`count_equal` sums its flags in int32 for this layout:
  the leading axis kept, many positions, a count float32 holds exactly."""
  positions = lambda: math.prod(n for i, n in enumerate(shape) if i not in axes)
  return (
      0 not in axes
      and surely(lambda: positions() >= _MANY_POSITIONS)
      and _counts_exact_in_float32(shape, axes)
  )


def element_count(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None,
    axis_name: str | None,
    groups: AxisIndexGroups,
) -> int | Array:
  """Number of reduced elements per position, over all devices: static unless masked."""
  if where is None:
    return math.prod(x.shape[a] for a in axes) * axis_size(axis_name, groups)
  local = count_true(jnp.broadcast_to(where, x.shape), axes).astype(jnp.int32)
  return global_sum(local, axis_name, groups)


def expand(value: Array, axes: tuple[int, ...]) -> Array:
  """A reduced ``value`` broadcastable against the input again."""
  return jnp.expand_dims(value, axes)


def global_mean(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """Mean over ``axes`` of the masked-in elements, across devices if named."""
  total = global_sum(
      jnp.sum(x, axes, where=where), axis_name, axis_index_groups
  )
  return total / element_count(x, axes, where, axis_name, axis_index_groups)


def has_nan(x, axes, where, axis_name, groups) -> Array:
  """Per position, whether any masked-in element on any device is NaN."""
  nan = jnp.isnan(x)
  if where is not None:
    nan = nan & where
  if not _counts_exact_in_float32(x.shape, axes):
    # count_true would sum int32 here, which XLA:CPU does over a materialized
    # int32 copy of the flags (as large as a float32 input); any() reduces
    # bytes.
    found = jnp.any(nan, axes).astype(jnp.int32)
    return global_sum(found, axis_name, groups) > 0
  return global_sum(count_true(nan, axes), axis_name, groups) > 0


def nan_among(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None,
    axis_name: str | None,
    groups: AxisIndexGroups,
) -> Array:
  """Per position, whether any masked-in element on any device is NaN.

  Where :func:`count_equal` sums flags in int32 (per-example layouts), a
  count of NaN flags, fused with the compare. Elsewhere (statistics over
  the batch) read off the plain sum of the elements, which XLA:CPU's library
  reductions take at little cost beside the max and min they make anyway
  (a compare, or any arithmetic before the sum, costs a pass of its own):
  the sum is NaN where an element is, and also where the elements hold both
  infinities (the mid-range is NaN then anyway) or their partial sums
  overflow both ways (elements so large that their squares, BatchNorm's
  variance, overflowed long before).
  """
  # A flag: no tangent to trace.
  x = jax.lax.stop_gradient(x)
  if _flags_sum_in_int32(x.shape, axes):
    nan = jnp.isnan(x) if where is None else jnp.isnan(x) & where
    count = jnp.sum(nan, axes, dtype=jnp.int32)
    return global_sum(count, axis_name, groups) > 0
  total = global_sum(jnp.sum(x, axes, where=where), axis_name, groups)
  return jnp.isnan(total)


def zero_tangent(a: Array | None) -> Array | None:
  """The zero tangent of a custom JVP's output ``a``: float0 for counts."""
  if a is None:
    return None
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return jnp.zeros_like(a)
  return np.zeros(a.shape, jax.dtypes.float0)
