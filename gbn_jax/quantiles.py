"""Exact empirical quantiles and superquantiles with tie-aware gradients.

Everything here is pure JAX (no Flax). The functions reduce over the given axes,
optionally over masked-in elements only (``where``) and optionally over the
union of all devices along a named axis (``axis_name``), which makes them exact
for the global batch under ``jax.shard_map`` and ``jax.pmap``.

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
"""

from __future__ import annotations

import fractions
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gbn_jax import _native, _radix_select, _select

Array = jax.Array
Axis = int | Sequence[int] | None
AxisIndexGroups = Any

__all__ = [
    "canonicalize_axes",
    "quantile",
    "quantile_rank",
    "superquantile",
    "validate_alpha",
]


def validate_alpha(alpha: Any) -> float:
  """Returns ``alpha`` as a float, or raises ``ValueError`` unless 0 < alpha < 1."""
  try:
    value = float(alpha)
  except (TypeError, ValueError):
    raise ValueError(
        f"alpha must be a real number strictly between 0 and 1, got {alpha!r}."
    ) from None
  if isinstance(alpha, bool) or not 0.0 < value < 1.0:
    raise ValueError(
        f"alpha must lie strictly between 0 and 1, got {alpha!r}."
    )
  return value


def canonicalize_axes(ndim: int, axis: Axis) -> tuple[int, ...]:
  """Returns the sorted, deduplicated, non-negative reduction axes.

  ``None`` means every axis. Raises ``ValueError`` for out-of-range or empty
  axes, since reducing over nothing has no batch statistic.
  """
  if axis is None:
    axes = tuple(range(ndim))
  elif isinstance(axis, int):
    axes = (axis,)
  else:
    axes = tuple(int(a) for a in axis)
  for a in axes:
    if not -ndim <= a < ndim:
      raise ValueError(f"axis {a} is out of range for an array of rank {ndim}.")
  axes = tuple(sorted({a % ndim for a in axes})) if ndim else ()
  if not axes:
    raise ValueError("at least one axis to reduce over is required.")
  return axes


def _decimal_fraction(alpha: float) -> fractions.Fraction:
  # repr() gives the shortest decimal that round-trips, i.e. what the user typed.
  return fractions.Fraction(repr(float(alpha)))


def quantile_rank(alpha: float, n: int | Array) -> int | Array:
  """The 1-based rank ``k = ceil(alpha * n)`` of ``q_alpha`` among ``n`` values.

  ``alpha * n`` is computed exactly for the decimal value of ``alpha``. ``n``
  may be a Python int (the result is an int) or an integer array (masked
  batches; the result is an int32 array, exact when alpha's reduced decimal
  fraction ``p/q`` has ``p*q < 2**31``, e.g. any alpha with four decimals, and
  rounded in float32 otherwise). The rank is clipped to ``[1, n]`` (to 1 when
  ``n == 0``).

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


def _global_sum(value: Any, axis_name: str | None, groups: AxisIndexGroups) -> Any:
  if axis_name is None:
    return value
  return lax.psum(value, axis_name, axis_index_groups=groups)


def _axis_size(axis_name: str | None, groups: AxisIndexGroups) -> int:
  if axis_name is None:
    return 1
  if groups is not None:
    return len(groups[0])
  return int(lax.psum(1, axis_name))


def _element_count(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None,
    axis_name: str | None,
    groups: AxisIndexGroups,
) -> int | Array:
  """Number of reduced elements per position: static unless masked."""
  if where is None:
    return math.prod(x.shape[a] for a in axes) * _axis_size(axis_name, groups)
  local = count_true(jnp.broadcast_to(where, x.shape), axes).astype(jnp.int32)
  return _global_sum(local, axis_name, groups)


def count_true(flags: Array, axes: tuple[int, ...]) -> Array:
  """Number of true flags over ``axes``.

  Summed in float32 while that is exact (fewer than 2**24 elements): XLA:CPU
  vectorizes float reductions but runs int32 ones through a slow generic loop.
  """
  if math.prod(flags.shape[a] for a in axes) < 2**24:
    return jnp.sum(flags, axes, dtype=jnp.float32)
  return jnp.sum(flags, axes, dtype=jnp.int32)


def _expand(value: Array, axes: tuple[int, ...]) -> Array:
  return jnp.expand_dims(value, axes)


def global_mean(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """Mean over ``axes`` of the masked-in elements, across devices if named."""
  total = _global_sum(jnp.sum(x, axes, where=where), axis_name, axis_index_groups)
  return total / _element_count(x, axes, where, axis_name, axis_index_groups)


def _known_or_counted(
    known: Array | None, flags: Callable[[], Array], axes: tuple[int, ...]
) -> Array:
  """Per position, how many of ``flags()`` are true: ``known`` where it is (>= 0).

  The native kernel (one device, no axis_name) counts as ``flags`` would,
  except where it says -1 (only on CPUs whose denormal mode it cannot read);
  counting here is a pass over the data, so only then, behind a ``lax.cond``
  that is left out where the kernel never says -1 (a cond costs tens of
  microseconds on XLA:CPU). ``flags`` is a function so that the flags are
  computed inside the branch that counts: a full-size operand of
  ``lax.cond`` would be materialized on every call.
  """
  count = lambda: count_true(flags(), axes)
  if known is None:
    return count()
  dtype = jax.eval_shape(count).dtype
  if _native.counts_always_known():
    return known.astype(dtype)
  return lax.cond(jnp.all(known >= 0), lambda: known.astype(dtype), count)


def _tie_split_jvp_rule(select, axes, axis_name, groups, primals, tangents):
  x, where = primals
  x_dot, _ = tangents
  value, known_ties = select(x, where)

  def selected():
    equal = x == _expand(value, axes)
    return equal if where is None else equal & where

  # The tangent must have the primal's dtype, which need not be x's: the
  # selection returns float32 for half-precision x (sqd with
  # force_float32_reductions=False passes bfloat16 here). Sum in the wider
  # of the two, then cast.
  dtype = jnp.promote_types(x_dot.dtype, value.dtype)
  moved = jnp.sum(jnp.where(selected(), x_dot.astype(dtype), 0), axes)
  ties = _known_or_counted(known_ties, selected, axes)
  moved, ties = _global_sum((moved, ties), axis_name, groups)
  return value, (moved / jnp.maximum(ties, 1).astype(dtype)).astype(value.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
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
  to ``value`` where the selection knew it (``-1`` elsewhere) or ``None``.
  The tangent is the mean tangent of the elements equal to the selected value,
  so the cotangent is split equally among tied elements; it has the dtype of
  the value, which is float32 for half-precision ``x`` where ``select`` is
  the quantile's (``_select.kth_smallest`` selects in float32). Collectives
  in the tangent are JAX's own ``psum``, so pmap and shard_map transpose them
  correctly.
  """
  del axes, axis_name, groups
  return select(x, where)[0]


_tie_split.defjvp(_tie_split_jvp_rule)


def prepare_reduction(x: Array, axis: Axis, where: Array | None):
  """``(x, axes, where)`` ready to reduce: floating ``x``, canonical axes, full mask."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    x = x.astype(jnp.float32)
  axes = canonicalize_axes(x.ndim, axis)
  if where is not None:
    where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
  return x, axes, where


def _has_nan(x, axes, where, axis_name, groups) -> Array:
  nan = jnp.isnan(x)
  if where is not None:
    nan = nan & where
  if math.prod(x.shape[a] for a in axes) >= 2**24:
    # count_true would sum int32 here, which XLA:CPU does over a materialized
    # int32 copy of the flags (as large as a float32 input); any() reduces
    # bytes.
    found = jnp.any(nan, axes).astype(jnp.int32)
    return _global_sum(found, axis_name, groups) > 0
  return _global_sum(count_true(nan, axes), axis_name, groups) > 0


def _select_quantile(x, where, *, alpha, axes, axis_name, groups, check_nan):
  n = _element_count(x, axes, where, axis_name, groups)
  k = quantile_rank(alpha, n)
  # check_nan=False: the caller propagates NaN itself, saving this pass.
  nan = _has_nan(x, axes, where, axis_name, groups) if check_nan else False
  # NaN is not replaced before selecting (that costs a full-size copy): its
  # bits order it beyond +-inf, the selection stays bounded, and the result
  # is overwritten with NaN below anyway.
  value, ties = _select.kth_smallest(
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
        _select_quantile, alpha=param, axes=axes, axis_name=axis_name, groups=groups,
        check_nan=check_nan,
    )
  return functools.partial(
      _select_extreme, largest=param, axes=axes, axis_name=axis_name, groups=groups
  )


def _quantile(x, alpha, axes, where, axis_name, groups, check_nan=True) -> Array:
  """Quantile of an already-prepared float array (no dtype handling)."""
  groups = _hashable_groups(groups)
  select = _selector("quantile", alpha, axes, axis_name, groups, check_nan)
  return _tie_split(select, axes, axis_name, groups, x, where)


def _native_sums(alpha, axes, x):
  n = math.prod(x.shape[a] for a in axes)
  return _select.kth_smallest_with_sums(x, quantile_rank(alpha, n), axes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _native_superquantile_parts(alpha, axes, x) -> tuple[Array, Array, Array]:
  """``(q_alpha, E[x], E[(x - q_alpha)^+])`` of unmasked float32 ``x``, one sweep.

  Differentiated as the separate computation would be: the quantile's tangent
  split among its ties, the excess's over the elements above ``q``.
  """
  q, _, mean, mean_excess, _ = _native_sums(alpha, axes, x)
  return q, mean, mean_excess


@_native_superquantile_parts.defjvp
def _native_superquantile_parts_jvp(alpha, axes, primals, tangents):
  (x,), (x_dot,) = primals, tangents
  q, known_ties, mean, mean_excess, known_above = _native_sums(alpha, axes, x)
  n = math.prod(x.shape[a] for a in axes)
  selected = lambda: x == _expand(q, axes)
  above = lambda: ~(x <= _expand(q, axes))  # as in _quantile_and_mean_excess: NaN is above
  ties = _known_or_counted(known_ties, selected, axes)
  n_above = _known_or_counted(known_above, above, axes)
  q_dot = jnp.sum(jnp.where(selected(), x_dot, 0), axes) / jnp.maximum(ties, 1).astype(x.dtype)
  mean_dot = jnp.sum(x_dot, axes) / n
  excess_dot = (
      jnp.sum(jnp.where(above(), x_dot, 0), axes) - q_dot * n_above.astype(x.dtype)
  ) / n
  return (q, mean, mean_excess), (q_dot, mean_dot, excess_dot)


def _accelerator_sums(alpha, axes, axis_name, groups, x, where):
  """``kth_smallest_with_sums_accelerator`` at ``q_alpha``'s rank, and the count."""
  if where is None:
    # Static, as _element_count gives it to the unfused path (exact for any
    # alpha; the traced rank may round in float32).
    k = quantile_rank(alpha, _element_count(x, axes, None, axis_name, groups))
  else:
    # The rank from the radix's own pooled count: no pass over the mask here.
    k = functools.partial(quantile_rank, alpha)
  return _radix_select.kth_smallest_with_sums_accelerator(
      x, k, axes, where=where, axis_name=axis_name, axis_index_groups=groups,
      return_count=True,
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _accelerator_superquantile_parts(
    alpha, axes, axis_name, groups, x, where
) -> tuple[Array, Array, Array]:
  """``(q_alpha, E[x], E[(x - q_alpha)^+])`` from the radix passes and one sums pass.

  ``x`` float32 or half precision (selected and summed in float32: ``q`` and
  the excess are float32, the mean has ``x``'s dtype, as in the unfused path),
  masked by ``where`` and pooled over ``axis_name``. Differentiated as the
  unfused computation: the quantile's tangent split among its ties, the
  excess's over the masked-in elements not ``<= q``.
  """
  q, _, mean, mean_excess, _, _ = _accelerator_sums(alpha, axes, axis_name, groups, x, where)
  return q, mean.astype(x.dtype), mean_excess


@_accelerator_superquantile_parts.defjvp
def _accelerator_superquantile_parts_jvp(alpha, axes, axis_name, groups, primals, tangents):
  x, where = primals
  x_dot, _ = tangents
  q, ties, mean, mean_excess, n_above, n = _accelerator_sums(
      alpha, axes, axis_name, groups, x, where
  )
  q_full = _expand(q, axes)
  selected = x == q_full
  above = ~(x <= q_full)  # as in _quantile_and_mean_excess: NaN is above
  if where is not None:
    selected, above = selected & where, above & where
  x_dot = x_dot.astype(jnp.float32)
  sums = (
      jnp.sum(jnp.where(selected, x_dot, 0), axes),
      jnp.sum(jnp.where(above, x_dot, 0), axes),
      jnp.sum(x_dot, axes, where=where),
  )
  if _select._compares_keep_denormals():  # pylint: disable=protected-access
    # The radix's key counts (pooled already) are what these float compares
    # count: XLA:GPU keeps denormals (unless run with --xla_gpu_ftz), and
    # -0.0 == +0.0 either way. Only a NaN with its sign bit set differs (its
    # key is below -inf, yet it is not <= q); qbar is NaN there anyway.
    moved, above_dot, total_dot = _global_sum(sums, axis_name, groups)
  else:
    # XLA:CPU and TPUs read denormals as zero in float compares, where the
    # keys tell them apart: for a zero or denormal q the key counts are not
    # the compares' counts. Count as the unfused path's JVP does, next to
    # the tangent sums (a lax.cond counting only for such q, as
    # _known_or_counted does, would cost a host sync per step on a TPU).
    sums += (count_true(selected, axes), count_true(above, axes))
    moved, above_dot, total_dot, ties, n_above = _global_sum(sums, axis_name, groups)
  count = n.astype(jnp.float32)
  q_dot = moved / jnp.maximum(ties, 1).astype(jnp.float32)
  # The fraction above first: qbar's q-derivative 1 - fraction / (1 - alpha)
  # is then 0 in float32 too when alpha * N is whole and q untied, rather
  # than an ulp of the O(1) terms that cancel there.
  excess_dot = above_dot / count - q_dot * (n_above.astype(jnp.float32) / count)
  mean_dot = total_dot / count
  primal_out = (q, mean.astype(x.dtype), mean_excess)
  return primal_out, (q_dot, mean_dot.astype(x.dtype), excess_dot)


def _superquantile_and_mean(x, alpha, axes, where, axis_name, groups) -> tuple[Array, ...]:
  """``(q_alpha, qbar_alpha, E[x])`` of a prepared float array.

  One sweep of the native kernel where it applies (see
  ``_select.native_sums_apply``); where the selection would be the radix
  select (``_radix_select.sums_apply``: accelerators, or a forced
  ``"accelerator"`` method), its passes and one sums pass; otherwise the
  selection and two means. A NaN element makes the excess, hence qbar, NaN,
  and then q too.
  """
  if _select.native_sums_apply(x, where, axis_name):
    q, mean, mean_excess = _native_superquantile_parts(alpha, axes, x)
  elif _radix_select.sums_apply(x, axes, axis_name, groups):
    q, mean, mean_excess = _accelerator_superquantile_parts(
        alpha, axes, axis_name, _hashable_groups(groups), x, where
    )
  else:
    q, mean_excess = _quantile_and_mean_excess(x, alpha, axes, where, axis_name, groups)
    mean = global_mean(x, axes, where, axis_name, groups)
  qbar = q + mean_excess / (1.0 - alpha)
  return jnp.where(jnp.isnan(qbar), jnp.nan, q), qbar, mean


def _quantile_and_mean_excess(x, alpha, axes, where, axis_name, groups) -> tuple[Array, Array]:
  """``(q_alpha, E[(x - q_alpha)^+])`` of a prepared float array, in JAX."""
  q = _quantile(x, alpha, axes, where, axis_name, groups, check_nan=False)
  # "Not at most q" rather than "above q": a NaN element makes the excess
  # NaN, which replaces the quantile's own NaN check (a pass).
  above = ~(x <= _expand(q, axes))
  if where is not None:
    above = above & where
  # where(), not maximum(): maximum's derivative at a tie is 1/2, which would
  # break the tie rule of the quantile's gradient.
  excess = jnp.where(above, x - _expand(q, axes), 0)
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

  >>> import jax.numpy as jnp
  >>> quantile(jnp.array([3., 1., 4., 1., 5.]), 0.5, axis=0)
  Array(3., dtype=float32)
  """
  alpha = validate_alpha(alpha)
  x_in, axes, where = prepare_reduction(x, axis, where)
  x = x_in.astype(jnp.promote_types(x_in.dtype, jnp.float32))
  groups = _hashable_groups(axis_index_groups)
  return _jitted_quantile(x, where, alpha, axes, axis_name, groups).astype(x_in.dtype)


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
  Arguments are those of :func:`quantile`. Reductions are in at least float32.

  >>> import jax.numpy as jnp
  >>> superquantile(jnp.array([1., 2., 3., 4.]), 0.5, axis=0)
  Array(3.5, dtype=float32)
  """
  alpha = validate_alpha(alpha)
  x_in, axes, where = prepare_reduction(x, axis, where)
  x = x_in.astype(jnp.promote_types(x_in.dtype, jnp.float32))
  groups = _hashable_groups(axis_index_groups)
  qbar = _jitted_superquantile(x, where, alpha, axes, axis_name, groups)
  return qbar.astype(x_in.dtype)


def _select_extreme(x, where, *, largest, axes, axis_name, groups):
  fill = -jnp.inf if largest else jnp.inf
  reduce = jnp.max if largest else jnp.min
  value = reduce(x, axes, where=where, initial=fill)
  if axis_name is not None:
    collective = lax.pmax if largest else lax.pmin
    value = collective(value, axis_name, axis_index_groups=groups)
  if where is not None:
    n = _element_count(x, axes, where, axis_name, groups)
    value = jnp.where(n == 0, jnp.nan, value)
  return value, None


def extreme(
    x: Array,
    axes: tuple[int, ...],
    *,
    largest: bool,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """Max (``largest``) or min over ``axes``, pooled across ``axis_name``.

  Differentiated like :func:`quantile`: the cotangent is split among ties.
  """
  groups = _hashable_groups(axis_index_groups)
  select = _selector("extreme", largest, axes, axis_name, groups)
  return _tie_split(select, axes, axis_name, groups, x, where)
