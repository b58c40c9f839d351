"""Exact quantiles/superquantiles: values vs definitions, gradients vs FD."""

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import _quantiles
from gbn_jax._selection import common
from gbn_jax._selection import fused
from gbn_jax._selection import native

from tests.helpers import reference as ref

ALPHAS = [1e-6, 0.01, 0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 0.9, 0.999999]


def _inputs(kind, shape, seed=0):
  rng = np.random.default_rng(seed)
  if kind == "normal":
    return rng.standard_normal(shape).astype(np.float32)
  if kind == "relu":
    return ref.relu_like(rng, shape)
  if kind == "coarse":
    return ref.coarse(rng, shape)
  if kind == "inf":
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::7] = np.inf
    x.reshape(-1)[3::11] = -np.inf
    return x
  raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "relu", "coarse", "inf"])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_quantile_matches_definition(kind, alpha):
  x = _inputs(kind, (37, 5))
  got = np.asarray(gbn_jax.quantile(x, alpha, axis=0))
  (want,) = ref.per_feature(lambda r: (ref.quantile_1d(r, alpha),), x, (0,))
  np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("kind", ["normal", "relu", "coarse"])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_superquantile_matches_integral_definition(kind, alpha):
  x = _inputs(kind, (37, 5))
  got = np.asarray(gbn_jax.superquantile(x, alpha, axis=0))
  (want,) = ref.per_feature(
      lambda r: (ref.superquantile_1d(r, alpha),), x, (0,)
  )
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 10, 20])
@pytest.mark.parametrize(
    "alpha", [0.1, 0.2, 0.25, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9]
)
def test_whole_alpha_n_selects_that_rank(n, alpha):
  # alpha*N whole (or nearly, in binary) must select exactly the alpha*N-th value.
  x = np.arange(n, dtype=np.float32)[::-1].copy()
  k = math.ceil(fractions.Fraction(repr(alpha)) * n)
  assert _quantiles.quantile_rank(alpha, n) == k
  assert float(gbn_jax.quantile(x, alpha, axis=0)) == float(k - 1)
  # Same rank when the count is traced (masked path).
  assert int(_quantiles.quantile_rank(alpha, jnp.int32(n))) == k


def test_agrees_with_numpy_inverted_cdf_where_unambiguous():
  x = _inputs("normal", (64, 3), seed=3)
  for alpha in (0.25, 0.5, 0.75, 0.125, 0.4375):  # alpha*64 exact in binary
    np.testing.assert_array_equal(
        np.asarray(gbn_jax.quantile(x, alpha, axis=0)),
        np.quantile(x, alpha, axis=0, method="inverted_cdf"),
    )


@pytest.mark.parametrize("axis", [(0, 1, 2), (0, 2), 1, -1, None])
def test_axes_and_shapes(axis):
  x = _inputs("relu", (6, 5, 4, 3), seed=1)
  got = np.asarray(gbn_jax.quantile(x, 0.6, axis=axis))
  axes = common.reduction_axes(x.ndim, axis)
  (want,) = ref.per_feature(lambda r: (ref.quantile_1d(r, 0.6),), x, axes)
  np.testing.assert_array_equal(got, want.astype(np.float32).reshape(got.shape))
  assert got.shape == np.quantile(x, 0.6, axis=axis).shape


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.9])
def test_mask_restricts_the_sample(alpha):
  rng = np.random.default_rng(5)
  x = _inputs("coarse", (30, 4), seed=5)
  mask = rng.random((30, 4)) < 0.6
  mask[:, 3] = False
  mask[7, 3] = True  # a feature with a single masked-in element
  got = np.asarray(gbn_jax.quantile(x, alpha, axis=0, where=mask))
  want = [ref.quantile_1d(x[mask[:, j], j], alpha) for j in range(4)]
  np.testing.assert_array_equal(got, np.float32(want))
  got_sq = np.asarray(gbn_jax.superquantile(x, alpha, axis=0, where=mask))
  want_sq = [ref.superquantile_1d(x[mask[:, j], j], alpha) for j in range(4)]
  np.testing.assert_allclose(got_sq, want_sq, rtol=1e-5, atol=1e-6)


def test_nan_and_empty_give_nan():
  x = np.ones((5, 3), np.float32)
  x[2, 1] = np.nan
  mask = np.ones((5, 3), bool)
  mask[:, 2] = False
  q = np.asarray(gbn_jax.quantile(x, 0.5, axis=0, where=mask))
  assert q[0] == 1 and np.isnan(q[1]) and np.isnan(q[2])
  assert np.isnan(np.asarray(gbn_jax.superquantile(x, 0.5, axis=0))[1])
  # a NaN that is masked out does not count
  mask[2, 1] = False
  assert float(gbn_jax.quantile(x, 0.5, axis=0, where=mask)[1]) == 1


def test_half_precision_is_selected_in_float32_and_keeps_dtype():
  x = _inputs("normal", (50, 2), seed=2)
  for dtype in (jnp.bfloat16, jnp.float16):
    xh = jnp.asarray(x, dtype)
    q = gbn_jax.quantile(xh, 0.3, axis=0)
    assert q.dtype == dtype
    (want,) = ref.per_feature(
        lambda r: (ref.quantile_1d(r, 0.3),), np.asarray(xh, np.float32), (0,)
    )
    np.testing.assert_array_equal(np.asarray(q, np.float32), want)


@pytest.mark.parametrize(
    "alpha", [0, 1, -0.1, 1.5, float("nan"), "half", None, True]
)
def test_bad_alpha(alpha):
  with pytest.raises(ValueError, match="alpha"):
    gbn_jax.quantile(jnp.ones(3), alpha, axis=0)


def test_bad_axis():
  with pytest.raises(ValueError, match="out of range"):
    gbn_jax.quantile(jnp.ones((3, 2)), 0.5, axis=2)
  with pytest.raises(ValueError, match="at least one axis"):
    gbn_jax.quantile(jnp.ones((3, 2)), 0.5, axis=())


# ------------------------------------------------------------ gradients


def _central_fd(f, x, direction, eps=1e-3):
  x = np.asarray(x, np.float64)
  return (
      np.asarray(f(jnp.asarray(x + eps * direction, jnp.float32)), np.float64)
      - np.asarray(f(jnp.asarray(x - eps * direction, jnp.float32)), np.float64)
  ) / (2 * eps)


def _separated(n, seed):
  # Generic point: values at least 0.05 apart, so +-1e-3 never reorders them.
  rng = np.random.default_rng(seed)
  return (rng.permutation(n) * 0.05 + rng.random(n) * 0.01).astype(np.float32)


@pytest.mark.parametrize("fn", ["quantile", "superquantile"])
@pytest.mark.parametrize("alpha", [0.05, 0.25, 0.3, 0.5, 0.77, 0.95])
def test_gradient_matches_finite_differences(fn, alpha):
  f = lambda x: getattr(gbn_jax, fn)(x, alpha, axis=0)
  x = _separated(23, seed=int(alpha * 100))
  g = np.asarray(jax.grad(f)(jnp.asarray(x)))
  rng = np.random.default_rng(0)
  for _ in range(4):
    d = rng.standard_normal(x.shape)
    np.testing.assert_allclose(
        g @ d, _central_fd(f, x, d), rtol=2e-3, atol=2e-3
    )
  assert abs(g.sum() - 1) < 1e-5  # translation equivariance


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.8])
def test_tie_rule_splits_equally_and_matches_tie_preserving_fd(alpha):
  # Heavy ties at the quantile (ReLU-like zeros and repeats).
  x = np.array([0, 0, 0, 0, 1.5, 0.7, 0, 2.5, 0.7, 3.1, 0.7, 0.2], np.float32)
  q = float(gbn_jax.quantile(x, alpha, axis=0))
  tied = x == q
  gq = np.asarray(jax.grad(lambda v: gbn_jax.quantile(v, alpha, axis=0))(x))
  np.testing.assert_allclose(gq[tied], 1 / tied.sum())
  assert np.all(gq[~tied] == 0)
  # Directions that keep tied values tied: q and qbar are differentiable there,
  # so the chosen rule must reproduce their finite differences exactly.
  groups = {v: np.flatnonzero(x == v) for v in np.unique(x)}
  rng = np.random.default_rng(1)
  for fn in ("quantile", "superquantile"):
    f = lambda v: getattr(gbn_jax, fn)(v, alpha, axis=0)
    g = np.asarray(jax.grad(f)(x))
    for _ in range(5):
      d = np.zeros_like(x, np.float64)
      for idx in groups.values():
        d[idx] = rng.standard_normal()
      np.testing.assert_allclose(
          g @ d, _central_fd(f, x, d, eps=1e-2), rtol=1e-4, atol=1e-4
      )


def test_superquantile_gradient_formula():
  # d qbar/dx_i = 1[x_i > q]/(N(1-alpha)) + (1 - P(x > q)/(1-alpha)) * dq/dx_i
  x = _separated(17, seed=9)
  alpha = 0.6
  q = float(gbn_jax.quantile(x, alpha, axis=0))
  n = len(x)
  want = (x > q) / (n * (1 - alpha)) + (1 - (x > q).mean() / (1 - alpha)) * (
      x == q
  )
  got = np.asarray(
      jax.grad(lambda v: gbn_jax.superquantile(v, alpha, axis=0))(x)
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_composes_with_jit_vmap_grad():
  x = jnp.asarray(_inputs("relu", (4, 40, 3), seed=4))
  f = lambda v: gbn_jax.superquantile(v, 0.4, axis=0)
  batched = jax.jit(jax.vmap(f))(x)
  one_by_one = jnp.stack([f(v) for v in x])
  np.testing.assert_allclose(batched, one_by_one, rtol=1e-6)
  gv = jax.jit(jax.vmap(jax.grad(lambda v: f(v).sum())))(x)
  g1 = jnp.stack([jax.grad(lambda v: f(v).sum())(v) for v in x])
  np.testing.assert_allclose(gv, g1, rtol=1e-6)
  # second pass through jit/grad of the masked, traced-rank path
  mask = x[0] > 0.1
  gm = jax.jit(
      jax.grad(lambda v: gbn_jax.quantile(v, 0.5, 0, where=mask).sum())
  )(x[0])
  assert np.isfinite(np.asarray(gm)).all() and np.allclose(
      np.asarray(gm).sum(0), 1
  )


@pytest.mark.parametrize("known", [[4, 0, 7], [4, -1, 7]])
def test_unknown_kernel_counts_are_counted_where_the_mode_is_unreadable(
    known, monkeypatch
):
  # Off x86 the kernel cannot read the denormal mode and says -1 for a zero
  # or denormal answer; the count then comes from the flags, behind a cond.
  monkeypatch.setattr(native, "counts_always_known", lambda: False)
  x = jnp.asarray(_inputs("relu", (50, 3), seed=2))
  flags = lambda: x == 0
  got = jax.jit(lambda k: fused.known_or_counted(k, flags, (0,)))(
      jnp.asarray(known)
  )
  # One unknown count sends every position to the counting branch.
  want = known if min(known) >= 0 else (np.asarray(x) == 0).sum(axis=0)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("trusted", [True, False])
def test_sqd_gradient_formula_with_and_without_the_fallback_count(
    trusted, monkeypatch
):
  # The kernel's counts used outright (x86) or behind the cond kept for CPUs
  # whose denormal mode it cannot read: the gradient of D = qbar - mean must
  # follow the definition either way. ReLU zeros put q_0.25 on a heavy tie.
  if not trusted:
    monkeypatch.setattr(native, "counts_always_known", lambda: False)
  alpha, w = 0.25, np.arange(1.0, 5.0)
  x = _inputs("relu", (300, 4), seed=3)
  f = lambda v: jnp.sum(gbn_jax.get_measure("sqd", alpha=alpha)(v, 0)[1] * w)
  g = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(x)), np.float64)
  n = x.shape[0]
  q = np.sort(x, axis=0)[math.ceil(alpha * n) - 1]
  tied, above = x == q, x > q
  dq = tied / tied.sum(axis=0)
  dqbar = (
      above / (n * (1 - alpha)) + (1 - above.mean(axis=0) / (1 - alpha)) * dq
  )
  np.testing.assert_allclose(g, w * (dqbar - 1 / n), rtol=1e-4, atol=1e-8)
