"""``GBatchNorm`` for flax.linen: a drop-in for ``flax.linen.BatchNorm``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax.linen import module as linen_module

from gbn_jax import _normalization
from gbn_jax.measures import MeasureFn

Array = jax.Array


class GBatchNorm(nn.BatchNorm):
  """Generalized Batch Normalization (Yuan et al., AAAI 2019).

  Normalizes each feature by ``(x - S(x)) / sqrt(D(x)^2 + epsilon)`` over the
  batch, then applies BatchNorm's learned scale and bias. ``(S, D)`` is a
  statistic and generalized deviation measure pair, chosen by ``measure``.
  Every field, default and argument of ``flax.linen.BatchNorm`` is kept with
  the same meaning, and ``measure='sd'`` (the default) *is* BatchNorm.

  Running statistics live in the ``batch_stats`` collection under flax's names:
  ``mean`` holds the running ``S`` and ``var`` the running ``D^2`` (so for
  ``'sd'`` they are exactly BatchNorm's mean and variance). They are updated as
  ``momentum * old + (1 - momentum) * batch`` and never while initializing.

  Example: swap ``nn.BatchNorm`` for ``GBatchNorm`` and pick a measure::

    >>> import jax, jax.numpy as jnp
    >>> from gbn_jax import GBatchNorm
    >>> norm = GBatchNorm(use_running_average=False, measure='sqd2')
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> variables = norm.init(jax.random.key(1), x)
    >>> y, updates = norm.apply(variables, x, mutable=['batch_stats'])
    >>> float((jax.nn.relu(y) == 0).mean())  # centering on the median
    0.5

  Attributes:
    measure: a name from :data:`gbn_jax.MEASURES` (``'sd'``, ``'mad'``,
      ``'rsd'``, ``'sqd'``, ``'sqd1'``..``'sqd3'``, ``'rbd'``, ``'wcd'``,
      ``'bpoe'``, or a registered one) or a callable
      ``measure(x, axis) -> (S, D)``. A callable that also accepts ``where``
      supports ``mask``; one that accepts ``axis_name``/``axis_index_groups``
      pools devices itself, otherwise the batch is gathered across
      ``axis_name`` for it.
    alpha: the probability level of ``'sqd'`` (strictly between 0 and 1).
    use_fast_variance: for ``'sd'``, flax's one-pass variance.
    (other fields): as in ``flax.linen.BatchNorm``.
  """

  measure: str | MeasureFn = "sd"
  alpha: float | None = None

  def __post_init__(self):
    # Fail at construction, not at the first call, for a bad measure or alpha.
    _normalization.bind_measure(self.measure, self.alpha, self.use_fast_variance)
    super().__post_init__()

  @nn.compact
  def __call__(
      self,
      x,
      use_running_average: bool | None = None,
      *,
      mask: Array | None = None,
  ):
    """Normalizes ``x`` with batch (or running) statistics.

    Args:
      x: the input.
      use_running_average: if true, use the running ``S`` and ``D^2`` from
        ``batch_stats`` instead of the batch's.
      mask: boolean array broadcastable to ``x``; statistics are computed over
        the masked-in elements only (all of ``x`` is normalized).

    Returns:
      The normalized input, of the shape of ``x``.
    """
    use_running_average = linen_module.merge_param(
        "use_running_average", self.use_running_average, use_running_average
    )
    feature_axes = _normalization.canonicalize_axes(x.ndim, self.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    feature_shape = [x.shape[ax] for ax in feature_axes]
    stats_dtype = (
        jnp.float32 if self.force_float32_reductions else self.param_dtype
    )
    ra_mean = self.variable(
        "batch_stats", "mean", lambda s: jnp.zeros(s, stats_dtype), feature_shape
    )
    ra_var = self.variable(
        "batch_stats", "var", lambda s: jnp.ones(s, stats_dtype), feature_shape
    )

    scale = bias = None
    if self.use_scale:
      scale = self.param(
          "scale", self.scale_init, tuple(feature_shape), self.param_dtype
      )
      if not self.force_float32_reductions:
        scale = jnp.asarray(scale, self.param_dtype)
    if self.use_bias:
      bias = self.param(
          "bias", self.bias_init, tuple(feature_shape), self.param_dtype
      )
      if not self.force_float32_reductions:
        bias = jnp.asarray(bias, self.param_dtype)

    if not use_running_average:
      measure = _normalization.bind_measure(
          self.measure, self.alpha, self.use_fast_variance
      )
      initializing = self.is_initializing()
      y, statistic, deviation_sq = _normalization.normalize_batch(
          measure,
          x,
          scale,
          bias,
          reduction_axes,
          feature_axes,
          dtype=self.dtype,
          epsilon=self.epsilon,
          mask=mask,
          axis_name=None if initializing else self.axis_name,
          axis_index_groups=self.axis_index_groups,
          force_float32_reductions=self.force_float32_reductions,
      )
      if not initializing:
        ra_mean.value = (
            self.momentum * ra_mean.value + (1 - self.momentum) * statistic
        )
        ra_var.value = (
            self.momentum * ra_var.value + (1 - self.momentum) * deviation_sq
        )
      return y

    statistic, deviation_sq = ra_mean.value, ra_var.value
    if not self.force_float32_reductions:
      statistic = jnp.asarray(statistic, self.param_dtype)
      deviation_sq = jnp.asarray(deviation_sq, self.param_dtype)
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
