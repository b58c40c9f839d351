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


def running_average(momentum: float, old: Array, batch: Array) -> Array:
  """The running statistic's update: ``momentum * old + (1 - momentum) *
  batch``, flax's expression (and so flax's rounding)."""
  return momentum * old + (1 - momentum) * batch
