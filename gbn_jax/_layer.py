"""What the linen and nnx ``GBatchNorm`` modules share: one copy of the layer.

The modules are thin: each declares its variables the way its framework
does (linen's ``batch_stats`` collection, nnx's ``BatchStat`` attributes),
applies its framework's dtype rules, and calls these pure helpers for the
rest. A helper that takes ``layer`` reads only its configuration fields
(the names are flax's and GBN's: ``measure``, ``alpha``, ``calibration``,
``use_fast_variance``, ``renorm``, ``renorm_clipping``, ``epsilon``,
``dtype``, ``axis_index_groups``), which both modules have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from flax.core import FrozenDict
import jax

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


def axes(ndim: int, axis: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(feature_axes, reduction_axes)`` of an input of rank ``ndim``."""
  feature_axes = _normalization.canonicalize_axes(ndim, axis)
  reduction_axes = tuple(i for i in range(ndim) if i not in feature_axes)
  return feature_axes, reduction_axes


def normalize_training(
    layer: LayerFields,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    running_statistic: Array,
    running_deviation_sq: Array,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
    *,
    mask: Array | None,
    axis_name: str | None,
    force_float32_reductions: bool = True,
) -> tuple[Array, Array, Array]:
  """The training-mode output and the batch's ``(S, D^2)``: ``(y, S, D^2)``.

  Plain GBN, or batch renormalization towards the running statistics with
  ``layer.renorm``. The running statistics are not updated here (see
  :func:`running_average`).
  """
  measure = _normalization.bind_measure(
      layer.measure, layer.alpha, layer.use_fast_variance, layer.calibration
  )
  reduction = dict(
      dtype=layer.dtype,
      epsilon=layer.epsilon,
      mask=mask,
      axis_name=axis_name,
      axis_index_groups=layer.axis_index_groups,
      force_float32_reductions=force_float32_reductions,
  )
  if layer.renorm:
    return _renorm.renormalize_batch(
        measure,
        x,
        scale,
        bias,
        running_statistic,
        running_deviation_sq,
        reduction_axes,
        feature_axes,
        limits=_renorm.renorm_limits(layer.renorm_clipping),
        **reduction,
    )
  return _normalization.normalize_batch(
      measure, x, scale, bias, reduction_axes, feature_axes, **reduction
  )


def normalize_inference(
    layer: LayerFields,
    x: Array,
    statistic: Array,
    deviation_sq: Array,
    scale: Array | None,
    bias: Array | None,
    reduction_axes: tuple[int, ...],
    feature_axes: tuple[int, ...],
) -> Array:
  """The output with the running ``S`` and ``D^2``."""
  return _normalization.normalize(
      x,
      statistic,
      deviation_sq,
      scale,
      bias,
      reduction_axes,
      feature_axes,
      layer.dtype,
      layer.epsilon,
  )


def running_average(momentum: float, old: Array, batch: Array) -> Array:
  """The running statistic's update: ``momentum * old + (1 - momentum) *
  batch``, flax's expression (and so flax's rounding)."""
  return momentum * old + (1 - momentum) * batch
