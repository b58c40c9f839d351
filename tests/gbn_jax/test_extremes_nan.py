"""NaN through the measures built on extremes (rbd, wcd) and the layers
using them, against numpy written from the definitions: np.max and np.min
propagate NaN, so a feature (group, example) holding a NaN has NaN
statistic and deviation, hence NaN output.

The layouts include those where XLA:CPU's own max and min skip NaN (the
leading axis kept over a short minor axis, or the batch axis reduced).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import deviations
import gbn_jax.linen

from tests.helpers import reference as ref

LAYOUTS = [
    ((1024, 8), (1,)),
    ((1024, 8), (0,)),
    ((32, 4, 4, 32), (1, 2)),
    ((8, 6, 7), (0, 1)),
]
SLOW = pytest.mark.slow


def _quick_first(values, quick):
  """``values`` as parameters, past the first ``quick`` marked slow (the
  quick suite's time is small; CI runs the slow ones too)."""
  slow = lambda v: pytest.param(
      *(v if isinstance(v, tuple) else (v,)), marks=SLOW
  )
  return [v if i < quick else slow(v) for i, v in enumerate(values)]


def _batch(shape, axes):
  """Normal values; NaN first, in the middle and last in some positions'
  elements, alone or beside an infinity, and infinities without NaN."""
  rng = np.random.default_rng(len(shape))
  rows = ref.rows(rng.standard_normal(shape).astype(np.float32), axes).copy()
  n = rows.shape[1]
  rows[0, 0] = np.nan
  rows[1, n // 2] = np.nan
  rows[2, -1] = np.nan
  rows[3, 0], rows[3, -1] = np.inf, np.nan
  rows[4, 1] = -np.inf
  rows[5, 0] = np.inf
  return ref.unrows(rows, shape, axes)


def _reference(name, x, axes, mask):
  """``(S, D)`` per position from the definitions, in float64."""
  rows = ref.rows(x.astype(np.float64), axes)
  keep = np.ones(rows.shape, bool) if mask is None else ref.rows(mask, axes)
  s, d = [], []
  with np.errstate(invalid="ignore"):  # inf - inf is NaN, as it should be
    for row, kept in zip(rows, keep):
      chosen = row[kept]
      if chosen.size == 0:
        s.append(np.nan)
        d.append(np.nan)
        continue
      hi, lo = np.max(chosen), np.min(chosen)
      if name == "rbd":
        s.append((hi + lo) / 2)
        d.append(hi - lo)
      else:
        s.append(hi)
        d.append(hi - np.mean(chosen))
  return np.array(s), np.array(d)


def _assert_matches(got, want):
  got = np.asarray(got, np.float64).ravel()
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape,axes", _quick_first(LAYOUTS, 3))
@pytest.mark.parametrize("name", ["rbd", "wcd"])
@pytest.mark.parametrize("masked", _quick_first([False, True], 1))
@pytest.mark.parametrize("jit", [False, True])
def test_measure_matches_numpy(shape, axes, name, masked, jit):
  x = _batch(shape, axes)
  mask = None
  if masked:
    mask = np.random.default_rng(1).random(shape) < 0.8
    rows = ref.rows(mask, axes)
    rows[:6] = True  # the special elements stay in
    rows[-1] = False
    mask = ref.unrows(rows, shape, axes)
  fn = lambda a: getattr(deviations, name)(a, axes, where=mask)
  s, d = (jax.jit(fn) if jit else fn)(jnp.asarray(x))
  want_s, want_d = _reference(name, x, axes, mask)
  _assert_matches(s, want_s)
  _assert_matches(d, want_d)


@pytest.mark.parametrize("name", ["rbd", "wcd"])
@pytest.mark.parametrize("jit", [False, True])
def test_measure_passes_no_cotangent_from_a_nan_position(name, jit):
  shape, axes = LAYOUTS[0]
  x = jnp.asarray(_batch(shape, axes))
  c = jnp.asarray(np.random.default_rng(2).standard_normal(shape[0]))

  def loss(a):
    s, d = getattr(deviations, name)(a, axes)
    return jnp.sum(jnp.where(jnp.isnan(s), 0.0, s) * c)

  grad = ref.rows(
      np.asarray((jax.jit(jax.grad(loss)) if jit else jax.grad(loss))(x)), axes
  )
  nan = np.isnan(ref.rows(np.asarray(x), axes)).any(1)
  assert nan.any() and not nan.all()
  np.testing.assert_array_equal(grad[nan], 0.0)
  # Elsewhere the cotangent reaches the extremes as the tie rule has it.
  np.testing.assert_allclose(grad[~nan].sum(1), np.asarray(c)[~nan], rtol=1e-6)


@pytest.mark.parametrize("shape,axes", _quick_first(LAYOUTS[:3], 1))
@pytest.mark.parametrize("name", ["rbd", "wcd"])
@pytest.mark.parametrize("jit", [False, True])
def test_finite_input_is_unchanged(shape, axes, name, jit):
  # The NaN check only ever replaces a value by NaN: on finite input the
  # pair is the plain reductions' bit for bit.
  x = jnp.asarray(np.random.default_rng(3).integers(-3, 4, shape), jnp.float32)

  def plain(a):
    hi, lo = jnp.max(a, axes), jnp.min(a, axes)
    if name == "rbd":
      return (hi + lo) / 2, hi - lo
    return hi, hi - jnp.mean(a, axes)

  fn = lambda a: getattr(deviations, name)(a, axes)
  if jit:
    fn, plain = jax.jit(fn), jax.jit(plain)
  for got, want in zip(fn(x), plain(x)):
    np.testing.assert_array_equal(got, want)


def _layers(measure):
  """(layer, shape, reduced axes, group size) with the NaN-skipping layouts."""
  return [
      (
          gbn_jax.linen.GBatchNorm(use_running_average=False, measure=measure),
          (1024, 8),
          (0,),
          1,
      ),
      (
          gbn_jax.linen.GBatchNorm(use_running_average=False, measure=measure),
          (16, 4, 4, 8),
          (0, 1, 2),
          1,
      ),
      (gbn_jax.linen.GLayerNorm(measure=measure), (1024, 8), (1,), 1),
      (
          gbn_jax.linen.GGroupNorm(num_groups=4, measure=measure),
          (1024, 8),
          (),
          2,
      ),
      (gbn_jax.linen.GInstanceNorm(measure=measure), (32, 4, 4, 32), (1, 2), 1),
  ]


# wcd's deviation, max - mean, was NaN there already: its layers are slow.
@pytest.mark.parametrize("measure", _quick_first(["rbd", "wcd"], 1))
@pytest.mark.parametrize("index", _quick_first([0, 2, 3, 4, 1], 4))
@pytest.mark.parametrize("jit", [False, True])
def test_layer_output_is_nan_where_its_batch_holds_one(measure, index, jit):
  layer, shape, axes, group = _layers(measure)[index]
  x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1)
  flat[:: 7 * flat.size // 10 + 1] = np.nan
  variables = layer.init(jax.random.key(0), jnp.asarray(x))
  apply = lambda a: layer.apply(variables, a, mutable=["batch_stats"])[0]
  y = np.asarray((jax.jit(apply) if jit else apply)(jnp.asarray(x)))
  # The reference: (x - S) / sqrt(D^2 + eps), S and D from the definitions
  # over each feature's (group's) elements; scale 1 and bias 0 at init.
  grouped = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  red = tuple(axes) + ((x.ndim,) if group > 1 else ())
  g = grouped if group > 1 else x
  s, d = _reference(measure, g, red, None)
  kept = [n for i, n in enumerate(g.shape) if i not in red]
  expand = lambda v: np.expand_dims(v.reshape(kept), red)
  want = (g - expand(s)) / np.sqrt(expand(d) ** 2 + 1e-6)
  want = want.reshape(shape)
  assert np.isnan(want).any() and not np.isnan(want).all()
  np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
