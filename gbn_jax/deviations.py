"""The built-in generalized deviation measures, as plain functions.

Each returns ``(S, D)``: the statistic ``S`` that GBN centers on and the
deviation ``D`` it divides by, one value per remaining (feature) position.
Expectations are plain means over the reduced elements (1/N, no Bessel
correction). Every built-in has the signature::

  fn(x, axis, *, where=None, axis_name=None, axis_index_groups=None, **params)

``where`` restricts the statistics to masked-in elements; ``axis_name`` pools
the elements of every device along that named axis (exact global-batch
statistics under ``shard_map``/``pmap``). The registry
(:mod:`gbn_jax.measures`) names them and declares these capabilities; layers
use them through :func:`gbn_jax.get_measure`.

>>> import jax.numpy as jnp
>>> sqd(jnp.array([[0.], [1.], [2.], [7.]]), 0, alpha=0.5)
(Array([1.], dtype=float32), Array([2.], dtype=float32))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gbn_jax import _quantiles
from gbn_jax._selection import reductions
from gbn_jax._selection.common import AxisIndexGroups
from gbn_jax._selection.common import global_sum
from gbn_jax._selection.reductions import Axis
from gbn_jax._selection.reductions import global_mean
from gbn_jax._selection.reductions import prepare_reduction

Array = jax.Array

__all__ = [
    "bpoe",
    "mad",
    "rbd",
    "rsd",
    "sd",
    "sqd",
    "wcd",
]

#: The built-ins defined for complex input, through the modulus: ``sd`` (mean
#: and ``sqrt(E|x - E x|^2)``, flax's BatchNorm) and ``mad`` (``E|x - E x|``).
#: The others order values (quantiles, extremes, the sign of ``x - E x``).
_COMPLEX_OK = ("sd", "mad")


def check_real(x: Array, name: str) -> None:
  """Raises ``TypeError`` if ``x`` is complex and measure ``name`` orders values.

  Args:
    x: the input.
    name: the measure's name, for the message; names in :data:`_COMPLEX_OK`
      pass.
  """
  if jnp.iscomplexobj(x) and name not in _COMPLEX_OK:
    raise TypeError(
        f"measure {name!r} is not defined for complex input ({jnp.result_type(x)}):"
        " it orders values (a quantile, an extreme or the sign of x - mean),"
        " and complex numbers have no order. Use measure='sd' (flax's"
        " BatchNorm: mean and E|x - mean|^2) or 'mad' (E|x - mean|), or"
        " normalize the real and imaginary parts as separate features."
    )


def _prepare(x, axis, where, name: str):
  """``prepare_reduction`` that keeps complex ``x`` complex where ``name``
  is defined for it, and raises where it is not (rather than dropping the
  imaginary part)."""
  check_real(jnp.asarray(x), name)
  return prepare_reduction(x, axis, where, allow_complex=True)


def _keep_nan(mean: Array, dev: Array) -> Array:
  # One-sided deviations compare with the mean; NaN compares False, which
  # alone would report a clean 0 deviation for a NaN batch.
  return jnp.where(jnp.isnan(mean), jnp.nan, dev)


def _centered(x: Array, center: Array, axes: tuple[int, ...]) -> Array:
  return x - jnp.expand_dims(center, axes)


def _abs_sq(x: Array) -> Array:
  # |x|^2 as flax's BatchNorm takes it; jnp.square for real x (bit for bit).
  if jnp.iscomplexobj(x):
    return jnp.square(jnp.real(x)) + jnp.square(jnp.imag(x))
  return jnp.square(x)


def _abs_by_select(x: Array) -> Array:
  # jnp.abs's values as a select (0 - x is +0.0 at both zeros), but for a
  # subnormal x where XLA treats subnormals as zero (CPU): 0, as the sums
  # this feeds take it anyway. Why a select: see _abs_real.
  return jnp.where(x > 0, x, 0 - x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _abs_real(x: Array, keeps_leading: bool) -> Array:
  # XLA:CPU's library fusion takes an elementwise op with the sum it feeds:
  # the fastest form over the leading axis (per-feature statistics), several
  # times slower where the leading axis is kept (per-example statistics). It
  # takes no select: XLA writes a select's values out and the library sums
  # them plainly, a pass more, and the faster form per example.
  return _abs_by_select(x) if keeps_leading else jnp.abs(x)


@_abs_real.defjvp
def _abs_real_jvp(keeps_leading, primals, tangents):
  # The tangent as a product with the sign rather than abs's own
  # select(x >= 0, t, -t): the transpose of that select is two selects
  # added, which XLA materializes at full size on grouped layouts; a product
  # transposes to one. The sign is +1 at -0.0 and -1 at NaN, as abs's rule
  # has it, so values and derivatives of every order agree with jnp.abs's
  # (a zero cotangent may come back as -0.0). XLA:CPU's library fusions
  # take no compare or select, so the sign is written out between them:
  # as int8, a quarter of a float32 copy, converted where it multiplies.
  (x,), (t,) = primals, tangents
  sign = jnp.where(x >= 0, jnp.int8(1), jnp.int8(-1)).astype(x.dtype)
  return _abs_real(x, keeps_leading), t * sign


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _twice_positive_part(x: Array, keeps_leading: bool) -> Array:
  # x + |x|: 2x or 0 exactly; no zero broadcast to compare or max with,
  # which XLA:CPU's library fusions would take written out at full size.
  # Where the reduction keeps the leading axis, the same bit for bit as a
  # select (x - x: 0, or NaN where x is NaN or -inf), for _abs_real's reason.
  if keeps_leading:
    return jnp.where(x > 0, x + x, x - x)
  return x + jnp.abs(x)


@_twice_positive_part.defjvp
def _twice_positive_part_jvp(keeps_leading, primals, tangents):
  # As _abs_real's: a product with the step written out as int8, where a
  # select's transpose would keep the reductions out of XLA:CPU's library
  # fusions. The step is 0 at 0 and at NaN, as where(x > 0, x, 0)'s.
  (x,), (t,) = primals, tangents
  step = jnp.where(x > 0, jnp.int8(2), jnp.int8(0)).astype(x.dtype)
  return _twice_positive_part(x, keeps_leading), t * step


def sd(
    x: Array,
    axis: Axis,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
    fast_variance: bool = True,
    squared: bool = False,
) -> tuple[Array, Array]:
  """Mean and standard deviation ``sqrt(E[(x - E x)^2])`` (BatchNorm's pair).

  For complex ``x`` the mean is complex and the variance ``E|x - E x|^2``
  real, as in flax.

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.
    fast_variance: the variance as ``E[x^2] - E[x]^2`` clipped at zero, in
      one pass (flax's ``use_fast_variance``); else two passes.
    squared: return the variance itself, which is what normalization layers
      use.

  Returns:
    ``(mean, std)``, or ``(mean, variance)`` if ``squared``.
  """
  x, axes, where = _prepare(x, axis, where, "sd")
  # Square before the first mean, as flax does: XLA:CPU fuses the backward
  # pass differently (and slower) when the mean comes first.
  x_sq = _abs_sq(x) if fast_variance else None
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  if fast_variance:
    mean_sq = global_mean(x_sq, axes, where, axis_name, axis_index_groups)
    var = jnp.maximum(0.0, mean_sq - _abs_sq(mean))
  else:
    var = global_mean(
        _abs_sq(_centered(x, mean, axes)),
        axes,
        where,
        axis_name,
        axis_index_groups,
    )
  return mean, (var if squared else jnp.sqrt(var))


# Alike gbn_jax/deviations.py::sd: the measure contract, in full per function.
def mad(
    x: Array,
    axis: Axis,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> tuple[Array, Array]:
  """Mean and mean absolute deviation ``E|x - E x|``.

  For complex ``x``, the modulus ``|x - E x|``.

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    ``(mean, mean absolute deviation)``.
  """
  x, axes, where = _prepare(x, axis, where, "mad")
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  dev = global_mean(
      jnp.abs(centered)
      if jnp.iscomplexobj(centered)
      else _abs_real(centered, 0 not in axes),
      axes,
      where,
      axis_name,
      axis_index_groups,
  )
  return mean, dev


# Alike gbn_jax/deviations.py::sd: the measure contract, in full per function.
def rsd(
    x: Array,
    axis: Axis,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> tuple[Array, Array]:
  """Mean and upper semideviation ``E[(x - E x)^+]``.

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    ``(mean, upper semideviation)``.
  """
  x, axes, where = _prepare(x, axis, where, "rsd")
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  dev = global_mean(
      _twice_positive_part(centered, 0 not in axes),
      axes,
      where,
      axis_name,
      axis_index_groups,
  )
  return mean, _keep_nan(mean, dev / 2)


# Alike gbn_jax/deviations.py::sd: the measure contract, in full per function.
def sqd(
    x: Array,
    axis: Axis,
    *,
    alpha: float,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> tuple[Array, Array]:
  """Quantile ``q_alpha`` and superquantile deviation ``qbar_alpha - E[x]``.

  Centering on ``q_alpha`` makes a following ReLU zero exactly a fraction
  ``alpha`` of the batch (ties aside).

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.
    alpha: the quantile level, strictly between 0 and 1.

  Returns:
    ``(q_alpha, qbar_alpha - mean)``, as :func:`gbn_jax.quantile` and
    :func:`gbn_jax.superquantile` define them.
  """
  alpha = _quantiles.validate_alpha(alpha)
  x, axes, where = _prepare(x, axis, where, "sqd")
  q, qbar, mean = _quantiles._superquantile_and_mean(  # pylint: disable=protected-access
      x, alpha, axes, where, axis_name, axis_index_groups
  )
  return q, qbar - mean


# Alike gbn_jax/deviations.py::sd: the measure contract, in full per function.
def rbd(
    x: Array,
    axis: Axis,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> tuple[Array, Array]:
  """Mid-range ``(max + min)/2`` and range ``max - min``.

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    ``(mid-range, range)``.
  """
  x, axes, where = _prepare(x, axis, where, "rbd")
  pooled = (where, axis_name, axis_index_groups)
  # One NaN check for both extremes rather than one each (a pass apiece).
  hi = _quantiles._extreme(x, True, axes, *pooled, check_nan=False)  # pylint: disable=protected-access
  lo = _quantiles._extreme(x, False, axes, *pooled, check_nan=False)  # pylint: disable=protected-access
  nan = reductions.nan_among(x, axes, *pooled)
  hi, lo = (jnp.where(nan, jnp.nan, v) for v in (hi, lo))
  return (hi + lo) / 2, hi - lo


# Alike gbn_jax/deviations.py::sd: the measure contract, in full per function.
def wcd(
    x: Array,
    axis: Axis,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> tuple[Array, Array]:
  """Maximum and worst-case deviation ``max - E[x]``.

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    ``(max, max - mean)``.
  """
  x, axes, where = _prepare(x, axis, where, "wcd")
  hi = _quantiles._extreme(  # pylint: disable=protected-access
      x, True, axes, where, axis_name, axis_index_groups, check_nan=False
  )
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  # A NaN element makes the mean NaN, which replaces the maximum's own NaN
  # check (a pass). The mean is NaN without one only where the deviation is
  # NaN anyway (both infinities, or a sum overflowing both ways).
  hi = jnp.where(jnp.isnan(mean), jnp.nan, hi)
  return hi, hi - mean


# Alike gbn_jax/deviations.py::sd: the measure contract, in full per function.
def bpoe(
    x: Array,
    axis: Axis,
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> tuple[Array, Array]:
  """Mean and ``E[x - E x | x > E x]`` (0 when no element exceeds the mean).

  This is SQD at the level where the quantile sits at the mean: GBN with it,
  followed by ReLU, is the paper's empirical bPOE transform.

  Args:
    x: the batch (a non-floating one is cast to float32).
    axis: the axis or axes to reduce (``None``: all).
    where: optional boolean mask broadcastable to ``x``; only masked-in
      elements count.
    axis_name: optional named axis whose devices' elements are pooled.
    axis_index_groups: optional groups of indices within ``axis_name``.

  Returns:
    ``(mean, conditional excess over the mean)``.
  """
  x, axes, where = _prepare(x, axis, where, "bpoe")
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  above = centered > 0
  if where is not None:
    above = above & where
  total = jnp.sum(jnp.where(above, centered, 0), axes)
  count = reductions.count_true(above, axes)
  total, count = global_sum((total, count), axis_name, axis_index_groups)
  dev = jnp.where(count > 0, total / jnp.maximum(count, 1), 0)
  return mean, _keep_nan(mean, dev)
