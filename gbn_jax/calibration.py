"""Normal-consistency constants: what ``calibration='normal'`` divides D by.

``calibration='normal'`` divides a measure's deviation ``D`` by its value for
a standard normal feature, so that ``D`` is ``sigma`` for Gaussian data, as
BatchNorm's is (the idea of scipy's
``median_abs_deviation(scale='normal')``). Where ``D`` has a population value
(every built-in but ``rbd`` and ``wcd``) that value is the constant, so
``D -> sigma`` as the batch grows; the range and the maximum grow without
bound (like ``sqrt(2 ln n)``), so ``rbd`` and ``wcd`` use the expectation for
the ``n`` values that the statistic actually sees, ``E[D] = sigma`` exactly.
Nothing here imports scipy: :class:`statistics.NormalDist` and numpy suffice.

>>> round(sqd_normal_scale(100, alpha=0.5), 6)  # 2 phi(0)
0.797885
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
import numbers
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gbn_jax import _quantiles
from gbn_jax import deviations

Array = jax.Array
#: ``D`` of a standard normal feature: a float, or ``f(n, **params)`` of the
#: number ``n`` of values per statistic (see
#: :func:`gbn_jax.register_measure`).
NormalScale = float | Callable[..., Any]

__all__ = [
    "CALIBRATIONS",
    "NormalScale",
    "expected_normal_max",
    "rbd_normal_scale",
    "sqd_normal_scale",
    "wcd_normal_scale",
]

#: The ``calibration`` values: ``None`` (raw ``D``) or ``'normal'``.
CALIBRATIONS = (None, "normal")

_NORMAL = statistics.NormalDist()
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_INV_SQRT_2_PI = 1 / math.sqrt(2 * math.pi)


def check_calibration(calibration: Any) -> None:
  """Raises ``ValueError`` unless ``calibration`` is one of :data:`CALIBRATIONS`.

  Args:
    calibration: the value to check.
  """
  if calibration not in CALIBRATIONS:
    raise ValueError(
        f"calibration must be None or 'normal', got {calibration!r}."
    )


# The trapezoid rule on the density of the maximum, n phi(x) Phi(x)^(n - 1):
# smooth and negligible at both ends of [-12, 12] for every n up to 2**48
# (the mass sits near sqrt(2 ln n) <= 8.2, with width >= 0.15), where the rule
# converges exponentially; 1/64 gives float64 accuracy (checked against
# scipy's quad in tests/gbn_jax/test_calibration.py).
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
# tests/gbn_jax/test_calibration.py against the exact values): float32 rounding.
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

  Args:
    n: the number of values: a Python integer, or an integer array of counts
      (traced, e.g. the per-feature counts under a mask).

  Returns:
    For a Python integer, a float from a float64 numerical integration
    (cached); for an array, a float32 array from a table lookup, exact up to
    ``n = 1024`` and interpolated in ``log n`` beyond (error below 2e-7
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


def sqd_normal_scale(n: int | Array, *, alpha: float, **unused: Any) -> float:
  """``sqd``'s constant ``CVaR_alpha(Z) - E[Z] = phi(Phi^-1(alpha)) / (1 - alpha)``.

  Args:
    n: the number of values per statistic (unused: a population value).
    alpha: the quantile level, strictly between 0 and 1.
    **unused: other bound parameters, ignored.

  Returns:
    The constant, a float.
  """
  del n, unused
  alpha = _quantiles.validate_alpha(alpha)
  return _NORMAL.pdf(_NORMAL.inv_cdf(alpha)) / (1 - alpha)


def rbd_normal_scale(n: int | Array, **unused: Any) -> float | Array:
  """``rbd``'s constant ``E[max - min] = 2 E[max]`` (the normal is symmetric).

  Args:
    n: the number of values per statistic (an int, or int32 counts).
    **unused: bound parameters, ignored.

  Returns:
    ``2 * expected_normal_max(n)``.
  """
  del unused
  return 2 * expected_normal_max(n)


def wcd_normal_scale(n: int | Array, **unused: Any) -> float | Array:
  """``wcd``'s constant ``E[max - mean] = E[max]``.

  Args:
    n: the number of values per statistic (an int, or int32 counts).
    **unused: bound parameters, ignored.

  Returns:
    ``expected_normal_max(n)``.
  """
  del unused
  return expected_normal_max(n)


#: Each built-in measure function's normal scale: what
#: :func:`gbn_jax.register_measure` takes for ``normal_scale`` when a name is
#: registered for one without it.
BUILTIN_SCALES: dict[Callable[..., Any], NormalScale] = {
    deviations.sd: 1.0,
    deviations.mad: _SQRT_2_OVER_PI,  # E|Z|
    deviations.rsd: _INV_SQRT_2_PI,  # E[Z+] = phi(0)
    deviations.sqd: sqd_normal_scale,
    deviations.rbd: rbd_normal_scale,
    deviations.wcd: wcd_normal_scale,
    deviations.bpoe: _SQRT_2_OVER_PI,  # E[Z | Z > 0] = phi(0) / (1/2)
}
