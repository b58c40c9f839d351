"""The measure registry: names, declared capabilities and bound measures.

A *measure* maps a batch and the axes to reduce to ``(S, D)``, one value per
remaining (feature) position: the statistic GBN centers on and the deviation
it divides by. The built-ins are the functions of :mod:`gbn_jax.deviations`;
this module names them, and yours (documented at the top level, as
``gbn_jax.register_measure`` and so on):

* :func:`register_measure` stores a function under a name with what it
  declares it supports: a ``mask`` (``supports_mask``) and pooling devices
  itself under ``axis_name`` (``pools_devices``). Nothing is read from the
  function's signature; an undeclared mask is a clear error, and an
  undeclared device pooling is done for the function by gathering the batch.
* :data:`MEASURES` maps each name to its :class:`MeasureSpec`.
* :func:`get_measure` binds a name to its parameters (and a calibration) as a
  :class:`Measure`, the callable the layers use;
  :func:`parse_measure_name` reads the ``'sqd:0.9'`` spelling of a name and
  its ``alpha``.

``calibration='normal'`` divides ``D`` by its value for a standard normal
feature (:meth:`Measure.normal_constant`, :mod:`gbn_jax.calibration`), so
that ``D`` is ``sigma`` for Gaussian data, as BatchNorm's is.

>>> import jax.numpy as jnp
>>> measure = get_measure('sqd2')
>>> s, d = measure(jnp.array([[0.], [1.], [2.], [7.]]), axis=0)
>>> s, d  # median 1; superquantile 4.5 (mean of the top half) minus mean 2.5
(Array([1.], dtype=float32), Array([2.], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
import contextlib
import dataclasses
import math
import numbers
import types
from typing import Any

from gbn_jax import _bound_measure
from gbn_jax import _quantiles
from gbn_jax import calibration as calibration_lib
from gbn_jax._bound_measure import MEASURE_CONTRACT  # noqa: F401
from gbn_jax._bound_measure import REQUIRED
from gbn_jax._bound_measure import Measure
from gbn_jax._bound_measure import MeasureFn
from gbn_jax._bound_measure import keyword_params
from gbn_jax.calibration import NormalScale
from gbn_jax.deviations import bpoe
from gbn_jax.deviations import mad
from gbn_jax.deviations import rbd
from gbn_jax.deviations import rsd
from gbn_jax.deviations import sd
from gbn_jax.deviations import sqd
from gbn_jax.deviations import wcd

# The rest of the registry's API is documented at the top level (gbn_jax).
__all__ = ["MeasureFn", "resolve_measure"]

# Every built-in supports masks and pools devices; a name registered for a
# built-in function inherits these declarations and its normal scale.
_BUILTINS = calibration_lib.BUILTIN_SCALES


@dataclasses.dataclass(frozen=True)
class MeasureSpec:
  """What a registered name stands for (the values of :data:`MEASURES`).

  Attributes:
    fn: The measure function, ``fn(x, axis, **keywords) -> (S, D)``.
    params: The parameters the name binds, as sorted ``(name, value)`` pairs
      (e.g. ``(('alpha', 0.5),)`` for ``'sqd2'``); :func:`get_measure`
      rejects overrides of them.
    normal_scale: ``D`` of a standard normal feature (a float, or a callable
      ``(n, **params)``), or None: then ``calibration='normal'`` is an error.
    supports_mask: Whether ``fn`` takes ``where=`` and honours it.
    pools_devices: Whether ``fn`` takes ``axis_name=`` and
      ``axis_index_groups=`` and pools the devices' elements itself.
  """

  fn: MeasureFn
  params: tuple[tuple[str, Any], ...] = ()
  normal_scale: NormalScale | None = None
  supports_mask: bool = False
  pools_devices: bool = False

  @property
  def accepted(self) -> tuple[str, ...]:
    """The parameters :func:`get_measure` accepts for this name."""
    bound = dict(self.params)
    return tuple(k for k in keyword_params(self.fn) if k not in bound)

  @property
  def required(self) -> tuple[str, ...]:
    """The parameters :func:`get_measure` must be given (``alpha`` for
    ``'sqd'``)."""
    bound = dict(self.params)
    return tuple(
        k
        for k, v in keyword_params(self.fn).items()
        if v is REQUIRED and k not in bound
    )


_REGISTRY: dict[str, MeasureSpec] = {}

#: The registered names, each to its :class:`MeasureSpec` (a live, read-only
#: view of the registry).
MEASURES: Mapping[str, MeasureSpec] = types.MappingProxyType(_REGISTRY)


# Alike gbn_jax/_quantiles.py::quantile: a signature alike in shape only.
def register_measure(
    name: str,
    fn: MeasureFn,
    *,
    overwrite: bool = False,
    normal_scale: NormalScale | None = None,
    supports_mask: bool | None = None,
    pools_devices: bool | None = None,
    **params: Any,
) -> None:
  """Registers ``fn`` under ``name`` so that modules accept ``measure=name``.

  What ``fn`` supports is declared here, never read from its signature:

  * ``supports_mask=True``: ``fn`` takes ``where=`` (a boolean mask of
    ``x``'s shape) and computes ``S`` and ``D`` over the masked-in elements.
    Without it, a ``mask`` (``GBatchNorm(...)(x, mask=...)``, or ``where=``
    in a call of the measure) is a ``TypeError`` naming the measure.
  * ``pools_devices=True``: ``fn`` takes ``axis_name=`` and
    ``axis_index_groups=`` and pools the elements of every device along the
    named axis itself (with the reductions of :mod:`gbn_jax.reductions`,
    which take the same keywords).
    Without it, under ``axis_name`` the batch (and the mask) is gathered
    across the named axis (``lax.all_gather``) and ``fn`` is called on the
    global batch: exact, at the cost of moving the activations.

  Args:
    name: the new name; it may not contain ``':'`` (the separator of
      :func:`parse_measure_name`).
    fn: ``fn(x, axis, **params) -> (S, D)``: ``x`` the batch, ``axis`` a
      tuple of the axes to reduce, ``S`` and ``D`` per-feature arrays; plus
      the keywords it declares support for.
    overwrite: allow replacing an existing name.
    normal_scale: what ``calibration='normal'`` divides ``D`` by: its value
      for a standard normal feature. A positive float, or a callable
      ``normal_scale(n, **params)`` of the number ``n`` of values per
      statistic and the measure's bound parameters. ``n`` is a Python int,
      except under a ``mask``, where it is an int32 array of per-feature
      counts (traced: write the callable with ``jnp``). Default: the
      built-in's constant when ``fn`` is a built-in measure, else none, and
      ``calibration='normal'`` is then an error.
    supports_mask: see above. Default: True for a built-in function (which
      all support masks), else False.
    pools_devices: see above. Default: True for a built-in function, else
      False.
    **params: parameters bound for this name (``get_measure`` rejects
      overrides of them).

  Raises:
    ValueError: a bad or taken name, or a bad ``normal_scale``.
    TypeError: ``fn`` not callable, parameters ``fn`` does not take, or a
      capability that is not a bool.

  >>> import jax.numpy as jnp
  >>> register_measure('sqd_p90', sqd, alpha=0.9)
  >>> get_measure('sqd_p90')
  Measure('sqd_p90', alpha=0.9)
  >>> iqr = lambda x, axis: (jnp.median(x, axis), jnp.subtract(
  ...     *jnp.quantile(x, jnp.array([0.75, 0.25]), axis=axis)))
  >>> register_measure('iqr', iqr, normal_scale=1.3489795)
  >>> get_measure('iqr', calibration='normal')
  Measure('iqr', calibration='normal')
  >>> MEASURES['iqr'].supports_mask, MEASURES['sqd_p90'].supports_mask
  (False, True)
  >>> unregister_measure('sqd_p90'); unregister_measure('iqr')
  """
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(
        f"measure names are non-empty strings without ':', got {name!r}."
    )
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"measure {name!r} is already registered.")
  if not callable(fn):
    raise TypeError(f"measure {name!r} must be callable, got {fn!r}.")
  _check_params(name, fn, params)
  builtin = fn in _BUILTINS
  if supports_mask is None:
    supports_mask = builtin
  if pools_devices is None:
    pools_devices = builtin
  supports_mask = _bound_measure.check_declared(
      name, "supports_mask", supports_mask
  )
  pools_devices = _bound_measure.check_declared(
      name, "pools_devices", pools_devices
  )
  if normal_scale is None:
    normal_scale = _BUILTINS.get(fn)
  elif not callable(normal_scale):
    if (
        isinstance(normal_scale, bool)
        or not isinstance(normal_scale, numbers.Real)
        or not 0 < normal_scale < math.inf
    ):
      raise ValueError(
          f"normal_scale of measure {name!r} must be a positive finite number"
          f" or a callable (n, **params) -> number, got {normal_scale!r}."
      )
    normal_scale = float(normal_scale)
  _REGISTRY[name] = MeasureSpec(
      fn,
      tuple(sorted(params.items())),
      normal_scale,
      supports_mask,
      pools_devices,
  )


def unregister_measure(name: str) -> None:
  """Removes a name :func:`register_measure` stored.

  Args:
    name: a registered name other than a built-in one (``'sd'``, ``'sqd2'``,
      ...: the layers' defaults and the training suite rely on them).

  Raises:
    ValueError: ``name`` is built in, or not registered.
  """
  if name in _BUILTIN_NAMES:
    raise ValueError(f"measure {name!r} is built in and cannot be removed.")
  if name not in _REGISTRY:
    raise ValueError(_unknown_message(name))
  del _REGISTRY[name]


@contextlib.contextmanager
def registered_measure(
    name: str, fn: MeasureFn, **declarations: Any
) -> Iterator[MeasureSpec]:
  """:func:`register_measure` for the length of a ``with`` block.

  On exit, normal or by an exception, the registry is restored: ``name`` is
  removed, or given back what it stood for before (with ``overwrite=True``).

  Args:
    name: the name, as for :func:`register_measure`.
    fn: the measure function, as for :func:`register_measure`.
    **declarations: :func:`register_measure`'s other keywords and the
      parameters the name binds.

  Yields:
    The name's :class:`MeasureSpec`.

  Raises:
    ValueError, TypeError: as :func:`register_measure`.

  >>> with registered_measure('sqd_p99', sqd, alpha=0.99) as spec:
  ...   get_measure('sqd_p99'), spec.params
  (Measure('sqd_p99', alpha=0.99), (('alpha', 0.99),))
  >>> 'sqd_p99' in MEASURES
  False
  """
  previous = _REGISTRY.get(name)
  register_measure(name, fn, **declarations)
  try:
    yield _REGISTRY[name]
  finally:
    if previous is None:
      _REGISTRY.pop(name, None)
    else:
      _REGISTRY[name] = previous


def _check_params(name: str, fn: MeasureFn, params: Mapping[str, Any]) -> None:
  accepted = keyword_params(fn)
  unknown = set(params) - set(accepted)
  if unknown:
    raise TypeError(
        f"measure {name!r} got unexpected parameter(s) {sorted(unknown)}; it"
        f" accepts {sorted(accepted) or 'none'}."
    )
  if "alpha" in params:
    _quantiles.validate_alpha(params["alpha"])


def _general_name(name: str) -> str | None:
  """The registered name of ``name``'s function with no parameter fixed."""
  fn = _REGISTRY[name].fn
  for other, spec in _REGISTRY.items():
    if spec.fn is fn and not spec.params:
      return other
  return None


class FixedParamsError(TypeError):
  """Parameters passed to a measure whose registration fixes them.

  Attributes:
    name: The measure's registered name (e.g. ``'sqd2'``).
    fixed: The parameters passed that ``name`` fixes (e.g. ``['alpha']``).
    general: The registered name of the same function with nothing fixed
      (e.g. ``'sqd'``), or None if there is none.
  """

  def __init__(
      self,
      name: str,
      fixed: list[str],
      call: Callable[[str, str], str] | None = None,
  ):
    """``call(general, 'alpha=...')`` writes the fix in the caller's terms
    (default: a :func:`get_measure` call)."""
    self.name, self.fixed, self.general = name, fixed, _general_name(name)
    if call is None:
      call = lambda general, choose: f"get_measure({general!r}, {choose})"
    choose = ", ".join(f"{k}=..." for k in fixed)
    if self.general is None:
      fix = (
          " register the measure's function under another name without"
          " fixing them to choose them."
      )
    else:
      fix = (
          " use the general measure to choose them:"
          f" {call(self.general, choose)}."
      )
    super().__init__(f"measure {name!r} fixes {fixed};{fix}")


def _unknown_message(name: Any) -> str:
  hint = ""
  if isinstance(name, str) and ":" in name:
    hint = " ('<name>:<alpha>' is read by gbn_jax.parse_measure_name)"
  return (
      f"unknown measure {name!r}{hint}; valid names:"
      f" {', '.join(sorted(_REGISTRY))}."
  )


def get_measure(
    name: str, calibration: str | None = None, **params: Any
) -> Measure:
  """Returns the registered measure ``name`` bound to ``params``.

  Args:
    name: one of :data:`MEASURES`.
    calibration: ``None`` (raw ``D``) or ``'normal'``: ``D`` divided by its
      value for a standard normal feature, so that ``D`` is ``sigma`` for
      Gaussian data (see :class:`Measure`).
    **params: the measure's parameters, e.g. ``alpha`` for ``'sqd'``.

  Returns:
    The bound :class:`Measure`, with the capabilities the name declares.

  Raises:
    ValueError: unknown name (the message lists valid ones), alpha outside
      (0, 1), an unknown calibration, or ``'normal'`` for a measure
      registered without a ``normal_scale``.
    TypeError: unexpected, missing or fixed parameters.

  >>> get_measure('sqd', alpha=0.9)
  Measure('sqd', alpha=0.9)
  >>> import jax
  >>> x = jax.random.normal(jax.random.key(0), (100_000, 1)) * 3
  >>> _, d = get_measure('mad', calibration='normal')(x, axis=0)
  >>> round(float(d[0]), 1)  # sigma
  3.0
  """
  calibration_lib.check_calibration(calibration)
  if name not in _REGISTRY:
    raise ValueError(_unknown_message(name))
  spec = _REGISTRY[name]
  bound = dict(spec.params)
  fixed = set(bound) & set(params)
  if fixed:
    raise FixedParamsError(name, sorted(fixed))
  _check_params(name, spec.fn, params)
  bound.update(params)
  missing = [
      k
      for k, v in keyword_params(spec.fn).items()
      if v is REQUIRED and k not in bound
  ]
  if missing:
    raise TypeError(f"measure {name!r} needs parameter(s) {missing}.")
  if calibration is not None and spec.normal_scale is None:
    raise ValueError(_bound_measure.no_constant_message(name))
  return Measure(
      name,
      spec.fn,
      tuple(sorted(bound.items())),
      calibration,
      spec.normal_scale,
      supports_mask=spec.supports_mask,
      pools_devices=spec.pools_devices,
  )


def parse_measure_name(text: str) -> tuple[str, dict[str, float]]:
  """Reads a measure name, or ``'<name>:<alpha>'`` (``'sqd:0.9'``).

  The one reader of that spelling (the training CLI's ``--norm``, the
  benchmarks and the tests use it); ``name, params =
  parse_measure_name(text)`` then ``get_measure(name, **params)`` is the
  measure.

  Args:
    text: a registered name, or one that takes ``alpha`` followed by ``':'``
      and the level; surrounding spaces are ignored.

  Returns:
    ``(name, params)``: ``params`` is ``{'alpha': level}`` for the
    ``':'`` form, else empty.

  Raises:
    ValueError: an unknown name; ``':'`` after a name that takes no
      ``alpha`` (or fixes it, as ``'sqd2'`` does); a level that is not a
      number, or not strictly between 0 and 1.

  >>> parse_measure_name('sqd:0.9'), parse_measure_name('mad')
  (('sqd', {'alpha': 0.9}), ('mad', {}))
  """
  if not isinstance(text, str):
    raise ValueError(f"a measure name is a string, got {text!r}.")
  name, sep, value = text.strip().partition(":")
  if name not in _REGISTRY:
    raise ValueError(_unknown_message(text))
  if not sep:
    return name, {}
  spec = _REGISTRY[name]
  if "alpha" not in spec.accepted:
    fixed = dict(spec.params)
    if "alpha" in fixed:
      general = _general_name(name)
      instead = f"; write '{general}:<alpha>'" if general else ""
      raise ValueError(
          f"measure {name!r} takes no alpha (it fixes alpha="
          f"{fixed['alpha']!r}{instead}), got {text!r}."
      )
    raise ValueError(f"measure {name!r} takes no alpha, got {text!r}.")
  try:
    alpha = float(value)
  except ValueError:
    raise ValueError(f"alpha in {text!r} is not a number.") from None
  if not 0.0 < alpha < 1.0:  # also rejects nan
    raise ValueError(f"alpha in {text!r} must lie strictly between 0 and 1.")
  return name, {"alpha": alpha}


def _callable_name(fn: Any) -> str:
  return getattr(fn, "__qualname__", None) or repr(fn)


def resolve_measure(
    measure: str | MeasureFn, calibration: str | None = None, **params: Any
) -> Measure:
  """A layer's ``measure`` field (a name, a :class:`Measure` or a callable)
  as a :class:`Measure`.

  Args:
    measure: a registered name (bound to ``params`` by
      :func:`get_measure`), a :class:`Measure`, or a callable
      ``fn(x, axis) -> (S, D)``, which becomes ``Measure(name, fn)``: no
      capability declared, no normal constant.
    calibration: ``None`` or ``'normal'``; a :class:`Measure` with a normal
      scale may be calibrated here, a plain callable may not (register it
      with one).
    **params: parameters of a named measure; those whose value is ``None``
      are ignored, so a module's unset fields do not reach measures that do
      not take them.

  Returns:
    The :class:`Measure`.

  Raises:
    ValueError: as :func:`get_measure`, or a calibration without a constant.
    TypeError: as :func:`get_measure`, a non-callable, or parameters for a
      callable.
  """
  calibration_lib.check_calibration(calibration)
  params = {k: v for k, v in params.items() if v is not None}
  if isinstance(measure, str):
    return get_measure(measure, calibration=calibration, **params)
  if not callable(measure):
    raise TypeError(
        f"measure must be a registered name or a callable, got {measure!r}."
    )
  if calibration is not None:
    if not isinstance(measure, Measure):
      raise ValueError(
          f"calibration={calibration!r} needs the measure's D for a standard"
          f" normal feature, which the callable {measure!r} does not have:"
          " register it with gbn_jax.register_measure(name, fn,"
          " normal_scale=...) and pass its name."
      )
    if measure.normal_scale is None:
      raise ValueError(_bound_measure.no_constant_message(measure.name))
    measure = dataclasses.replace(measure, calibration=calibration)
  if params:
    raise TypeError(
        f"parameters {sorted(params)} only apply to named measures; bind them"
        " into your callable instead."
    )
  if not isinstance(measure, Measure):
    measure = Measure(_callable_name(measure), measure)
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

# The names above: unregister_measure refuses them.
_BUILTIN_NAMES = frozenset(_REGISTRY)
