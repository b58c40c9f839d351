"""Measures vs numpy definitions; registry and custom measures."""

import fractions

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import deviations
from gbn_jax import measures

from tests.helpers import reference as ref
from tests.helpers.gradients import assert_matches_central_differences
from tests.helpers.measures import BUILTIN_MEASURES
from tests.helpers.measures import COMPLETE_MEASURES


def _data(kind, shape=(41, 6), seed=0):
  rng = np.random.default_rng(seed)
  return {
      "normal": lambda: rng.standard_normal(shape).astype(np.float32),
      "skewed": lambda: rng.exponential(size=shape).astype(np.float32) ** 2,
      "relu": lambda: ref.relu_like(rng, shape),
      "coarse": lambda: ref.coarse(rng, shape),
  }[kind]()


def test_reference_defines_exactly_the_builtin_measures():
  # The numpy definitions are keyed by name: a measure added to the registry
  # without one would otherwise go untested against a definition.
  assert set(ref.MEASURE_NAMES) == set(BUILTIN_MEASURES)


def _assert_matches_definition(got, name, x, axis, alpha=None, mask=None):
  """``got = (S, D)`` of measure ``name`` over ``axis`` against the numpy
  definitions, per feature (masked-out elements left out)."""
  want_s, want_d = ref.per_feature(
      lambda r: ref.measure_1d(name, r, alpha), x, axis, mask=mask
  )
  # Also checks the shapes (numpy's assert_allclose would broadcast).
  chex.assert_trees_all_close(got[0], want_s, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(got[1], want_d, rtol=1e-4, atol=1e-5)


class MeasureVariantsTest(chex.TestCase):
  """Each measure jitted and not, against the definitions in numpy."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(
      kind=["normal", "skewed", "relu", "coarse"],
      name=[*COMPLETE_MEASURES, "sqd:0.1", "sqd:0.93"],
  )
  def test_measure_matches_definition(self, name, kind):
    name, params = gbn_jax.parse_measure_name(name)
    x = _data(kind)
    measure = gbn_jax.get_measure(name, **params)
    got = self.variant(lambda v: measure(v, 0))(x)
    _assert_matches_definition(got, name, x, (0,), alpha=params.get("alpha"))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(
      name=COMPLETE_MEASURES,
      # Over the batch (per feature) and keeping the leading axis (per
      # example): some measures compile differently for the two.
      axes=[(0, 1, 2), (1, 2)],
  )
  def test_measure_with_mask_and_multiple_axes(self, name, axes):
    rng = np.random.default_rng(3)
    x = _data("relu", (7, 5, 3, 4), seed=3)
    mask = rng.random(x.shape) < 0.7
    measure = gbn_jax.get_measure(name)
    got = self.variant(lambda v, m: measure(v, axes, where=m))(x, mask)
    _assert_matches_definition(got, name, x, axes, mask=mask)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*COMPLETE_MEASURES)
  def test_gradients_match_finite_differences(self, name):
    # Generic point: no ties, so every measure is differentiable there.
    rng = np.random.default_rng(7)
    x = rng.permutation(60).reshape(20, 3) * 0.05 + rng.random((20, 3)) * 0.01
    x = x.astype(np.float32)
    m = gbn_jax.get_measure(name)
    w = rng.standard_normal(2 * 3)
    f = lambda v: jnp.concatenate(m(v, 0)) @ w
    g = np.asarray(self.variant(jax.grad(f))(jnp.asarray(x)), np.float64)
    assert_matches_central_differences(f, g, x, rng, directions=3)


@pytest.mark.parametrize("kind", ["normal", "relu"])
@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.9])
def test_sqd_on_a_large_batch_values_and_gradient_formula(kind, alpha):
  # Over 16384 rows the native CPU kernel selects q from a sampled bracket and
  # returns sqd's sums from the same sweep: check both statistics and the
  # gradient against the definitions. ReLU zeros put q at 0 for small alpha,
  # where the tie counts come from JAX, not the kernel.
  rng = np.random.default_rng(int(alpha * 100))
  x = rng.standard_normal((20000, 3)).astype(np.float32)
  if kind == "relu":
    x = np.maximum(x, 0)
  n = x.shape[0]
  k = int(np.ceil(fractions.Fraction(repr(alpha)) * n))
  q = np.sort(x, axis=0)[k - 1].astype(np.float64)
  x64 = x.astype(np.float64)
  above, tied = x64 > q, x64 == q
  qbar = q + np.where(above, x64 - q, 0).mean(axis=0) / (1 - alpha)
  s, d = gbn_jax.get_measure("sqd", alpha=alpha)(x, 0)
  np.testing.assert_array_equal(s, q.astype(np.float32))
  np.testing.assert_allclose(d, qbar - x64.mean(axis=0), rtol=1e-5, atol=1e-6)
  w_s, w_d = rng.standard_normal(3), rng.standard_normal(3)
  f = lambda v: jnp.sum(
      w_s * gbn_jax.get_measure("sqd", alpha=alpha)(v, 0)[0]
  ) + jnp.sum(w_d * gbn_jax.get_measure("sqd", alpha=alpha)(v, 0)[1])
  g = np.asarray(jax.grad(f)(jnp.asarray(x)), np.float64)
  dq = tied / tied.sum(axis=0)
  dqbar = (
      above / (n * (1 - alpha)) + (1 - above.mean(axis=0) / (1 - alpha)) * dq
  )
  np.testing.assert_allclose(
      g, w_s * dq + w_d * (dqbar - 1 / n), rtol=1e-4, atol=1e-9
  )


def test_sd_fast_and_two_pass_variance_agree_and_squared_is_variance():
  x = _data("skewed")
  _, v_fast = measures.sd(x, 0, squared=True)
  _, v_slow = measures.sd(x, 0, squared=True, fast_variance=False)
  np.testing.assert_allclose(v_fast, np.var(x.astype(np.float64), 0), rtol=1e-5)
  np.testing.assert_allclose(v_slow, np.var(x.astype(np.float64), 0), rtol=1e-5)


def test_bpoe_is_sqd_at_the_level_of_the_mean():
  # The paper's "optimal choice": with alpha = P(x <= E x), the superquantile
  # deviation of SQD equals bPOE's conditional excess E[x - Ex | x > Ex].
  x = _data("skewed", (200, 1))[:, 0]
  mean = x.astype(np.float64).mean()
  alpha = float(np.mean(x <= mean))
  _, d_sqd = gbn_jax.get_measure("sqd", alpha=alpha)(x, 0)
  _, d_bpoe = gbn_jax.get_measure("bpoe")(x, 0)
  np.testing.assert_allclose(d_sqd, d_bpoe, rtol=1e-4)


def test_constant_and_single_element_features():
  for name in COMPLETE_MEASURES:
    m = gbn_jax.get_measure(name)
    s, d = m(jnp.full((9, 2), 3.0), 0)
    np.testing.assert_allclose(s, 3.0)
    np.testing.assert_allclose(d, 0.0, atol=1e-6)
    s, d = m(jnp.array([[2.5, -1.0]]), 0)  # one element per feature
    np.testing.assert_array_equal(s, [2.5, -1.0])
    np.testing.assert_array_equal(d, [0.0, 0.0])


@pytest.mark.parametrize("per_example", [False, True])
def test_nan_propagates_to_both_statistics(per_example):
  x = np.ones((6, 2), np.float32)
  x[1, 0] = np.nan
  # Per example: the statistics of each row, the leading axis kept.
  x, axis = (x.T, 1) if per_example else (x, 0)
  for name in COMPLETE_MEASURES:
    s, d = gbn_jax.get_measure(name)(x, axis)
    assert np.isnan(s[0]) and np.isnan(d[0]), name
    assert np.isfinite(s[1]) and np.isfinite(d[1]), name


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("keeps_leading", [False, True])
def test_rsd_positive_part_is_x_plus_abs_bit_for_bit(keeps_leading, jit):
  # rsd sums x + |x| (twice the positive part); its tangent follows
  # where(x > 0, x, 0)'s rule, doubled: 0 at 0 and at NaN.
  x = jnp.array(
      [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 1e-45, -1e-45, 3e38],
      jnp.float32,
  )
  part = lambda v: deviations._twice_positive_part(v, keeps_leading)  # pylint: disable=protected-access
  reference = lambda v: 2 * jnp.where(v > 0, v, 0)
  tangent = jnp.full_like(x, 1.5)
  run = jax.jit if jit else (lambda f: f)
  value, tangent_out = run(lambda v, t: jax.jvp(part, (v,), (t,)))(x, tangent)
  # XLA's own x + |x| (which flushes the subnormals, as the forms do).
  want_value = np.asarray(run(lambda v: v + jnp.abs(v))(x))
  np.testing.assert_array_equal(np.isnan(value), np.isnan(want_value))
  keep = ~np.isnan(want_value)
  np.testing.assert_array_equal(
      np.asarray(value).view(np.uint32)[keep], want_value.view(np.uint32)[keep]
  )
  _, want_tangent = jax.jvp(reference, (x,), (tangent,))
  np.testing.assert_array_equal(tangent_out, want_tangent)


def test_registry_errors():
  with pytest.raises(ValueError, match="valid names: .*sqd2"):
    gbn_jax.get_measure("sqd4")
  with pytest.raises(TypeError, match="unexpected parameter"):
    gbn_jax.get_measure("mad", alpha=0.5)
  with pytest.raises(TypeError, match="needs parameter"):
    gbn_jax.get_measure("sqd")
  with pytest.raises(TypeError, match="fixes"):
    gbn_jax.get_measure("sqd2", alpha=0.3)
  # The suggested general measure is the one with the same function.
  with pytest.raises(TypeError, match=r"get_measure\('sqd', alpha=\.\.\.\)"):
    gbn_jax.get_measure("sqd1", alpha=0.3)
  with pytest.raises(ValueError, match="alpha"):
    gbn_jax.get_measure("sqd", alpha=1.0)
  with pytest.raises(ValueError, match="already registered"):
    gbn_jax.register_measure("sd", measures.sd)


def test_register_a_new_measure():
  def trimmed_range(
      x, axis, *, where=None, axis_name=None, axis_index_groups=None, alpha
  ):
    lo = gbn_jax.quantile(x, 1 - alpha, axis, where=where, axis_name=axis_name)
    hi = gbn_jax.quantile(x, alpha, axis, where=where, axis_name=axis_name)
    return (hi + lo) / 2, hi - lo

  gbn_jax.register_measure("test_trimmed_range", trimmed_range, overwrite=True)
  assert "test_trimmed_range" in gbn_jax.MEASURES
  x = _data("normal")
  s, d = gbn_jax.get_measure("test_trimmed_range", alpha=0.9)(x, 0)
  hi = np.array([ref.quantile_1d(x[:, j], 0.9) for j in range(x.shape[1])])
  lo = np.array([ref.quantile_1d(x[:, j], 0.1) for j in range(x.shape[1])])
  np.testing.assert_allclose(d, hi - lo, rtol=1e-6)
  np.testing.assert_allclose(s, (hi + lo) / 2, rtol=1e-6, atol=1e-7)
