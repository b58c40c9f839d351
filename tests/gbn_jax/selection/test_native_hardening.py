"""Regression tests of the C++ selection kernel's hardening.

Each finding of the issue is checked through the public API
(``gbn_jax.quantile``, ``gbn_jax.superquantile``, the ``sqd`` measure) where
it shows there, against numpy float64 references written from the
definitions: ``q_alpha`` is the ``ceil(alpha N)``-th smallest value and
``qbar_alpha = q_alpha + E[(x - q_alpha)^+] / (1 - alpha)``. The kernel's
paths behind them (histogram passes for brackets over large atoms, the
single-key bracket at an open end) are checked bit for bit through
``gbn_jax._selection.dispatch``. Memory and allocation failure run in subprocesses.
``test_kernel_portable_code`` reruns the in-process tests on the kernel's
portable (non-AVX2) code.
"""

from __future__ import annotations

import fractions
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import native

from tests.helpers.process import run_python_result
from tests.helpers.selection import assert_passes_on_portable_kernel

TINY = np.finfo(np.float32).tiny
needs_native = pytest.mark.skipif(
    not native.available(), reason="C++ kernel not built"
)


# --------------------------------------------------------------------------
# References from the definitions (float64).


def rank(alpha: float, n: int) -> int:
  """ceil(alpha * n) for alpha as the decimal it prints as, at least 1."""
  return max(1, math.ceil(fractions.Fraction(repr(alpha)) * n))


def reference_quantile(x: np.ndarray, alpha: float) -> np.ndarray:
  """Per column of (N, F) ``x``: the ceil(alpha N)-th smallest (no NaN in x)."""
  return np.sort(np.asarray(x, np.float64), axis=0)[rank(alpha, x.shape[0]) - 1]


def reference_superquantile(x: np.ndarray, alpha: float) -> np.ndarray:
  q = reference_quantile(x, alpha)
  excess = np.maximum(np.asarray(x, np.float64) - q, 0.0).mean(axis=0)
  return q + excess / (1.0 - alpha)


def ulps(got, want) -> np.ndarray:
  """|got - want| in units of float32's spacing at ``want``."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return np.abs(got - want) / np.spacing(
      np.abs(want).astype(np.float32)
  ).astype(np.float64)


def daz(x):
  """``x`` as XLA:CPU's float comparisons read it: denormals as zero."""
  x = np.asarray(x, np.float32)
  return np.where(np.abs(x) < TINY, np.float32(0), x)


# --------------------------------------------------------------------------
# 1. Precision of E[(x - q)^+] at small alpha.


def _close_values(kind: str, rows: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if kind == "offset":  # 1000 + N(0, 1): the excess is small next to x
    return (1000 + rng.standard_normal((rows, 16))).astype(np.float32)
  # values a few ulp apart near 0.73
  base = np.float32(0.73)
  return (base + rng.integers(0, 6, (rows, 16)) * np.spacing(base)).astype(
      np.float32
  )


@pytest.mark.parametrize("alpha", [1e-4, 1e-3, 0.25])
@pytest.mark.parametrize(
    "rows", [10000, 50000]
)  # whole-column and sampled-bracket paths
@pytest.mark.parametrize("kind", ["offset", "few_ulps"])
def test_superquantile_within_two_ulp_at_small_alpha(kind, rows, alpha):
  # A small alpha opened the kernel's bracket down to key 0, its excess was
  # summed relative to 0 in float32 and cancelled (3.4 and 73 ulp).
  x = _close_values(kind, rows)
  got = np.asarray(gbn_jax.superquantile(x, alpha, axis=0))
  assert ulps(got, reference_superquantile(x, alpha)).max() <= 2.0
  # E[(x - q)^+] >= 0, so qbar >= q (an excess once came out negative)
  q = np.asarray(gbn_jax.quantile(x, alpha, axis=0))
  np.testing.assert_array_equal(
      q, reference_quantile(x, alpha).astype(np.float32)
  )
  assert np.all(got >= q)


@needs_native
@pytest.mark.parametrize("rows", [10000, 50000])
def test_kernel_excess_is_never_negative(rows):
  # Near-constant columns: one element a few ulp above the rest at most.
  rng = np.random.default_rng(rows)
  base = np.float32(0.73)
  x = np.full((rows, 9), base, np.float32)
  x[rng.integers(0, rows, 9), np.arange(9)] += np.arange(9) * np.spacing(base)
  for k in (1, 2, rows // 1000, rows // 2, rows):
    value, _, _, excess, _ = native.kth_smallest_with_sums(x, k, (0,))
    want = np.maximum(
        x.astype(np.float64) - np.asarray(value, np.float64), 0
    ).mean(axis=0)
    assert np.all(np.asarray(excess) >= 0)
    np.testing.assert_allclose(excess, want, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------
# 4. The above count (#{not x <= q}) with negative NaNs.


@needs_native
def test_kernel_above_count_with_negative_nans():
  # 20000 normal values, three -nan; k = 10 is the 7th smallest number (the
  # negative NaNs' keys sort first): 19993 elements are not <= q, not 19996.
  x = np.random.default_rng(4).standard_normal((20000, 1)).astype(np.float32)
  x[[5, 777, 12345], 0] = np.copysign(np.float32(np.nan), -1)
  value, _, _, _, above = native.kth_smallest_with_sums(x, 10, (0,))
  assert float(value[0]) == np.sort(x[~np.isnan(x)])[6]
  want = int((~(daz(x) <= daz(value)[None])).sum())
  assert want == 19993
  assert int(above[0]) == want


def test_superquantile_tangent_counts_nan_as_above():
  # Public face of the above count: the superquantile's derivative along the
  # element at q is 1 - #{not x <= q} / (N (1 - alpha)) (NaN counts as above).
  n, alpha = 20000, 0.0005  # rank(alpha, n) == 10
  x = np.random.default_rng(4).standard_normal((n, 1)).astype(np.float32)
  x[[5, 777, 12345], 0] = np.copysign(np.float32(np.nan), -1)
  q = np.sort(x[~np.isnan(x)])[6]  # the 10th smallest key: after the 3 -nan
  tangent = np.zeros_like(x)
  tangent[np.flatnonzero(x[:, 0] == q), 0] = 1.0
  _, got = jax.jvp(
      lambda v: gbn_jax.superquantile(v, alpha, axis=0), (x,), (tangent,)
  )
  above = n - int((x <= q).sum())
  assert above == 19993
  np.testing.assert_allclose(
      got, 1 - above / (n * (1 - alpha)), rtol=0, atol=1e-6
  )


# --------------------------------------------------------------------------
# 5. 2**31 rows or more.


@pytest.mark.parametrize(
    "fn,shape",
    [
        (lambda x: gbn_jax.quantile(x, 0.5, axis=0), (2**31 + 5, 1)),
        (lambda x: gbn_jax.superquantile(x, 0.5, axis=0), (2**31 + 5, 1)),
        (lambda x: gbn_jax.get_measure("sqd1")(x, 0), (2**31 + 5, 3)),
        (
            lambda x: gbn_jax.quantile(x, 0.5, axis=(0, 1)),
            (2**16, 2**15 + 1, 2),
        ),
    ],
    ids=["quantile", "superquantile", "sqd1", "two_axes"],
)
def test_more_than_int32_rows_is_a_clear_error(fn, shape):
  # int32 ranks and counts wrapped: a 2**31 + 5 row column gave NaN. Traced
  # only: jax.eval_shape allocates nothing.
  with pytest.raises(ValueError, match=r"2\*\*31 - 1"):
    jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, jnp.float32))


def test_int32_row_limit_itself_traces():
  at_limit = jax.ShapeDtypeStruct((2**31 - 1, 1), jnp.float32)
  out = jax.eval_shape(
      lambda x: gbn_jax.superquantile(x, 0.5, axis=0), at_limit
  )
  assert out.shape == (1,)
  common.check_element_count(2**31 - 1)
  with pytest.raises(ValueError, match="at most"):
    common.check_element_count(2**31)


# --------------------------------------------------------------------------
# 6. Values near +-1e38.


def _huge(rows: int, seed: int = 6) -> np.ndarray:
  rng = np.random.default_rng(seed)
  sign = rng.choice(np.float32([-1, 1]), (rows, 8))
  return (sign * rng.uniform(0.5, 1.0, (rows, 8)) * np.float32(1e38)).astype(
      np.float32
  )


@pytest.mark.parametrize("alpha", [1e-6, 0.5])
@pytest.mark.parametrize("rows", [10000, 50000])
def test_sqd_keeps_the_quantile_of_values_near_float_max(rows, alpha):
  # float32 block sums of +-1e38 overflowed; at alpha = 1e-6 the kernel's
  # excess came out NaN and took the quantile S with it.
  x = _huge(rows)
  s, d = gbn_jax.get_measure("sqd", alpha=alpha)(x, 0)
  np.testing.assert_array_equal(
      s, reference_quantile(x, alpha).astype(np.float32)
  )
  if not native.available():
    return  # the sort path keeps S; only its D may overflow
  x64 = x.astype(np.float64)
  scale = 1e38
  want_qbar = reference_superquantile(x, alpha)
  np.testing.assert_allclose(
      gbn_jax.superquantile(x, alpha, axis=0),
      want_qbar,
      rtol=0,
      atol=1e-6 * scale,
  )
  np.testing.assert_allclose(
      d, want_qbar - x64.mean(axis=0), rtol=0, atol=1e-5 * scale
  )


@needs_native
def test_kernel_sums_do_not_overflow_where_the_result_is_finite():
  # Means and excesses of values near float's max, summed in float64 where a
  # float32 block sum overflows; both sweeps (8 and 11 columns), both paths.
  for rows in (10000, 50000):
    x = np.concatenate(
        [_huge(rows), _huge(rows, seed=7)[:, :3]], axis=1
    ) * np.float32(3.0)
    for k in (1, rows // 2, rows):
      value, _, mean, excess, _ = native.kth_smallest_with_sums(x, k, (0,))
      x64 = x.astype(np.float64)
      want_excess = np.maximum(x64 - np.asarray(value, np.float64), 0).mean(
          axis=0
      )
      np.testing.assert_allclose(
          mean, x64.mean(axis=0), rtol=1e-5, atol=1e-7 * 3e38
      )
      with np.errstate(over="ignore"):
        want_excess = want_excess.astype(
            np.float32
        )  # +inf beyond float's range
      np.testing.assert_allclose(
          excess, want_excess, rtol=1e-5, atol=1e-7 * 3e38
      )


# --------------------------------------------------------------------------
# 7. bracket_sigmas is validated.


@needs_native
@pytest.mark.parametrize("sigmas", [np.inf, 1e17, np.nan, -1.0])
def test_kernel_rejects_bad_bracket_sigmas(sigmas):
  # selection_config refuses most of these; the kernel must still refuse all
  # of them from a direct call (it overflowed int64_t(floor(...)) before).
  x = jnp.asarray(
      np.random.default_rng(0).standard_normal((20000, 3)), jnp.float32
  )
  for call in (native.kth_smallest_keys, native.kth_smallest_sums):
    with pytest.raises(Exception, match="bracket_sigmas"):
      jax.block_until_ready(
          call(x, jnp.full((3,), 7, jnp.int32), bracket_sigmas=sigmas)
      )


@pytest.mark.parametrize("sigmas", [np.inf, np.nan, -1.0])
def test_selection_config_rejects_bad_bracket_sigmas(sigmas):
  with pytest.raises(ValueError, match="bracket_sigmas"):
    with gbn_jax.selection.selection_config(bracket_sigmas=sigmas):
      pass


# --------------------------------------------------------------------------
# 2. (kernel side) Brackets over large atoms: histogram passes, single keys.


def numpy_kth(x, k):
  """k-th smallest per column (bitwise; -0.0 as +0.0), from np.sort."""
  out = np.sort(np.asarray(x, np.float32), axis=0)[
      np.asarray(k) - 1, np.arange(x.shape[1])
  ]
  return np.where(out == 0, np.float32(0), out)


def check_kernel(x, k, paths=None):
  """Value, ties, mean, excess and above count of both entry points vs numpy."""
  k = np.broadcast_to(np.asarray(k, np.int32), (x.shape[1],))
  want = numpy_kth(x, k)
  value, ties = dispatch.kth_smallest(
      x, jnp.asarray(k), (0,), method="native", return_ties=True
  )
  np.testing.assert_array_equal(
      np.asarray(value).view(np.int32), want.view(np.int32)
  )
  want_ties = (daz(x) == daz(want)[None]).sum(axis=0)
  np.testing.assert_array_equal(ties, want_ties)
  got = native.kth_smallest_sums(jnp.asarray(x), jnp.asarray(k))
  np.testing.assert_array_equal(common.key_to_output(got[0]), want)
  np.testing.assert_array_equal(got[1], want_ties)
  x64 = x.astype(np.float64)
  finite = np.abs(x64[np.isfinite(x64)])
  scale = max(float(finite.mean()) if finite.size else 1.0, 1e-30)
  np.testing.assert_allclose(
      got[3], x64.mean(axis=0), rtol=1e-6, atol=1e-7 * scale
  )
  q = want.astype(np.float64)[None]
  with np.errstate(
      invalid="ignore"
  ):  # inf - inf where x == q == inf: not taken
    excess = np.where(x64 > q, x64 - q, 0.0).mean(axis=0)
  np.testing.assert_allclose(got[4], excess, rtol=1e-6, atol=1e-7 * scale)
  np.testing.assert_array_equal(
      got[5], (~(daz(x) <= daz(want)[None])).sum(axis=0)
  )
  if paths is not None:
    got_paths = {native.PATHS[p] for p in np.asarray(got[2])}
    assert got_paths <= set(paths), got_paths
  return got


@needs_native
@pytest.mark.parametrize(
    "columns", [1, 3, 9, 19]
)  # scalar sweep, and AVX2 groups
def test_kernel_bracket_over_two_atoms_uses_histogram_passes(columns):
  # Two values half and half: a bracket around the middle spans both, more
  # keys than the sweep may gather (an eighth of the column). It used to
  # gather them all.
  rows = 300_000
  rng = np.random.default_rng(columns)
  x = rng.choice(np.float32([-0.5, 2.0]), (rows, columns))
  x[rng.integers(0, rows, 50), rng.integers(0, columns, 50)] = 1.0
  counts = (x == -0.5).sum(axis=0)
  for k in (counts, counts + 1, counts - 5, counts + 7):
    got = check_kernel(x, k)
    assert "histogram" in {native.PATHS[p] for p in np.asarray(got[2])}


@needs_native
def test_kernel_histogram_pass_resolves_a_bin_too_large_to_gather():
  # Over a million keys in the target's histogram bin (two adjacent floats):
  # a second histogram pass over the column, not a gather.
  rng = np.random.default_rng(12)
  one = np.float32(1.0)
  x = np.concatenate(
      [
          rng.uniform(0.9, 1.0, 50_000).astype(np.float32),
          np.full(1_200_000, one),
          np.full(1_200_000, np.nextafter(one, np.float32(2))),
      ]
  )
  x = rng.permutation(x)[:, None]
  got = check_kernel(x, [50_010])
  assert native.PATHS[int(got[2][0])] == "histogram"
  check_kernel(x, [1_250_000])


@needs_native
@pytest.mark.parametrize("columns", [1, 9])
def test_kernel_atom_at_an_extreme_rank_is_a_single_key(columns):
  # A constant column (or ReLU zeros) at a rank near an end: the sample sees
  # one value across an open-ended bracket, which is counted, not gathered.
  rows = 100_000
  x = np.full((rows, columns), 3.25, np.float32)
  for k in (1, 2, 5, rows - 3, rows):
    check_kernel(x, k, paths={"single_key"})
  relu = np.maximum(
      np.random.default_rng(1).standard_normal((rows, columns)), 0
  ).astype(np.float32)
  check_kernel(relu, 3, paths={"single_key"})
  # A few values below the atom that the sample missed: the bracket misses
  # and the column is selected whole, still exactly.
  z = np.zeros((rows, columns), np.float32)
  z[np.random.default_rng(2).integers(0, rows, 9)] = -1.0
  check_kernel(z, 4)
  check_kernel(z, 100)


@needs_native
@pytest.mark.parametrize("columns", [2, 9, 16])
def test_kernel_missed_brackets_by_histogram_and_gather(columns, monkeypatch):
  # bracket_sigmas = 0 makes brackets miss: few columns are selected by
  # histogram passes (a gathered column would cost more than the input), many
  # gathered whole.
  with gbn_jax.selection.selection_config(bracket_sigmas=0.0):
    rng = np.random.default_rng(columns)
    x = rng.standard_normal((40_000, columns)).astype(np.float32)
    x[rng.random(x.shape) < 0.01] = np.inf
    for k in (1, 123, 20_000, 39_999):
      check_kernel(x, k)


# --------------------------------------------------------------------------
# 2. Peak memory on atoms at an extreme rank (subprocess: ru_maxrss).

MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np, jax, jax.numpy as jnp, gbn_jax
    rows, kind, fn, alpha = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    if kind == "constant":
      x = jnp.full((rows, 1), 3.25, jnp.float32)
      want = 3.25
    else:  # two values, half and half
      x = jnp.where(jnp.arange(rows) % 2 == 0, 1.0, 0.0).astype(jnp.float32)[:, None]
      want = 0.0 if fn == "quantile" else 1.0
    x.block_until_ready()
    f = jax.jit(lambda v: getattr(gbn_jax, fn)(v, alpha, axis=0)).lower(x).compile()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = float(np.asarray(f(x))[0])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert abs(got - want) <= 1e-6, (got, want)
    print("GROWTH", (after - before) * 1024 / (4 * rows))
    """)


@needs_native
@pytest.mark.parametrize(
    "kind,fn,alpha",
    [
        ("constant", "quantile", 1e-7),
        ("constant", "superquantile", 0.9999999),
        ("two_valued", "superquantile", 0.5),
    ],
)
def test_subprocess_peak_memory_on_atoms(kind, fn, alpha):
  # A constant 50M x 1 column at alpha = 1e-7 grew peak RSS by 5.1x its size:
  # the bracket spanned the atom and every key was gathered. Now the extra
  # memory must stay under 1.5x the input (it is near zero).
  rows = 20_000_000  # 80 MB
  proc = run_python_result(
      MEMORY_SCRIPT, str(rows), kind, fn, repr(alpha), timeout=300
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  growth = float(proc.stdout.split("GROWTH")[-1])
  assert growth <= 1.5, growth


# --------------------------------------------------------------------------
# 3. An allocation failure is a Python exception (subprocess: RLIMIT_AS).

ALLOCATION_SCRIPT = textwrap.dedent("""
    import gc, resource, sys
    import numpy as np, jax, gbn_jax
    rows, columns, kind, sigmas = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    rng = np.random.default_rng(0)
    if kind == "two_valued":
      host = (rng.random((rows, columns), dtype=np.float32) < 0.5).astype(np.float32)
    else:
      host = rng.standard_normal((rows, columns), dtype=np.float32)
    x = jax.device_put(host)
    x.block_until_ready()
    del host
    gc.collect()
    # Compiled, not run: a run would leave freed kernel memory in the heap.
    # The kernel's bracket width is fixed when tracing.
    with gbn_jax.selection.selection_config(bracket_sigmas=sigmas):
      f = jax.jit(lambda v: gbn_jax.superquantile(v, 0.5, axis=0)).lower(x).compile()

    def vm_size():
      with open("/proc/self/status") as status:
        for line in status:
          if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

    # No more address space than the process holds now (jax is up, the input
    # and the executable exist): the kernel's larger allocations fail.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_size() if hard == resource.RLIM_INFINITY else min(vm_size(), hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
      limited = np.asarray(f(x))
      print("RETURNED", flush=True)
    except Exception as e:
      print("RAISED", type(e).__name__, str(e).splitlines()[0], flush=True)
      limited = None
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    # The process lives on, and the same call works with memory to spare.
    free = np.asarray(f(x))
    if limited is not None:
      assert np.array_equal(limited, free), (limited, free)
    print("ALIVE", free[:2], flush=True)
    """)


@needs_native
@pytest.mark.parametrize(
    "rows,columns,kind,sigmas,must_raise",
    [
        # The case (a two-valued column under ulimit -v died with
        # SIGABRT or heap corruption): it may now fit, or must raise.
        (1_000_000, 16, "two_valued", 3.0, False),
        # Brackets that all miss (bracket_sigmas = 0) gather each column
        # whole, 96 MB a column here (past glibc's largest mmap threshold,
        # so never from freed heap): that cannot fit, and must raise.
        (8_000_000, 8, "normal", 0.0, True),
    ],
    ids=["two_valued", "missed_brackets"],
)
def test_subprocess_allocation_failure_raises(
    rows, columns, kind, sigmas, must_raise
):
  proc = run_python_result(
      ALLOCATION_SCRIPT,
      str(rows),
      str(columns),
      kind,
      repr(sigmas),
      timeout=300,
  )
  output = proc.stdout + proc.stderr[-3000:]
  assert proc.returncode == 0, f"died with {proc.returncode}: {output}"
  assert "ALIVE" in proc.stdout, output
  if must_raise or "RAISED" in proc.stdout:
    assert "RAISED" in proc.stdout and "out of memory" in proc.stdout, output


# --------------------------------------------------------------------------
# The in-process tests again on the kernel's portable code.


@needs_native
@pytest.mark.slow
def test_kernel_portable_code():
  # GBN_KTH_SCALAR=1 makes the kernel run its portable (non-AVX2) code.
  assert_passes_on_portable_kernel(
      __file__, "kernel and not portable and not subprocess"
  )
