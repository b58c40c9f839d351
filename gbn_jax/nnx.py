"""GBN for flax.nnx: ``GBatchNorm``, a drop-in for ``flax.nnx.BatchNorm``,
and the per-example layers :class:`GLayerNorm`, :class:`GGroupNorm` and
:class:`GInstanceNorm`, drop-ins for nnx's ``LayerNorm``, ``GroupNorm`` and
``InstanceNorm``.

Also :func:`convert_batchnorm`, which replaces a model's ``nnx.BatchNorm``
layers by GBN keeping their Variables, and :func:`precise_batch_stats`, the
precise running statistics of :func:`gbn_jax.precise_batch_stats` for an nnx
model, updated in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
import dataclasses
from types import MappingProxyType
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from gbn_jax import _layer
from gbn_jax import _normalization
from gbn_jax import _precise
from gbn_jax._convert import convert_batchnorm
from gbn_jax._nnx_example_norms import GGroupNorm
from gbn_jax._nnx_example_norms import GInstanceNorm
from gbn_jax._nnx_example_norms import GLayerNorm
from gbn_jax.measures import MeasureFn

Array = jax.Array

__all__ = [
    "GBatchNorm",
    "GGroupNorm",
    "GInstanceNorm",
    "GLayerNorm",
    "convert_batchnorm",
    "precise_batch_stats",
]


class GBatchNorm(nnx.BatchNorm):
  """Generalized Batch Normalization for nnx (Yuan et al., AAAI 2019).

  Same constructor, variables (``mean``/``var`` as ``nnx.BatchStat``, ``scale``
  and ``bias`` as ``nnx.Param``), ``train()``/``eval()`` behaviour and call as
  ``nnx.BatchNorm``, plus ``measure``, ``alpha``, ``calibration``, ``renorm``
  and ``renorm_clipping`` (see :class:`gbn_jax.GBatchNorm`, the linen layer,
  which computes the same). ``mean`` holds the running statistic ``S`` and
  ``var`` the running ``D^2``; with ``measure='sd'`` it is BatchNorm. Beyond
  flax's checks: ``momentum`` outside [0, 1] fails here; an ``axis`` the
  input lacks, an input without ``num_features`` features and a non-boolean
  ``mask`` fail at the call. Under a ``mask``, a feature with no masked-in
  element keeps its running statistics, which flax's BatchNorm would make
  NaN for good.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> norm = gbn_jax.nnx.GBatchNorm(3, measure='sqd1', rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> float((jax.nn.relu(norm(x)) == 0).mean())  # a quarter at or below q_.25
    0.25

  ``renorm=True`` turns on generalized batch renormalization in training:

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
      calibration: str | None = None,
      renorm: bool = False,
      renorm_clipping: Mapping[str, float] | None = None,
      use_running_average: bool | None = False,
      axis: int = -1,
      momentum: float = 0.99,
      epsilon: float = 1e-5,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: Callable[..., Array] = nnx.initializers.zeros_init(),
      scale_init: Callable[..., Array] = nnx.initializers.ones_init(),
      axis_name: str | None = None,
      axis_index_groups: Any = None,
      use_fast_variance: bool = True,
      promote_dtype: Callable[..., Any] | None = None,
      rngs: nnx.Rngs,
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      scale_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    """Builds the layer; bad GBN arguments fail here, before any allocation.

    Args:
      num_features: the number of input features.
      measure: a name from :data:`gbn_jax.MEASURES` or a callable
        ``measure(x, axis) -> (S, D)``, as :class:`gbn_jax.GBatchNorm`'s.
      alpha: the probability level of ``'sqd'`` (strictly between 0 and 1).
      calibration: ``None`` (the raw ``D``) or ``'normal'`` (``D`` is
        ``sigma`` for Gaussian data), as :class:`gbn_jax.GBatchNorm`'s.
      renorm: batch renormalization in training; inference and the running
        statistics are unchanged.
      renorm_clipping: ``None`` or a dict with keys ``'rmax'``, ``'rmin'``,
        ``'dmax'``, as :class:`gbn_jax.GBatchNorm`'s; stored as a
        ``FrozenDict``.
      use_running_average: if true, normalize with the running ``S`` and
        ``D^2`` instead of the batch's (``train()``/``eval()`` set it).
      axis: the feature axis of the input.
      momentum: the decay rate of the running statistics' moving average.
      epsilon: added to ``D^2`` before the square root.
      dtype: the dtype of the result (default: inferred from the input and
        the parameters).
      param_dtype: the dtype of ``scale`` and ``bias``.
      use_bias: whether to add a learned ``bias``.
      use_scale: whether to multiply by a learned ``scale``.
      bias_init: the initializer of ``bias`` (zeros).
      scale_init: the initializer of ``scale`` (ones).
      axis_name: the named axis (``pmap``, ``shard_map``) whose devices pool
        their batches into one for the statistics.
      axis_index_groups: groups of indices along ``axis_name`` that pool
        separately, e.g. ``[[0, 1], [2, 3]]``.
      use_fast_variance: for ``'sd'``, flax's one-pass variance.
      promote_dtype: promotes ``(x, mean, var, scale, bias)`` to a common
        dtype, called with a ``dtype`` keyword; ``None`` is nnx's default.
      rngs: the random number generators that initialize the parameters.
      bias_metadata: metadata of the ``bias`` ``nnx.Param``.
      scale_metadata: metadata of the ``scale`` ``nnx.Param``.
    """
    renorm_clipping = _layer.validate(
        measure, alpha, use_fast_variance, calibration, renorm, renorm_clipping
    )
    _layer.check_momentum(momentum)
    # Left out when not given, so that nnx's own defaults apply.
    optional = dict(
        promote_dtype=promote_dtype,
        bias_metadata=bias_metadata or None,
        scale_metadata=scale_metadata or None,
    )
    super().__init__(
        num_features,
        use_running_average=use_running_average,
        axis=axis,
        momentum=momentum,
        epsilon=epsilon,
        dtype=dtype,
        param_dtype=param_dtype,
        use_bias=use_bias,
        use_scale=use_scale,
        bias_init=bias_init,
        scale_init=scale_init,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        use_fast_variance=use_fast_variance,
        rngs=rngs,
        **{k: v for k, v in optional.items() if v is not None},
    )
    self.measure = measure
    self.alpha = alpha
    self.calibration = calibration
    self.renorm = renorm
    self.renorm_clipping = renorm_clipping

  # Alike gbn_jax/linen.py::GBatchNorm.__call__: each API's layer, in full.
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
      use_running_average: if true, use the running ``S`` and ``D^2``
        instead of the batch's; takes precedence over the attribute.
      mask: boolean array broadcastable to ``x``; statistics are computed over
        the masked-in elements only (all of ``x`` is normalized). A feature
        with no masked-in element keeps its running statistics (flax's
        BatchNorm makes them NaN for good); its output is NaN.

    Returns:
      The normalized input, of the shape of ``x``.

    Raises:
      ValueError: ``use_running_average`` is ``None`` here and on the layer;
        ``axis`` is not an axis of ``x``; ``x`` has not ``num_features``
        features; ``mask`` does not broadcast to ``x``'s shape (the message
        names the shape it needs).
      TypeError: ``mask`` is not boolean.
    """
    _layer.check_mask(mask, x.shape)
    if use_running_average is None:
      use_running_average = self.use_running_average
    if use_running_average is None:
      raise ValueError(
          "No `use_running_average` argument was provided to GBatchNorm:"
          " pass it to the constructor or the call, or use .train()/.eval()."
      )
    reduction = _layer.reduction(self, x.ndim, axis_name=self.axis_name)
    _layer.check_num_features(self.num_features, x, reduction.feature_axes)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, statistic, deviation_sq, scale, bias = self.promote_dtype(
        (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
    )
    if not use_running_average:
      y, statistic, deviation_sq = _layer.normalize_training(
          self, x, scale, bias, statistic, deviation_sq, reduction, mask
      )
      found = _layer.has_elements(mask, x.shape, reduction)
      for variable, batch in ((self.mean, statistic), (self.var, deviation_sq)):
        _update(
            variable,
            jax.lax.stop_gradient(
                _layer.running_average(
                    self.momentum, variable[...], batch, found
                )
            ),
        )
      return y
    return _normalization.normalize(
        x, statistic, deviation_sq, scale, bias, reduction
    )


def _update(variable: nnx.Variable, value: Array) -> None:
  """``variable[...] = value``, except that a complex running mean (of
  complex input) replaces the real zeros it starts from: assigning into them
  would drop its imaginary part. linen's BatchNorm keeps it complex too."""
  if jnp.iscomplexobj(value) and not jnp.iscomplexobj(variable[...]):
    variable.set_value(value)
  else:
    variable[...] = value


def _norm_layers(model: nnx.Module) -> list[tuple[str, nnx.BatchNorm]]:
  """Every ``nnx.BatchNorm`` (GBN included) in ``model``, by path, once."""
  return [
      ("/".join(map(str, path)) or "<model>", node)
      for path, node in nnx.iter_graph(model)
      if isinstance(node, nnx.BatchNorm)
  ]


def precise_batch_stats(
    model: nnx.Module,
    batches: Iterable[Any] | Any,
    *,
    forward: Callable[[nnx.Module, Any], Any] | None = None,
    stacked: bool = False,
) -> None:
  """Sets every norm layer's running statistics to their precise values.

  :func:`gbn_jax.precise_batch_stats` for nnx: the running ``mean`` and
  ``var`` of every ``nnx.BatchNorm`` in ``model`` (:class:`GBatchNorm` of
  any measure included) become the equal-weight average over ``batches`` of
  that layer's batch ``S`` and ``D^2``, with the parameters frozen
  (PreciseBN, Wu & Johnson 2021). The model is updated in place; nothing
  else in it changes.

  The calls run on a copy of the model whose norm layers normalize with
  their batch's statistics (``use_running_average=False``) whatever the
  model's mode, so a model in ``eval()`` mode needs no ``train()``; the
  rest of the model (dropout, say) runs in the mode it is in. How each
  layer's batch statistic is read off its update, and what that needs of
  the model, is as in :func:`gbn_jax.precise_batch_stats`.

  Args:
    model: the model; its norm layers' ``mean``/``var`` are replaced.
    batches: an iterable of batches, each passed to ``forward`` as is; or,
      with ``stacked=True`` (implied for a single array), one pytree whose
      leaves stack the batches along their first axis, scanned with
      ``jax.lax.scan``.
    forward: ``forward(model, batch)``, one call of the model (its outputs
      are compared between two probe calls); ``None`` calls
      ``model(batch)``. It must not pass ``use_running_average=True``.
    stacked: see ``batches``.

  Raises:
    ValueError: no norm layers; no batches; a layer that the call did not
      update (its momentum is 1, or ``forward`` passed
      ``use_running_average=True``: its ``mean``/``var`` Variables still
      hold the arrays they were given), or an output that reads the running
      statistics (``renorm=True``); under ``nnx.jit`` too, decided while
      tracing from each layer's ``momentum`` and ``renorm`` attributes.

  Example: the statistics of two batches, with the layer in eval mode::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import gbn_jax.nnx
    >>> norm = gbn_jax.nnx.GBatchNorm(1, measure='mad', momentum=0.99,
    ...                               rngs=nnx.Rngs(0))
    >>> norm.eval()
    >>> batches = [jnp.arange(4.).reshape(4, 1) + shift for shift in (0, 10)]
    >>> gbn_jax.nnx.precise_batch_stats(norm, batches)
    >>> norm.mean[...], norm.var[...]  # means 1.5 and 11.5; MAD 1 both times
    (Array([6.5], dtype=float32), Array([1.], dtype=float32))
    >>> norm.use_running_average
    True
  """
  layers = _norm_layers(model)
  if not layers:
    raise ValueError(
        f"the model holds no nnx.BatchNorm layers (GBatchNorm included):"
        f" no running statistics to recompute in {type(model).__name__}."
    )
  if forward is None:
    forward = lambda m, batch: m(batch)
  graphdef, state = nnx.split(model)

  def run(stats, batch):
    # Fresh Variables, made in this trace (lax.scan's body included).
    copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    copy_layers = [layer for _, layer in _norm_layers(copy)]
    given = []
    for i, layer in enumerate(copy_layers):
      layer.use_running_average = False
      layer.mean[...], layer.var[...] = stats[2 * i], stats[2 * i + 1]
      given.append([v.get_value() for v in _pair(layer)])
    outputs = forward(copy, batch)
    calls = []
    for layer, values in zip(copy_layers, given):
      call = _precise.LayerCall.of(layer, False)
      # A layer that the forward call ran with use_running_average=True
      # leaves its Variables holding the very arrays given to them.
      for variable, value in zip(_pair(layer), values):
        kept = variable.get_value() is value
        calls.append(
            dataclasses.replace(call, updates=call.updates and not kept)
        )
    return (
        outputs,
        [v[...] for layer in copy_layers for v in _pair(layer)],
        calls,
    )

  old = [v[...] for _, layer in layers for v in _pair(layer)]
  names = [f"{path}/{n}" for path, _ in layers for n in ("mean", "var")]
  means = _precise.average_batch_statistics(
      run, old, batches, stacked=stacked, names=names
  )
  for i, (_, layer) in enumerate(layers):
    layer.mean[...], layer.var[...] = means[2 * i], means[2 * i + 1]


def _pair(layer: nnx.BatchNorm) -> tuple[nnx.Variable, nnx.Variable]:
  return layer.mean, layer.var
