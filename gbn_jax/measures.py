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

``calibration='normal'`` divides ``D`` by its value for a standard normal
feature (:meth:`Measure.normal_constant`), so that ``D`` is ``sigma`` for
Gaussian data, as BatchNorm's is (the idea of scipy's
``median_abs_deviation(scale='normal')``).

>>> import jax.numpy as jnp
>>> measure = get_measure('sqd2')
>>> s, d = measure(jnp.array([[0.], [1.], [2.], [7.]]), axis=0)
>>> s, d  # median 1; superquantile 4.5 (mean of the top half) minus mean 2.5
(Array([1.], dtype=float32), Array([2.], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import functools
import inspect
import math
import numbers
import statistics
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gbn_jax import quantiles
from gbn_jax._selection import reductions
from gbn_jax._selection.common import global_sum
from gbn_jax._selection.reductions import global_mean
from gbn_jax._selection.reductions import prepare_reduction
from gbn_jax.quantiles import extreme

Array = jax.Array
MeasureFn = Callable[..., tuple[Array, Array]]
#: ``D`` of a standard normal feature: a float, or ``f(n, **params)`` of the
#: number ``n`` of values per statistic (see :func:`register_measure`).
NormalScale = float | Callable[..., Any]

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
    "expected_normal_max",
]

#: The ``calibration`` values: ``None`` (raw ``D``) or ``'normal'``.
CALIBRATIONS = (None, "normal")

_REQUIRED = object()


def _keep_nan(mean: Array, dev: Array) -> Array:
  # One-sided deviations compare with the mean; NaN compares False, which
  # alone would report a clean 0 deviation for a NaN batch.
  return jnp.where(jnp.isnan(mean), jnp.nan, dev)


def _centered(x: Array, center: Array, axes: tuple[int, ...]) -> Array:
  return x - jnp.expand_dims(center, axes)


#: The built-ins defined for complex input, through the modulus: ``sd`` (mean
#: and ``sqrt(E|x - E x|^2)``, flax's BatchNorm) and ``mad`` (``E|x - E x|``).
#: The others order values (quantiles, extremes, the sign of ``x - E x``).
_COMPLEX_OK = ("sd", "mad")


def _prepare(x, axis, where, name: str):
  """``prepare_reduction`` that keeps complex ``x`` complex where ``name``
  is defined for it, and raises where it is not (rather than dropping the
  imaginary part)."""
  x = jnp.asarray(x)
  if not jnp.iscomplexobj(x):
    return prepare_reduction(x, axis, where)
  check_real(x, name)
  _, axes, where = prepare_reduction(jnp.real(x), axis, where)
  return x, axes, where


def check_real(x, name: str) -> None:
  """Raises ``TypeError`` if ``x`` is complex and ``name`` orders values."""
  if jnp.iscomplexobj(x) and name not in _COMPLEX_OK:
    raise TypeError(
        f"measure {name!r} is not defined for complex input ({jnp.result_type(x)}):"
        " it orders values (a quantile, an extreme or the sign of x - mean),"
        " and complex numbers have no order. Use measure='sd' (flax's"
        " BatchNorm: mean and E|x - mean|^2) or 'mad' (E|x - mean|), or"
        " normalize the real and imaginary parts as separate features."
    )


def _abs_sq(x: Array) -> Array:
  # |x|^2 as flax's BatchNorm takes it; jnp.square for real x (bit for bit).
  if jnp.iscomplexobj(x):
    return jnp.square(jnp.real(x)) + jnp.square(jnp.imag(x))
  return jnp.square(x)


def sd(
    x,
    axis,
    *,
    where=None,
    axis_name=None,
    axis_index_groups=None,
    fast_variance: bool = True,
    squared: bool = False,
):
  """Mean and standard deviation ``sqrt(E[(x - E x)^2])`` (BatchNorm's pair).

  With ``fast_variance`` the variance is ``E[x^2] - E[x]^2`` clipped at zero,
  in one pass (flax's ``use_fast_variance``). ``squared=True`` returns the
  variance itself, which is what normalization layers use. For complex ``x``
  the mean is complex and the variance ``E|x - E x|^2`` real, as in flax.
  """
  x, axes, where = _prepare(x, axis, where, "sd")
  # Square before the first mean, as flax does: XLA:CPU fuses the backward
  # pass differently (and slower) when the mean comes first.
  x_sq = _abs_sq(x) if fast_variance else None
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  if fast_variance:
    mean_sq = global_mean(x_sq, axes, where, axis_name, axis_index_groups)
    var = jnp.maximum(0.0, mean_sq - _abs_sq(mean))
  else:
    var = global_mean(
        _abs_sq(_centered(x, mean, axes)),
        axes,
        where,
        axis_name,
        axis_index_groups,
    )
  return mean, (var if squared else jnp.sqrt(var))


def mad(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mean and mean absolute deviation ``E|x - E x|`` (the modulus, for
  complex ``x``)."""
  x, axes, where = _prepare(x, axis, where, "mad")
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  dev = global_mean(
      jnp.abs(_centered(x, mean, axes)),
      axes,
      where,
      axis_name,
      axis_index_groups,
  )
  return mean, dev


def rsd(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mean and upper semideviation ``E[(x - E x)^+]``."""
  x, axes, where = _prepare(x, axis, where, "rsd")
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  dev = global_mean(
      jnp.where(centered > 0, centered, 0),
      axes,
      where,
      axis_name,
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
  x, axes, where = _prepare(x, axis, where, "sqd")
  q, qbar, mean = quantiles._superquantile_and_mean(  # pylint: disable=protected-access
      x, alpha, axes, where, axis_name, axis_index_groups
  )
  return q, qbar - mean


def rbd(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mid-range ``(max + min)/2`` and range ``max - min``."""
  x, axes, where = _prepare(x, axis, where, "rbd")
  kw = dict(
      where=where, axis_name=axis_name, axis_index_groups=axis_index_groups
  )
  hi = extreme(x, axes, largest=True, **kw)
  lo = extreme(x, axes, largest=False, **kw)
  return (hi + lo) / 2, hi - lo


def wcd(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Maximum and worst-case deviation ``max - E[x]``."""
  x, axes, where = _prepare(x, axis, where, "wcd")
  hi = extreme(
      x,
      axes,
      largest=True,
      where=where,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
  )
  return hi, hi - global_mean(x, axes, where, axis_name, axis_index_groups)


def bpoe(x, axis, *, where=None, axis_name=None, axis_index_groups=None):
  """Mean and ``E[x - E x | x > E x]`` (0 when no element exceeds the mean).

  This is SQD at the level where the quantile sits at the mean: GBN with it,
  followed by ReLU, is the paper's empirical bPOE transform.
  """
  x, axes, where = _prepare(x, axis, where, "bpoe")
  mean = global_mean(x, axes, where, axis_name, axis_index_groups)
  centered = _centered(x, mean, axes)
  above = centered > 0
  if where is not None:
    above = above & where
  total = jnp.sum(jnp.where(above, centered, 0), axes)
  count = reductions.count_true(above, axes)
  total, count = global_sum((total, count), axis_name, axis_index_groups)
  dev = jnp.where(count > 0, total / jnp.maximum(count, 1), 0)
  return mean, _keep_nan(mean, dev)


# ------------------------------------------------ normal-consistency constants
#
# calibration='normal' divides D by its value for a standard normal feature.
# Where D has a population value (every built-in but rbd and wcd) that value
# is the constant, so D -> sigma as the batch grows; the range and the maximum
# grow without bound (like sqrt(2 ln n)), so rbd and wcd use the expectation
# for the n values that the statistic actually sees, E[D] = sigma exactly.
# Nothing here imports scipy: statistics.NormalDist and numpy suffice.

_NORMAL = statistics.NormalDist()
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)

# The trapezoid rule on the density of the maximum, n phi(x) Phi(x)^(n - 1):
# smooth and negligible at both ends of [-12, 12] for every n up to 2**48
# (the mass sits near sqrt(2 ln n) <= 8.2, with width >= 0.15), where the rule
# converges exponentially; 1/64 gives float64 accuracy (checked against
# scipy's quad in tests/test_calibration.py).
_GRID_STEP = 1 / 64
_GRID = np.linspace(-12.0, 12.0, 24 * 64 + 1)


@functools.cache
def _log_phi_and_cdf() -> tuple[np.ndarray, np.ndarray]:
  log_pdf = -0.5 * _GRID**2 - 0.5 * math.log(2 * math.pi)
  # log Phi without cancellation at either end: erfc keeps the lower tail's
  # relative accuracy, log1p the upper tail's.
  log_cdf = np.array(
      [
          math.log1p(-0.5 * math.erfc(v / math.sqrt(2)))
          if v > 0
          else math.log(0.5 * math.erfc(-v / math.sqrt(2)))
          for v in _GRID
      ]
  )
  return log_pdf, log_cdf


def _expected_max_float64(n: np.ndarray) -> np.ndarray:
  """E[max of n standard normals] for real ``n`` (0 where ``n <= 1``)."""
  n = np.asarray(n, np.float64)
  log_pdf, log_cdf = _log_phi_and_cdf()
  out = np.zeros(n.shape)
  flat, res = n.reshape(-1), out.reshape(-1)
  for start in range(0, flat.size, 256):  # bounded temporaries
    m = flat[start : start + 256, None]
    density = np.exp(np.log(np.maximum(m, 1)) + log_pdf + (m - 1) * log_cdf)
    f = _GRID * density
    trapezoid = _GRID_STEP * (f.sum(axis=1) - 0.5 * (f[:, 0] + f[:, -1]))
    res[start : start + 256] = np.where(m[:, 0] > 1, trapezoid, 0.0)
  return out


@functools.lru_cache(maxsize=4096)
def _expected_max_static(n: int) -> float:
  return float(_expected_max_float64(np.array([n]))[0])


# With a mask the count is traced: a table, exact for every n up to
# _EXACT_UP_TO, then 128 points an octave in log n up to 2**48 (clamped
# beyond), interpolated linearly in log n. E[max_n] is smooth and concave in
# log n there, so the error is below 2e-7 relative (measured in
# tests/test_calibration.py against the exact values): float32 rounding.
_EXACT_UP_TO = 1024
_TABLE_OCTAVES = (10, 48)
_TABLE_PER_OCTAVE = 128


@functools.cache
def _expected_max_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  exact = _expected_max_float64(np.arange(_EXACT_UP_TO + 1))
  lo, hi = _TABLE_OCTAVES
  log2_n = np.linspace(lo, hi, (hi - lo) * _TABLE_PER_OCTAVE + 1)
  log_n = log2_n * math.log(2)
  return (
      exact.astype(np.float32),
      log_n.astype(np.float32),
      _expected_max_float64(np.exp(log_n)).astype(np.float32),
  )


def expected_normal_max(n: int | Array) -> float | Array:
  """``E[max(Z_1, ..., Z_n)]`` for independent standard normals.

  For a Python integer, a float64 numerical integration (cached); for an
  array of counts (traced, e.g. under a mask), a float32 table lookup, exact
  up to ``n = 1024`` and interpolated in ``log n`` beyond (error below 2e-7
  relative up to ``n = 2**48``, clamped beyond). 0 for ``n <= 1``.

  >>> round(expected_normal_max(2), 6), round(1 / math.sqrt(math.pi), 6)
  (0.56419, 0.56419)
  >>> round(expected_normal_max(1000), 4)
  3.2414
  """
  if isinstance(n, numbers.Integral):
    return _expected_max_static(int(n)) if n > 1 else 0.0
  exact, log_grid, table = _expected_max_table()
  n = jnp.asarray(n, jnp.float32)
  small = jnp.asarray(exact)[jnp.clip(n, 0, _EXACT_UP_TO).astype(jnp.int32)]
  large = jnp.interp(
      jnp.log(jnp.maximum(n, 1)), jnp.asarray(log_grid), jnp.asarray(table)
  )
  return jnp.where(n <= _EXACT_UP_TO, small, large)


def _sqd_normal_scale(n, *, alpha: float, **unused) -> float:
  # CVaR_alpha(Z) - E[Z] = phi(Phi^-1(alpha)) / (1 - alpha).
  del n, unused
  alpha = quantiles.validate_alpha(alpha)
  return _NORMAL.pdf(_NORMAL.inv_cdf(alpha)) / (1 - alpha)


def _rbd_normal_scale(n, **unused):
  # E[max - min] = 2 E[max], by the symmetry of the normal.
  del unused
  return 2 * expected_normal_max(n)


def _wcd_normal_scale(n, **unused):
  del unused
  return expected_normal_max(n)  # E[max - mean] = E[max]


#: Each built-in's D for a standard normal feature (see ``normal_scale`` in
#: :func:`register_measure`); a registered name inherits its function's entry.
_BUILTIN_NORMAL_SCALES: dict[MeasureFn, NormalScale] = {
    sd: 1.0,
    mad: _SQRT_2_OVER_PI,  # E|Z|
    rsd: 1 / math.sqrt(2 * math.pi),  # E[Z+] = phi(0)
    sqd: _sqd_normal_scale,
    rbd: _rbd_normal_scale,
    wcd: _wcd_normal_scale,
    bpoe: _SQRT_2_OVER_PI,  # E[Z | Z > 0] = phi(0) / (1/2)
}


# ----------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class _Entry:
  fn: MeasureFn
  params: Mapping[str, Any]  # name -> default, or _REQUIRED; fixed if bound
  fixed: frozenset[str] = frozenset()
  normal_scale: NormalScale | None = None


_REGISTRY: dict[str, _Entry] = {}

#: The registered measure names (a live, read-only view of the registry).
MEASURES: Mapping[str, Any] = types.MappingProxyType(_REGISTRY)


def register_measure(
    name: str,
    fn: MeasureFn,
    *,
    overwrite: bool = False,
    normal_scale: NormalScale | None = None,
    **params: Any,
) -> None:
  """Registers ``fn`` under ``name`` so that modules accept ``measure=name``.

  Args:
    name: the new name.
    fn: ``fn(x, axis, **params) -> (S, D)``; it may also accept the keywords
      ``where``, ``axis_name`` and ``axis_index_groups``.
    overwrite: allow replacing an existing name.
    normal_scale: what ``calibration='normal'`` divides ``D`` by: its value
      for a standard normal feature. A positive float, or a callable
      ``normal_scale(n, **params)`` of the number ``n`` of values per
      statistic and the measure's bound parameters. ``n`` is a Python int,
      except under a ``mask``, where it is an int32 array of per-feature
      counts (traced: write the callable with ``jnp``). Default: the
      built-in's constant when ``fn`` is a built-in measure, else none, and
      ``calibration='normal'`` is then an error.
    **params: parameters bound for this name (``get_measure`` rejects
      overrides of them).

  >>> import jax.numpy as jnp
  >>> register_measure('sqd_p90', sqd, alpha=0.9, overwrite=True)
  >>> get_measure('sqd_p90')
  Measure('sqd_p90', alpha=0.9)
  >>> iqr = lambda x, axis: (jnp.median(x, axis), jnp.subtract(
  ...     *jnp.quantile(x, jnp.array([0.75, 0.25]), axis=axis)))
  >>> register_measure('iqr', iqr, normal_scale=1.3489795, overwrite=True)
  >>> get_measure('iqr', calibration='normal')
  Measure('iqr', calibration='normal')
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"measure names are non-empty strings, got {name!r}.")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"measure {name!r} is already registered.")
  if not callable(fn):
    raise TypeError(f"measure {name!r} must be callable, got {fn!r}.")
  _check_params(name, fn, params)
  if normal_scale is None:
    normal_scale = _BUILTIN_NORMAL_SCALES.get(fn)
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
  _REGISTRY[name] = _Entry(fn, dict(params), frozenset(params), normal_scale)


def _check_calibration(calibration: Any) -> None:
  if calibration not in CALIBRATIONS:
    raise ValueError(
        f"calibration must be None or 'normal', got {calibration!r}."
    )


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
  """A measure bound to its parameters: ``measure(x, axis) -> (S, D)``.

  With ``calibration='normal'`` the ``D`` it returns is divided by
  :meth:`normal_constant` of the number ``n`` of values per statistic: the
  product of the reduced axes' sizes times the devices pooled along
  ``axis_name`` (static), or under ``where`` the per-feature count of
  masked-in elements (traced). A constant of exactly 1 (``sd``) divides
  nothing, so the result is bit for bit the raw one.
  """

  name: str
  fn: MeasureFn = dataclasses.field(repr=False, compare=True)
  params: tuple[tuple[str, Any], ...] = ()
  calibration: str | None = None
  normal_scale: NormalScale | None = dataclasses.field(
      default=None, repr=False, compare=True
  )

  def _check_complex(self, x) -> None:
    # Named here by the registered name (e.g. 'sqd2'), not the function's.
    if not jnp.iscomplexobj(x):
      return
    if self.fn in (rsd, sqd, rbd, wcd, bpoe):
      check_real(x, self.name)
    if self.calibration is not None and self.normal_scale != 1:
      raise ValueError(
          f"calibration={self.calibration!r} of measure {self.name!r} is"
          " defined for real features (D of a real standard normal), not for"
          f" complex input ({jnp.result_type(x)}); use calibration=None."
      )

  def __call__(self, x, axis, **reduction):
    self._check_complex(x)
    s, d = self.fn(x, axis, **reduction, **dict(self.params))
    if self.calibration is None:
      return s, d
    return s, _divide(d, self._constant(x, axis, reduction))

  def squared_deviation(self, x, axis, **reduction):
    """``(S, D^2)``; exact (no sqrt round trip) for ``sd``."""
    self._check_complex(x)
    if "squared" in inspect.signature(self.fn).parameters:
      s, d2 = self.fn(x, axis, squared=True, **reduction, **dict(self.params))
      if self.calibration is None:
        return s, d2
      c = self._constant(x, axis, reduction)
      return s, _divide(d2, c if _is_one(c) else jnp.square(c))
    s, d = self(x, axis, **reduction)
    return s, jnp.square(d)

  def normal_constant(self, n: int | Array) -> float | Array:
    """``D`` of a standard normal feature of ``n`` values: the divisor of
    ``calibration='normal'`` (whether or not this measure uses it).

    Population values for ``sd`` (1), ``mad`` and ``bpoe`` (sqrt(2/pi)),
    ``rsd`` (1/sqrt(2 pi)) and ``sqd`` (``phi(Phi^-1(alpha)) / (1 - alpha)``);
    ``E[D]`` for ``rbd`` (``2 E[max_n]``) and ``wcd`` (``E[max_n]``), by
    :func:`expected_normal_max`.

    >>> round(get_measure('sqd2').normal_constant(100), 6)  # 2 phi(0)
    0.797885
    >>> round(get_measure('rbd').normal_constant(2), 6)  # E|Z1 - Z2|
    1.128379

    Raises:
      ValueError: the measure has no constant (a user measure registered
        without ``normal_scale``).
    """
    if self.normal_scale is None:
      raise ValueError(_no_constant_message(self.name))
    if callable(self.normal_scale):
      return self.normal_scale(n, **dict(self.params))
    return self.normal_scale

  def _constant(self, x, axis, reduction) -> float | Array:
    if not callable(self.normal_scale):  # no n needed (nor a mask count)
      return self.normal_constant(0)
    x, axes, where = prepare_reduction(x, axis, reduction.get("where"))
    n = reductions.element_count(
        x,
        axes,
        where,
        reduction.get("axis_name"),
        reduction.get("axis_index_groups"),
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


def _no_constant_message(name: str) -> str:
  return (
      f"measure {name!r} has no normal-consistency constant, so"
      " calibration='normal' cannot apply to it; register it with"
      " gbn_jax.register_measure(name, fn, normal_scale=...), a float or a"
      " callable (n, **params) giving its D for a standard normal feature."
  )


def _general_name(name: str) -> str | None:
  """The registered name of ``name``'s function with no parameter fixed."""
  fn = _REGISTRY[name].fn
  for other, entry in _REGISTRY.items():
    if entry.fn is fn and not entry.fixed:
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
  _check_calibration(calibration)
  if name not in _REGISTRY:
    raise ValueError(
        f"unknown measure {name!r}; valid names: {', '.join(sorted(_REGISTRY))}."
    )
  entry = _REGISTRY[name]
  fixed = entry.fixed & set(params)
  if fixed:
    raise FixedParamsError(name, sorted(fixed))
  _check_params(name, entry.fn, params)
  bound = {**entry.params, **params}
  accepted = _keyword_params(entry.fn)
  missing = [
      k for k, v in accepted.items() if v is _REQUIRED and k not in bound
  ]
  if missing:
    raise TypeError(f"measure {name!r} needs parameter(s) {missing}.")
  if calibration is not None and entry.normal_scale is None:
    raise ValueError(_no_constant_message(name))
  return Measure(
      name,
      entry.fn,
      tuple(sorted(bound.items())),
      calibration,
      entry.normal_scale,
  )


def resolve_measure(
    measure: str | MeasureFn, calibration: str | None = None, **params: Any
) -> MeasureFn:
  """A name (with ``params``) or a callable -> a callable measure.

  ``params`` whose value is ``None`` are ignored, so a module's unset fields do
  not reach measures that do not take them. A :class:`Measure` (from
  :func:`get_measure`) may be calibrated here; a plain callable may not: it
  has no normal constant (register it with one).
  """
  _check_calibration(calibration)
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
      raise ValueError(_no_constant_message(measure.name))
    measure = dataclasses.replace(measure, calibration=calibration)
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
