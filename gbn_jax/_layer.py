"""What the linen and nnx ``GBatchNorm`` modules share: one copy of the layer.

The modules are thin: each declares its variables the way its framework
does (linen's ``batch_stats`` collection, nnx's ``BatchStat`` attributes),
applies its framework's dtype rules, and calls these pure helpers for the
rest. A helper that takes ``layer`` reads only its configuration fields
(the names are flax's and GBN's: ``measure``, ``alpha``, ``calibration``,
``use_fast_variance``, ``renorm``, ``renorm_clipping``, ``axis``,
``epsilon``, ``dtype``, ``axis_index_groups``), which both modules have.
The output with running statistics is :func:`gbn_jax._normalization.normalize`
itself.
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
  it needs (:func:`gbn_jax._normalization.check_mask_shape`), raised here
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
  _normalization.check_mask_shape(np.shape(mask), shape)


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
