"""The per-example layers for flax.nnx: ``GLayerNorm``, ``GGroupNorm`` and
``GInstanceNorm`` (public in :mod:`gbn_jax.nnx`), drop-ins for nnx's
``LayerNorm``, ``GroupNorm`` and ``InstanceNorm``; their computation is
:mod:`gbn_jax._layer`'s, shared with the linen layers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from gbn_jax import _layer
from gbn_jax.measures import MeasureFn

Array = jax.Array


_EXAMPLE_ARGS = """measure: a name from :data:`gbn_jax.MEASURES` or a callable
        ``measure(x, axis) -> (S, D)``, as :class:`gbn_jax.GBatchNorm`'s.
      alpha: the probability level of ``'sqd'`` (strictly between 0 and 1).
      calibration: ``None`` (the raw ``D``) or ``'normal'``: ``D`` divided
        by its value for a standard normal sample of as many values as each
        statistic sees.
      (other arguments): as in flax's layer, with its defaults."""


def _optional(promote_dtype, bias_metadata, scale_metadata) -> dict[str, Any]:
  # Left out when not given, so that nnx's own defaults apply.
  optional = dict(
      promote_dtype=promote_dtype,
      bias_metadata=bias_metadata or None,
      scale_metadata=scale_metadata or None,
  )
  return {k: v for k, v in optional.items() if v is not None}


class _ExampleNorm:
  """The call of the nnx per-example layers; each layer names its
  reduction (:meth:`_reduction`)."""

  def _reduction(self, shape):
    raise NotImplementedError

  def _set_measure(self, measure, alpha, calibration, use_fast_variance):
    _layer.check_measure(
        measure, alpha, use_fast_variance, calibration, type(self).__name__
    )
    self.measure = measure
    self.alpha = alpha
    self.calibration = calibration

  def __call__(self, x, *, mask: Array | None = None):
    """Normalizes ``x`` with each example's own ``(S, D)``.

    Args:
      x: the input.
      mask: boolean array broadcastable to ``x``: the elements the
        statistics see (all of ``x`` is normalized).

    Returns:
      The normalized input, of the shape of ``x``.

    Raises:
      ValueError: the layer's axes do not fit ``x`` (as flax's layer);
        ``mask`` does not broadcast to ``x``'s shape.
      TypeError: ``mask`` is not boolean.
    """
    _layer.check_mask(mask, x.shape)
    reduction = self._reduction(x.shape)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    return _layer.normalize_examples(self, x, scale, bias, reduction, mask)


class GLayerNorm(_ExampleNorm, nnx.LayerNorm):
  """Layer normalization with a generalized deviation measure, for nnx.

  Same constructor (with flax's defaults), parameters and call as
  ``nnx.LayerNorm``, plus ``measure``, ``alpha`` and ``calibration``: see
  :class:`gbn_jax.linen.GLayerNorm`, which computes the same. With
  ``measure='sd'`` it is LayerNorm.

    >>> import jax
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> norm = gbn_jax.nnx.GLayerNorm(768, measure='mad', rngs=nnx.Rngs(0))
    >>> y = norm(jax.random.normal(jax.random.key(0), (2, 768)))
    >>> [round(float(abs(y[i] - y[i].mean()).mean()), 4) for i in range(2)]
    [1.0, 1.0]
  """

  def __init__(
      self,
      num_features: int,
      *,
      measure: str | MeasureFn = "sd",
      alpha: float | None = None,
      calibration: str | None = None,
      epsilon: float = 1e-6,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: Callable[..., Array] = nnx.initializers.zeros_init(),
      scale_init: Callable[..., Array] = nnx.initializers.ones_init(),
      reduction_axes: Any = -1,
      feature_axes: Any = -1,
      axis_name: str | None = None,
      axis_index_groups: Any = None,
      use_fast_variance: bool = True,
      promote_dtype: Callable[..., Any] | None = None,
      rngs: nnx.Rngs,
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      scale_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    """Builds the layer; bad GBN arguments fail here.

    Args:
      num_features: the number of features (the size of ``scale`` and
        ``bias``).
      EXAMPLE_ARGS
    """
    self._set_measure(measure, alpha, calibration, use_fast_variance)
    super().__init__(
        num_features,
        epsilon=epsilon,
        dtype=dtype,
        param_dtype=param_dtype,
        use_bias=use_bias,
        use_scale=use_scale,
        bias_init=bias_init,
        scale_init=scale_init,
        reduction_axes=reduction_axes,
        feature_axes=feature_axes,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        use_fast_variance=use_fast_variance,
        rngs=rngs,
        **_optional(promote_dtype, bias_metadata, scale_metadata),
    )

  def _reduction(self, shape):
    return _layer.layer_norm_reduction(
        self, len(shape), self.reduction_axes, self.feature_axes
    )


class GGroupNorm(_ExampleNorm, nnx.GroupNorm):
  """Group normalization with a generalized deviation measure, for nnx.

  Same constructor (with flax's defaults), parameters and call as
  ``nnx.GroupNorm``, plus ``measure``, ``alpha`` and ``calibration``: see
  :class:`gbn_jax.linen.GGroupNorm`, which computes the same. With
  ``measure='sd'`` it is GroupNorm.

    >>> import jax
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> norm = gbn_jax.nnx.GGroupNorm(32, num_groups=4, measure='sqd2',
    ...                               rngs=nnx.Rngs(0))
    >>> y = norm(jax.random.normal(jax.random.key(0), (2, 16, 16, 32)))
    >>> float((y.reshape(2, 256, 4, 8) > 0).mean((1, 3)).max())  # medians
    0.5
  """

  def __init__(
      self,
      num_features: int,
      num_groups: int | None = 32,
      group_size: int | None = None,
      *,
      measure: str | MeasureFn = "sd",
      alpha: float | None = None,
      calibration: str | None = None,
      epsilon: float = 1e-6,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: Callable[..., Array] = nnx.initializers.zeros_init(),
      scale_init: Callable[..., Array] = nnx.initializers.ones_init(),
      reduction_axes: Any = None,
      axis_name: str | None = None,
      axis_index_groups: Any = None,
      use_fast_variance: bool = True,
      promote_dtype: Callable[..., Any] | None = None,
      rngs: nnx.Rngs,
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      scale_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    """Builds the layer; bad GBN arguments fail here, bad groups as flax's.

    Args:
      num_features: the number of channels (the last axis).
      num_groups: the number of channel groups (``None`` with
        ``group_size``).
      group_size: the number of channels in a group.
      EXAMPLE_ARGS
    """
    self._set_measure(measure, alpha, calibration, use_fast_variance)
    super().__init__(
        num_features,
        num_groups,
        group_size,
        epsilon=epsilon,
        dtype=dtype,
        param_dtype=param_dtype,
        use_bias=use_bias,
        use_scale=use_scale,
        bias_init=bias_init,
        scale_init=scale_init,
        reduction_axes=reduction_axes,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        use_fast_variance=use_fast_variance,
        rngs=rngs,
        **_optional(promote_dtype, bias_metadata, scale_metadata),
    )

  def _reduction(self, shape):
    # The groups were fixed at construction (flax's num_groups and
    # group_size attributes both hold them then): the size decides.
    return _layer.group_norm_reduction(
        self, shape, self.reduction_axes, None, self.group_size
    )


class GInstanceNorm(_ExampleNorm, nnx.InstanceNorm):
  """Instance normalization with a generalized deviation measure, for nnx.

  Same constructor (with flax's defaults), parameters and call as
  ``nnx.InstanceNorm``, plus ``measure``, ``alpha`` and ``calibration``:
  see :class:`gbn_jax.linen.GInstanceNorm`, which computes the same. With
  ``measure='sd'`` it is InstanceNorm.

    >>> import jax
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> norm = gbn_jax.nnx.GInstanceNorm(3, measure='rsd', rngs=nnx.Rngs(0))
    >>> y = norm(jax.random.normal(jax.random.key(0), (2, 8, 8, 3)))
    >>> round(float(jax.nn.relu(y).mean((1, 2)).max()), 4)  # E[(y - E y)+]
    1.0
  """

  def __init__(
      self,
      num_features: int,
      *,
      measure: str | MeasureFn = "sd",
      alpha: float | None = None,
      calibration: str | None = None,
      epsilon: float = 1e-6,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: Callable[..., Array] = nnx.initializers.zeros,
      scale_init: Callable[..., Array] = nnx.initializers.ones,
      feature_axes: Any = -1,
      axis_name: str | None = None,
      axis_index_groups: Any = None,
      use_fast_variance: bool = True,
      promote_dtype: Callable[..., Any] | None = None,
      rngs: nnx.Rngs,
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      scale_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    """Builds the layer; bad GBN arguments fail here.

    Args:
      num_features: the number of features (the size of ``scale`` and
        ``bias``).
      EXAMPLE_ARGS
    """
    self._set_measure(measure, alpha, calibration, use_fast_variance)
    super().__init__(
        num_features,
        epsilon=epsilon,
        dtype=dtype,
        param_dtype=param_dtype,
        use_bias=use_bias,
        use_scale=use_scale,
        bias_init=bias_init,
        scale_init=scale_init,
        feature_axes=feature_axes,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        use_fast_variance=use_fast_variance,
        rngs=rngs,
        **_optional(promote_dtype, bias_metadata, scale_metadata),
    )

  def _reduction(self, shape):
    return _layer.instance_norm_reduction(self, len(shape), self.feature_axes)


for _cls in (GLayerNorm, GGroupNorm, GInstanceNorm):
  _cls.__init__.__doc__ = _cls.__init__.__doc__.replace(
      "EXAMPLE_ARGS", _EXAMPLE_ARGS
  )
del _cls
