"""Tests of gbn_jax._selection (exact k-th smallest) against numpy sorts.

The oracle and the data are shared with the other backends' tests
(``tests/helpers/selection.py``): per feature, ``np.sort`` of the masked-in
elements and take index ``k - 1``. Results must match bit for bit
(``-0.0`` is expected back as ``+0.0``). Every method runs every test.
"""

from __future__ import annotations

import functools
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax._selection import common
from gbn_jax._selection import config
from gbn_jax._selection import dispatch
from gbn_jax._selection import loop
from gbn_jax._selection import native
from gbn_jax._selection import radix
from gbn_jax._selection import sort

from tests.helpers import selection
from tests.helpers.process import forced_host_devices
from tests.helpers.process import run_python_result
from tests.helpers.selection import TINY
from tests.helpers.selection import assert_bitwise

# A forced "native" raises where the kernel is not built.
METHODS = tuple(
    m for m in dispatch.METHODS if m != "native" or native.available()
)
# The shared data kinds but "huge", and "wide" magnitudes below e**80: beyond
# that, the float32 mean of |x| that scales the superquantile tests' tolerance
# overflows, and their sums would be checked against an infinite tolerance.
KINDS = [kind for kind in selection.KINDS if kind != "huge"]
data = functools.partial(selection.data, wide_log_range=(-80, 80))


def numpy_kth(x, k, axis, where=None):
  """The shared oracle's k-th smallest per position of the kept axes."""
  return selection.numpy_kth(x, k, axis, where)[0]


@jax.jit(static_argnames=("axis", "method"))
def jit_select(x, k, axis, method, where=None):
  return dispatch.kth_smallest(x, k, axis, where=where, method=method)


def select_traced_k(x, k, axis, method, where=None):
  """Under jit with ``k`` an int32 array: one compilation for all ``k``."""
  kept = [x.shape[d] for d in range(x.ndim) if d not in axis]
  k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), kept)
  return jit_select(x, k, axis, method, where)


def ranks(n):
  return sorted(
      {
          1,
          2,
          max(1, n // 4),
          max(1, n // 2),
          max(1, (3 * n) // 4),
          n - 1 or 1,
          n,
      }
  )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_nhwc_matches_numpy(method, kind):
  # N = 2048 rows: above the adaptive method's small-batch shortcut.
  x = data(kind, (8, 16, 16, 3), seed=KINDS.index(kind))
  axis = (0, 1, 2)
  for k in ranks(8 * 16 * 16):
    assert_bitwise(select_traced_k(x, k, axis, method), numpy_kth(x, k, axis))


@pytest.mark.parametrize("method", METHODS)
def test_per_feature_k_and_small_batch_shortcut(method):
  x = data("normal", (300, 7), seed=1)
  k = np.array([1, 300, 150, 2, 299, 77, 151], np.int32)
  assert_bitwise(
      jit_select(x, jnp.asarray(k), (0,), method), numpy_kth(x, k, (0,))
  )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_batches(method, n):
  x = data("halves", (n, 5), seed=n)
  for k in range(1, n + 1):
    assert_bitwise(select_traced_k(x, k, (0,), method), numpy_kth(x, k, (0,)))


@pytest.mark.parametrize("method", METHODS)
def test_mask(method):
  x, where = selection.masked_halves(4)
  n = where.sum(axis=(0, 1))
  axis = (0, 1)
  for frac in (0.0, 0.25, 0.5, 1.0):
    k = np.maximum(np.ceil(frac * n), 1).astype(np.int32)
    got = select_traced_k(x, k, axis, method, where)
    assert_bitwise(got, numpy_kth(x, k, axis, where))


@pytest.mark.parametrize("method", METHODS)
def test_broadcast_mask_and_empty_feature_gives_nan(method):
  x = data("normal", (2000, 3), seed=4)
  where = np.ones((2000, 3), bool)
  where[:, 2] = False
  got = np.asarray(
      dispatch.kth_smallest(x, 5, (0,), where=where[:, :], method=method)
  )
  assert_bitwise(got[:2], numpy_kth(x[:, :2], 5, (0,)))
  if method != "sort":  # the reference does not check k <= n
    assert np.isnan(got[2])
  row_mask = np.arange(2000)[:, None] < 1000  # broadcast over features
  got = dispatch.kth_smallest(x, 500, (0,), where=row_mask, method=method)
  assert_bitwise(got, numpy_kth(x[:1000], 500, (0,)))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "shape,axis",
    [
        ((30, 4, 70), (0, 2)),
        ((5, 600), (1,)),
        ((3, 40, 50), (0, 1, 2)),
        ((512, 6), (0,)),
    ],
)
def test_axes(method, shape, axis):
  x = data("normal", shape, seed=5)
  n = int(np.prod([shape[a] for a in axis]))
  for k in (1, (n + 1) // 2, n):
    assert_bitwise(select_traced_k(x, k, axis, method), numpy_kth(x, k, axis))


@pytest.mark.parametrize("method", METHODS)
def test_vmap(method):
  x = data("relu", (3, 1200, 2), seed=6)
  got = jax.vmap(lambda v: dispatch.kth_smallest(v, 600, (0,), method=method))(
      x
  )
  want = np.stack([numpy_kth(v, 600, (0,)) for v in x])
  assert_bitwise(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_traceable_under_grad(method):
  x = jnp.asarray(data("normal", (1500, 2), seed=7))
  g = jax.jit(
      jax.grad(
          lambda v: jnp.sum(dispatch.kth_smallest(v, 700, (0,), method=method))
      )
  )(x)
  assert g.shape == x.shape and not np.any(np.asarray(g))


def test_forced_collisions_and_sort_fallback_stay_exact(monkeypatch):
  # Few fold buckets make folds ambiguous (retried on narrower brackets); a
  # tiny pass budget forces the sort fallback for unfinished features.
  x = data("normal", (6000, 8), seed=8)
  k = np.array([1, 2, 1500, 3000, 3001, 4500, 5999, 6000], np.int32)
  want = numpy_kth(x, k, (0,))
  monkeypatch.setattr(loop, "_FOLD_ELEMENTS", 8 * 13)
  monkeypatch.setattr(loop, "_CHUNK_ELEMENTS", 8 * 96)
  assert_bitwise(
      dispatch.kth_smallest(x, jnp.asarray(k), (0,), method="adaptive"), want
  )
  monkeypatch.setattr(loop, "_MAX_PASSES", 2)
  assert_bitwise(
      dispatch.kth_smallest(x, jnp.asarray(k), (0,), method="adaptive"), want
  )
  assert_bitwise(
      dispatch.kth_smallest(x, jnp.asarray(k), (0,), method="bisect"), want
  )


def test_default_method_and_reference_agree_with_numpy():
  x = data("normal", (4, 8, 8, 5), seed=9)
  assert_bitwise(
      dispatch.kth_smallest(x, 100, (0, 1, 2)), numpy_kth(x, 100, (0, 1, 2))
  )
  assert_bitwise(
      sort.kth_smallest_reference(x, 100, (0, 1, 2)),
      numpy_kth(x, 100, (0, 1, 2)),
  )
  x16 = jnp.asarray(x, jnp.bfloat16)
  want = numpy_kth(np.asarray(x16.astype(jnp.float32)), 100, (0, 1, 2))
  assert_bitwise(dispatch.kth_smallest(x16, 100, (0, 1, 2)), want)


def test_accelerators_default_to_the_bracket_and_compare_histograms(
    monkeypatch,
):
  """The defaults measured fastest on an H100 (results/benchmarks/h100_*)."""
  monkeypatch.setattr(native, "applies", lambda axis_name: False)
  for backend, large, small, histogram in (
      ("gpu", "bracket", "sort", ("compare", 4)),
      ("tpu", "bracket", "sort", ("compare", 4)),
      ("cpu", "adaptive", "bisect", ("scatter", 8)),
  ):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    assert dispatch.default_method(dispatch._ADAPTIVE_MIN_ROWS) == large
    assert dispatch.default_method(dispatch._ADAPTIVE_MIN_ROWS - 1) == small
    assert radix.default_histogram() == histogram
    assert radix._resolve_histogram(None, None) == histogram
    assert radix._resolve_histogram("scatter", None)[1] == (
        8 if histogram[0] == "compare" else histogram[1]
    )
    assert radix._resolve_histogram("compare", 2) == ("compare", 2)


def test_native_kernel_is_built_where_expected():
  # .ci/run sets GBN_EXPECT_NATIVE=1 when a C++ compiler is present, so a
  # kernel that silently failed to build or load fails here, not in timings.
  if os.environ.get("GBN_EXPECT_NATIVE") != "1":
    pytest.skip("GBN_EXPECT_NATIVE is not set")
  assert native.available()
  assert dispatch.default_method(10**6) == "native"


needs_native = pytest.mark.skipif(
    not native.available(), reason="C++ kernel not built"
)


@needs_native
@pytest.mark.parametrize("sigmas", [3.0, 0.0])
@pytest.mark.parametrize("kind", KINDS)
def test_native_sampled_bracket_path(kind, sigmas, monkeypatch):
  # Over 16384 rows the kernel brackets the target from a sample and gathers;
  # sigmas=0 makes brackets miss often, exercising its whole-column fallback.
  # 19 features: two groups of eight take the AVX2 sweep, three the scalar one.
  with gbn_jax.selection.selection_config(bracket_sigmas=sigmas):
    select = jax.jit(
        lambda v, k: dispatch.kth_smallest(v, k, (0, 1, 2), method="native")
    )
    x = data(kind, (41, 25, 20, 19), seed=10 + KINDS.index(kind))
    fallbacks = 0
    for k in ranks(41 * 25 * 20):
      want = numpy_kth(x, k, (0, 1, 2))
      assert_bitwise(select(x, jnp.full((19,), k, jnp.int32)), want)
      keys, _, path = native.kth_smallest_keys(
          jnp.asarray(x).reshape(-1, 19), jnp.full((19,), k, jnp.int32)
      )
      assert_bitwise(common.key_to_output(keys), want)
      fallbacks += int(
          np.sum(np.asarray(path) == native.PATHS.index("missed_bracket"))
      )
    # The fallback must stay the exception (a bracket misses ~0.3% of the
    # time at 3 sigmas): a wrong count in the sweep would send columns there and
    # still answer right. At 0 sigmas brackets on continuous data must miss, or
    # the fallback would go untested (with atoms they still often hit).
    if sigmas > 0:
      assert fallbacks <= 4, fallbacks
    elif kind in ("normal", "wide"):
      assert fallbacks >= 19, fallbacks


def as_xla_cpu_compares(x):
  """``x`` as XLA:CPU's float comparisons read it: denormals as zero (DAZ)."""
  x = np.asarray(x, np.float32)
  return np.where(np.abs(x) < TINY, np.float32(0), x)


def test_xla_cpu_reads_denormals_as_zero_in_comparisons():
  # The native kernel's counts promise XLA:CPU's comparison semantics, which
  # it reads from the CPU's flag; this pins what that is, on the CPU device
  # whatever the default backend (GPUs compare denormals as they are).
  cpu = jax.devices("cpu")[0]
  x = jax.device_put(np.float32([1e-45, -3e-39, 0.0, -0.0, TINY, 1.0]), cpu)
  got = jax.jit(lambda v: (v == 0, v <= 0))(x)
  want = as_xla_cpu_compares(x)
  np.testing.assert_array_equal(got[0], want == 0)
  np.testing.assert_array_equal(got[1], want <= 0)


@needs_native
@pytest.mark.parametrize("sigmas", [3.0, 0.0])
@pytest.mark.parametrize(
    "rows", [3000, 41000]
)  # whole-column and sampled-bracket paths
@pytest.mark.parametrize(
    "kind", ["halves", "relu", "inf", "denormal", "signed_zero", "tiny_set"]
)
def test_native_tie_counts(kind, rows, sigmas, monkeypatch):
  # The kernel reports how many elements equal the answer as XLA:CPU's float
  # comparison counts them (zeros and denormals all equal); quantile
  # gradients divide by it.
  with gbn_jax.selection.selection_config(bracket_sigmas=sigmas):
    select = jax.jit(
        lambda v, k: dispatch.kth_smallest(
            v, k, (0,), method="native", return_ties=True
        )
    )
    x = data(
        kind, (rows, 11), seed=rows + len(kind)
    )  # two AVX2 groups, overlapping
    for frac in (0.0, 0.3, 0.5, 0.9, 1.0):
      k = max(1, int(np.ceil(frac * rows)))
      value, ties = select(x, jnp.full((11,), k, jnp.int32))
      want = numpy_kth(x, k, (0,))
      assert_bitwise(value, want)
      want_ties = (
          as_xla_cpu_compares(x) == as_xla_cpu_compares(want)[None]
      ).sum(axis=0)
      # Where the kernel says -1 (a CPU whose denormal mode it cannot
      # read), kth_smallest counts itself: the same counts either way.
      np.testing.assert_array_equal(np.asarray(ties), want_ties)


@needs_native
def test_native_tie_count_of_inf_excludes_masked_out_elements():
  # Masked-out elements reach the kernel as +inf: a +inf answer must not
  # count them among its ties.
  rng = np.random.default_rng(5)
  x = data("normal", (30000, 9), seed=5)
  x[rng.random(x.shape) < 0.05] = np.inf
  where = rng.random(x.shape) < 0.7
  n = where.sum(axis=0)
  value, ties = jax.jit(
      lambda v, k, w: dispatch.kth_smallest(
          v, k, (0,), where=w, return_ties=True
      )
  )(x, jnp.asarray(n, jnp.int32), where)
  assert np.all(np.isinf(value))
  np.testing.assert_array_equal(ties, (np.isinf(x) & where).sum(axis=0))


@needs_native
def test_native_large_batch_mask_per_feature_k_and_vmap():
  rng = np.random.default_rng(11)
  x = data("relu", (30000, 9), seed=11)
  where = rng.random(x.shape) < 0.7
  where[:, 3] = rng.random(30000) < 0.001  # 30-odd elements: k within them
  where[:, 8] = rng.random(30000) < 0.001  # the same in the scalar column
  n = where.sum(axis=0)
  k = np.maximum(np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]) * n // 9, 1).astype(
      np.int32
  )
  assert_bitwise(
      jit_select(x, jnp.asarray(k), (0,), "native", where),
      numpy_kth(x, k, (0,), where),
  )
  xs = data("normal", (2, 20000, 3), seed=12)
  got = jax.vmap(
      lambda v: dispatch.kth_smallest(v, 4321, (0,), method="native")
  )(xs)
  assert_bitwise(got, np.stack([numpy_kth(v, 4321, (0,)) for v in xs]))


def numpy_sums(x, q):
  """Per column of (N, F) ``x`` and answer ``q``: the mean, the mean of
  ``(x - q)^+`` (NaN if a NaN is present) and ``#{not x <= q}`` as XLA:CPU
  compares (denormals as zero; NaN counts): from the definitions."""
  above = ~(as_xla_cpu_compares(x) <= as_xla_cpu_compares(q)[None])
  x = np.asarray(x, np.float64)
  q = np.asarray(q, np.float64)[None]
  nan = np.isnan(x).any(axis=0)
  with np.errstate(invalid="ignore"):  # inf - inf: NaN, as wanted
    excess = np.where(x > q, x - q, 0.0).mean(axis=0)
    mean = x.mean(axis=0)
  excess = np.where(nan, np.nan, excess)
  count = above.sum(axis=0)
  if not native.counts_always_known():
    count = np.where(np.abs(q[0]) < TINY, -1, count)
  return mean, excess, count


@needs_native
@pytest.mark.parametrize("sigmas", [3.0, 0.0])
@pytest.mark.parametrize(
    "rows", [3000, 41000]
)  # whole-column and sampled-bracket paths
@pytest.mark.parametrize("kind", KINDS + ["offset", "nan"])
def test_native_sums_for_the_superquantile(kind, rows, sigmas, monkeypatch):
  # The kernel's second entry point also returns E[x], E[(x - q)^+] and
  # #{x > q}, summed in the sweep that selects q; sqd takes its statistics
  # from there. 11 features: the last AVX2 group overlaps the one before.
  with gbn_jax.selection.selection_config(bracket_sigmas=sigmas):
    select = jax.jit(lambda v, k: native.kth_smallest_with_sums(v, k, (0,)))
    if kind == "offset":  # cancellation: E[(x - q)^+] is small next to x
      x = (1000 + data("normal", (rows, 11), seed=rows)).astype(np.float32)
    elif (
        kind == "nan"
    ):  # NaNs of both signs (keys at both ends) in some columns
      x = data("normal", (rows, 11), seed=rows)
      x[np.random.default_rng(rows).integers(0, rows, 3), [1, 8, 10]] = np.nan
      x[np.random.default_rng(rows + 1).integers(0, rows, 3), [1, 2, 10]] = (
          np.copysign(np.nan, -1)
      )
      assert (np.isnan(x[:, 2]) & np.signbit(x[:, 2])).any()
    else:
      x = data(kind, (rows, 11), seed=rows + len(kind))
    finite = np.abs(x[np.isfinite(x)])
    scale = float(finite.mean()) if finite.size else 1.0
    for frac in (0.0, 0.25, 0.5, 0.9, 1.0):
      k = max(1, int(np.ceil(frac * rows)))
      value, ties, mean, excess, above = select(x, k)
      want = numpy_kth(x, k, (0,))
      if kind != "nan":
        assert_bitwise(value, want)
      want_mean, want_excess, want_above = numpy_sums(x, value)
      # float32 sums in blocks of rows, float64 across blocks
      np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6 * scale)
      np.testing.assert_allclose(
          excess, want_excess, rtol=1e-5, atol=1e-6 * scale
      )
      np.testing.assert_array_equal(above, want_above)
      if kind != "nan" and native.counts_always_known():
        want_ties = (
            as_xla_cpu_compares(x) == as_xla_cpu_compares(want)[None]
        ).sum(axis=0)
        np.testing.assert_array_equal(ties, want_ties)


@needs_native
@pytest.mark.slow
def test_native_portable_code():
  # The kernel runs AVX2 code where the CPU has it, portable code elsewhere;
  # GBN_KTH_SCALAR=1 forces the portable code, for this machine's native tests.
  selection.assert_passes_on_portable_kernel(
      __file__, "native and not portable"
  )


@pytest.mark.parametrize("method", ["adaptive", "sort"])
@pytest.mark.parametrize(
    "kind", ["normal", "relu", "halves", "inf", "denormal"]
)
def test_accelerator_code_paths_on_cpu(kind, method, monkeypatch):
  # GPU/TPU take other branches (8 thresholds per pass, one-kernel fold,
  # sort along the minor axis); force them here so CI checks them too.
  monkeypatch.setattr(common, "on_cpu", lambda: False)
  select = jax.jit(
      lambda v, k, w: dispatch.kth_smallest(
          v, k, (0, 1), where=w, method=method
      )
  )
  x = data(kind, (300, 90, 3), seed=20 + len(kind))
  where = np.random.default_rng(1).random(x.shape) < 0.9
  n = where.sum(axis=(0, 1))
  for frac in (0.001, 0.25, 0.5, 0.99, 1.0):
    k = np.maximum(np.ceil(frac * n), 1).astype(np.int32)
    assert_bitwise(
        select(x, jnp.asarray(k), where), numpy_kth(x, k, (0, 1), where)
    )


@pytest.mark.parametrize(
    "axis,err",
    [
        ((), ValueError),
        ((1, 0), ValueError),
        ((0, 0), ValueError),
        ((3,), ValueError),
    ],
)
def test_bad_axes(axis, err):
  with pytest.raises(err, match="axis"):
    dispatch.kth_smallest(jnp.ones((4, 3, 2)), 1, axis)


def test_bad_arguments():
  with pytest.raises(TypeError, match="floating"):
    dispatch.kth_smallest(jnp.ones((4, 3), jnp.int32), 1, (0,))
  with pytest.raises(TypeError, match="integer"):
    dispatch.kth_smallest(jnp.ones((4, 3)), 1.5, (0,))
  with pytest.raises(ValueError, match="method"):
    dispatch.kth_smallest(jnp.ones((4, 3)), 1, (0,), method="quick")


MULTIDEVICE_SCRIPT = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from gbn_jax._selection import dispatch, sort
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("b",))
    rng = np.random.default_rng(0)

    def check(got, want):
      got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
      assert np.array_equal(got.view(np.int32), want.view(np.int32)), (got, want)

    for kind in ("normal", "halves"):
      x = rng.standard_normal((4 * 700, 6, 3)).astype(np.float32)
      if kind == "halves":
        x = np.round(x * 2) / 2
      where = rng.random(x.shape) < 0.8
      k = np.array([[1, 900, 1680], [2, 1000, 3000], [1500, 700, 4], [1, 2, 3], [3360, 17, 8], [5, 6, 7]], np.int32)
      # A forced "native" cannot pool devices: it raises (tests/gbn_jax/test_export_lowering.py).
      for method in [m for m in dispatch.METHODS if m != "native"]:
        def local(xs, ws, method=method):
          a = dispatch.kth_smallest(xs, 1000, (0,), axis_name="b", method=method)
          b = dispatch.kth_smallest(xs, jnp.asarray(k) // 2 + 1, (0,), where=ws, axis_name="b", method=method)
          return a[None], b[None]
        a, b = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("b"), P("b")), out_specs=P("b")))(x, where)
        for d in range(4):
          check(a[d], sort.kth_smallest_reference(x, 1000, (0,)))
          check(b[d], sort.kth_smallest_reference(x, k // 2 + 1, (0,), where=where))
        # axis_index_groups: devices {0, 1} and {2, 3} select separately.
        groups = [[0, 1], [2, 3]]
        g = jax.pmap(lambda xs: dispatch.kth_smallest(xs, 700, (0,), axis_name="b", axis_index_groups=groups, method=method), axis_name="b")(x.reshape(4, 700, 6, 3))
        check(g[0], sort.kth_smallest_reference(x[:1400], 700, (0,)))
        check(g[1], g[0])
        check(g[2], sort.kth_smallest_reference(x[1400:], 700, (0,)))
        check(g[3], g[2])
    # Reference, single device, vs numpy on the concatenation.
    xs = rng.standard_normal((4 * 300, 2)).astype(np.float32)
    want = np.sort(xs, axis=0)[599]
    got = jax.pmap(lambda v: dispatch.kth_smallest(v, 600, (0,), axis_name="b"), axis_name="b")(xs.reshape(4, 300, 2))
    for d in range(4):
      check(got[d], want)
    print("MULTIDEVICE OK")
    """)


@pytest.mark.slow
def test_multidevice_equals_single_device_on_concatenated_batch():
  # Self-contained: the subprocess gets 4 forced host devices.
  proc = run_python_result(
      MULTIDEVICE_SCRIPT, env=forced_host_devices(4), timeout=600
  )
  assert proc.returncode == 0 and "MULTIDEVICE OK" in proc.stdout, (
      proc.stdout + proc.stderr[-5000:]
  )


def test_float64_keeps_its_precision_under_x64():
  """float64 selects in int64 keys: the answer is an element, not its float32."""
  import gbn_jax  # pylint: disable=g-import-not-at-top

  from tests.helpers import reference as ref  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(5)
  # Values float32 cannot tell apart, ties, -0.0/+0.0, +-inf, denormals.
  x = 1.0 + rng.integers(0, 40, (97, 3)) * 1e-12
  x[:5, 0] = [-0.0, 0.0, np.inf, -np.inf, 5e-324]
  x[10:20, 1] = x[0, 1]
  with jax.enable_x64(True):
    xj = jnp.asarray(x, jnp.float64)
    for k in (1, 13, 49, 97):
      got = dispatch.kth_smallest(xj, k, (0,))
      assert got.dtype == jnp.float64
      np.testing.assert_array_equal(
          np.asarray(got), np.sort(x, axis=0)[k - 1] + 0.0
      )
    for alpha in (0.05, 0.5, 0.9):
      q = gbn_jax.quantile(xj[:, 1:], alpha, axis=0)
      qbar = gbn_jax.superquantile(xj[:, 1:], alpha, axis=0)
      assert q.dtype == qbar.dtype == jnp.float64
      np.testing.assert_array_equal(
          np.asarray(q), [ref.quantile_1d(x[:, j], alpha) for j in (1, 2)]
      )
      np.testing.assert_allclose(
          np.asarray(qbar),
          [ref.superquantile_1d(x[:, j], alpha) for j in (1, 2)],
          rtol=1e-13,
      )


def test_selection_config_is_part_of_the_trace_context(monkeypatch):
  # A function jitted once must follow a later change of the method: the
  # setting is in jit's cache key (a module global was silently ignored).
  x = data("normal", (300, 4), seed=30)
  want = numpy_kth(x, 150, (0,))
  loops, traces = [], []
  counting_passes = loop.kth_smallest_loop

  def spy(*args, **kwargs):
    # At trace time, once per kind of platform traced for: only "adaptive"
    # and "bisect" get here.
    loops.append(common.lowering_platform())
    return counting_passes(*args, **kwargs)

  monkeypatch.setattr(loop, "kth_smallest_loop", spy)

  @jax.jit
  def f(v):
    traces.append(1)
    return dispatch.kth_smallest(v, 150, (0,))

  with gbn_jax.selection.selection_config(method="sort"):
    assert_bitwise(f(x), want)
  assert (len(traces), len(loops)) == (1, 0)
  with gbn_jax.selection.selection_config(method="bisect"):
    assert_bitwise(f(x), want)
    assert_bitwise(f(x), want)  # cached within the setting
    with gbn_jax.selection.selection_config(
        bracket_sigmas=1.0
    ):  # nested: keeps the method
      assert config.current() == config.SelectionConfig(
          method="bisect", bracket_sigmas=1.0
      )
    assert config.current().bracket_sigmas == 3.0
  assert (len(traces), loops) == (2, [common.CPU, common.ACCELERATOR])
  with gbn_jax.selection.selection_config(method="sort"):
    assert_bitwise(f(x), want)  # the first trace, from the cache
  assert len(traces) == 2
  # The public quantile (jitted inside the package) follows it too.
  with gbn_jax.selection.selection_config(method="bisect"):
    got = gbn_jax.quantile(x, 0.5, axis=0)
  # With tie counts, which tell GPUs from TPUs.
  assert set(loops[2:]) == {common.CPU, common.GPU, common.TPU}
  assert_bitwise(got, want)
  with pytest.raises(ValueError, match="method"):
    with gbn_jax.selection.selection_config(method="quick"):
      pass


@needs_native
def test_bracket_sigmas_setting_reaches_a_jitted_kernel_call():
  x = data("normal", (41000, 11), seed=31)
  k = jnp.full((11,), 20500, jnp.int32)
  missed = native.PATHS.index("missed_bracket")
  f = jax.jit(lambda v, k: native.kth_smallest_keys(v, k)[2])
  with gbn_jax.selection.selection_config(bracket_sigmas=3.0):
    wide = np.asarray(f(x, k))
  # The same jit object as above.
  with gbn_jax.selection.selection_config(bracket_sigmas=0.0):
    narrow = np.asarray(f(x, k))
  # At 0 sigmas brackets on continuous data miss (see the sampled-path test).
  assert np.sum(wide == missed) <= 1 and np.sum(narrow == missed) >= 9, (
      wide,
      narrow,
  )
