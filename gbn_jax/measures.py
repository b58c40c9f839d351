"""Generalized deviation measures: (statistic S, deviation D) pairs.

A *measure* maps a batch and the axes to reduce to ``(S, D)``, one value per
remaining (feature) position. Expectations are plain means over the reduced
elements (1/N, no Bessel correction). Everything here is pure JAX.

Built-in measures are functions with the signature::

  fn(x, axis, *, where=None, axis_name=None, axis_index_groups=None, **params)

``where`` restricts the statistics to masked-in elements; ``axis_name`` pools
the elements of every device along that named axis (exact global-batch
statistics under ``shard_map``/``pmap``). A user-defined measure only needs the
contract ``measure(x, axis) -> (S, D)``; it may accept those keywords too.

>>> import jax.numpy as jnp
>>> measure = get_measure('sqd2')
>>> s, d = measure(jnp.array([[0.], [1.], [2.], [7.]]), axis=0)
>>> s, d  # median 1; superquantile 4.5 (mean of the top half) minus mean 2.5
(Array([1.], dtype=float32), Array([2.], dtype=float32))
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gbn_jax import quantiles
from gbn_jax.quantiles import extreme, global_mean, prepare_reduction

Array = jax.Array
MeasureFn = Callable[..., tuple[Array, Array]]

__all__ = [
    "MEASURES",
    "Measure",
    "get_measure",
    "register_measure",
    "sd",
    "mad",
    "rsd",
    "sqd",
    "rbd",
    "wcd",
    "bpoe",
]

_REQUIRED = object()


def _keep_nan(mean: Array, dev: Array) -> Array:
  # One-sided deviations compare with the mean; NaN compares False, which
  # alone would report a clean 0 deviation for a NaN batch.
  return jnp.where(jnp.isnan(mean), jnp.nan, dev)


def _centered(x: Array, center: Array, axes: tuple[int, ...]) -> Array:
  return x - jnp.expand_dims(center, axes)


def sd(
    x, axis, *, where=None, axis_name=None, axis_index_groups=None,
    fast_variance: bool = True, squared: bool = False,
):
  """Mean and standard deviation ``sqrt(E[(x - E x)^2])`` (BatchNorm's pair).

  With ``fast_variance`` the variance is ``E[x^2] - E[x]^2`` clipped at zero,
  in one pass (flax's ``use_fast_variance``). ``squared=True`` returns the
  variance itself, which is what normalization layers use.
  """
  x, axes, where = prepare_reduction(x, axis, where)
  # Square before the first mean, as flax does: XLA:CPU fuses the backward
  # pass differently (and slower) when the mean comes first.
  x_sq = jnp.square(x) if fast_variance else None
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  if fast_variance:
    mean_sq = global_mean(x_sq, axes, where, axis_name, axis_index_groups)
    var = jnp.maximum(0.0, mean_sq - jnp.square(mean))
  else:
    var = global_mean(
        jnp.square(_centered(x, mean, axes)), axes, where, axis_name,
        axis_index_groups,
    )
  return mean, (var if squared else jnp.sqrt(var))


def mad(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mean and mean absolute deviation ``E|x - E x|``."""
  x, axes, where = prepare_reduction(x, axis, where)
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  dev = global_mean(
      jnp.abs(_centered(x, mean, axes)), axes, where, axis_name, axis_index_groups
  )
  return mean, dev


def rsd(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mean and upper semideviation ``E[(x - E x)^+]``."""
  x, axes, where = prepare_reduction(x, axis, where)
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  dev = global_mean(
      jnp.where(centered > 0, centered, 0), axes, where, axis_name,
      axis_index_groups,
  )
  return mean, _keep_nan(mean, dev)


def sqd(
    x, axis, *, alpha: float, where=None, axis_name=None, axis_index_groups=None
):
  """Quantile ``q_alpha`` and superquantile deviation ``qbar_alpha - E[x]``.

  Centering on ``q_alpha`` makes a following ReLU zero exactly a fraction
  ``alpha`` of the batch (ties aside).
  """
  alpha = quantiles.validate_alpha(alpha)
  x, axes, where = prepare_reduction(x, axis, where)
  q, qbar, mean = quantiles._superquantile_and_mean(  # pylint: disable=protected-access
      x, alpha, axes, where, axis_name, axis_index_groups
  )
  return q, qbar - mean


def rbd(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mid-range ``(max + min)/2`` and range ``max - min``."""
  x, axes, where = prepare_reduction(x, axis, where)
  kw = dict(where=where, axis_name=axis_name, axis_index_groups=axis_index_groups)
  hi = extreme(x, axes, largest=True, **kw)
  lo = extreme(x, axes, largest=False, **kw)
  return (hi + lo) / 2, hi - lo


def wcd(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Maximum and worst-case deviation ``max - E[x]``."""
  x, axes, where = prepare_reduction(x, axis, where)
  hi = extreme(
      x, axes, largest=True, where=where, axis_name=axis_name,
      axis_index_groups=axis_index_groups,
  )
  return hi, hi - global_mean(x, axes, where, axis_name, axis_index_groups)


def bpoe(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mean and ``E[x - E x | x > E x]`` (0 when no element exceeds the mean).

  This is SQD at the level where the quantile sits at the mean: GBN with it,
  followed by ReLU, is the paper's empirical bPOE transform.
  """
  x, axes, where = prepare_reduction(x, axis, where)
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  above = centered > 0
  if where is not None:
    above = above & where
  total = jnp.sum(jnp.where(above, centered, 0), axes)
  count = quantiles.count_true(above, axes)
  total, count = quantiles._global_sum(  # pylint: disable=protected-access
      (total, count), axis_name, axis_index_groups
  )
  dev = jnp.where(count > 0, total / jnp.maximum(count, 1), 0)
  return mean, _keep_nan(mean, dev)


# ----------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class _Entry:
  fn: MeasureFn
  params: Mapping[str, Any]  # name -> default, or _REQUIRED; fixed if bound
  fixed: frozenset[str] = frozenset()


_REGISTRY: dict[str, _Entry] = {}

#: The registered measure names (a live, read-only view of the registry).
MEASURES: Mapping[str, Any] = types.MappingProxyType(_REGISTRY)


def register_measure(
    name: str,
    fn: MeasureFn,
    *,
    overwrite: bool = False,
    **params: Any,
) -> None:
  """Registers ``fn`` under ``name`` so that modules accept ``measure=name``.

  Args:
    name: the new name.
    fn: ``fn(x, axis, **params) -> (S, D)``; it may also accept the keywords
      ``where``, ``axis_name`` and ``axis_index_groups``.
    overwrite: allow replacing an existing name.
    **params: parameters bound for this name (``get_measure`` rejects
      overrides of them).

  >>> import jax.numpy as jnp
  >>> register_measure('sqd_p90', sqd, alpha=0.9, overwrite=True)
  >>> get_measure('sqd_p90')
  Measure('sqd_p90', alpha=0.9)
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"measure names are non-empty strings, got {name!r}.")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"measure {name!r} is already registered.")
  if not callable(fn):
    raise TypeError(f"measure {name!r} must be callable, got {fn!r}.")
  _check_params(name, fn, params)
  _REGISTRY[name] = _Entry(fn, dict(params), frozenset(params))


def _keyword_params(fn: MeasureFn) -> dict[str, Any]:
  """Keyword-only parameters of ``fn`` other than the reduction keywords."""
  reserved = {"where", "axis_name", "axis_index_groups", "squared"}
  out = {}
  for p in inspect.signature(fn).parameters.values():
    if p.kind is p.KEYWORD_ONLY and p.name not in reserved:
      out[p.name] = _REQUIRED if p.default is p.empty else p.default
  return out


def _check_params(name: str, fn: MeasureFn, params: Mapping[str, Any]) -> None:
  accepted = _keyword_params(fn)
  unknown = set(params) - set(accepted)
  if unknown:
    raise TypeError(
        f"measure {name!r} got unexpected parameter(s) {sorted(unknown)}; it"
        f" accepts {sorted(accepted) or 'none'}."
    )
  if "alpha" in params:
    quantiles.validate_alpha(params["alpha"])


@dataclasses.dataclass(frozen=True)
class Measure:
  """A measure bound to its parameters: ``measure(x, axis) -> (S, D)``."""

  name: str
  fn: MeasureFn = dataclasses.field(repr=False, compare=True)
  params: tuple[tuple[str, Any], ...] = ()

  def __call__(self, x, axis, **reduction):
    return self.fn(x, axis, **reduction, **dict(self.params))

  def squared_deviation(self, x, axis, **reduction):
    """``(S, D^2)``; exact (no sqrt round trip) for ``sd``."""
    if "squared" in inspect.signature(self.fn).parameters:
      return self.fn(x, axis, squared=True, **reduction, **dict(self.params))
    s, d = self(x, axis, **reduction)
    return s, jnp.square(d)

  def __repr__(self):
    args = "".join(f", {k}={v!r}" for k, v in self.params)
    return f"Measure({self.name!r}{args})"


def get_measure(name: str, **params: Any) -> Measure:
  """Returns the registered measure ``name`` bound to ``params``.

  Args:
    name: one of :data:`MEASURES`.
    **params: the measure's parameters, e.g. ``alpha`` for ``'sqd'``.

  Raises:
    ValueError: unknown name (the message lists valid ones) or alpha outside
      (0, 1).
    TypeError: unexpected, missing or fixed parameters.

  >>> get_measure('sqd', alpha=0.9)
  Measure('sqd', alpha=0.9)
  """
  if name not in _REGISTRY:
    raise ValueError(
        f"unknown measure {name!r}; valid names: {', '.join(sorted(_REGISTRY))}."
    )
  entry = _REGISTRY[name]
  fixed = entry.fixed & set(params)
  if fixed:
    raise TypeError(
        f"measure {name!r} fixes {sorted(fixed)}; use the general measure to"
        " choose them (e.g. get_measure('sqd', alpha=...))."
    )
  _check_params(name, entry.fn, params)
  bound = {**entry.params, **params}
  accepted = _keyword_params(entry.fn)
  missing = [k for k, v in accepted.items() if v is _REQUIRED and k not in bound]
  if missing:
    raise TypeError(f"measure {name!r} needs parameter(s) {missing}.")
  return Measure(name, entry.fn, tuple(sorted(bound.items())))


def resolve_measure(measure: str | MeasureFn, **params: Any) -> MeasureFn:
  """A name (with ``params``) or a callable -> a callable measure.

  ``params`` whose value is ``None`` are ignored, so a module's unset fields do
  not reach measures that do not take them.
  """
  params = {k: v for k, v in params.items() if v is not None}
  if isinstance(measure, str):
    return get_measure(measure, **params)
  if not callable(measure):
    raise TypeError(
        f"measure must be a registered name or a callable, got {measure!r}."
    )
  if params:
    raise TypeError(
        f"parameters {sorted(params)} only apply to named measures; bind them"
        " into your callable instead."
    )
  return measure


register_measure("sd", sd)
register_measure("mad", mad)
register_measure("rsd", rsd)
register_measure("sqd", sqd)
register_measure("sqd1", sqd, alpha=0.25)
register_measure("sqd2", sqd, alpha=0.5)
register_measure("sqd3", sqd, alpha=0.75)
register_measure("rbd", rbd)
register_measure("wcd", wcd)
register_measure("bpoe", bpoe)
