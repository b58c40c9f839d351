"""sqd from the radix select's fused sums (the accelerator path), on the CPU.

``gbn_jax.selection.selection_config(method="accelerator")`` makes ``quantiles._superquantile_and_mean``
take ``q``, ``E[x]`` and ``E[(x - q)^+]`` from one call of
``radix.kth_smallest_with_sums_accelerator``, as it does by default on a
GPU for large batches. Values and gradients are checked against numpy written
from the definitions, against finite differences along directions that keep
ties tied, and against the unfused path (the sort reference).
"""

import fractions
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import _quantiles
from gbn_jax import measures
from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import native
from gbn_jax._selection import radix

from tests.helpers.process import forced_host_devices
from tests.helpers.process import run_python_result
from tests.helpers.selection import count_calls

ALPHAS = [1e-6, 0.25, 0.5, 0.75, 0.99, 0.999999]
N_FEATURES = 8


@pytest.fixture
def fused(monkeypatch):
  """Forces the radix select and counts the fused calls; the unfused path raises."""
  calls = count_calls(monkeypatch, radix, "kth_smallest_with_sums_accelerator")

  def unfused(*args, **kwargs):
    raise AssertionError("sqd fell back to the unfused selection and means")

  monkeypatch.setattr(_quantiles, "_quantile_and_mean_excess", unfused)
  # Traced for the CPU only (as a CPU jit lowers it), not once per kind of
  # platform: the calls counted are then one trace's.
  with gbn_jax.selection.selection_config(method="accelerator"):
    with common.platform_scope(common.CPU):
      yield calls


_QUANTILE_AND_MEAN_EXCESS = _quantiles._quantile_and_mean_excess  # pylint: disable=protected-access


def _unfused(fn, *args, monkeypatch):
  """``fn(*args)`` with the sort reference selecting (no fused sums)."""
  with (
      gbn_jax.selection.selection_config(method="sort"),
      monkeypatch.context() as m,
  ):
    m.setattr(
        _quantiles, "_quantile_and_mean_excess", _QUANTILE_AND_MEAN_EXCESS
    )
    return fn(*args)


def _data(n, seed=0):
  """One kind of data per column: ties, repeated values, ReLU zeros, NaN."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, N_FEATURES)).astype(np.float32)
  x[:, 1] = np.round(x[:, 1] * 2) / 2  # many ties
  x[:, 2] = rng.integers(0, 3, n)  # three values only
  x[:, 3] = np.maximum(x[:, 3], 0)  # ReLU: half zeros ...
  x[rng.random(n) < 0.2, 3] = -0.0  # ... some of them negative zeros
  x[:, 4] = 1.5  # constant
  x[n // 2, 5] = np.nan  # a NaN feature
  x[:, 6] = x[:, 6] * 1e3 + 1e4  # offset: the excess is summed relative to q
  x[:, 7] = np.repeat(x[: (n + 1) // 2, 7], 2)[:n]  # pairs
  return x


def _mask(n, seed=1):
  rng = np.random.default_rng(seed)
  where = rng.random((n, N_FEATURES)) < 0.7
  where[0] = True  # at least one element per feature ...
  where[:, 4] = False  # ... except an empty feature
  return where


def _ref_sqd(x, alpha, where=None):
  """``(q, D)`` per column from the definitions, float64.

  ``q``: the ``ceil(alpha * N)``-th smallest (``alpha`` as the decimal it prints
  as); ``qbar = q + E[(x - q)^+] / (1 - alpha)``; ``D = qbar - E[x]``. NaN for a
  column with a NaN or nothing masked in.
  """
  x = np.asarray(x, np.float64)
  where = np.ones(x.shape, bool) if where is None else where
  q, d = np.full(x.shape[1], np.nan), np.full(x.shape[1], np.nan)
  for f in range(x.shape[1]):
    v = x[where[:, f], f]
    if v.size == 0 or np.isnan(v).any():
      continue
    k = math.ceil(fractions.Fraction(repr(alpha)) * v.size)
    q[f] = np.sort(v)[max(k, 1) - 1]
    qbar = q[f] + np.maximum(v - q[f], 0).mean() / (1 - alpha)
    d[f] = qbar - v.mean()
  return q, d


def _ref_grad(x, alpha, cq, cd, where=None):
  """Gradient of ``sum(cq * q + cd * D)`` from the definitions (tie rule).

  ``q``'s derivative is split equally among the elements equal to ``q``;
  ``E[(x - q)^+]`` moves with the elements above ``q``, minus ``q``'s move
  once per such element; ``E[x]`` moves by ``1/N`` per element.
  """
  x = np.asarray(x, np.float64)
  where = np.ones(x.shape, bool) if where is None else where
  q, _ = _ref_sqd(x, alpha, where)
  grad = np.zeros_like(x)
  for f in range(x.shape[1]):
    if np.isnan(q[f]):
      continue
    inside = where[:, f]
    n = inside.sum()
    tied = inside & (x[:, f] == q[f])
    above = inside & (x[:, f] > q[f])
    dq = tied / tied.sum()
    dqbar = dq + (above - above.sum() * dq) / (n * (1 - alpha))
    grad[:, f] = cq[f] * dq + cd[f] * (dqbar - inside / n)
  return grad


def _weights():
  rng = np.random.default_rng(5)
  return (
      rng.standard_normal(N_FEATURES).astype(np.float32),
      rng.standard_normal(N_FEATURES).astype(np.float32),
  )


def _objective(alphas, cq, cd):
  """Jitted ``x, where -> [((s, d), grad) for alpha in alphas]`` (one compile)."""

  def loss(x, where, alpha):
    s, d = measures.sqd(x, 0, alpha=alpha, where=where)
    # NaN features stay NaN in (s, d) but must not poison the other gradients.
    value = jnp.sum(jnp.where(jnp.isnan(s), 0, s) * cq) + jnp.sum(
        jnp.where(jnp.isnan(d), 0, d) * cd
    )
    return value, (s, d)

  def all_alphas(x, where):
    out = []
    for alpha in alphas:
      (_, stats), grad = jax.value_and_grad(loss, has_aux=True)(x, where, alpha)
      out.append((stats, grad))
    return out

  return jax.jit(all_alphas)


def _tie_preserving_fd(x, alpha, cq, cd, where, eps=1e-3):
  """Central difference of the reference along ``v = h(x)`` (equal x move equally)."""
  x = np.asarray(x, np.float64)
  # A smooth function of the value: tied elements stay tied, and for small
  # eps the order is kept (eps * max|h'| below the smallest gap).
  v = np.sin(3 * x) + 0.5
  v = np.where(np.isfinite(x), v, 0)

  def loss(y):
    q, d = _ref_sqd(y, alpha, where)
    return np.nansum(cq * np.nan_to_num(q)) + np.nansum(cd * np.nan_to_num(d))

  return (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps), v


def _assert_d_close(x, d, want):
  """``D`` within float32 rounding of sums of values up to ``max|x|``, NaN alike."""
  scale = 1 + np.abs(np.nan_to_num(x)).max(axis=0)
  d, want = np.asarray(d, np.float64), np.asarray(want, np.float64)
  assert np.array_equal(np.isnan(d), np.isnan(want)), (d, want)
  err = np.abs(np.nan_to_num(d - want)) / (np.abs(np.nan_to_num(want)) + scale)
  assert err.max() < 2e-6, (d, want)


def _assert_matches_reference(x, where, alpha, s, d, grad):
  cq, cd = _weights()
  want_q, want_d = _ref_sqd(x, alpha, where)
  np.testing.assert_array_equal(np.asarray(s), want_q.astype(np.float32))
  _assert_d_close(x, d, want_d)
  want_g = _ref_grad(x, alpha, cq, cd, where)
  ok = ~np.isnan(want_q)  # NaN features: checked against the unfused path
  np.testing.assert_allclose(
      np.asarray(grad)[:, ok], want_g[:, ok], rtol=1e-5, atol=1e-6
  )
  return want_g


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_values_and_gradients_match_definitions(masked, fused, monkeypatch):
  x = _data(96)
  where = _mask(96) if masked else None
  cq, cd = _weights()
  step = _objective(ALPHAS, cq, cd)
  results = step(jnp.asarray(x), where)
  assert len(fused) == len(ALPHAS), "the fused sums were not called"
  unfused = _unfused(
      _objective(ALPHAS, cq, cd), jnp.asarray(x), where, monkeypatch=monkeypatch
  )
  for alpha, ((s, d), grad), ((s0, d0), grad0) in zip(ALPHAS, results, unfused):
    _assert_matches_reference(x, where, alpha, s, d, grad)
    # Tie-preserving finite differences of the float64 reference, on the
    # features whose statistics are defined.
    finite = ~np.isnan(_ref_sqd(x, alpha, where)[0])
    fd, v = _tie_preserving_fd(x, alpha, cq * finite, cd * finite, where)
    got = float(np.sum(np.asarray(grad)[:, finite] * v[:, finite]))
    assert got == pytest.approx(fd, rel=2e-3, abs=2e-3), alpha
    # And the unfused path, NaN features and masked-out elements included.
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    _assert_d_close(x, d, d0)
    np.testing.assert_allclose(
        np.asarray(grad), np.asarray(grad0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_batches(n, fused, monkeypatch):
  x = _data(n, seed=n)
  alphas = (1e-6, 0.5, 0.99)
  # Masked only (one compile): the mask keeps row 0 of every feature but an
  # empty one, so one row is a full-batch case too.
  for where in (_mask(n, seed=n),):
    results = _objective(alphas, *_weights())(jnp.asarray(x), where)
    unfused = _unfused(
        _objective(alphas, *_weights()),
        jnp.asarray(x),
        where,
        monkeypatch=monkeypatch,
    )
    for alpha, ((s, d), grad), ((s0, d0), grad0) in zip(
        alphas, results, unfused
    ):
      _assert_matches_reference(x, where, alpha, s, d, grad)
      np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
      _assert_d_close(x, d, d0)
      np.testing.assert_allclose(
          np.asarray(grad), np.asarray(grad0), rtol=1e-5, atol=1e-6
      )
  assert fused


def test_nan_and_empty_features(fused):
  x, where = _data(40), _mask(40)
  s, d = measures.sqd(jnp.asarray(x), 0, alpha=0.5, where=where)
  nan = np.isnan(_ref_sqd(x, 0.5, where)[0])
  assert nan[4] and nan[5] and nan.sum() == 2
  np.testing.assert_array_equal(np.isnan(np.asarray(s)), nan)
  np.testing.assert_array_equal(np.isnan(np.asarray(d)), nan)
  # qbar itself: NaN with the quantile (superquantile's jitted entry point
  # traces afresh for this where/shape).
  qbar = gbn_jax.superquantile(x, 0.5, axis=0, where=where)
  np.testing.assert_array_equal(np.isnan(np.asarray(qbar)), nan)
  assert fused


def test_zero_and_denormal_answers_count_as_float_compares_do(
    fused, monkeypatch
):
  """On XLA:CPU compares flush denormals, so the JVP counts ties itself."""
  tiny = np.float32(1e-40)  # denormal
  x = np.zeros((12, 3), np.float32)
  x[:4, 0] = [tiny, -tiny, 0.0, -0.0]
  x[:, 1] = np.where(np.arange(12) % 3 == 0, tiny, 0.0)
  x[:, 2] = np.linspace(-1, 1, 12)
  x[6, 2] = tiny
  step = lambda: _objective((0.5,), *(w[:3] for w in _weights()))
  [((s, d), grad)] = step()(jnp.asarray(x), None)
  [((s0, d0), grad0)] = _unfused(
      step(), jnp.asarray(x), None, monkeypatch=monkeypatch
  )
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
  np.testing.assert_allclose(
      np.asarray(d), np.asarray(d0), rtol=1e-6, atol=1e-45
  )
  np.testing.assert_allclose(np.asarray(grad), np.asarray(grad0), rtol=1e-6)
  assert fused


def _full_size_sums(jaxpr, size):
  """How many ``reduce_sum`` in ``jaxpr`` (nested ones too) read ``size`` elements."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "reduce_sum" and eqn.invars[0].aval.size == size:
      count += 1
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None and hasattr(inner, "eqns"):
        count += _full_size_sums(inner, size)
      elif hasattr(param, "eqns"):
        count += _full_size_sums(param, size)
  return count


@pytest.mark.parametrize("alpha", [0.25, 0.99])
def test_key_counts_where_compares_keep_denormals(alpha, fused, monkeypatch):
  """The GPU branch: ties and counts above from the radix, not recounted.

  Without denormals the key counts equal the float compares' on any backend,
  so this runs the branch on the CPU.
  """
  monkeypatch.setattr(common, "compares_keep_denormals", lambda: True)
  x, where = _data(64), _mask(64)
  # No NaN: a NaN with its sign bit set has a key below -inf, so the key
  # count above q misses it where ~(x <= q) counts it (qbar is NaN anyway).
  x[:, 5] = 0.25
  for w in (None, where):
    f = lambda x, w=w: measures.sqd(x, 0, alpha=alpha, where=w)
    cq, cd = _weights()
    loss = lambda x: jnp.sum(
        jnp.nan_to_num(jnp.stack(f(x))) * jnp.stack([cq, cd])
    )
    grad = jax.jit(jax.grad(loss))(jnp.asarray(x))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x)[1])))(jnp.asarray(x))
    want_g = _ref_grad(x, alpha, cq, cd, w)
    ok = ~np.isnan(_ref_sqd(x, alpha, w)[0])
    np.testing.assert_allclose(
        np.asarray(grad)[:, ok], want_g[:, ok], rtol=1e-5, atol=1e-6
    )
    # Full-size reductions left in the gradient: the sums pass's two (the
    # JVP's tangent sums transpose to broadcasts), no tie or "above" counts.
    assert _full_size_sums(jaxpr.jaxpr, x.size) == 2
    monkeypatch.setattr(common, "compares_keep_denormals", lambda: False)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x)[1])))(jnp.asarray(x))
    assert _full_size_sums(jaxpr.jaxpr, x.size) == 4  # ... which the CPU counts
    monkeypatch.setattr(common, "compares_keep_denormals", lambda: True)
  assert fused


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keeps_dtypes(dtype, fused, monkeypatch):
  x = _data(48)
  # Within float16's range when summed: the unfused mean sums in x's dtype
  # (the fused one in float32), so 48 values of 1e4 overflow only there.
  x[:, 6] -= 1e4
  x = jnp.asarray(np.round(x * 4) / 4, dtype)  # exact in both dtypes

  def parts_and_grad(x):
    def loss(x):
      parts = _quantiles._superquantile_and_mean(  # pylint: disable=protected-access
          x, 0.75, (0,), None, None, None
      )
      return (
          sum(jnp.sum(jnp.nan_to_num(a.astype(jnp.float32))) for a in parts),
          parts,
      )

    return jax.grad(loss, has_aux=True)(x)[::-1]

  # Two jit objects, each traced under its own method.
  got, g = jax.jit(parts_and_grad)(x)
  want, g0 = _unfused(jax.jit(parts_and_grad), x, monkeypatch=monkeypatch)
  # q, qbar float32; the mean (summed in float32 here) and the gradient in
  # x's dtype, as before.
  assert [a.dtype for a in got] == [a.dtype for a in want]
  assert [a.dtype for a in got] == [jnp.float32, jnp.float32, dtype]
  assert g.dtype == g0.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  for a, b in zip(got[1:], want[1:]):
    np.testing.assert_allclose(
        np.asarray(a, np.float32),
        np.asarray(b, np.float32),
        rtol=1e-2,
        atol=1e-2,
    )
  np.testing.assert_allclose(
      np.asarray(g, np.float32),
      np.asarray(g0, np.float32),
      rtol=1e-2,
      atol=1e-3,
  )
  assert fused


def test_gbatchnorm_output_and_input_gradient(fused, monkeypatch):
  x = jnp.asarray(_data(32)[:, [0, 1, 2, 3, 6, 7]])
  norm = gbn_jax.GBatchNorm(use_running_average=False, measure="sqd3")
  variables = norm.init(jax.random.key(0), x)

  def loss(x):
    y, _ = norm.apply(variables, x, mutable=["batch_stats"])
    return jnp.sum(jnp.sin(y)), y

  # Two jit objects, each traced under its own method.
  (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
  (_, y0), g0 = _unfused(
      jax.jit(jax.value_and_grad(loss, has_aux=True)),
      x,
      monkeypatch=monkeypatch,
  )
  np.testing.assert_allclose(
      np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
      np.asarray(g), np.asarray(g0), rtol=1e-4, atol=1e-5
  )
  assert fused


def test_one_call_and_default_dispatch(fused, monkeypatch):
  """One fused call per sqd (value and gradient); the default picks it only
  where kth_smallest would pick the radix select."""
  x = jnp.asarray(_data(40))
  jax.make_jaxpr(jax.grad(lambda x: jnp.sum(measures.sqd(x, 0, alpha=0.5)[1])))(
      x
  )
  assert len(fused) == 1
  rows = dispatch._ADAPTIVE_MIN_ROWS  # pylint: disable=protected-access
  big = jax.ShapeDtypeStruct((rows, 2), jnp.float32)
  small = jax.ShapeDtypeStruct((8, 2), jnp.float32)
  fuses = (
      lambda x: dispatch.fused_sums_backend(x, (0,), None, None, None)
      == "accelerator"
  )
  monkeypatch.setattr(common, "on_cpu", lambda: False)
  monkeypatch.setattr(native, "applies", lambda axis_name: False)
  with gbn_jax.selection.selection_config(method=None):
    # Accelerators default to the bracket select (measured faster): unfused.
    assert not fuses(big)
    monkeypatch.setattr(dispatch, "_ACCELERATOR_LARGE_METHOD", "accelerator")
    assert fuses(big)
    assert not fuses(small)  # sorted there
    monkeypatch.setattr(common, "on_cpu", lambda: True)
    assert not fuses(big)  # adaptive on CPU
  with jax.enable_x64(True):  # method="accelerator" from the fixture
    # The sums are float32: float64 keeps the float64 selection.
    for dtype, fused_sums in ((jnp.float64, False), (jnp.float32, True)):
      assert fuses(jnp.zeros((4, 2), dtype)) == fused_sums


_SHARD_MAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import gbn_jax
    from gbn_jax import measures
    from gbn_jax._selection import common, radix

    calls = []
    original = radix.kth_smallest_with_sums_accelerator
    def counted(*a, **k):
      calls.append(1)
      return original(*a, **k)
    radix.kth_smallest_with_sums_accelerator = counted

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    x[:, 1] = np.round(x[:, 1])
    x[:, 2] = np.maximum(x[:, 2], 0)
    where = rng.random(x.shape) < 0.7
    c = np.arange(1.0, 5.0, dtype=np.float32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("b",))

    def loss(x, w, axis_name):
      s, d = measures.sqd(x, 0, alpha=0.75, where=w, axis_name=axis_name)
      return jnp.sum(s * c) + jnp.sum(d * c[::-1]), (s, d)

    pooled = jax.shard_map(lambda x, w: loss(x, w, "b"), mesh=mesh,
                           in_specs=(P("b"), P("b")), out_specs=(P(), (P(), P())))
    results = {}
    for method in ("accelerator", "sort"):
      # Traced for the CPU only: one trace's calls, not one per platform.
      with gbn_jax.selection.selection_config(method=method), common.platform_scope("cpu"):
        for masked in (False, True):
          w = where if masked else np.ones_like(where)
          got = jax.jit(jax.value_and_grad(lambda x: pooled(x, w), has_aux=True))(x)
          one = jax.jit(jax.value_and_grad(lambda x: loss(x, w, None), has_aux=True))(x)
          results[method, masked] = got
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(calls) == 4, calls  # two with the axis name, two without
    for masked in (False, True):
      for a, b in zip(jax.tree.leaves(results["accelerator", masked]),
                      jax.tree.leaves(results["sort", masked])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("OK")
""")


def test_shard_map_over_two_host_devices():
  proc = run_python_result(
      _SHARD_MAP_SCRIPT, env=forced_host_devices(2), timeout=300
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, (
      proc.stdout + proc.stderr[-5000:]
  )
