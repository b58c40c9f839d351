"""The per-example layers for flax.linen: ``GLayerNorm``, ``GGroupNorm`` and
``GInstanceNorm`` (public in :mod:`gbn_jax.linen`), drop-ins for linen's
``LayerNorm``, ``GroupNorm`` and ``InstanceNorm``; their computation is
:mod:`gbn_jax._layer`'s, shared with the nnx layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gbn_jax import _layer
from gbn_jax import _normalization
from gbn_jax.measures import MeasureFn

Array = jax.Array


def _scale_and_bias(
    module: nn.Module, x: Array, reduction: _normalization.Reduction
) -> tuple[Array | None, Array | None]:
  """A per-example layer's ``scale`` and ``bias`` params (flax's names,
  shapes, initializers and dtypes), on ``reduction.param_axes``."""
  shape = tuple(x.shape[ax] for ax in reduction.param_axes)
  params = {}
  for name, used, init in (
      ("scale", module.use_scale, module.scale_init),
      ("bias", module.use_bias, module.bias_init),
  ):
    if not used:
      params[name] = None
      continue
    value = module.param(name, init, shape, module.param_dtype)
    if not module.force_float32_reductions:
      value = jnp.asarray(value, module.param_dtype)
    params[name] = value
  return params["scale"], params["bias"]


_EXAMPLE_FIELDS = """measure: a name from :data:`gbn_jax.MEASURES` or a callable
      ``measure(x, axis) -> (S, D)``, as :class:`gbn_jax.GBatchNorm`'s
      (a ``mask`` needs a measure that supports one).
    alpha: the probability level of ``'sqd'`` (strictly between 0 and 1).
    calibration: ``None`` (the raw ``D``) or ``'normal'``: ``D`` divided by
      its value for a standard normal sample of ``n`` values, ``n`` the
      number of elements each statistic sees (under a ``mask``, its
      count), as :class:`gbn_jax.GBatchNorm`'s.
    use_fast_variance: for ``'sd'``, flax's one-pass variance.
    (other fields): as in flax's layer."""


class GLayerNorm(nn.LayerNorm):
  """Layer normalization with a generalized deviation measure.

  ``y = (x - S) / sqrt(D^2 + epsilon) * scale + bias`` with ``(S, D)`` of
  each example over ``reduction_axes`` (default: the last axis), and
  ``scale``/``bias`` on ``feature_axes``. Every field, default and argument
  of ``flax.linen.LayerNorm`` is kept with the same meaning, and
  ``measure='sd'`` (the default) *is* LayerNorm. Nothing is kept between
  calls: there are no running statistics.

    >>> import jax, jax.numpy as jnp
    >>> from gbn_jax.linen import GLayerNorm
    >>> x = jax.random.normal(jax.random.key(0), (2, 768))
    >>> norm = GLayerNorm(measure='sqd2')  # centred on each token's median
    >>> variables = norm.init(jax.random.key(1), x)
    >>> y = norm.apply(variables, x)
    >>> [int((y[i] > 0).sum()) for i in range(2)]
    [384, 384]

  Attributes:
    EXAMPLE_FIELDS
  """

  measure: str | MeasureFn = "sd"
  alpha: float | None = None
  calibration: str | None = None

  def __post_init__(self):
    _layer.check_measure(
        self.measure,
        self.alpha,
        self.use_fast_variance,
        self.calibration,
        type(self).__name__,
    )
    super().__post_init__()

  @nn.compact
  def __call__(self, x, *, mask: Array | None = None):
    """Normalizes each example of ``x`` with its own ``(S, D)``.

    Args:
      x: the input.
      mask: boolean array broadcastable to ``x``: the elements the
        statistics see (all of ``x`` is normalized).

    Returns:
      The normalized input, of the shape of ``x``.

    Raises:
      ValueError: an axis is not an axis of ``x``; ``mask`` does not
        broadcast to ``x``'s shape.
      TypeError: ``mask`` is not boolean.
    """
    _layer.check_mask(mask, x.shape)
    reduction = _layer.layer_norm_reduction(
        self,
        x.ndim,
        self.reduction_axes,
        self.feature_axes,
        force_float32_reductions=self.force_float32_reductions,
    )
    scale, bias = _scale_and_bias(self, x, reduction)
    return _layer.normalize_examples(self, x, scale, bias, reduction, mask)


class GGroupNorm(nn.GroupNorm):
  """Group normalization with a generalized deviation measure.

  The channels (the last axis) in groups of ``group_size`` consecutive
  channels (or ``num_groups`` groups); ``(S, D)`` of each example's group
  over its channels and the other ``reduction_axes`` (default: all but the
  leading, batch, axis), shared by the group's channels; ``scale`` and
  ``bias`` per channel. Every field, default and argument of
  ``flax.linen.GroupNorm`` is kept with the same meaning, and
  ``measure='sd'`` (the default) *is* GroupNorm.

    >>> import jax, jax.numpy as jnp
    >>> from gbn_jax.linen import GGroupNorm
    >>> x = jax.random.normal(jax.random.key(0), (2, 16, 16, 32))
    >>> norm = GGroupNorm(num_groups=4, measure='rbd')
    >>> y = norm.apply(norm.init(jax.random.key(1), x), x)
    >>> groups = y.reshape(2, 256, 4, 8)  # each group's range is 1
    >>> bool(jnp.allclose(groups.max((1, 3)) - groups.min((1, 3)), 1, 1e-4))
    True

  Attributes:
    EXAMPLE_FIELDS
  """

  measure: str | MeasureFn = "sd"
  alpha: float | None = None
  calibration: str | None = None

  def __post_init__(self):
    _layer.check_measure(
        self.measure,
        self.alpha,
        self.use_fast_variance,
        self.calibration,
        type(self).__name__,
    )
    super().__post_init__()

  @nn.compact
  def __call__(self, x, *, mask: Array | None = None):
    """Normalizes each example's channel groups with their own ``(S, D)``.

    Args:
      x: the input, channels last.
      mask: boolean array broadcastable to ``x``: the elements the
        statistics see (all of ``x`` is normalized).

    Returns:
      The normalized input, of the shape of ``x``.

    Raises:
      ValueError: ``reduction_axes`` leave out the last axis or are not
        axes of ``x``; not exactly one of ``num_groups`` and
        ``group_size``; they do not divide the channels; ``mask`` does not
        broadcast to ``x``'s shape.
      TypeError: ``mask`` is not boolean.
    """
    _layer.check_mask(mask, x.shape)
    reduction = _layer.group_norm_reduction(
        self,
        x.shape,
        self.reduction_axes,
        self.num_groups,
        self.group_size,
        force_float32_reductions=self.force_float32_reductions,
    )
    scale, bias = _scale_and_bias(self, x, reduction)
    return _layer.normalize_examples(self, x, scale, bias, reduction, mask)


class GInstanceNorm(nn.InstanceNorm):
  """Instance normalization with a generalized deviation measure.

  ``(S, D)`` of each example (the leading axis) and feature (on
  ``feature_axes``, default the last axis) over every other axis;
  ``scale`` and ``bias`` per feature. Every field, default and argument of
  ``flax.linen.InstanceNorm`` is kept with the same meaning, and
  ``measure='sd'`` (the default) *is* InstanceNorm.

    >>> import jax, jax.numpy as jnp
    >>> from gbn_jax.linen import GInstanceNorm
    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    >>> norm = GInstanceNorm(measure='wcd')  # each map's maximum goes to 0
    >>> y = norm.apply(norm.init(jax.random.key(1), x), x)
    >>> bool((y.max((1, 2)) == 0).all())
    True

  Attributes:
    EXAMPLE_FIELDS
  """

  measure: str | MeasureFn = "sd"
  alpha: float | None = None
  calibration: str | None = None

  def __post_init__(self):
    _layer.check_measure(
        self.measure,
        self.alpha,
        self.use_fast_variance,
        self.calibration,
        type(self).__name__,
    )
    super().__post_init__()

  @nn.compact
  def __call__(self, x, *, mask: Array | None = None):
    """Normalizes each example's features with their own ``(S, D)``.

    Args:
      x: the input, examples on the leading axis.
      mask: boolean array broadcastable to ``x``: the elements the
        statistics see (all of ``x`` is normalized).

    Returns:
      The normalized input, of the shape of ``x``.

    Raises:
      ValueError: ``feature_axes`` include the leading axis or are not axes
        of ``x``; ``mask`` does not broadcast to ``x``'s shape.
      TypeError: ``mask`` is not boolean.
    """
    _layer.check_mask(mask, x.shape)
    reduction = _layer.instance_norm_reduction(
        self,
        x.ndim,
        self.feature_axes,
        force_float32_reductions=self.force_float32_reductions,
    )
    scale, bias = _scale_and_bias(self, x, reduction)
    return _layer.normalize_examples(self, x, scale, bias, reduction, mask)


for _cls in (GLayerNorm, GGroupNorm, GInstanceNorm):
  _cls.__doc__ = _cls.__doc__.replace("EXAMPLE_FIELDS", _EXAMPLE_FIELDS)
del _cls
