"""Tests of gbn_jax._radix_select (radix select, fixed pass count) against numpy.

The oracle is written from the definition: per feature, ``np.sort`` of the
masked-in elements, index ``k - 1``; tie and "above" counts are numpy's IEEE
compares (no denormal flushing, ``-0.0 == +0.0``), which is what integer keys
give. Values must match bit for bit (``-0.0`` is expected back as ``+0.0``).
Multi-device runs are in tests/multidevice/test_radix_multidevice.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax import _radix_select, _select

TINY = np.finfo(np.float32).tiny


def columns(x, axis, where=None):
  """``x`` (and the mask) as ``(N, F)`` columns: reduced axes first, flattened."""
  x = np.asarray(x, np.float32)
  kept = [d for d in range(x.ndim) if d not in axis]
  perm = list(axis) + kept
  n_cols = int(np.prod([x.shape[d] for d in kept]))
  cols = np.transpose(x, perm).reshape(-1, n_cols)
  mask = np.ones(cols.shape, bool)
  if where is not None:
    mask = np.transpose(np.broadcast_to(where, x.shape), perm).reshape(cols.shape)
  return cols, mask, [x.shape[d] for d in kept]


def numpy_kth(x, k, axis, where=None):
  """k-th smallest, ``#{x == it}`` and ``#{not x <= it}`` per kept position."""
  cols, mask, kept_shape = columns(x, axis, where)
  ks = np.broadcast_to(np.asarray(k), kept_shape).reshape(-1)
  value = np.full(cols.shape[1], np.nan, np.float32)
  ties = np.zeros(cols.shape[1], np.int64)
  above = np.zeros(cols.shape[1], np.int64)
  for f in range(cols.shape[1]):
    kept = cols[mask[:, f], f]
    if not 1 <= ks[f] <= kept.size:
      continue
    # np.sort orders denormals exactly and -0.0 == 0.0; IEEE compares (numpy
    # flushes nothing) count ties and elements above the same way.
    v = np.sort(kept)[ks[f] - 1]
    value[f] = 0.0 if v == 0 else v
    ties[f] = np.sum(kept == v)
    above[f] = np.sum(~(kept <= v))
  return tuple(a.reshape(kept_shape) for a in (value, ties, above))


def assert_bitwise(got, want):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@functools.partial(jax.jit, static_argnames=("axis", "digit_bits", "histogram"))
def select(x, k, axis, where=None, digit_bits=8, histogram="scatter"):
  return _radix_select.kth_smallest_with_sums_accelerator(
      x, k, axis, where=where, digit_bits=digit_bits, histogram=histogram
  )


@functools.partial(jax.jit, static_argnames=("axis",))
def select_local_ties(x, k, axis, where=None):
  return _radix_select.kth_smallest_accelerator(x, k, axis, where=where, return_ties=True)


def check(x, k, axis, where=None, **kw):
  """Value, ties and above against numpy; ``k`` per kept position (traced)."""
  _, _, kept_shape = columns(x, axis)
  k = np.broadcast_to(np.asarray(k, np.int32), kept_shape)
  value, ties, _, _, above = select(x, jnp.asarray(k), axis, where, **kw)
  want_value, want_ties, want_above = numpy_kth(x, k, axis, where)
  assert_bitwise(value, want_value)
  valid = ~np.isnan(want_value)
  np.testing.assert_array_equal(np.asarray(ties)[valid], want_ties[valid])
  np.testing.assert_array_equal(np.asarray(above)[valid], want_above[valid])


def ranks(n):
  wanted = {1, 2, n // 4, n // 2, (n + 1) // 2, (3 * n) // 4, n - 1, n}
  return sorted(k for k in wanted if 1 <= k <= n)


def rank_matrix(n, n_cols, seed=0):
  """Per-feature ranks: every rank of ``ranks(n)`` plus random ones."""
  rng = np.random.default_rng(seed)
  fixed = ranks(n)
  extra = rng.integers(1, n + 1, max(0, n_cols - len(fixed)))
  return np.concatenate([fixed, extra])[:n_cols].astype(np.int32)


def data(kind, shape, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  if kind == "relu":  # half the data exactly zero
    x = np.maximum(x, 0)
  elif kind == "halves":  # few distinct values
    x = np.round(x * 2) / 2
  elif kind == "tiny_set":
    x = rng.choice(np.float32([-1.5, 0.0, 2.0, 7.0]), size=shape)
  elif kind == "constant":
    x = np.full(shape, -3.25, np.float32)
  elif kind == "inf":
    x[rng.random(shape) < 0.15] = np.inf
    x[rng.random(shape) < 0.15] = -np.inf
  elif kind == "signed_zero":
    x = rng.choice(np.float32([-0.0, 0.0, -1.0, 1.0]), size=shape, p=[0.3, 0.3, 0.2, 0.2])
  elif kind == "denormal":
    # Denormals of both signs among zeros and normals: distinct integer keys.
    pool = np.float32([-3e-39, -1e-45, -0.0, 0.0, 1e-45, 2e-45, 5e-39, TINY, -TINY, 1.0])
    x = rng.choice(pool, size=shape)
  elif kind == "wide":  # magnitudes over the whole float range
    x = (np.sign(x) * np.exp(rng.uniform(-87, 88, shape))).astype(np.float32)
  elif kind == "huge":
    big = np.float32([np.finfo(np.float32).max, -np.finfo(np.float32).max, 3e38, -1e38])
    x = np.where(rng.random(shape) < 0.5, rng.choice(big, size=shape), x)
  return np.asarray(x, np.float32)


KINDS = ["normal", "relu", "halves", "tiny_set", "constant", "inf", "signed_zero", "denormal",
         "wide", "huge"]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 20000])
def test_row_counts_per_feature_k(n):
  # 13 features (not a multiple of 8), a different rank in each.
  x = data("normal", (n, 13), seed=n)
  k = rank_matrix(n, 13, seed=n)
  check(x, k, (0,))
  got = select(x, jnp.asarray(k), (0,))[0]
  assert_bitwise(got, _select.kth_smallest_reference(x, k, (0,)))


@pytest.mark.parametrize("kind", KINDS)
def test_nhwc_data_kinds_and_counts(kind):
  # NHWC over (0, 1, 2): 1024 rows, 3 features; every rank of ranks(n).
  x = data(kind, (4, 16, 16, 3), seed=KINDS.index(kind))
  for k in ranks(4 * 16 * 16):
    check(x, np.full(3, k), (0, 1, 2))


@pytest.mark.parametrize("kind", ["relu", "tiny_set", "signed_zero", "denormal"])
def test_repeated_values_at_every_target(kind):
  # Ranks at both ends of every run of tied values, and inside it.
  x = data(kind, (300, 4), seed=3 + len(kind))
  ordered = np.sort(x, axis=0)
  ends = set()
  for f in range(4):
    change = np.flatnonzero(ordered[1:, f] != ordered[:-1, f]) + 1
    ends.update(change.tolist())
    ends.update((change + 1).tolist())
  for k in sorted(e for e in ends if 1 <= e <= 300):
    check(x, np.full(4, k), (0,))


@pytest.mark.parametrize(
    "shape,axis", [((30, 4, 70), (0, 2)), ((5, 600), (1,)), ((3, 40, 50), (0, 1, 2))]
)
def test_other_axes(shape, axis):
  x = data("normal", shape, seed=5)
  n = int(np.prod([shape[a] for a in axis]))
  for k in (1, (n + 1) // 2, n):
    check(x, k, axis)


def test_masks_per_feature_k_and_empty_features():
  rng = np.random.default_rng(3)
  x = data("halves", (40, 50, 5), seed=3)
  where = rng.random(x.shape) < 0.6
  where[:, :, 1] = False
  where[7, 3, 1] = True  # a feature with a single masked-in element
  where[:, :, 2] = rng.random((40, 50)) < 0.02  # a sparse feature
  where[:, :, 4] = False  # all masked out: NaN
  x[~where] = -np.inf  # masked-out values must not matter (smaller than all)
  n = where.sum(axis=(0, 1))
  axis = (0, 1)
  for alpha in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):  # k = ceil(alpha * n), alpha*n whole too
    k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
    check(x, k, axis, where)
    value = np.asarray(select(x, jnp.asarray(k), axis, where)[0])
    assert np.isnan(value[4]) and not np.isnan(value[:4]).any()


def test_out_of_range_k_gives_nan():
  x = data("normal", (50, 4), seed=1)
  value = select(x, jnp.asarray([0, -3, 51, 50], jnp.int32), (0,))[0]
  assert np.isnan(np.asarray(value[:3])).all()
  assert_bitwise(value[3], np.max(x[:, 3]))
  row_mask = np.arange(50)[:, None] < 20  # broadcast mask: n = 20
  value = jax.jit(lambda v: _radix_select.kth_smallest_accelerator(v, 21, (0,), where=row_mask))(x)
  assert np.isnan(np.asarray(value)).all()


@pytest.mark.parametrize("histogram,digit_bits", [("scatter", 4), ("scatter", 16), ("scatter", 2),
                                                   ("compare", 8), ("compare", 4)])
def test_histogram_kernels_and_digit_widths(histogram, digit_bits):
  rng = np.random.default_rng(7)
  x = np.concatenate([data("relu", (150, 3), 7), data("denormal", (150, 3), 8)], axis=1)
  x[:, 1] = data("inf", (150,), 9)
  where = rng.random(x.shape) < 0.8
  n = where.sum(axis=0)
  for alpha in (0.0, 0.3, 0.5, 1.0):
    k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
    check(x, k, (0,), where, digit_bits=digit_bits, histogram=histogram)


def test_local_ties_without_axis_name_are_the_ties():
  x = data("tiny_set", (500, 6), seed=2)
  for k in (1, 125, 250, 500):
    value, ties = select_local_ties(x, jnp.full((6,), k, jnp.int32), (0,))
    want_value, want_ties, _ = numpy_kth(x, k, (0,))
    assert_bitwise(value, want_value)
    assert ties.dtype == jnp.float32
    np.testing.assert_array_equal(ties, want_ties)


@pytest.mark.parametrize("kind", ["normal", "offset", "inf", "relu"])
def test_sums_for_the_superquantile(kind):
  if kind == "offset":  # cancellation: E[(x - q)^+] is small next to x
    x = 1000 + data("normal", (3000, 5), seed=4)
  else:
    x = data(kind, (3000, 5), seed=4)
  where = np.random.default_rng(4).random(x.shape) < 0.9
  n = where.sum(axis=0)
  finite = np.abs(x[np.isfinite(x)])
  scale = float(finite.mean())
  for alpha in (0.0, 0.5, 0.95, 1.0):
    k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
    value, _, mean, excess, _ = select(x, jnp.asarray(k), (0,), where)
    x64 = np.where(where, x, 0).astype(np.float64)
    q = np.asarray(value, np.float64)[None]
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as wanted
      want_mean = x64.sum(axis=0) / n
      want_excess = np.where(where & (x > q), x64 - q, 0.0).sum(axis=0) / n
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(excess, want_excess, rtol=1e-5, atol=1e-6 * scale)


def test_no_while_loop_and_fixed_pass_count():
  # The point of issue 10: no data-dependent loop, hence no host sync per pass.
  x = jnp.asarray(data("normal", (2000, 7), seed=0))
  where = jnp.asarray(np.random.default_rng(0).random(x.shape) < 0.5)
  k = jnp.full((7,), 300, jnp.int32)
  fns = [
      lambda v, m: _radix_select.kth_smallest_accelerator(v, k, (0,), where=m, return_ties=True),
      lambda v, m: _radix_select.kth_smallest_with_sums_accelerator(v, k, (0,), where=m),
  ]
  for fn in fns:
    jaxpr = str(jax.make_jaxpr(fn)(x, where))
    assert "while" not in jaxpr and "scan" not in jaxpr and "cond" not in jaxpr
    hlo = jax.jit(fn).lower(x, where).as_text()
    assert "while" not in hlo
  # One scatter (the histogram) per 8-bit digit.
  jaxpr = str(jax.make_jaxpr(fns[0])(x, where))
  assert jaxpr.count("scatter-add") == 4
  # Pooled over a named (vmapped) axis: one psum per pass, still no loop.
  pooled = jax.make_jaxpr(jax.vmap(
      lambda v: _radix_select.kth_smallest_accelerator(v, 100, (0,), axis_name="b"), axis_name="b"
  ))(x.reshape(4, 500, 7))
  assert "while" not in str(pooled)


def test_vmap_and_vmap_axis_name_pooling():
  x = data("relu", (4, 600, 3), seed=6)
  got = jax.jit(jax.vmap(lambda v: _radix_select.kth_smallest_accelerator(v, 300, (0,))))(x)
  assert_bitwise(got, np.stack([numpy_kth(v, 300, (0,))[0] for v in x]))
  # A named vmapped axis pools its members, as devices along axis_name do.
  where = np.random.default_rng(6).random(x.shape) < 0.7
  k = jnp.asarray([1, 800, 1680], jnp.int32)
  pooled = jax.jit(jax.vmap(
      lambda v, m: _radix_select.kth_smallest_accelerator(
          v, k, (0,), where=m, axis_name="b", return_ties=True),
      axis_name="b",
  ))(x, where)
  want_value, want_ties, _ = numpy_kth(x.reshape(-1, 3), k, (0,), where.reshape(-1, 3))
  for d in range(4):
    assert_bitwise(pooled[0][d], want_value)
  local_ties = np.asarray(pooled[1])  # each member's own rows
  np.testing.assert_array_equal(local_ties.sum(axis=0), want_ties)
  for d in range(4):
    np.testing.assert_array_equal(
        local_ties[d], ((x[d] == want_value[None]) & where[d]).sum(axis=0))


def test_half_precision_and_gradient():
  x16 = jnp.asarray(data("normal", (4, 8, 8, 5), seed=9), jnp.bfloat16)
  want = numpy_kth(np.asarray(x16.astype(jnp.float32)), 100, (0, 1, 2))[0]
  got = jax.jit(lambda v: _radix_select.kth_smallest_accelerator(v, 100, (0, 1, 2)))(x16)
  assert_bitwise(got, want)
  x = jnp.asarray(data("normal", (300, 2), seed=7))
  g = jax.jit(jax.grad(lambda v: jnp.sum(_radix_select.kth_smallest_accelerator(v, 70, (0,)))))(x)
  assert g.shape == x.shape and not np.any(np.asarray(g))


def test_bad_arguments():
  x = jnp.ones((4, 3))
  with pytest.raises(ValueError, match="digit_bits"):
    _radix_select.kth_smallest_accelerator(x, 1, (0,), digit_bits=3)
  with pytest.raises(ValueError, match="histogram"):
    _radix_select.kth_smallest_accelerator(x, 1, (0,), histogram="sort")
  with pytest.raises(ValueError, match="axis"):
    _radix_select.kth_smallest_accelerator(x, 1, (1, 0))
  with pytest.raises(TypeError, match="floating"):
    _radix_select.kth_smallest_accelerator(jnp.ones((4, 3), jnp.int32), 1, (0,))


def test_dispatch_through_kth_smallest_and_the_quantile_layers(monkeypatch):
  """method="accelerator" reaches the radix select; the measures' values and
  gradients equal those of the sort reference."""
  import gbn_jax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(7)
  x = rng.standard_normal((300, 5)).astype(np.float32)
  x[::3, 1] = 0.0  # ties at the target
  got = _select.kth_smallest(jnp.asarray(x), 90, (0,), method="accelerator")
  np.testing.assert_array_equal(np.asarray(got), np.sort(x, axis=0)[89])
  value, ties = _select.kth_smallest(jnp.asarray(x), 90, (0,),
                                     method="accelerator", return_ties=True)
  assert ties is None  # XLA:CPU flushes denormals in compares: caller counts

  def measures(x):
    s, d = gbn_jax.get_measure("sqd1")(x, axis=0)
    return jnp.sum(s * jnp.arange(5.0)) + jnp.sum(d), (s, d)

  results = {}
  for method in ("sort", "accelerator"):
    monkeypatch.setattr(_select, "DEFAULT_METHOD", method)
    (_, stats), grad = jax.value_and_grad(measures, has_aux=True)(
        jnp.asarray(x))
    results[method] = (stats, grad)
  # atol: "accelerator" takes the fused sums (one pass, counts from the
  # radix), "sort" separate means; at q the gradient is O(1) terms that
  # cancel, so the two round apart by ulps of the largest term. A GPU sums
  # in another order than a CPU (this failed there with atol=1e-6, commit
  # b329b70), so the bound scales with the largest entry.
  for a, b in zip(jax.tree.leaves(results["sort"]),
                  jax.tree.leaves(results["accelerator"])):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())
