"""Pure helpers shared by the linen and nnx GBatchNorm modules."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

from flax.linen import dtypes
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax import deviations
from gbn_jax import measures as measures_lib
from gbn_jax._mask_shape import check_mask_shape

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
    layer: str = "GBatchNorm",
) -> measures_lib.Measure:
  """Resolves a module's ``measure``/``alpha``/``calibration`` fields into a
  :class:`~gbn_jax.Measure`.

  ``layer`` is the module's class name, for the messages.

  Raises the registry's errors (unknown name, alpha outside (0, 1), unexpected
  parameters, a calibration the measure has no constant for), so a
  misconfigured module fails when it is constructed. A plain callable becomes
  a ``Measure`` that declares no capability (see
  :func:`gbn_jax.measures.resolve_measure`).
  """
  try:
    fn = measures_lib.resolve_measure(measure, calibration, alpha=alpha)
  except measures_lib.FixedParamsError as e:
    # The module's fields, not get_measure, are what the user wrote.
    raise measures_lib.FixedParamsError(
        e.name,
        e.fixed,
        lambda general, choose: f"{layer}(measure={general!r}, {choose})",
    ) from None
  if not isinstance(measure, (str, measures_lib.Measure)):
    check_measure_signature(measure)
  if fn.fn is measures_lib.sd:
    fn = dataclasses.replace(
        fn,
        params=tuple(
            sorted(
                {**dict(fn.params), "fast_variance": use_fast_variance}.items()
            )
        ),
    )
  return fn


MEASURE_CONTRACT = measures_lib.MEASURE_CONTRACT


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


#: A batch renormalization correction: ``(S, D^2, operands) -> (r, d)``.
Correct = Callable[[Array, Array, Any], tuple[Array, Array]]


class Reduction(NamedTuple):
  """How a layer reduces its batch, all but the arrays: over which axes, in
  which dtype, with which ``epsilon``, pooled across which devices.

  ``feature_axes`` are the axes the statistics keep (all but
  ``reduction_axes``). ``param_axes`` are those of ``scale`` and ``bias``:
  ``None`` (BatchNorm's) for the feature axes themselves; a layer or
  instance norm names its own, which may overlap the reduced axes. With
  ``group_size``, the last axis (a feature axis: the channels) is split
  into groups of that many consecutive channels, each group reduced with
  ``reduction_axes`` into one statistic that its channels share (group
  normalization).

  Hashable when ``axis_index_groups`` is (a tuple of tuples, or ``None``).
  """

  reduction_axes: tuple[int, ...]
  feature_axes: tuple[int, ...]
  dtype: Any
  epsilon: float
  axis_name: str | None = None
  axis_index_groups: Any = None
  force_float32_reductions: bool = True
  param_axes: tuple[int, ...] | None = None
  group_size: int | None = None


def batch_statistics(
    measure: measures_lib.Measure,
    x: Array,
    mask: Array | None,
    reduction: Reduction,
) -> tuple[Array, Array]:
  """``(S, D^2)`` of the batch, in at least float32 like flax's BatchNorm.

  ``measure`` (from :func:`bind_measure`) applies its declared capabilities:
  a mask for a measure without ``supports_mask`` is a ``TypeError``; one
  without ``pools_devices`` gets the global batch gathered across
  ``reduction.axis_name`` (exact, at the cost of moving the activations).
  A mask that does not broadcast to ``x`` is a ``ValueError`` naming the
  shape it needs (:func:`check_mask_shape`).
  """
  if mask is not None:
    check_mask_shape(np.shape(mask), np.shape(x))
  if reduction.group_size is not None:
    return _group_statistics(measure, x, mask, reduction)
  if not reduction.reduction_axes:
    # Only feature axes (an unbatched call, or one example per device under
    # vmap with axis_name): each feature has one element here, and the
    # elements of every device along axis_name pool into one batch. A new
    # leading axis of size one gives every measure that batch to reduce.
    return batch_statistics(
        measure,
        jnp.expand_dims(x, 0),
        None if mask is None else jnp.broadcast_to(mask, x.shape)[None],
        reduction._replace(
            reduction_axes=(0,),
            feature_axes=tuple(a + 1 for a in reduction.feature_axes),
        ),
    )
  dtype = reduction.dtype
  if dtype is None:
    dtype = jnp.result_type(x)
  if reduction.force_float32_reductions:
    dtype = jnp.promote_types(dtype, jnp.float32)
  x = jnp.asarray(x, dtype)
  where = (
      None
      if mask is None
      else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
  )
  s, d2 = measure.squared_deviation(
      x,
      reduction.reduction_axes,
      where=where,
      axis_name=reduction.axis_name,
      axis_index_groups=reduction.axis_index_groups,
  )
  feature_shape = tuple(
      n for i, n in enumerate(x.shape) if i not in reduction.reduction_axes
  )
  for name, value in (("statistic", s), ("deviation", d2)):
    if jnp.shape(value) != feature_shape:
      raise ValueError(
          f"measure {measure!r} returned a {name} of shape {jnp.shape(value)};"
          f" expected the per-feature shape {feature_shape}."
      )
  # D^2 is real for complex input too (flax's var is E|x - mean|^2).
  return jnp.asarray(s, dtype), jnp.asarray(d2, _real_dtype(dtype))


def _group_statistics(
    measure: measures_lib.Measure,
    x: Array,
    mask: Array | None,
    reduction: Reduction,
) -> tuple[Array, Array]:
  """:func:`batch_statistics` of each group of ``reduction.group_size``
  consecutive channels (the last axis), repeated for the group's channels.

  The measure sees the groups as an axis of their own (``(..., groups,
  group_size)``), so that its element count, which calibration reads, is
  the group's.
  """
  size = reduction.group_size
  channels = x.shape[-1]
  grouped = tuple(x.shape[:-1]) + (channels // size, size)
  if mask is not None:
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape).reshape(grouped)
  within = reduction._replace(
      reduction_axes=reduction.reduction_axes + (x.ndim,),
      group_size=None,
      param_axes=None,
  )
  statistic, deviation_sq = batch_statistics(
      measure, jnp.reshape(x, grouped), mask, within
  )
  return (
      jnp.repeat(statistic, size, axis=-1),
      jnp.repeat(deviation_sq, size, axis=-1),
  )


def _param_shape(shape: tuple[int, ...], reduction: Reduction) -> list[int]:
  """The shape ``scale`` and ``bias`` broadcast in: ``shape`` on their
  axes, 1 elsewhere."""
  axes = reduction.param_axes
  if axes is None:
    axes = reduction.feature_axes
  out = [1] * len(shape)
  for ax in axes:
    out[ax] = shape[ax]
  return out


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
    reduction: Reduction,
    correction: tuple[Array, Array] | None = None,
) -> Array:
  """``(x - S) * rsqrt(D^2 + eps) * scale + bias``, in flax's operation order.

  For ``S = mean`` and ``D^2 = var`` this is exactly flax's BatchNorm output.
  With a batch renormalization ``correction = (r, d)`` it is ``((x - S) *
  rsqrt(D^2 + eps) * r + d) * scale + bias``: the multiplier scaled by ``r``
  and the bias shifted by ``d * scale``, so that ``r = 1, d = 0`` gives the
  uncorrected output bit for bit.
  """
  feature_shape = _param_shape(x.shape, reduction)
  # expand_dims, not reshape: XLA:CPU fuses the two differently, and this is
  # the form flax uses (measured: reshape materializes a full-size multiplier).
  # Same operation order as flax too: XLA's fusion decisions follow it.
  expand = lambda v: jnp.expand_dims(v, reduction.reduction_axes)
  y = x - expand(statistic)
  mul = lax.rsqrt(expand(deviation_sq) + reduction.epsilon)
  shift = None
  if correction is not None:
    r, d = correction
    mul *= expand(r)
    shift = expand(d)
  args = [x]
  if scale is not None:
    scale = scale.reshape(feature_shape)
    mul *= scale
    if shift is not None:
      shift *= scale
    args.append(scale)
  y *= mul
  if bias is not None:
    bias = bias.reshape(feature_shape)
    shift = bias if shift is None else shift + bias
    args.append(bias)
  if shift is not None:
    y += shift
  return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=reduction.dtype))


def normalize_batch(
    measure: measures_lib.Measure,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    mask: Array | None,
    reduction: Reduction,
    correct: Correct | None = None,
    correction_operands: Any = (),
) -> tuple[Array, Array, Array]:
  """Normalizes ``x`` with the batch's own statistics.

  :func:`batch_statistics`, then :func:`normalize`, as one nested ``jax.jit``
  per layer configuration under a staging trace, else inline.

  Args:
    measure: the bound measure giving ``(S, D)``.
    x: the activations.
    scale: the learned scale, or None.
    bias: the learned bias, or None.
    mask: a boolean mask of ``x``'s shape (the elements that count), or None.
    reduction: the axes and device pooling to reduce over.
    correct: the batch renormalization correction, ``correct(S, D^2,
      correction_operands) -> (r, d)``, or None. It must hash and compare by
      value (a frozen dataclass of its settings, not a closure).
    correction_operands: a pytree of the arrays ``correct`` reads.

  Returns:
    ``(y, S, D^2)``: the normalized output and the batch's statistic and
    squared deviation.
  """
  # Under a staging trace (jit, make_jaxpr, scan, remat, jax.export) the
  # whole layer is one nested jit, traced once per measure, reduction,
  # correction settings, shapes, dtypes and trace context and bound by every
  # layer sharing them: a quantile measure traces a branch per kind of
  # platform, a large program to trace once per layer otherwise. The whole
  # layer nests, not its statistics alone: reverse mode sums a nested call's
  # cotangents of x before those from outside it, so statistics nested apart
  # from normalize() would round the gradients unlike the inline program.
  # Eagerly the layer runs op by op, as flax's does: one compiled program's
  # fusions need not round like separate operations. Nesting assumes, as
  # jax.jit does, that a measure traces the same for the same arguments and
  # trace context; unhashable settings or non-array operands stay inline.
  if _under_staging_trace(x):
    key = _static_key(measure, reduction, correct)
    if key is not None and _arrays(
        x, scale, bias, mask, *jax.tree_util.tree_leaves(correction_operands)
    ):
      return _layer_traced_once(*key, x, scale, bias, mask, correction_operands)
  return _normalize_inline(
      measure, reduction, correct, x, scale, bias, mask, correction_operands
  )


def _normalize_inline(
    measure: measures_lib.Measure,
    reduction: Reduction,
    correct: Correct | None,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    mask: Array | None,
    correction_operands: Any = (),
) -> tuple[Array, Array, Array]:
  """:func:`normalize_batch`, traced inline (the static arguments first)."""
  # Plain GBN on one device (or under SPMD jit) has its derivative written out
  # (_fused_normalize, a JVP that JAX transposes): its backward pass costs
  # BatchNorm's plus the measure's own VJP, and forward mode works too. With
  # axis_name, complex input or a correction it is left to autodiff, whose
  # collectives JAX transposes for pmap and shard_map alike; so is sd per
  # example and channel (_flax_derivative_is_faster).
  if (
      reduction.axis_name is None
      and correct is None
      and not jnp.iscomplexobj(x)
      and not _flax_derivative_is_faster(measure, reduction, x.ndim)
  ):
    # A static argument of the custom VJP must hash: the device groups,
    # unused without an axis name, may be lists.
    local = reduction._replace(axis_index_groups=None)
    return _fused_normalize(measure, local, x, scale, bias, mask)
  statistic, deviation_sq = batch_statistics(measure, x, mask, reduction)
  y = normalize(
      x,
      statistic,
      deviation_sq,
      scale,
      bias,
      reduction,
      correction=(
          None
          if correct is None
          else correct(statistic, deviation_sq, correction_operands)
      ),
  )
  return y, statistic, deviation_sq


def _flax_derivative_is_faster(
    measure: measures_lib.Measure, reduction: Reduction, ndim: int
) -> bool:
  """Whether ``sd`` is left to autodiff of its (flax's) operations: where the
  statistics keep the leading and last axes, no groups (InstanceNorm's),
  XLA:CPU compiles the written derivative's input gradient as a loop and
  flax's as a library fusion; elsewhere the written one is as fast."""
  kept = {0, ndim - 1}.isdisjoint(reduction.reduction_axes)
  return measure.fn is deviations.sd and kept and reduction.group_size is None


# Module level, so that its cache outlives every trace. Measure, reduction
# and the correction's settings (or None) are static (hashed), the arrays
# (the correction's operands among them) traced; JAX
# keys the cache on their shapes, dtypes and shardings and on its trace
# context, which holds the platform kind that
# ``_selection.common.per_platform`` traces each branch under and the
# selection settings (both ``jax.make_user_context``), the config flags
# (x64) and the axis environment (the named axes that collectives over
# ``axis_name`` reduce under shard_map, pmap or vmap).
_layer_traced_once = jax.jit(_normalize_inline, static_argnums=(0, 1, 2))


def _static_key(
    measure: measures_lib.Measure,
    reduction: Reduction,
    correct: Correct | None = None,
) -> tuple[measures_lib.Measure, Reduction, Correct | None] | None:
  """``(measure, reduction, correct)`` as the nested jit's static arguments,
  or None.

  Device groups given as lists become tuples. None where any does not hash
  (a measure parameter or a correction setting that is a numpy array): then
  nothing nests.
  """
  groups = reduction.axis_index_groups
  if groups is not None:
    try:
      groups = tuple(tuple(group) for group in groups)
    except TypeError:
      return None
  key = (measure, reduction._replace(axis_index_groups=groups), correct)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _arrays(x: Any, *optional: Any) -> bool:
  # A list or a scalar would be a pytree of scalars to jit, not one array.
  return isinstance(x, jax.Array) and all(
      a is None or isinstance(a, jax.Array) for a in optional
  )


def _under_staging_trace(x: Any) -> bool:
  """Whether JAX stages a program here (jit, make_jaxpr, scan, remat,
  export) rather than running the layer op by op.

  JAX has no public query for it. An operation on constants is evaluated at
  once eagerly and under eager ``vmap``, ``grad`` and ``jvp`` (which hand it
  to the trace below them), and is a tracer only where a program is staged;
  there it leaves one unused equation of two scalars, which lowering drops.
  A concrete ``x`` needs no probe: nothing above it is staging.
  """
  if not isinstance(x, jax.core.Tracer):
    return False
  return isinstance(lax.add(np.int32(0), np.int32(0)), jax.core.Tracer)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _fused_normalize(measure, reduction: Reduction, x, scale, bias, mask):
  statistic, deviation_sq = batch_statistics(measure, x, mask, reduction)
  y = normalize(x, statistic, deviation_sq, scale, bias, reduction)
  return y, statistic, deviation_sq


def _fused_normalize_jvp(measure, reduction, primals, tangents):
  """BatchNorm's derivative, generalized, written as a JVP.

  With ``r = (D^2 + eps)^-1/2`` and ``y = (x - S) r scale + bias``::

    dy = (dx - dS) r scale + (x - S) (r dscale - r^3 scale dD^2 / 2) + dbias

  with ``(dS, dD^2)`` the measure's own JVP. JAX transposes this for reverse
  mode into BatchNorm's backward pass (the two reductions ``sum g`` and
  ``sum g (x - S)``, plus the measure's VJP), and differentiates it again for
  forward-over-reverse; a ``custom_vjp`` would allow reverse mode only. Zero
  tangents stay symbolic, so that differentiating the parameters alone (the
  first layer of a network, whose input is data) adds no pass over the
  measure.
  """
  x, scale, bias, mask = primals
  x_dot, scale_dot, bias_dot, _ = tangents
  stats = lambda v: batch_statistics(measure, v, mask, reduction)
  if _is_zero(x_dot):
    statistic, deviation_sq = stats(x)
    statistic_dot = deviation_sq_dot = None
  else:
    (statistic, deviation_sq), (statistic_dot, deviation_sq_dot) = jax.jvp(
        stats, (x,), (x_dot.astype(x.dtype),)
    )
  y = normalize(x, statistic, deviation_sq, scale, bias, reduction)

  dtype = statistic.dtype
  expand = lambda v: jnp.expand_dims(v, reduction.reduction_axes)
  if reduction.param_axes is None:
    # Statistics and parameters are per feature: the coefficients are too,
    # broadcast against x only at the end.
    stat_form = lambda v: v
    param_form = lambda v: _feature_vector(v, dtype)
    to_x = expand
  else:
    # Parameters on axes of their own (layer, group, instance norm): the
    # coefficients live in the broadcast of the two, at x's rank.
    param_shape = _param_shape(x.shape, reduction)
    stat_form = expand
    param_form = lambda v: _feature_vector(v, dtype).reshape(param_shape)
    to_x = lambda v: v
  r = stat_form(lax.rsqrt(deviation_sq + reduction.epsilon))
  gain = r if scale is None else r * param_form(scale)
  # dy = dx gain + (x - S) centered + constant, with per-feature
  # coefficients (None where zero). dS joins dbias in the constant, so that
  # the transpose reduces g once for both (BatchNorm's sum g).
  centered = constant = None
  if statistic_dot is not None:
    centered = -0.5 * r * r * gain * stat_form(deviation_sq_dot)
    constant = -gain * stat_form(statistic_dot)
  if scale is not None and not _is_zero(scale_dot):
    term = r * param_form(scale_dot)
    centered = term if centered is None else centered + term
  if bias is not None and not _is_zero(bias_dot):
    term = param_form(bias_dot)
    constant = term if constant is None else constant + term
  y_dot = None
  if statistic_dot is not None:
    y_dot = x_dot.astype(dtype) * to_x(gain)
  if centered is not None:
    term = (x.astype(dtype) - expand(statistic)) * to_x(centered)
    y_dot = term if y_dot is None else y_dot + term
  if constant is not None:
    y_dot = to_x(constant) if y_dot is None else y_dot + to_x(constant)
  y_dot = (
      jnp.zeros_like(y)
      if y_dot is None
      else jnp.broadcast_to(y_dot, y.shape).astype(y.dtype)
  )
  if statistic_dot is None:
    statistic_dot = jnp.zeros_like(statistic)
    deviation_sq_dot = jnp.zeros_like(deviation_sq)
  return (y, statistic, deviation_sq), (y_dot, statistic_dot, deviation_sq_dot)


def _is_zero(tangent: Any) -> bool:
  return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def _feature_vector(v: Array, dtype: Any) -> Array:
  """A scale or bias (feature-shaped, as the statistics are) in ``dtype``."""
  return jnp.asarray(v, dtype)


_fused_normalize.defjvp(_fused_normalize_jvp, symbolic_zeros=True)
