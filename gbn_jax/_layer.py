"""What the linen and nnx modules share: one copy of each layer.

The modules are thin: each declares its variables the way its framework
does (linen's ``batch_stats`` collection, nnx's ``BatchStat`` attributes),
applies its framework's dtype rules, and calls these pure helpers for the
rest. A helper that takes ``layer`` reads only its configuration fields
(the names are flax's and GBN's: ``measure``, ``alpha``, ``calibration``,
``use_fast_variance``, ``renorm``, ``renorm_clipping``, ``axis``,
``epsilon``, ``dtype``, ``axis_index_groups``), which both modules have.
The output with running statistics is :func:`gbn_jax._normalization.normalize`
itself.

The per-example layers (``GLayerNorm``, ``GGroupNorm``, ``GInstanceNorm``)
keep no running statistics: a ``*_reduction`` helper turns their axes
fields into a :class:`gbn_jax._normalization.Reduction` (statistics per
example, parameters on their own axes, channels in groups), and
:func:`normalize_examples` is their output, by the same normalization as
GBatchNorm's in training.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any, Protocol

from flax.core import FrozenDict
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax import _mask_shape
from gbn_jax import _normalization
from gbn_jax import _renorm
from gbn_jax.measures import MeasureFn

Array = jax.Array


class LayerFields(Protocol):
  """The configuration fields of a ``GBatchNorm`` module (linen or nnx)."""

  measure: str | MeasureFn
  alpha: float | None
  calibration: str | None
  use_fast_variance: bool
  renorm: bool
  renorm_clipping: Mapping[str, float] | None
  axis: Any
  epsilon: float
  dtype: Any
  axis_index_groups: Any


def validate(
    measure: str | MeasureFn,
    alpha: float | None,
    use_fast_variance: bool,
    calibration: str | None,
    renorm: bool,
    renorm_clipping: Mapping[str, float] | None,
) -> FrozenDict | None:
  """Checks a module's GBN fields at construction; returns the clipping frozen.

  Raises the registry's errors for a bad ``measure``/``alpha``/
  ``calibration`` and :func:`gbn_jax._renorm.freeze_renorm_clipping`'s for a
  bad ``renorm_clipping``, before anything is allocated or traced.
  """
  _normalization.bind_measure(measure, alpha, use_fast_variance, calibration)
  return _renorm.freeze_renorm_clipping(renorm, renorm_clipping)


def check_momentum(momentum: Any) -> None:
  """Raises ValueError unless ``momentum`` is a number in [0, 1].

  Flax takes any value, and outside [0, 1] the running statistics diverge
  or flip sign, silently; 1 (never update) and 0 (the last batch) are kept.
  """
  ok = False
  # float() would take "0.9" and True: neither is a momentum.
  if not isinstance(momentum, (bool, str, bytes)):
    try:
      ok = 0 <= float(momentum) <= 1
    except (TypeError, ValueError):
      pass
  if not ok:
    raise ValueError(
        f"momentum must be a number in [0, 1] (the weight of the old running"
        f" statistics), got momentum={momentum!r}."
    )


def check_axis(axis: Any, ndim: int) -> None:
  """Raises ValueError if a feature ``axis`` is not an axis of a rank-``ndim``
  input (flax raises an IndexError from deep inside instead)."""
  for a in axis if isinstance(axis, (tuple, list)) else (axis,):
    if not -ndim <= a < ndim:
      raise ValueError(
          f"axis={axis!r} is out of range for an input of rank {ndim}: a"
          f" feature axis must be in [{-ndim}, {ndim - 1}]."
      )


def check_mask(mask: Any, shape: tuple[Any, ...]) -> None:
  """Raises unless ``mask`` is ``None`` or a boolean array that broadcasts to
  ``shape`` (the input's).

  A float or int mask would be cast to bool, so that every nonzero weight
  counts as 1: a weighted mask is not supported, and is refused with a
  TypeError. A mask that does not broadcast is a ValueError naming the shape
  it needs (:func:`gbn_jax._mask_shape.check_mask_shape`), raised here
  rather than from a ``broadcast_to`` deep inside the measure.
  """
  if mask is None:
    return
  dtype = mask.dtype if hasattr(mask, "dtype") else jnp.asarray(mask).dtype
  if dtype != jnp.bool_:
    raise TypeError(
        f"mask must be a boolean array (True: the element counts in the"
        f" statistics), got dtype {dtype}; pass e.g. `mask=weights > 0`."
    )
  _mask_shape.check_mask_shape(np.shape(mask), shape)


def check_num_features(
    num_features: int, x: Array, feature_axes: tuple[int, ...]
) -> None:
  """Raises ValueError if ``x`` does not have ``num_features`` features."""
  size = math.prod(x.shape[a] for a in feature_axes)
  if size != num_features:
    where = feature_axes[0] if len(feature_axes) == 1 else feature_axes
    raise ValueError(
        f"num_features={num_features} but the input has {size} features"
        f" along axis {where} (input shape {tuple(x.shape)})."
    )


def has_elements(
    mask: Array | None,
    shape: tuple[int, ...],
    reduction: _normalization.Reduction,
) -> Array | None:
  """Per feature, whether any element is masked in (across ``axis_name``).

  ``None`` without a mask. A feature with no masked-in element has NaN
  batch statistics: its running statistics must keep their value (see
  :func:`running_average`), while the other features' are updated.
  """
  if mask is None:
    return None
  mask = jnp.broadcast_to(jnp.asarray(mask, bool), shape)
  found = jnp.any(mask, axis=reduction.reduction_axes)
  if reduction.axis_name is not None:
    # Another device's elements count: the statistics pool the devices.
    found = (
        lax.psum(
            found.astype(jnp.int32),
            reduction.axis_name,
            axis_index_groups=reduction.axis_index_groups,
        )
        > 0
    )
  return found


def reduction(
    layer: LayerFields,
    ndim: int,
    *,
    axis_name: str | None,
    force_float32_reductions: bool = True,
) -> _normalization.Reduction:
  """The layer's reduction of an input of rank ``ndim``.

  ``axis_name`` and ``force_float32_reductions`` come from the call: linen
  reduces on one device while it initializes, and nnx always reduces in
  float32 (see the modules).
  """
  check_axis(layer.axis, ndim)
  feature_axes = _normalization.canonicalize_axes(ndim, layer.axis)
  return _normalization.Reduction(
      reduction_axes=tuple(i for i in range(ndim) if i not in feature_axes),
      feature_axes=feature_axes,
      dtype=layer.dtype,
      epsilon=layer.epsilon,
      axis_name=axis_name,
      axis_index_groups=layer.axis_index_groups,
      force_float32_reductions=force_float32_reductions,
  )


def normalize_training(
    layer: LayerFields,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    running_statistic: Array,
    running_deviation_sq: Array,
    reduction: _normalization.Reduction,
    mask: Array | None,
) -> tuple[Array, Array, Array]:
  """The training-mode output and the batch's ``(S, D^2)``: ``(y, S, D^2)``.

  Plain GBN, or batch renormalization towards the running statistics with
  ``layer.renorm``. The running statistics are not updated here (see
  :func:`running_average`).
  """
  measure = _normalization.bind_measure(
      layer.measure, layer.alpha, layer.use_fast_variance, layer.calibration
  )
  if layer.renorm:
    return _renorm.renormalize_batch(
        measure,
        x,
        scale,
        bias,
        running_statistic,
        running_deviation_sq,
        mask,
        reduction,
        limits=_renorm.renorm_limits(layer.renorm_clipping),
    )
  return _normalization.normalize_batch(
      measure, x, scale, bias, mask, reduction
  )


def running_average(
    momentum: float, old: Array, batch: Array, found: Array | None = None
) -> Array:
  """The running statistic's update: ``momentum * old + (1 - momentum) *
  batch``, flax's expression (and so flax's rounding).

  ``found`` (from :func:`has_elements`) keeps ``old`` for the features
  without a masked-in element, whose batch statistics are NaN: flax's
  BatchNorm makes them NaN for good instead.
  """
  new = momentum * old + (1 - momentum) * batch
  return new if found is None else jnp.where(found, new, old)


class ExampleLayerFields(Protocol):
  """The configuration fields of a per-example norm module (``GLayerNorm``,
  ``GGroupNorm``, ``GInstanceNorm``; linen or nnx)."""

  measure: str | MeasureFn
  alpha: float | None
  calibration: str | None
  use_fast_variance: bool
  epsilon: float
  dtype: Any
  axis_name: str | None
  axis_index_groups: Any


def check_measure(
    measure: str | MeasureFn,
    alpha: float | None,
    use_fast_variance: bool,
    calibration: str | None,
    layer: str,
) -> None:
  """Raises the registry's errors for a bad ``measure``/``alpha``/
  ``calibration`` of the module ``layer``, before anything is allocated."""
  _normalization.bind_measure(
      measure, alpha, use_fast_variance, calibration, layer=layer
  )


def layer_norm_reduction(
    layer: ExampleLayerFields,
    ndim: int,
    reduction_axes: Any,
    feature_axes: Any,
    *,
    force_float32_reductions: bool = True,
) -> _normalization.Reduction:
  """Layer normalization's reduction: the statistics over ``reduction_axes``
  (the rest are kept: one statistic per example), ``scale`` and ``bias``
  on ``feature_axes``."""
  check_axes("reduction_axes", reduction_axes, ndim)
  check_axes("feature_axes", feature_axes, ndim)
  reduced = _normalization.canonicalize_axes(ndim, reduction_axes)
  return _example_reduction(
      layer,
      ndim,
      reduced,
      _normalization.canonicalize_axes(ndim, feature_axes),
      force_float32_reductions=force_float32_reductions,
  )


def instance_norm_reduction(
    layer: ExampleLayerFields,
    ndim: int,
    feature_axes: Any,
    *,
    force_float32_reductions: bool = True,
) -> _normalization.Reduction:
  """Instance normalization's reduction: per example (the leading axis) and
  per feature, over every other axis.

  Raises:
    ValueError: ``feature_axes`` include the leading (batch) axis, with
      flax's message.
  """
  check_axes("feature_axes", feature_axes, ndim)
  features = _normalization.canonicalize_axes(ndim, feature_axes)
  if 0 in features:
    raise ValueError(
        "The channel axes cannot include the leading dimension as this is"
        " assumed to be the batch axis."
    )
  reduced = tuple(i for i in range(1, ndim) if i not in features)
  return _example_reduction(
      layer,
      ndim,
      reduced,
      features,
      force_float32_reductions=force_float32_reductions,
  )


def group_norm_reduction(
    layer: ExampleLayerFields,
    shape: tuple[int, ...],
    reduction_axes: Any,
    num_groups: int | None,
    group_size: int | None,
    *,
    force_float32_reductions: bool = True,
) -> _normalization.Reduction:
  """Group normalization's reduction of an input of ``shape``: the channels
  (the last axis) in groups, each group's statistics over its channels and
  the other ``reduction_axes`` (``None``: all but the leading axis);
  ``scale`` and ``bias`` per channel.

  Raises:
    ValueError: ``reduction_axes`` leave out the last axis; not exactly one
      of ``num_groups`` and ``group_size`` is given; they do not divide the
      channels.
  """
  ndim = len(shape)
  if reduction_axes is None:
    reduction_axes = tuple(range(1, ndim - 1)) + (-1,)
  check_axes("reduction_axes", reduction_axes, ndim)
  reduced = _normalization.canonicalize_axes(ndim, reduction_axes)
  if reduced[-1] != ndim - 1:
    raise ValueError(
        f"reduction_axes={reduction_axes!r} must include the final dimension"
        " (the channels, which are grouped)."
    )
  size = group_size_of(shape[-1], num_groups, group_size)
  return _example_reduction(
      layer,
      ndim,
      reduced[:-1],
      (ndim - 1,),
      group_size=size,
      force_float32_reductions=force_float32_reductions,
  )


def group_size_of(
    channels: int, num_groups: int | None, group_size: int | None
) -> int:
  """The channels per group, from exactly one of ``num_groups`` and
  ``group_size`` (flax's GroupNorm rules and errors)."""
  if (num_groups is None) == (group_size is None):
    raise ValueError(
        "Either `num_groups` or `group_size` should be specified. If"
        " `group_size` is to be specified, pass `num_groups=None` as"
        " argument to override the default `num_groups` value of 32."
    )
  if group_size is not None:
    if group_size <= 0 or channels % group_size:
      raise ValueError(
          f"Number of channels ({channels}) is not multiple of the group"
          f" size ({group_size})."
      )
    return group_size
  if (
      not isinstance(num_groups, int)
      or num_groups <= 0
      or channels % num_groups
  ):
    raise ValueError(
        f"Number of groups ({num_groups}) does not divide the number of"
        f" channels ({channels})."
    )
  return channels // num_groups


def check_axes(name: str, axes: Any, ndim: int) -> None:
  """Raises ValueError if an axis in ``axes`` (the field ``name``) is not
  an axis of a rank-``ndim`` input."""
  for a in axes if isinstance(axes, (tuple, list)) else (axes,):
    if not -ndim <= a < ndim:
      raise ValueError(
          f"{name}={axes!r} is out of range for an input of rank {ndim}: an"
          f" axis must be in [{-ndim}, {ndim - 1}]."
      )


def _example_reduction(
    layer: ExampleLayerFields,
    ndim: int,
    reduced: tuple[int, ...],
    param_axes: tuple[int, ...],
    *,
    group_size: int | None = None,
    force_float32_reductions: bool = True,
) -> _normalization.Reduction:
  return _normalization.Reduction(
      reduction_axes=reduced,
      feature_axes=tuple(i for i in range(ndim) if i not in reduced),
      dtype=layer.dtype,
      epsilon=layer.epsilon,
      axis_name=layer.axis_name,
      axis_index_groups=layer.axis_index_groups,
      force_float32_reductions=force_float32_reductions,
      param_axes=param_axes,
      group_size=group_size,
  )


def normalize_examples(
    layer: ExampleLayerFields,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    reduction: _normalization.Reduction,
    mask: Array | None,
) -> Array:
  """A per-example norm layer's output: GBN's normalization of ``x`` with
  its own statistics over ``reduction`` (no running statistics)."""
  measure = _normalization.bind_measure(
      layer.measure,
      layer.alpha,
      layer.use_fast_variance,
      layer.calibration,
      layer=type(layer).__name__,
  )
  return _normalization.normalize_batch(
      measure, x, scale, bias, mask, reduction
  )[0]
