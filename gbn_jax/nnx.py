"""``GBatchNorm`` for flax.nnx: a drop-in for ``flax.nnx.BatchNorm``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
from flax.nnx.module import first_from
import jax
import jax.numpy as jnp

from gbn_jax import _normalization
from gbn_jax.measures import MeasureFn

Array = jax.Array

__all__ = ["GBatchNorm"]


class GBatchNorm(nnx.BatchNorm):
  """Generalized Batch Normalization for nnx.

  Same constructor, variables (``mean``/``var`` as ``nnx.BatchStat``, ``scale``
  and ``bias`` as ``nnx.Param``), ``train()``/``eval()`` behaviour and call as
  ``nnx.BatchNorm``, plus ``measure``, ``alpha`` and ``calibration`` (see
  :class:`gbn_jax.GBatchNorm`). ``mean`` holds the running statistic ``S`` and
  ``var`` the running ``D^2``; with ``measure='sd'`` it is BatchNorm.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> norm = gbn_jax.nnx.GBatchNorm(3, measure='sqd1', rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> float((jax.nn.relu(norm(x)) == 0).mean())  # a quarter at or below q_.25
    0.25

  ``renorm=True`` turns on generalized batch renormalization in training
  (``renorm_clipping`` as in :class:`gbn_jax.GBatchNorm`):

    >>> renorm = gbn_jax.nnx.GBatchNorm(
    ...     3, measure='sqd1', renorm=True,
    ...     renorm_clipping={'rmax': 3.0, 'dmax': 5.0}, rngs=nnx.Rngs(0))
    >>> renorm(x).shape, renorm.renorm_clipping['rmax']
    ((8, 3), 3.0)
  """

  def __init__(
      self,
      num_features: int,
      *,
      measure: str | MeasureFn = "sd",
      alpha: float | None = None,
      renorm: bool = False,
      renorm_clipping: Mapping[str, float] | None = None,
      calibration: str | None = None,
      **kwargs: Any,
  ):
    """Args: as ``nnx.BatchNorm``, plus ``measure``, ``alpha``, ``renorm``,
    ``renorm_clipping`` and ``calibration`` (see
    :class:`gbn_jax.GBatchNorm`)."""
    use_fast_variance = kwargs.get("use_fast_variance", True)
    # Validate before allocating anything: bad names/alpha/calibration/clipping
    # fail here.
    _normalization.bind_measure(measure, alpha, use_fast_variance, calibration)
    renorm_clipping = _normalization.freeze_renorm_clipping(
        renorm, renorm_clipping
    )
    super().__init__(num_features, **kwargs)
    self.measure = measure
    self.alpha = alpha
    self.renorm = renorm
    self.renorm_clipping = renorm_clipping
    self.calibration = calibration

  def __call__(
      self,
      x,
      use_running_average: bool | None = None,
      *,
      mask: Array | None = None,
  ):
    """Normalizes ``x``; arguments as ``nnx.BatchNorm.__call__``."""
    use_running_average = first_from(
        use_running_average,
        self.use_running_average,
        error_msg=(
            "No `use_running_average` argument was provided to GBatchNorm:"
            " pass it to the constructor or the call, or use .train()/.eval()."
        ),
    )
    feature_axes = _normalization.canonicalize_axes(x.ndim, self.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, statistic, deviation_sq, scale, bias = self.promote_dtype(
        (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
    )
    if not use_running_average:
      measure = _normalization.bind_measure(
          self.measure, self.alpha, self.use_fast_variance, self.calibration
      )
      reduction = dict(
          dtype=self.dtype,
          epsilon=self.epsilon,
          mask=mask,
          axis_name=self.axis_name,
          axis_index_groups=self.axis_index_groups,
      )
      if self.renorm:
        y, statistic, deviation_sq = _normalization.renormalize_batch(
            measure,
            x,
            scale,
            bias,
            statistic,
            deviation_sq,
            reduction_axes,
            feature_axes,
            limits=_normalization.renorm_limits(self.renorm_clipping),
            **reduction,
        )
      else:
        y, statistic, deviation_sq = _normalization.normalize_batch(
            measure, x, scale, bias, reduction_axes, feature_axes, **reduction
        )
      _update(
          self.mean,
          jax.lax.stop_gradient(
              self.momentum * self.mean[...] + (1 - self.momentum) * statistic
          ),
      )
      _update(
          self.var,
          jax.lax.stop_gradient(
              self.momentum * self.var[...] + (1 - self.momentum) * deviation_sq
          ),
      )
      return y
    return _normalization.normalize(
        x,
        statistic,
        deviation_sq,
        scale,
        bias,
        reduction_axes,
        feature_axes,
        self.dtype,
        self.epsilon,
    )


def _update(variable: nnx.Variable, value: Array) -> None:
  """``variable[...] = value``, except that a complex running mean (of
  complex input) replaces the real zeros it starts from: assigning into them
  would drop its imaginary part. linen's BatchNorm keeps it complex too."""
  if jnp.iscomplexobj(value) and not jnp.iscomplexobj(variable[...]):
    variable.set_value(value)
  else:
    variable[...] = value
