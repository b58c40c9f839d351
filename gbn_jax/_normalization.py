"""Pure helpers shared by the linen and nnx GBatchNorm modules."""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import functools
import inspect
import numbers
from typing import Any, NamedTuple

from flax.core import FrozenDict
from flax.linen import dtypes
import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax import measures as measures_lib

Array = jax.Array


def canonicalize_axes(rank: int, axes: Any) -> tuple[int, ...]:
  """Sorted, deduplicated, non-negative axes (flax's convention)."""
  if isinstance(axes, int):
    axes = (axes,)
  return tuple(sorted({rank + a if a < 0 else a for a in axes}))


def bind_measure(
    measure: Any,
    alpha: float | None,
    use_fast_variance: bool,
    calibration: str | None = None,
) -> measures_lib.MeasureFn:
  """Resolves a module's ``measure``/``alpha``/``calibration`` fields into a
  callable.

  Raises the registry's errors (unknown name, alpha outside (0, 1), unexpected
  parameters, a calibration the measure has no constant for), so a
  misconfigured module fails when it is constructed.
  """
  try:
    fn = measures_lib.resolve_measure(measure, calibration, alpha=alpha)
  except measures_lib.FixedParamsError as e:
    # The module's fields, not get_measure, are what the user wrote.
    raise measures_lib.FixedParamsError(
        e.name,
        e.fixed,
        lambda general, choose: f"GBatchNorm(measure={general!r}, {choose})",
    ) from None
  if not isinstance(fn, measures_lib.Measure):
    check_measure_signature(fn)
  if isinstance(fn, measures_lib.Measure) and fn.fn is measures_lib.sd:
    fn = dataclasses.replace(
        fn,
        params=tuple(
            sorted(
                {**dict(fn.params), "fast_variance": use_fast_variance}.items()
            )
        ),
    )
  return fn


MEASURE_CONTRACT = (
    "a custom measure is called as measure(x, axis) -> (S, D): x the"
    " activations, axis a tuple of the reduced axes, S and D arrays of the"
    " per-feature statistic and deviation (it may also take where=,"
    " axis_name= and axis_index_groups= keywords)"
)


def check_measure_signature(fn: Any) -> None:
  """Raises a TypeError naming the contract if ``fn`` can't take ``(x, axis)``.

  A callable whose signature can't be read (some builtins) is let through:
  only the first call can tell.
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return
  try:
    signature.bind(None, None)
  except TypeError as e:
    raise TypeError(
        f"measure {fn!r} can't be called with two positional arguments (x,"
        f" axis): its signature is {signature} ({e}); {MEASURE_CONTRACT}."
    ) from None


def _accepts(fn: Any, keyword: str) -> bool:
  if isinstance(fn, measures_lib.Measure):
    return True
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def batch_statistics(
    measure: measures_lib.MeasureFn,
    x: Array,
    reduction_axes: tuple[int, ...],
    *,
    dtype: Any,
    mask: Array | None,
    axis_name: str | None,
    axis_index_groups: Any,
    force_float32_reductions: bool = True,
) -> tuple[Array, Array]:
  """``(S, D^2)`` of the batch, in at least float32 like flax's BatchNorm.

  A user measure that does not take ``axis_name`` gets the global batch
  gathered across the named axis instead (exact, at the cost of moving the
  activations); one that does not take ``where`` cannot honour a mask.
  """
  if not reduction_axes:
    # Only feature axes (an unbatched call, or one example per device under
    # vmap with axis_name): each feature has one element here, and the
    # elements of every device along axis_name pool into one batch. A new
    # leading axis of size one gives every measure that batch to reduce.
    return batch_statistics(
        measure,
        jnp.expand_dims(x, 0),
        (0,),
        dtype=dtype,
        mask=None if mask is None else jnp.broadcast_to(mask, x.shape)[None],
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        force_float32_reductions=force_float32_reductions,
    )
  if dtype is None:
    dtype = jnp.result_type(x)
  if force_float32_reductions:
    dtype = jnp.promote_types(dtype, jnp.float32)
  x = jnp.asarray(x, dtype)
  where = (
      None
      if mask is None
      else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
  )
  reduction = {}
  if where is not None:
    if not _accepts(measure, "where"):
      raise TypeError(
          f"measure {measure!r} does not accept `where`, so it cannot honour"
          " `mask`; add a `where=None` keyword to it."
      )
    reduction["where"] = where
  if axis_name is not None:
    if _accepts(measure, "axis_name"):
      reduction["axis_name"] = axis_name
      reduction["axis_index_groups"] = axis_index_groups
    else:
      gather = lambda a: lax.all_gather(
          a,
          axis_name,
          axis_index_groups=axis_index_groups,
          axis=reduction_axes[0],
          tiled=True,
      )
      x = gather(x)
      if where is not None:
        reduction["where"] = gather(where)
  if isinstance(measure, measures_lib.Measure):
    s, d2 = measure.squared_deviation(x, reduction_axes, **reduction)
  else:
    result = measure(x, reduction_axes, **reduction)
    # Unpacking a single array would iterate over it, and fail (or not)
    # with a message about shapes that does not point at the measure.
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
      what = (
          f"an array of shape {result.shape}"
          if hasattr(result, "shape")
          else f"a {type(result).__name__}"
      )
      raise TypeError(
          f"measure {measure!r} returned {what}, not a pair (S, D);"
          f" {MEASURE_CONTRACT}."
      )
    s, d = result
    if jnp.iscomplexobj(d):
      raise TypeError(
          f"measure {measure!r} returned a complex deviation; D must be real"
          " (for complex input, e.g. a mean absolute deviation |x - S|)."
      )
    d2 = jnp.square(d)
  feature_shape = tuple(
      n for i, n in enumerate(x.shape) if i not in reduction_axes
  )
  for name, value in (("statistic", s), ("deviation", d2)):
    if jnp.shape(value) != feature_shape:
      raise ValueError(
          f"measure {measure!r} returned a {name} of shape {jnp.shape(value)};"
          f" expected the per-feature shape {feature_shape}."
      )
  # D^2 is real for complex input too (flax's var is E|x - mean|^2).
  return jnp.asarray(s, dtype), jnp.asarray(d2, _real_dtype(dtype))


def _real_dtype(dtype: Any) -> Any:
  """``dtype`` itself if real, the dtype of its real part if complex."""
  return (
      jnp.finfo(dtype).dtype
      if jnp.issubdtype(dtype, jnp.complexfloating)
      else dtype
  )


def normalize(
    x: Array,
    statistic: Array,
    deviation_sq: Array,
    scale: Array | None,
    bias: Array | None,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
    dtype: Any,
    epsilon: float,
) -> Array:
  """``(x - S) * rsqrt(D^2 + eps) * scale + bias``, in flax's operation order.

  For ``S = mean`` and ``D^2 = var`` this is exactly flax's BatchNorm output.
  """
  feature_shape = [1] * x.ndim
  for ax in feature_axes:
    feature_shape[ax] = x.shape[ax]
  # expand_dims, not reshape: XLA:CPU fuses the two differently, and this is
  # the form flax uses (measured: reshape materializes a full-size multiplier).
  # Same operation order as flax too: XLA's fusion decisions follow it.
  statistic = jnp.expand_dims(statistic, reduction_axes)
  deviation_sq = jnp.expand_dims(deviation_sq, reduction_axes)
  y = x - statistic
  mul = lax.rsqrt(deviation_sq + epsilon)
  args = [x]
  if scale is not None:
    scale = scale.reshape(feature_shape)
    mul *= scale
    args.append(scale)
  y *= mul
  if bias is not None:
    bias = bias.reshape(feature_shape)
    y += bias
    args.append(bias)
  return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=dtype))


def normalize_batch(
    measure: measures_lib.MeasureFn,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
    *,
    dtype: Any,
    epsilon: float,
    mask: Array | None,
    axis_name: str | None,
    axis_index_groups: Any,
    force_float32_reductions: bool = True,
) -> tuple[Array, Array, Array]:
  """Normalizes with the batch's own statistics: ``(y, S, D^2)``.

  On one device (or under SPMD ``jit``) the backward pass is written out
  (:func:`_fused_normalize`) so that it costs what BatchNorm's does plus the
  measure's own vector-Jacobian product; with ``axis_name`` (or complex
  input) it is left to autodiff, whose collectives JAX transposes for pmap
  and shard_map alike.
  """
  # Complex input takes autodiff: the written-out backward is for real x.
  if axis_name is None and not jnp.iscomplexobj(x):
    static = _Static(
        measure,
        reduction_axes,
        feature_axes,
        dtype,
        epsilon,
        force_float32_reductions,
    )
    return _fused_normalize(static, x, scale, bias, mask)
  statistic, deviation_sq = batch_statistics(
      measure,
      x,
      reduction_axes,
      dtype=dtype,
      mask=mask,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      force_float32_reductions=force_float32_reductions,
  )
  y = normalize(
      x,
      statistic,
      deviation_sq,
      scale,
      bias,
      reduction_axes,
      feature_axes,
      dtype,
      epsilon,
  )
  return y, statistic, deviation_sq


class _Static(NamedTuple):
  measure: Any
  reduction_axes: tuple[int, ...]
  feature_axes: tuple[int, ...]
  dtype: Any
  epsilon: float
  force_float32_reductions: bool


def _fused_forward(static: _Static, x, scale, bias, mask):
  def stats(v):
    return batch_statistics(
        static.measure,
        v,
        static.reduction_axes,
        dtype=static.dtype,
        mask=mask,
        axis_name=None,
        axis_index_groups=None,
        force_float32_reductions=static.force_float32_reductions,
    )

  (statistic, deviation_sq), stats_vjp = jax.vjp(stats, x)
  y = normalize(
      x,
      statistic,
      deviation_sq,
      scale,
      bias,
      static.reduction_axes,
      static.feature_axes,
      static.dtype,
      static.epsilon,
  )
  return (y, statistic, deviation_sq), stats_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_normalize(static: _Static, x, scale, bias, mask):
  return _fused_forward(static, x, scale, bias, mask)[0]


def _fused_normalize_fwd(static, x, scale, bias, mask):
  out, stats_vjp = _fused_forward(static, x, scale, bias, mask)
  _, statistic, deviation_sq = out
  return out, (x, statistic, deviation_sq, scale, bias, mask, stats_vjp)


def _fused_normalize_bwd(static, residuals, cotangents):
  """BatchNorm's backward, generalized.

  With ``xhat = (x - S) r``, ``r = (D^2 + eps)^-1/2`` and ``y = xhat * scale
  + bias``, two reductions of the output cotangent ``g`` give everything:
  ``dbias = sum g``, ``dscale = sum g xhat``, ``dS = -r scale sum g`` and
  ``d(D^2) = -r^2 scale sum(g xhat) / 2``; the measure's own VJP turns
  ``(dS, dD^2)`` into its share of ``dx``.
  """
  x, statistic, deviation_sq, scale, bias, mask, stats_vjp = residuals
  g, g_statistic, g_deviation_sq = cotangents
  axes = static.reduction_axes
  expand = lambda v: jnp.expand_dims(v, axes)
  r = lax.rsqrt(deviation_sq + static.epsilon)
  g = g.astype(statistic.dtype)
  xhat = (x - expand(statistic)) * expand(r)
  sum_g = jnp.sum(g, axes)
  sum_g_xhat = jnp.sum(g * xhat, axes)
  gain = r if scale is None else r * scale.astype(r.dtype)
  g_statistic = g_statistic - gain * sum_g
  g_deviation_sq = g_deviation_sq - 0.5 * r * gain * sum_g_xhat
  (dx_stats,) = stats_vjp((g_statistic, g_deviation_sq))
  dx = (g * expand(gain) + dx_stats).astype(x.dtype)
  dscale = None if scale is None else sum_g_xhat.astype(scale.dtype)
  dbias = None if bias is None else sum_g.astype(bias.dtype)
  return dx, dscale, dbias, None


_fused_normalize.defvjp(_fused_normalize_fwd, _fused_normalize_bwd)


# ------------------------------------------------------------ batch renorm


class RenormLimits(NamedTuple):
  """Clipping limits of batch renormalization; ``None`` leaves a side open."""

  rmin: float | None
  rmax: float | None
  dmax: float | None


_RENORM_KEYS = ("rmax", "rmin", "dmax")


def freeze_renorm_clipping(
    renorm: bool, renorm_clipping: Mapping[str, float] | None
) -> FrozenDict | None:
  """Validates a module's ``renorm_clipping`` and returns it hashable.

  The mapping takes Keras' keys: ``rmax`` (at least 1), ``rmin`` (in (0, 1],
  default ``1 / rmax``) and ``dmax`` (at least 0); a key left out leaves that
  side unclipped, and ``None`` clips nothing.

  Raises:
    ValueError: unknown keys, limits out of range, or clipping without
      ``renorm=True``.
    TypeError: not a mapping of real numbers.
  """
  if renorm_clipping is None:
    return None
  if not renorm:
    raise ValueError(
        "renorm_clipping only applies to batch renormalization; pass"
        " renorm=True as well (or drop renorm_clipping)."
    )
  if not isinstance(renorm_clipping, Mapping):
    raise TypeError(
        "renorm_clipping must be a dict with keys 'rmax', 'rmin', 'dmax' or"
        f" None, got {renorm_clipping!r}."
    )
  unknown = sorted(set(renorm_clipping) - set(_RENORM_KEYS), key=str)
  if unknown:
    raise ValueError(
        f"renorm_clipping has unknown key(s) {unknown}; valid keys:"
        " 'rmax', 'rmin', 'dmax'."
    )
  limits = {}
  for key, value in renorm_clipping.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise TypeError(
          f"renorm_clipping[{key!r}] must be a real number, got {value!r}."
      )
    limits[key] = float(value)
  rmax, rmin, dmax = (limits.get(k) for k in _RENORM_KEYS)
  if rmax is not None and not rmax >= 1:
    raise ValueError(f"renorm_clipping['rmax'] must be >= 1, got {rmax}.")
  if rmin is not None and not 0 < rmin <= 1:
    raise ValueError(f"renorm_clipping['rmin'] must be in (0, 1], got {rmin}.")
  if dmax is not None and not dmax >= 0:
    raise ValueError(f"renorm_clipping['dmax'] must be >= 0, got {dmax}.")
  return FrozenDict(limits)


def renorm_limits(renorm_clipping: Mapping[str, float] | None) -> RenormLimits:
  """``(rmin, rmax, dmax)`` of a validated clipping; ``rmin`` is ``1/rmax``
  unless given."""
  if renorm_clipping is None:
    return RenormLimits(None, None, None)
  rmax = renorm_clipping.get("rmax")
  rmin = renorm_clipping.get("rmin")
  if rmin is None and rmax is not None:
    rmin = 1 / rmax
  return RenormLimits(rmin, rmax, renorm_clipping.get("dmax"))


def renorm_correction(
    statistic: Array,
    deviation_sq: Array,
    running_statistic: Array,
    running_deviation_sq: Array,
    epsilon: float,
    limits: RenormLimits,
) -> tuple[Array, Array]:
  """Batch renormalization's ``(r, d)``, constants for autodiff.

  ``r = clip(D_B / D_run, rmin, rmax)`` and ``d = clip((S_B - S_run) /
  D_run, -dmax, dmax)`` with ``D = sqrt(D^2 + eps)`` for both (Ioffe, 2017).
  """
  dtype = jnp.result_type(statistic)
  running_statistic = jnp.asarray(running_statistic, dtype)
  running_deviation = jnp.sqrt(
      jnp.asarray(running_deviation_sq, dtype) + epsilon
  )
  r = jnp.sqrt(deviation_sq + epsilon) / running_deviation
  d = (statistic - running_statistic) / running_deviation
  if limits.rmin is not None or limits.rmax is not None:
    r = jnp.clip(r, limits.rmin, limits.rmax)
  if limits.dmax is not None:
    d = jnp.clip(d, -limits.dmax, limits.dmax)
  return lax.stop_gradient(r), lax.stop_gradient(d)


def renormalize(
    x: Array,
    statistic: Array,
    deviation_sq: Array,
    r: Array,
    d: Array,
    scale: Array | None,
    bias: Array | None,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
    dtype: Any,
    epsilon: float,
) -> Array:
  """``((x - S) * rsqrt(D^2 + eps) * r + d) * scale + bias``.

  Written as :func:`normalize` with the multiplier scaled by ``r`` and the
  bias shifted by ``d * scale``, so that ``r = 1, d = 0`` gives its output
  bit for bit.
  """
  feature_shape = [1] * x.ndim
  for ax in feature_axes:
    feature_shape[ax] = x.shape[ax]
  expand = lambda v: jnp.expand_dims(v, reduction_axes)
  y = x - expand(statistic)
  mul = lax.rsqrt(expand(deviation_sq) + epsilon)
  mul *= expand(r)
  shift = expand(d)
  args = [x]
  if scale is not None:
    scale = scale.reshape(feature_shape)
    mul *= scale
    shift *= scale
    args.append(scale)
  y *= mul
  if bias is not None:
    bias = bias.reshape(feature_shape)
    shift += bias
    args.append(bias)
  y += shift
  return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=dtype))


def renormalize_batch(
    measure: measures_lib.MeasureFn,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    running_statistic: Array,
    running_deviation_sq: Array,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
    *,
    dtype: Any,
    epsilon: float,
    limits: RenormLimits,
    mask: Array | None,
    axis_name: str | None,
    axis_index_groups: Any,
    force_float32_reductions: bool = True,
) -> tuple[Array, Array, Array]:
  """Generalized batch renormalization in training: ``(y, S, D^2)``.

  The batch's ``(S, D^2)``, corrected towards the running ones by the
  constants ``(r, d)`` of :func:`renorm_correction`; gradients flow through
  the measure by autodiff (with or without ``axis_name``).
  """
  if jnp.iscomplexobj(x):
    raise TypeError(
        "renorm=True is not defined for complex input: its correction d is"
        " clipped to [-dmax, dmax], which has no meaning for complex numbers."
    )
  statistic, deviation_sq = batch_statistics(
      measure,
      x,
      reduction_axes,
      dtype=dtype,
      mask=mask,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      force_float32_reductions=force_float32_reductions,
  )
  r, d = renorm_correction(
      statistic,
      deviation_sq,
      running_statistic,
      running_deviation_sq,
      epsilon,
      limits,
  )
  y = renormalize(
      x,
      statistic,
      deviation_sq,
      r,
      d,
      scale,
      bias,
      reduction_axes,
      feature_axes,
      dtype,
      epsilon,
  )
  return y, statistic, deviation_sq
