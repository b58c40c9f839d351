"""GBN for flax.linen: drop-ins for flax's normalization layers.

The batch layer is :class:`gbn_jax.GBatchNorm` (defined here, documented at
the top level); this module adds :class:`BatchNorm`, the layer under flax's
class name, :func:`batchnorm_as_gbn`, which computes every ``nn.BatchNorm``
as GBN while a context is open, and the per-example layers
:class:`GLayerNorm`, :class:`GGroupNorm` and :class:`GInstanceNorm`, drop-ins
for ``nn.LayerNorm``, ``nn.GroupNorm`` and ``nn.InstanceNorm``.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
from flax.linen import module as linen_module
import jax
import jax.numpy as jnp

from gbn_jax import _layer
from gbn_jax import _normalization
from gbn_jax._convert import batchnorm_as_gbn
from gbn_jax._linen_example_norms import GGroupNorm
from gbn_jax._linen_example_norms import GInstanceNorm
from gbn_jax._linen_example_norms import GLayerNorm
from gbn_jax.measures import MeasureFn

Array = jax.Array

__all__ = [
    "BatchNorm",
    "GGroupNorm",
    "GInstanceNorm",
    "GLayerNorm",
    "batchnorm_as_gbn",
]


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
  ``momentum * old + (1 - momentum) * batch`` and never while initializing;
  under a ``mask``, a feature with no masked-in element in the batch (on any
  device along ``axis_name``) keeps them, where flax's BatchNorm would make
  them NaN for good (its batch statistics are NaN: there is nothing to
  average).

  An input with no axis left to reduce (only feature axes: an unbatched
  call, or one example per device under ``vmap``/``pmap`` with
  ``axis_name``) is a batch of one element per feature, pooled across
  ``axis_name``; alone, every built-in measure gives ``S = x`` and ``D = 0``,
  so the output is ``bias``, as flax's. Complex input: ``'sd'`` is flax's
  (complex ``mean``, real ``var = E|x - mean|^2``), ``'mad'`` takes the
  modulus, and the measures that order values raise ``TypeError``.

  Example: swap ``nn.BatchNorm`` for ``GBatchNorm`` and pick a measure::

    >>> import jax, jax.numpy as jnp
    >>> from gbn_jax import GBatchNorm
    >>> norm = GBatchNorm(use_running_average=False, measure='sqd2')
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> variables = norm.init(jax.random.key(1), x)
    >>> y, updates = norm.apply(variables, x, mutable=['batch_stats'])
    >>> float((jax.nn.relu(y) == 0).mean())  # centering on the median
    0.5

  Generalized batch renormalization (Ioffe, 2017), with ``renorm=True``: in
  training the layer outputs ``((x - S_B) / D_B * r + d) * scale + bias``,
  where ``D = sqrt(D^2 + epsilon)`` for the batch (``_B``) and the running
  (``_run``) statistics alike, and ``r = D_B / D_run`` and ``d = (S_B -
  S_run) / D_run``, clipped, are constants for autodiff. Unclipped, the
  output is the inference output. The running statistics are updated and
  used at inference as without it. With ``rmax=1, dmax=0`` it is plain GBN::

    >>> renorm = GBatchNorm(use_running_average=False, measure='mad',
    ...                     renorm=True,
    ...                     renorm_clipping={'rmax': 3.0, 'dmax': 5.0})
    >>> variables = renorm.init(jax.random.key(1), x)
    >>> y, updates = renorm.apply(variables, x, mutable=['batch_stats'])
    >>> plain = GBatchNorm(use_running_average=False, measure='mad')
    >>> y_gbn, _ = plain.apply(variables, x, mutable=['batch_stats'])
    >>> one = renorm.clone(renorm_clipping={'rmax': 1, 'dmax': 0})
    >>> y_one, _ = one.apply(variables, x, mutable=['batch_stats'])
    >>> bool((y_one == y_gbn).all()), bool((y == y_gbn).all())
    (True, False)

  ``calibration='normal'`` makes ``D`` the standard deviation for Gaussian
  data, for every measure::

    >>> z = jax.random.normal(jax.random.key(2), (100_000, 3)) * 5
    >>> cal = GBatchNorm(use_running_average=False, measure='rsd',
    ...                  calibration='normal', momentum=0.0)
    >>> _, updates = cal.apply(variables, z, mutable=['batch_stats'])
    >>> [round(float(v), 1) for v in jnp.sqrt(updates['batch_stats']['var'])]
    [5.0, 5.0, 5.0]

  Attributes:
    measure: a name from :data:`gbn_jax.MEASURES` (``'sd'``, ``'mad'``,
      ``'rsd'``, ``'sqd'``, ``'sqd1'``..``'sqd3'``, ``'rbd'``, ``'wcd'``,
      ``'bpoe'``, or a registered one) or a callable
      ``measure(x, axis) -> (S, D)``. What a callable supports is declared,
      never guessed from its signature: register it with
      ``register_measure(name, fn, supports_mask=..., pools_devices=...)`` or
      wrap it as ``gbn_jax.Measure(name, fn, supports_mask=True)``. Without
      ``supports_mask`` a ``mask`` is refused with an error naming the
      measure; without ``pools_devices`` the batch is gathered across
      ``axis_name`` for it.
    alpha: the probability level of ``'sqd'`` (strictly between 0 and 1).
    calibration: ``None`` (the default: the raw ``D``) or ``'normal'``: ``D``
      divided by its value for a standard normal feature, so that ``D`` is
      ``sigma`` for Gaussian data and the layer has BatchNorm's gain at
      initialization whatever the measure (as scipy's
      ``median_abs_deviation(scale='normal')``). The constants: 1 (``sd``,
      which is then unchanged), ``sqrt(2/pi)`` (``mad``, ``bpoe``),
      ``1/sqrt(2 pi)`` (``rsd``), ``phi(Phi^-1(alpha)) / (1 - alpha)``
      (``sqd``), and for the ``n`` values per statistic (the reduced axes'
      sizes times the devices along ``axis_name``, or under ``mask`` each
      feature's count) ``2 E[max_n]`` (``rbd``) and ``E[max_n]`` (``wcd``).
      The running ``var`` holds the calibrated ``D^2``. A registered measure
      needs a ``normal_scale`` (see :func:`gbn_jax.register_measure`); a
      plain callable cannot be calibrated.
    use_fast_variance: for ``'sd'``, flax's one-pass variance.
    renorm: batch renormalization in training (see above); inference and the
      running statistics are unchanged.
    renorm_clipping: ``None`` (no clipping) or a dict with Keras' keys
      ``'rmax'`` (>= 1), ``'rmin'`` (in (0, 1], default ``1 / rmax``) and
      ``'dmax'`` (>= 0): ``r`` is clipped to ``[rmin, rmax]`` and ``d`` to
      ``[-dmax, dmax]``; a key left out leaves that side unclipped. Stored
      as a ``FrozenDict``.
    (other fields): as in ``flax.linen.BatchNorm``; ``momentum`` must be in
      [0, 1] (checked at construction).
  """

  measure: str | MeasureFn = "sd"
  alpha: float | None = None
  renorm: bool = False
  renorm_clipping: Mapping[str, float] | None = None
  calibration: str | None = None

  def __post_init__(self):
    # Fail at construction, not at the first call, for a bad measure, alpha,
    # calibration, clipping (kept hashable, like the module) or momentum.
    _layer.check_momentum(self.momentum)
    object.__setattr__(
        self,
        "renorm_clipping",
        _layer.validate(
            self.measure,
            self.alpha,
            self.use_fast_variance,
            self.calibration,
            self.renorm,
            self.renorm_clipping,
        ),
    )
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
        the masked-in elements only (all of ``x`` is normalized). A feature
        with no masked-in element keeps its running statistics (flax's
        BatchNorm makes them NaN for good); its output is NaN.

    Returns:
      The normalized input, of the shape of ``x``.

    Raises:
      ValueError: ``axis`` is not an axis of ``x``; ``mask`` does not
        broadcast to ``x``'s shape (the message names the shape it needs).
      TypeError: ``mask`` is not boolean.
    """
    _layer.check_mask(mask, x.shape)
    use_running_average = linen_module.merge_param(
        "use_running_average", self.use_running_average, use_running_average
    )
    initializing = self.is_initializing()
    reduction = _layer.reduction(
        self,
        x.ndim,
        # flax's BatchNorm initializes without the collective as well.
        axis_name=None if initializing else self.axis_name,
        force_float32_reductions=self.force_float32_reductions,
    )
    feature_shape = [x.shape[ax] for ax in reduction.feature_axes]
    stats_dtype = (
        jnp.float32 if self.force_float32_reductions else self.param_dtype
    )
    ra_mean = self.variable(
        "batch_stats",
        "mean",
        lambda s: jnp.zeros(s, stats_dtype),
        feature_shape,
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
      y, statistic, deviation_sq = _layer.normalize_training(
          self, x, scale, bias, ra_mean.value, ra_var.value, reduction, mask
      )
      if not initializing:
        found = _layer.has_elements(mask, x.shape, reduction)
        ra_mean.value = _layer.running_average(
            self.momentum, ra_mean.value, statistic, found
        )
        ra_var.value = _layer.running_average(
            self.momentum, ra_var.value, deviation_sq, found
        )
      return y

    statistic, deviation_sq = ra_mean.value, ra_var.value
    if not self.force_float32_reductions:
      statistic = jnp.asarray(statistic, self.param_dtype)
      deviation_sq = jnp.asarray(deviation_sq, self.param_dtype)
    return _normalization.normalize(
        x, statistic, deviation_sq, scale, bias, reduction
    )


class BatchNorm(GBatchNorm):
  """:class:`GBatchNorm` under flax's class name, for flax's auto-names.

  Linen names an unnamed submodule after its class, so ``GBatchNorm`` in a
  compact module is ``GBatchNorm_0`` where ``nn.BatchNorm`` was
  ``BatchNorm_0``, and a checkpoint saved with flax's layer does not load
  after the swap. Either name the layer (``GBatchNorm(...,
  name='BatchNorm_0')``) or use this class, which differs from
  :class:`GBatchNorm` only in its name: its auto-names, variables and
  summaries are ``nn.BatchNorm``'s.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import gbn_jax.linen
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return gbn_jax.linen.BatchNorm(use_running_average=True)(x)
    >>> list(Net().init(jax.random.key(0), jnp.ones((2, 3)))['params'])
    ['BatchNorm_0']
  """
