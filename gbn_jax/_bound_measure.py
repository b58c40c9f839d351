"""A measure function bound to its parameters, capabilities and calibration.

:class:`Measure` is the callable the layers use: it checks a call against
what its function declares (a mask needs ``supports_mask``; without
``pools_devices`` the batch is gathered across ``axis_name`` for it),
validates the ``(S, D)`` it returns, and divides ``D`` by the normal
constant under ``calibration='normal'``. :func:`gbn_jax.get_measure` builds
one from a registered name (:mod:`gbn_jax.measures`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import inspect
import numbers
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax import calibration as calibration_lib
from gbn_jax import deviations
from gbn_jax._selection import reductions
from gbn_jax._selection.common import AxisIndexGroups
from gbn_jax._selection.common import reduction_axes
from gbn_jax._selection.reductions import Axis
from gbn_jax.calibration import NormalScale
from gbn_jax.deviations import bpoe
from gbn_jax.deviations import rbd
from gbn_jax.deviations import rsd
from gbn_jax.deviations import sd
from gbn_jax.deviations import sqd
from gbn_jax.deviations import wcd

Array = jax.Array
#: A measure function: ``fn(x, axis, **keywords) -> (S, D)``.
MeasureFn = Callable[..., tuple[Array, Array]]

__all__ = [
    "Measure",
    "MeasureFn",
]

#: What a measure function is, for error messages.
MEASURE_CONTRACT = (
    "a custom measure is called as measure(x, axis) -> (S, D): x the"
    " activations, axis a tuple of the reduced axes, S and D arrays of the"
    " per-feature statistic and deviation; it takes where= if registered"
    " with supports_mask=True, and axis_name= and axis_index_groups= if"
    " registered with pools_devices=True"
)

# The built-ins that order values: complex input is an error for them.
_ORDERING = (rsd, sqd, rbd, wcd, bpoe)


#: The default of a parameter a measure function requires
#: (:func:`keyword_params`).
REQUIRED = object()
# Keywords that are not a measure's parameters: the reduction's, and sd's.
_RESERVED = frozenset({"where", "axis_name", "axis_index_groups", "squared"})


def keyword_params(fn: MeasureFn) -> dict[str, Any]:
  """Keyword-only parameters of ``fn`` other than the reduction keywords,
  each to its default (:data:`REQUIRED` for none)."""
  out = {}
  for p in inspect.signature(fn).parameters.values():
    if p.kind is p.KEYWORD_ONLY and p.name not in _RESERVED:
      out[p.name] = REQUIRED if p.default is p.empty else p.default
  return out


def check_declared(name: str, what: str, value: Any) -> bool:
  """Returns ``value``, a declared capability, or raises ``TypeError``."""
  if not isinstance(value, bool):
    raise TypeError(
        f"{what} of measure {name!r} must be True or False, got {value!r}."
    )
  return value


def _no_mask_message(name: str, refusal: str | None) -> str:
  if refusal is not None:
    return f"measure {name!r} does not accept a mask: {refusal}."
  return (
      f"measure {name!r} does not accept `where` (it is not declared with"
      " supports_mask=True), so it cannot honour a mask. If it takes a"
      " where=None keyword and honours it, register it with"
      f" gbn_jax.register_measure({name!r}, fn, supports_mask=True) (or"
      " build gbn_jax.Measure(name, fn, supports_mask=True)); else call it"
      " without a mask."
  )


@dataclasses.dataclass(frozen=True)
class Measure:
  """A measure bound to its parameters: ``measure(x, axis) -> (S, D)``.

  :func:`get_measure` builds one from a registered name; a callable passed
  to a layer as ``measure=fn`` becomes ``Measure(name, fn)``, which declares
  no capability. Build one yourself to use an unregistered function with
  its capabilities, e.g. ``Measure('mine', fn, supports_mask=True)``.

  A call with ``where`` needs ``supports_mask`` (else a ``TypeError`` naming
  the measure). A call with ``axis_name`` passes it on if
  ``pools_devices``; otherwise the batch (and the mask) is gathered across
  the named axis along the first reduced axis and ``fn`` sees the global
  batch.

  With ``calibration='normal'`` the ``D`` it returns is divided by
  :meth:`normal_constant` of the number ``n`` of values per statistic: the
  product of the reduced axes' sizes times the devices pooled along
  ``axis_name`` (static), or under ``where`` the per-feature count of
  masked-in elements (traced). A constant of exactly 1 (``sd``) divides
  nothing, so the result is bit for bit the raw one.

  Attributes:
    name: The name, for messages (the registered one from
      :func:`get_measure`).
    fn: The measure function.
    params: Keyword parameters passed to ``fn``, sorted ``(name, value)``
      pairs.
    calibration: None or ``'normal'``.
    normal_scale: ``D`` of a standard normal feature, as in
      :func:`register_measure`, or None.
    supports_mask: Whether ``fn`` takes and honours ``where=``.
    pools_devices: Whether ``fn`` takes ``axis_name=`` and
      ``axis_index_groups=`` and pools devices itself.
    mask_refusal: Without ``supports_mask``, why: the reason the error for
      a mask gives instead of the generic advice to declare the capability
      (for a measure that cannot honour one, e.g. "its constant needs the
      static number of values").
  """

  name: str
  fn: MeasureFn = dataclasses.field(repr=False, compare=True)
  params: tuple[tuple[str, Any], ...] = ()
  calibration: str | None = None
  normal_scale: NormalScale | None = dataclasses.field(
      default=None, repr=False, compare=True
  )
  supports_mask: bool = dataclasses.field(default=False, kw_only=True)
  pools_devices: bool = dataclasses.field(default=False, kw_only=True)
  mask_refusal: str | None = dataclasses.field(
      default=None, kw_only=True, compare=False
  )

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"a measure's name is a string, got {self.name!r}.")
    if not callable(self.fn):
      raise TypeError(f"measure {self.name!r} must be callable: {self.fn!r}.")
    check_declared(self.name, "supports_mask", self.supports_mask)
    check_declared(self.name, "pools_devices", self.pools_devices)
    if self.mask_refusal is not None and (
        self.supports_mask or not isinstance(self.mask_refusal, str)
    ):
      raise ValueError(
          f"mask_refusal of measure {self.name!r} is the reason it takes no"
          " mask: a string, and only with supports_mask=False; got"
          f" {self.mask_refusal!r} with supports_mask={self.supports_mask}."
      )
    calibration_lib.check_calibration(self.calibration)
    if self.calibration is not None and self.normal_scale is None:
      raise ValueError(no_constant_message(self.name))

  def _check_complex(self, x: Any) -> None:
    # Named here by the registered name (e.g. 'sqd2'), not the function's.
    if not jnp.iscomplexobj(x):
      return
    if self.fn in _ORDERING:
      deviations.check_real(x, self.name)
    if self.calibration is not None and self.normal_scale != 1:
      raise ValueError(
          f"calibration={self.calibration!r} of measure {self.name!r} is"
          " defined for real features (D of a real standard normal), not for"
          f" complex input ({jnp.result_type(x)}); use calibration=None."
      )

  def _reduction(
      self,
      x: Any,
      axis: Axis,
      where: Array | None,
      axis_name: str | None,
      groups: AxisIndexGroups,
  ) -> tuple[Any, dict[str, Any]]:
    """``x`` and the keywords for ``fn``, by the declared capabilities."""
    keywords = {}
    if where is not None:
      if not self.supports_mask:
        raise TypeError(_no_mask_message(self.name, self.mask_refusal))
      keywords["where"] = where
    if axis_name is None:
      return x, keywords
    if self.pools_devices:
      keywords.update(axis_name=axis_name, axis_index_groups=groups)
      return x, keywords
    # The documented fallback: fn sees the global batch.
    x = jnp.asarray(x)
    first = reduction_axes(x.ndim, axis)[0]
    gather = lambda a: lax.all_gather(
        a, axis_name, axis_index_groups=groups, axis=first, tiled=True
    )
    if where is not None:
      keywords["where"] = gather(
          jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
      )
    return gather(x), keywords

  def _pair(self, result: Any) -> tuple[Array, Array]:
    # Unpacking a single array would iterate over it, and fail (or not)
    # with a message about shapes that does not point at the measure.
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
      what = (
          f"an array of shape {result.shape}"
          if hasattr(result, "shape")
          else f"a {type(result).__name__}"
      )
      raise TypeError(
          f"measure {self.name!r} returned {what}, not a pair (S, D);"
          f" {MEASURE_CONTRACT}."
      )
    s, d = result
    if jnp.iscomplexobj(d):
      raise TypeError(
          f"measure {self.name!r} returned a complex deviation; D must be"
          " real (for complex input, e.g. a mean absolute deviation |x - S|)."
      )
    return s, d

  # Alike gbn_jax/deviations.py::sd: a Measure is called as its function is.
  def __call__(
      self,
      x: Array,
      axis: Axis,
      *,
      where: Array | None = None,
      axis_name: str | None = None,
      axis_index_groups: AxisIndexGroups = None,
  ) -> tuple[Array, Array]:
    """``(S, D)`` of ``x`` over ``axis``.

    Args:
      x: the batch.
      axis: the axis or axes to reduce.
      where: optional boolean mask (needs ``supports_mask``).
      axis_name: optional named axis whose devices' elements are pooled.
      axis_index_groups: optional groups of indices within ``axis_name``.

    Returns:
      The per-feature statistic ``S`` and deviation ``D`` (calibrated if
      ``calibration`` is set).

    Raises:
      TypeError: ``where`` without ``supports_mask``; complex input to a
        measure that orders values; ``fn`` returned no real pair.
    """
    self._check_complex(x)
    x, keywords = self._reduction(x, axis, where, axis_name, axis_index_groups)
    s, d = self._pair(self.fn(x, axis, **keywords, **dict(self.params)))
    if self.calibration is None:
      return s, d
    return s, _divide(d, self._constant(x, axis, keywords))

  # Alike gbn_jax/_bound_measure.py::Measure.__call__: the same call, for D^2.
  def squared_deviation(
      self,
      x: Array,
      axis: Axis,
      *,
      where: Array | None = None,
      axis_name: str | None = None,
      axis_index_groups: AxisIndexGroups = None,
  ) -> tuple[Array, Array]:
    """``(S, D^2)``; exact (no sqrt round trip) for ``sd``.

    Args and errors are those of :meth:`__call__`.

    Returns:
      The per-feature statistic ``S`` and squared deviation ``D^2``.
    """
    if self.fn is not sd:
      s, d = self(
          x,
          axis,
          where=where,
          axis_name=axis_name,
          axis_index_groups=axis_index_groups,
      )
      return s, jnp.square(d)
    self._check_complex(x)
    x, keywords = self._reduction(x, axis, where, axis_name, axis_index_groups)
    s, d2 = self._pair(
        self.fn(x, axis, squared=True, **keywords, **dict(self.params))
    )
    if self.calibration is None:
      return s, d2
    c = self._constant(x, axis, keywords)
    return s, _divide(d2, c if _is_one(c) else jnp.square(c))

  def normal_constant(self, n: int | Array) -> float | Array:
    """``D`` of a standard normal feature of ``n`` values: the divisor of
    ``calibration='normal'`` (whether or not this measure uses it).

    Population values for ``sd`` (1), ``mad`` and ``bpoe`` (sqrt(2/pi)),
    ``rsd`` (1/sqrt(2 pi)) and ``sqd`` (``phi(Phi^-1(alpha)) / (1 - alpha)``);
    ``E[D]`` for ``rbd`` (``2 E[max_n]``) and ``wcd`` (``E[max_n]``), by
    :func:`gbn_jax.calibration.expected_normal_max`.

    Args:
      n: the number of values per statistic: a Python int, or an int32
        array of per-feature counts.

    Returns:
      The constant: a float, or an array for an array ``n`` where it
      depends on ``n``.

    Raises:
      ValueError: the measure has no constant (a user measure registered
        without ``normal_scale``).

    >>> from gbn_jax import get_measure
    >>> round(get_measure('sqd2').normal_constant(100), 6)  # 2 phi(0)
    0.797885
    >>> round(get_measure('rbd').normal_constant(2), 6)  # E|Z1 - Z2|
    1.128379
    """
    if self.normal_scale is None:
      raise ValueError(no_constant_message(self.name))
    if callable(self.normal_scale):
      return self.normal_scale(n, **dict(self.params))
    return self.normal_scale

  def _constant(
      self, x: Any, axis: Axis, keywords: Mapping[str, Any]
  ) -> float | Array:
    if not callable(self.normal_scale):  # no n needed (nor a mask count)
      return self.normal_constant(0)
    x, axes, where = reductions.prepare_reduction(
        x, axis, keywords.get("where"), allow_complex=True
    )
    n = reductions.element_count(
        x,
        axes,
        where,
        keywords.get("axis_name"),
        keywords.get("axis_index_groups"),
    )
    return self.normal_constant(n)

  def __repr__(self):
    args = "".join(f", {k}={v!r}" for k, v in self.params)
    if self.calibration is not None:
      args += f", calibration={self.calibration!r}"
    return f"Measure({self.name!r}{args})"


def _is_one(c: Any) -> bool:
  return isinstance(c, numbers.Real) and c == 1


def _divide(d: Array, c: float | Array) -> Array:
  """``d / c``, leaving ``d`` where ``c`` is not positive (``n <= 1``, where
  ``rbd`` and ``wcd`` have ``D = 0`` and so does their constant)."""
  if isinstance(c, numbers.Real):
    # A product with the float64 reciprocal: XLA may rewrite a division by a
    # constant into one in some programs and not others, which made the same
    # layer differ by an ulp between its fused and its autodiff paths.
    return d if c == 1 or not c > 0 else d * (1 / c)
  c = jnp.asarray(c, jnp.result_type(d))
  return d / jnp.where(c > 0, c, 1)


def no_constant_message(name: str) -> str:
  """The error for ``calibration='normal'`` without a normal scale."""
  return (
      f"measure {name!r} has no normal-consistency constant, so"
      " calibration='normal' cannot apply to it; register it with"
      " gbn_jax.register_measure(name, fn, normal_scale=...), a float or a"
      " callable (n, **params) giving its D for a standard normal feature."
  )
