"""The extremes' values and tie-split derivatives against numpy, on both
layouts their tie count distinguishes: many positions with the leading axis
kept (group, layer and instance statistics) and reductions over the leading
axis or of few positions (a statistic per feature).

The references are written from the definition: the cotangent of the
maximum (minimum) is split equally among the masked-in elements equal to
it, none when it is NaN (no element equals it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax._selection import reductions

from tests.helpers import reference as ref

# (shape, axes): the first three have at least reductions._MANY_POSITIONS
# positions and keep the leading axis; the others do not.
LAYOUTS = [
    ((1024, 8), (1,)),
    ((128, 4, 8, 2), (1, 3)),
    ((32, 4, 4, 32), (1, 2)),
    ((8, 6, 5), (0, 1)),
    ((6, 8), (1,)),
]


def _positions(shape, axes):
  return int(np.prod([n for i, n in enumerate(shape) if i not in axes]))


def test_layouts_cover_both_counts():
  many = [
      0 not in axes
      and _positions(shape, axes) >= reductions._MANY_POSITIONS  # pylint: disable=protected-access
      for shape, axes in LAYOUTS
  ]
  assert any(many) and not all(many)


def _batch(shape, axes, seed, *, special=True):
  """Small integers (many ties); NaN, inf and -inf at some positions."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-3, 4, shape).astype(np.float64)
  if special:
    rows = ref.rows(x, axes)
    rows[0, 0] = np.nan
    rows[1, :2] = np.inf
    rows[2, 1] = -np.inf
    rows[3, :] = -np.inf
    x = ref.unrows(rows, shape, axes)
  return x


def _mask(shape, axes, seed):
  """Random, with one position that has nothing masked in."""
  rng = np.random.default_rng(seed)
  mask = rng.random(shape) < 0.7
  rows = ref.rows(mask, axes)
  rows[-1, :] = False
  return ref.unrows(rows, shape, axes)


def _reference(x, axes, largest, mask):
  """Per position: the extreme and each element's share of its cotangent.

  A NaN among the masked-in elements gives NaN (np.max propagates it), and
  a NaN extreme passes no cotangent on (no element equals it).
  """
  rows = ref.rows(x, axes)
  keep = np.ones(rows.shape, bool) if mask is None else ref.rows(mask, axes)
  values = np.empty(rows.shape[0])
  share = np.zeros(rows.shape)
  for i, (row, kept) in enumerate(zip(rows, keep)):
    chosen = row[kept]
    if chosen.size == 0:
      values[i] = np.nan
      continue
    values[i] = chosen.max() if largest else chosen.min()
    if np.isnan(values[i]):
      continue
    tied = kept & (row == values[i])
    share[i, tied] = 1.0 / tied.sum()
  return values, share


@pytest.mark.parametrize("shape,axes", LAYOUTS)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_value_grad_and_jvp(shape, axes, largest, masked):
  x = _batch(shape, axes, seed=len(shape))
  mask = _mask(shape, axes, seed=3) if masked else None
  values, share = _reference(x, axes, largest, mask)
  fn = lambda a: gbn_jax.reductions.extreme(
      a, axes, largest=largest, where=mask
  )
  xj = jnp.asarray(x, jnp.float32)
  got = fn(xj)
  np.testing.assert_array_equal(got, values.reshape(got.shape))

  rng = np.random.default_rng(5)
  cotangent = rng.standard_normal(got.shape)
  grad = jax.grad(lambda a: jnp.vdot(fn(a), cotangent))(xj)
  want = ref.unrows(share * cotangent.reshape(-1, 1), shape, axes)
  np.testing.assert_allclose(grad, want, rtol=1e-6, atol=0)

  tangent = rng.standard_normal(shape)
  _, jvp = jax.jvp(fn, (xj,), (jnp.asarray(tangent, jnp.float32),))
  want_jvp = (share * ref.rows(tangent, axes)).sum(1)
  np.testing.assert_allclose(
      jvp, want_jvp.reshape(jvp.shape), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("shape,axes", LAYOUTS)
def test_gradient_equals_jnp_max(shape, axes):
  # jnp.max's own rule splits the cotangent among ties as well.
  x = jnp.asarray(_batch(shape, axes, seed=7, special=False), jnp.float32)
  w = jax.random.normal(
      jax.random.key(0), ref.rows(np.asarray(x), axes)[:, 0].shape
  )
  w = w.reshape(jnp.max(x, axes).shape)
  for largest, reduce in ((True, jnp.max), (False, jnp.min)):
    got = jax.grad(
        lambda a, l=largest: jnp.vdot(
            gbn_jax.reductions.extreme(a, axes, largest=l), w
        )
    )(x)
    want = jax.grad(lambda a, r=reduce: jnp.vdot(r(a, axes), w))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape,axes", LAYOUTS)
@pytest.mark.parametrize("masked", [False, True])
def test_hessian_vector_product(shape, axes, masked):
  # f = sum c * max^2: grad = 2 c max share, and along v the derivative of
  # that is 2 c (share . v) share (max is linear along v within its ties).
  x = _batch(shape, axes, seed=11, special=False)
  mask = _mask(shape, axes, seed=12) if masked else None
  values, share = _reference(x, axes, True, mask)
  rng = np.random.default_rng(13)
  c = rng.standard_normal(values.shape)
  v = rng.standard_normal(shape)

  def f(a):
    m = gbn_jax.reductions.extreme(a, axes, largest=True, where=mask)
    m = jnp.where(jnp.isnan(m), 0.0, m)
    return jnp.sum(jnp.asarray(c.reshape(m.shape), m.dtype) * m * m)

  with jax.enable_x64(True):
    _, hvp = jax.jvp(jax.grad(f), (jnp.asarray(x),), (jnp.asarray(v),))
  valid = ~np.isnan(values)
  dm = (share * ref.rows(v, axes)).sum(1)
  want = 2 * (c * dm * valid).reshape(-1, 1) * share
  np.testing.assert_allclose(hvp, ref.unrows(want, shape, axes), rtol=1e-12)


@pytest.mark.parametrize("shape,axes", LAYOUTS[:3])
def test_half_precision_gradient(shape, axes):
  x = _batch(shape, axes, seed=17, special=False)
  values, share = _reference(x, axes, True, None)
  xj = jnp.asarray(x, jnp.bfloat16)
  got = gbn_jax.reductions.extreme(xj, axes, largest=True)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float64).ravel(), values)
  grad = jax.grad(
      lambda a: jnp.sum(
          gbn_jax.reductions.extreme(a, axes, largest=True).astype(jnp.float32)
      )
  )(xj)
  assert grad.dtype == jnp.bfloat16
  np.testing.assert_allclose(
      np.asarray(grad, np.float64), ref.unrows(share, shape, axes), rtol=1e-2
  )


@pytest.mark.parametrize("shape,axes", LAYOUTS)
@pytest.mark.parametrize("masked", [False, True])
def test_count_equal_counts_masked_in_ties(shape, axes, masked):
  x = _batch(shape, axes, seed=19)
  mask = _mask(shape, axes, seed=20) if masked else None
  rng = np.random.default_rng(21)
  value = rng.integers(-3, 4, ref.rows(x, axes).shape[0]).astype(np.float64)
  value[1] = np.inf
  value[2] = np.nan
  rows = ref.rows(x, axes) == value[:, None]
  if mask is not None:
    rows &= ref.rows(mask, axes)
  xj = jnp.asarray(x, jnp.float32)
  kept = [n for i, n in enumerate(shape) if i not in axes]
  got = reductions.count_equal(
      xj,
      jnp.asarray(value, jnp.float32).reshape(kept),
      axes,
      None if mask is None else jnp.asarray(mask),
  )
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got.ravel(), rows.sum(1))


def _central_differences(f, x, direction, eps=1e-6):
  return (f(x + eps * direction) - f(x - eps * direction)) / (2 * eps)


@pytest.mark.parametrize("measure", ["rbd", "wcd"])
def test_group_norm_gradient_at_ties_is_a_tie_preserving_difference(measure):
  # 64 examples of 16 groups: many positions, the group's channels last.
  rng = np.random.default_rng(23)
  with jax.enable_x64(True):
    x = jnp.asarray(rng.integers(-3, 4, (64, 2, 2, 32)), jnp.float64)
    layer = gbn_jax.linen.GGroupNorm(
        num_groups=16, measure=measure, use_bias=False
    )
    variables = {"params": {"scale": jnp.linspace(0.5, 1.5, 32)}}
    w = jnp.asarray(rng.standard_normal(x.shape))
    loss = jax.jit(lambda a: jnp.sum(layer.apply(variables, a) * w))
    levels = rng.standard_normal(7)
    # Equal within a tie, so the ties stay ties along it.
    d = jnp.asarray(levels[(np.asarray(x) + 3).astype(int)])
    np.testing.assert_allclose(
        jnp.sum(jax.jit(jax.grad(loss))(x) * d),
        _central_differences(loss, x, d),
        rtol=1e-6,
    )
