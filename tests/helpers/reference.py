"""Numpy references written from the definitions, independent of gbn_jax.

Everything works on a 1-D float64 sample; ``per_feature`` lifts a 1-D
reference to "reduce over these axes" for arrays.
"""

from __future__ import annotations

import fractions

import numpy as np


def quantile_1d(x: np.ndarray, alpha: float) -> float:
  """min{z : P(x <= z) >= alpha}, with alpha taken as the decimal it prints as."""
  x = np.sort(np.asarray(x, np.float64))
  n = len(x)
  level = fractions.Fraction(repr(float(alpha))) * n
  for z in x:  # the minimum over candidate values, straight from the definition
    if fractions.Fraction(int(np.sum(x <= z))) >= level:
      return float(z)
  raise AssertionError("unreachable: P(x <= max) = 1 >= alpha")


def superquantile_1d(x: np.ndarray, alpha: float) -> float:
  """CVaR as the average of the quantile function over [alpha, 1].

  For the empirical distribution, q_p = x_(i) on ((i-1)/N, i/N]; integrate
  exactly, which is independent of the Rockafellar-Uryasev formula.
  """
  x = np.sort(np.asarray(x, np.float64))
  n = len(x)
  total = 0.0
  for i, v in enumerate(x):
    lo, hi = max(i / n, alpha), (i + 1) / n
    if hi > lo:
      total += v * (hi - lo)
  return total / (1 - alpha)


def _sqd(x: np.ndarray, mean: float, alpha: float) -> tuple[float, float]:
  return quantile_1d(x, alpha), superquantile_1d(x, alpha) - mean


def _bpoe(x: np.ndarray, mean: float) -> tuple[float, float]:
  above = x[x > mean]
  return mean, (above - mean).mean() if above.size else 0.0


# Each built-in measure's (S, D), from the paper's table, as
# ``fn(x, mean, alpha)``; 'sqd' takes alpha, 'sqd1'..'sqd3' bind it.
# tests/gbn_jax/test_measures.py checks that the names are the registry's built-ins.
_DEFINITIONS = {
    "sd": lambda x, mean, _: (mean, np.sqrt(np.mean((x - mean) ** 2))),
    "mad": lambda x, mean, _: (mean, np.mean(np.abs(x - mean))),
    "rsd": lambda x, mean, _: (mean, np.mean(np.clip(x - mean, 0, None))),
    "sqd": _sqd,
    "sqd1": lambda x, mean, _: _sqd(x, mean, 0.25),
    "sqd2": lambda x, mean, _: _sqd(x, mean, 0.5),
    "sqd3": lambda x, mean, _: _sqd(x, mean, 0.75),
    "rbd": lambda x, mean, _: ((x.max() + x.min()) / 2, x.max() - x.min()),
    "wcd": lambda x, mean, _: (x.max(), x.max() - mean),
    "bpoe": lambda x, mean, _: _bpoe(x, mean),
}

#: The measure names :func:`measure_1d` defines.
MEASURE_NAMES: tuple[str, ...] = tuple(_DEFINITIONS)


def measure_1d(name: str, x: np.ndarray, alpha: float | None = None):
  """(S, D) of the paper's table, from the definitions."""
  if name not in _DEFINITIONS:
    raise ValueError(name)
  x = np.asarray(x, np.float64)
  return _DEFINITIONS[name](x, x.mean(), alpha)


def per_feature(fn, x: np.ndarray, axes: tuple[int, ...], mask=None):
  """Applies ``fn(sample_1d) -> tuple`` to every feature position.

  Returns a tuple of arrays of the non-reduced shape.
  """
  x = np.asarray(x, np.float64)
  rest = [i for i in range(x.ndim) if i not in axes]
  moved = np.transpose(x, rest + list(axes))
  flat = moved.reshape(-1, int(np.prod([x.shape[a] for a in axes])))
  if mask is not None:
    m = np.transpose(np.broadcast_to(mask, x.shape), rest + list(axes))
    m = m.reshape(flat.shape)
  outs = []
  for i, row in enumerate(flat):
    outs.append(fn(row if mask is None else row[m[i]]))
  shape = [x.shape[i] for i in rest]
  return tuple(np.array(col, np.float64).reshape(shape) for col in zip(*outs))


def rows(a: np.ndarray, axes) -> np.ndarray:
  """``a`` as (positions, reduced elements): one row per position kept,
  the positions in order, each row the elements reduced over ``axes``."""
  kept = [i for i in range(a.ndim) if i not in axes]
  moved = np.transpose(a, kept + list(axes))
  return moved.reshape(-1, int(np.prod([a.shape[i] for i in axes])))


def unrows(array_rows: np.ndarray, shape, axes) -> np.ndarray:
  """The inverse of :func:`rows`: back to ``shape``."""
  kept = [i for i in range(len(shape)) if i not in axes]
  order = kept + list(axes)
  moved = array_rows.reshape([shape[i] for i in order])
  return np.transpose(moved, np.argsort(order))


def normalize(x, s, d, axes, scale=1.0, bias=0.0, eps=1e-5):
  """(x - S) / sqrt(D^2 + eps) * scale + bias with per-feature S, D."""
  s = np.expand_dims(s, axes)
  d = np.expand_dims(d, axes)
  return (np.asarray(x, np.float64) - s) / np.sqrt(d**2 + eps) * scale + bias


def relu_like(rng: np.random.Generator, shape, zero_frac=0.5, dtype=np.float32):
  """ReLU outputs: many exact zeros, the rest positive and continuous."""
  x = rng.standard_normal(shape) + (rng.random(shape) < 0.1) * 2
  x[rng.random(shape) < zero_frac] = 0.0
  return np.maximum(x, 0).astype(dtype)


def coarse(rng: np.random.Generator, shape, levels=4, dtype=np.float32):
  """Values from a tiny set, so every quantile sits on a heavy tie."""
  return (rng.integers(0, levels, shape) * 0.5 - 0.5).astype(dtype)
