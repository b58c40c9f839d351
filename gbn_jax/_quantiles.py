"""Exact empirical quantiles and superquantiles with tie-aware gradients.

Everything here is pure JAX (no Flax). The functions reduce over the given axes,
optionally over masked-in elements only (``where``) and optionally over the
union of all devices along a named axis (``axis_name``), which makes them exact
for the global batch under ``jax.shard_map`` and ``jax.pmap``. With
:func:`extreme` (max and min) and :func:`mean` they are what a custom measure
is built from (see :func:`gbn_jax.register_measure`); all take the same
arguments ``(x, ..., axis, *, where, axis_name, axis_index_groups)``.

Conventions:

* ``q_alpha(x) = min{z : P(x <= z) >= alpha}``: over ``N`` values, the
  ``ceil(alpha * N)``-th smallest (numpy's ``method='inverted_cdf'``). The
  product ``alpha * N`` is evaluated exactly for the decimal number that
  ``repr(alpha)`` shows, so ``alpha=0.3`` with ``N=10`` selects the 3rd smallest
  value (plain floating point would give ``ceil(3.0000000000000004) = 4``).
* ``qbar_alpha(x) = q_alpha + E[(x - q_alpha)^+] / (1 - alpha)``
  (Rockafellar-Uryasev), exact for empirical distributions, ties included.
* Gradients: the cotangent of an order statistic flows to the elements equal to
  the selected value, split equally among them when several are tied. The
  same rule is used for ``max`` and ``min`` (it is also what ``jnp.max`` does).
  The backward pass reuses the selected value; it never sorts.
* NaN among the reduced (masked-in) elements gives NaN; an empty reduction
  (everything masked out) gives NaN.

The selection itself (``gbn_jax._selection``) is exact whichever backend runs;
:func:`gbn_jax.selection.selection_config` forces one.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax._selection import dispatch
from gbn_jax._selection import fused
from gbn_jax._selection.common import AxisIndexGroups
from gbn_jax._selection.common import global_sum
from gbn_jax._selection.reductions import Axis
from gbn_jax._selection.reductions import count_equal
from gbn_jax._selection.reductions import count_true
from gbn_jax._selection.reductions import element_count
from gbn_jax._selection.reductions import expand
from gbn_jax._selection.reductions import global_mean
from gbn_jax._selection.reductions import has_nan
from gbn_jax._selection.reductions import nan_among
from gbn_jax._selection.reductions import prepare_reduction
from gbn_jax._selection.reductions import quantile_rank
from gbn_jax._selection.reductions import zero_tangent

Array = jax.Array

__all__ = [
    "extreme",
    "mean",
    "quantile",
    "quantile_rank",
    "superquantile",
]


def validate_alpha(alpha: Any) -> float:
  """Checks a quantile level.

  Args:
    alpha: the level, a real number.

  Returns:
    ``alpha`` as a Python float.

  Raises:
    ValueError: ``alpha`` is not a real number strictly between 0 and 1.
  """
  try:
    value = float(alpha)
  except (TypeError, ValueError):
    raise ValueError(
        f"alpha must be a real number strictly between 0 and 1, got {alpha!r}."
    ) from None
  if isinstance(alpha, bool) or not 0.0 < value < 1.0:
    raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha!r}.")
  return value


def _check_real(x: Any, function: str) -> None:
  """A clear ``TypeError`` for complex input to an order statistic."""
  if jnp.iscomplexobj(x):
    raise TypeError(
        f"gbn_jax.{function} is not defined for complex input"
        f" ({jnp.result_type(x)}): it orders values, and complex numbers have"
        " no order; apply it to the real part, the imaginary part or the"
        " modulus (jnp.real, jnp.imag, jnp.abs)."
    )


def _tie_split_jvp_rule(select, axes, axis_name, groups, primals, tangents):
  x, where = primals
  x_dot, _ = tangents
  # Through _selected itself, not select: differentiated again (a Hessian,
  # forward over reverse) the value then has this rule's tangent, where
  # select's own has none (a stop_gradient selection) or none defined (pmax).
  value, known_ties = _selected(select, axes, axis_name, groups, x, where)

  def selected():
    equal = x == expand(value, axes)
    return equal if where is None else equal & where

  # The tangent must have the primal's dtype, which need not be x's: the
  # selection returns float32 for half-precision x (sqd with
  # force_float32_reductions=False passes bfloat16 here). Sum in the wider
  # of the two, then cast.
  dtype = jnp.promote_types(x_dot.dtype, value.dtype)
  moved = jnp.sum(jnp.where(selected(), x_dot.astype(dtype), 0), axes)
  # The selection's counts are this platform's compares'.
  ties = count_true(selected(), axes) if known_ties is None else known_ties
  moved, ties = global_sum((moved, ties), axis_name, groups)
  value_dot = (moved / jnp.maximum(ties, 1).astype(dtype)).astype(value.dtype)
  return (value, known_ties), (value_dot, zero_tangent(known_ties))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _selected(
    select: Callable[[Array, Array | None], Array],
    axes: tuple[int, ...],
    axis_name: str | None,
    groups: AxisIndexGroups,
    x: Array,
    where: Array | None,
) -> tuple[Array, Array | None]:
  """``select(x, where)``: the value and its tie count (see :func:`_tie_split`)."""
  del axes, axis_name, groups
  return select(x, where)


_selected.defjvp(_tie_split_jvp_rule)


# Alike gbn_jax/_quantiles.py::_selected: the value alone of that custom_jvp.
def _tie_split(
    select: Callable[[Array, Array | None], Array],
    axes: tuple[int, ...],
    axis_name: str | None,
    groups: AxisIndexGroups,
    x: Array,
    where: Array | None,
) -> Array:
  """``select(x, where)[0]``, an element of ``x``, differentiated as such.

  ``select`` returns ``(value, ties)``, ``ties`` the number of elements equal
  to ``value`` as the platform's compares count them, or ``None``.
  The tangent is the mean tangent of the elements equal to the selected value,
  so the cotangent is split equally among tied elements; it has the dtype of
  the value, which is float32 for half-precision ``x`` where ``select`` is
  the quantile's (``dispatch.kth_smallest`` selects in float32). Collectives
  in the tangent are JAX's own ``psum``, so pmap and shard_map transpose them
  correctly.
  """
  return _selected(select, axes, axis_name, groups, x, where)[0]


def _select_quantile(x, where, *, alpha, axes, axis_name, groups, check_nan):
  n = element_count(x, axes, where, axis_name, groups)
  k = quantile_rank(alpha, n)
  # check_nan=False: the caller propagates NaN itself, saving this pass.
  nan = has_nan(x, axes, where, axis_name, groups) if check_nan else False
  # NaN is not replaced before selecting (that costs a full-size copy): its
  # bits order it beyond +-inf, the selection stays bounded, and the result
  # is overwritten with NaN below anyway.
  value, ties = dispatch.kth_smallest(
      x,
      k,
      axes,
      where=where,
      axis_name=axis_name,
      axis_index_groups=groups,
      return_ties=True,
  )
  if axis_name is not None:
    # Every device already holds the same value; pmax (C floats) makes that
    # visible to shard_map's replication typing, so stats can leave with P().
    value = lax.pmax(value, axis_name, axis_index_groups=groups)
  invalid = nan if where is None else nan | (n == 0)
  if invalid is not False:
    value = jnp.where(invalid, jnp.nan, value)
  return value, ties


def _hashable_groups(groups: AxisIndexGroups) -> AxisIndexGroups:
  return None if groups is None else tuple(tuple(g) for g in groups)


@functools.lru_cache(maxsize=None)
def _selector(
    kind: str, param: Any, axes, axis_name, groups, check_nan: bool = True
) -> Callable:
  # One object per configuration: JAX caches traces by function identity, so
  # a fresh partial per call would recompile every eager call.
  if kind == "quantile":
    return functools.partial(
        _select_quantile,
        alpha=param,
        axes=axes,
        axis_name=axis_name,
        groups=groups,
        check_nan=check_nan,
    )
  return functools.partial(
      _select_extreme,
      largest=param,
      axes=axes,
      axis_name=axis_name,
      groups=groups,
      check_nan=check_nan,
  )


def _quantile(
    x, alpha, axes, where, axis_name, groups, check_nan=True
) -> Array:
  """Quantile of an already-prepared float array (no dtype handling)."""
  groups = _hashable_groups(groups)
  select = _selector("quantile", alpha, axes, axis_name, groups, check_nan)
  return _tie_split(select, axes, axis_name, groups, x, where)


def _superquantile_and_mean(
    x, alpha, axes, where, axis_name, groups
) -> tuple[Array, ...]:
  """``(q_alpha, qbar_alpha, E[x])`` of a prepared float array.

  The sums from the selection's own sweep where a backend fuses them
  (``fused.superquantile_parts``: the native kernel, the radix select);
  otherwise the selection and two means. A NaN element makes the excess,
  hence qbar, NaN, and then q too.
  """

  def unfused():
    q, mean_excess = _quantile_and_mean_excess(
        x, alpha, axes, where, axis_name, groups
    )
    return q, global_mean(x, axes, where, axis_name, groups), mean_excess

  q, mean, mean_excess = fused.superquantile_parts(
      x, alpha, axes, where, axis_name, _hashable_groups(groups), unfused
  )
  qbar = q + mean_excess / (1.0 - alpha)
  return jnp.where(jnp.isnan(qbar), jnp.nan, q), qbar, mean


def _quantile_and_mean_excess(
    x, alpha, axes, where, axis_name, groups
) -> tuple[Array, Array]:
  """``(q_alpha, E[(x - q_alpha)^+])`` of a prepared float array, in JAX."""
  q = _quantile(x, alpha, axes, where, axis_name, groups, check_nan=False)
  # "Not at most q" rather than "above q": a NaN element makes the excess
  # NaN, which replaces the quantile's own NaN check (a pass).
  above = ~(x <= expand(q, axes))
  if where is not None:
    above = above & where
  # where(), not maximum(): maximum's derivative at a tie is 1/2, which would
  # break the tie rule of the quantile's gradient.
  excess = jnp.where(above, x - expand(q, axes), 0)
  return q, global_mean(excess, axes, where, axis_name, groups)


# jit so that eager calls do not dispatch the selection op by op; under an
# outer jit/shard_map this inlines.
@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _jitted_quantile(x, where, alpha, axes, axis_name, groups):
  return _quantile(x, alpha, axes, where, axis_name, groups)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _jitted_superquantile(x, where, alpha, axes, axis_name, groups):
  return _superquantile_and_mean(x, alpha, axes, where, axis_name, groups)[1]


def quantile(
    x: Array,
    alpha: float,
    axis: Axis = None,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """The empirical ``alpha``-quantile ``q_alpha = min{z : P(x <= z) >= alpha}``.

  Over ``N`` values this is the ``ceil(alpha * N)``-th smallest, as
  ``jnp.quantile(x, alpha, axis, method='inverted_cdf')``, but computed by an
  exact selection instead of a sort, and with a gradient that flows to the
  selected element (split equally among ties).

  Args:
    x: input array. Half-precision inputs are selected in float32; the result
      has the input's floating dtype (an element of ``x``).
    alpha: probability level, a Python float strictly between 0 and 1.
    axis: axis or axes to reduce over (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis (``shard_map``/``pmap``) whose devices'
      elements are pooled, giving the quantile of the global batch.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    The reduced array (``keepdims=False``).

  Raises:
    ValueError: ``alpha`` outside (0, 1).
    TypeError: complex ``x`` (complex numbers have no order).

  >>> import jax.numpy as jnp
  >>> quantile(jnp.array([3., 1., 4., 1., 5.]), 0.5, axis=0)
  Array(3., dtype=float32)
  """
  alpha = validate_alpha(alpha)
  _check_real(x, "quantile")
  x_in, axes, where = prepare_reduction(x, axis, where)
  x = x_in.astype(jnp.promote_types(x_in.dtype, jnp.float32))
  groups = _hashable_groups(axis_index_groups)
  return _jitted_quantile(x, where, alpha, axes, axis_name, groups).astype(
      x_in.dtype
  )


# Alike gbn_jax/_quantiles.py::quantile: the reductions' contract, per function.
def superquantile(
    x: Array,
    alpha: float,
    axis: Axis = None,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """The superquantile (CVaR) ``qbar_alpha = q_alpha + E[(x - q_alpha)^+]/(1-alpha)``.

  Exact for empirical distributions, atoms and ties included (unlike the mean
  of the top ``(1-alpha)N`` values, which is exact only when that is whole).
  Reductions are in at least float32.

  Args:
    x: input array; the result has its floating dtype.
    alpha: probability level, a Python float strictly between 0 and 1.
    axis: axis or axes to reduce over (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis (``shard_map``/``pmap``) whose devices'
      elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    The reduced array (``keepdims=False``).

  Raises:
    ValueError: ``alpha`` outside (0, 1).
    TypeError: complex ``x`` (complex numbers have no order).

  >>> import jax.numpy as jnp
  >>> superquantile(jnp.array([1., 2., 3., 4.]), 0.5, axis=0)
  Array(3.5, dtype=float32)
  """
  alpha = validate_alpha(alpha)
  _check_real(x, "superquantile")
  x_in, axes, where = prepare_reduction(x, axis, where)
  x = x_in.astype(jnp.promote_types(x_in.dtype, jnp.float32))
  groups = _hashable_groups(axis_index_groups)
  qbar = _jitted_superquantile(x, where, alpha, axes, axis_name, groups)
  return qbar.astype(x_in.dtype)


def _select_extreme(x, where, *, largest, axes, axis_name, groups, check_nan):
  fill = -jnp.inf if largest else jnp.inf
  reduce = jnp.max if largest else jnp.min
  value = reduce(x, axes, where=where, initial=fill)
  if axis_name is not None:
    collective = lax.pmax if largest else lax.pmin
    value = collective(value, axis_name, axis_index_groups=groups)
  # The reduction itself need not propagate NaN (XLA:CPU's skips it on
  # some layouts). check_nan=False: the caller propagates NaN itself, from
  # a pass it makes anyway or shares between extremes.
  invalid = False
  if check_nan:
    invalid = nan_among(x, axes, where, axis_name, groups)
  if where is not None:
    n = element_count(x, axes, where, axis_name, groups)
    invalid = invalid | (n == 0)
  if invalid is not False:
    value = jnp.where(invalid, jnp.nan, value)
  # This device's ties at the global extreme, for the derivative (the rule
  # sums them over devices). Where nothing differentiates the value, the
  # count is unused and drops out of the compiled program.
  return value, count_equal(x, value, axes, where)


# Alike gbn_jax/_quantiles.py::quantile: the reductions' contract, per function.
def extreme(
    x: Array,
    axis: Axis = None,
    *,
    largest: bool,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """The maximum (``largest=True``) or minimum over ``axis``.

  Differentiated like :func:`quantile`: the cotangent is split equally among
  the elements equal to the selected value (as ``jnp.max`` does).

  Args:
    x: input array (a non-floating one is cast to float32); the result is an
      element of it, in its dtype.
    axis: axis or axes to reduce over (``None``: all).
    largest: the maximum if true, else the minimum.
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count (NaN where none does).
    axis_name: optional named axis (``shard_map``/``pmap``) whose devices'
      elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    The reduced array (``keepdims=False``).

  Raises:
    TypeError: complex ``x`` (complex numbers have no order).

  >>> import jax.numpy as jnp
  >>> extreme(jnp.array([[3., 1.], [4., 1.]]), 0, largest=True)
  Array([4., 1.], dtype=float32)
  """
  _check_real(x, "extreme")
  x, axes, where = prepare_reduction(x, axis, where)
  return _extreme(x, largest, axes, where, axis_name, axis_index_groups)


def _extreme(
    x, largest, axes, where, axis_name, groups, check_nan=True
) -> Array:
  """Maximum or minimum of an already-prepared float array."""
  groups = _hashable_groups(groups)
  select = _selector("extreme", largest, axes, axis_name, groups, check_nan)
  return _tie_split(select, axes, axis_name, groups, x, where)


# Alike gbn_jax/_quantiles.py::quantile: the reductions' contract, per function.
def mean(
    x: Array,
    axis: Axis = None,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """The mean over ``axis`` of the masked-in elements of every device.

  ``jnp.mean(x, axis, where=where)`` pooled over ``axis_name``: the sum and
  the count of every device, then one division (exact for the global batch,
  unlike a mean of per-device means when the devices' counts differ).

  Args:
    x: input array (a non-floating one is cast to float32; complex stays
      complex); summed in its dtype.
    axis: axis or axes to reduce over (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count (NaN where none does).
    axis_name: optional named axis (``shard_map``/``pmap``) whose devices'
      elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    The reduced array (``keepdims=False``).

  >>> import jax.numpy as jnp
  >>> x = jnp.array([[1., 2.], [3., 6.]])
  >>> mean(x, 0, where=x < 5)
  Array([2., 2.], dtype=float32)
  """
  x, axes, where = prepare_reduction(x, axis, where, allow_complex=True)
  return global_mean(x, axes, where, axis_name, axis_index_groups)
