"""The C++ kernels under AddressSanitizer and UndefinedBehaviorSanitizer.

Builds the library's ``gbn_jax/csrc/kth_smallest_cpu.cc`` and the training
suite's convolution kernels (``train/native/csrc``, the objects of
``train.native.build.conv_sources``) with ``-fsanitize=address,undefined``,
once per run, shared by the xdist workers (``train.native.build.build``: a
folder keyed by the inputs' hash, file-locked, in the system's temp dir).
The selection's two FFI entry points get a bounded fuzz in a subprocess that
loads the library through ``GBN_KTH_LIBRARY``, the convolution's three
handlers random geometries, each with the sanitizer runtime preloaded
(libstdc++ beside libasan, or ASAN aborts inside jaxlib on ``__cxa_throw``).
Every result is compared with numpy references written from the definitions;
any sanitizer report fails the test. Skipped without a C++ compiler or
libasan. About a minute and a half on two cores.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import textwrap

import jax
import pytest

from train.native import build as native_build

from tests.helpers.process import ProcessError
from tests.helpers.process import run_program
from tests.helpers.process import run_python_result

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[3]
CSRC = ROOT / "gbn_jax" / "csrc"
SOURCE = CSRC / "kth_smallest_cpu.cc"
INCLUDE = CSRC / "third_party"
# The instrumented libraries, shared by the xdist workers and later runs (one
# folder per hash of the build's inputs).
BUILD_ROOT = pathlib.Path(tempfile.gettempdir()) / f"gbn_jax_asan_{os.getuid()}"
# Seconds of fuzzing per run (after the fixed cases), AVX2 and portable code.
FUZZ_SECONDS = {"avx2": 6.0, "portable": 2.0}
SANITIZER_REPORTS = (
    "ERROR: AddressSanitizer",
    "runtime error:",
    "ERROR: LeakSanitizer",
    "UndefinedBehaviorSanitizer",
    "AddressSanitizer:DEADLYSIGNAL",
)


def _runtime_library(cxx: str, name: str) -> str | None:
  """The compiler's copy of a runtime library (libasan.so, libstdc++.so)."""
  try:
    found = run_program([cxx, f"-print-file-name={name}"], timeout=60)
  except (OSError, ProcessError):
    return None
  path = found.stdout.strip()
  return (
      os.path.realpath(path)
      if os.path.isabs(path) and os.path.exists(path)
      else None
  )


def _sanitized(name: str, sources, include_dirs):
  """``(library, preload)``: ``sources`` built with ASAN and UBSAN, and the
  runtime libraries to preload.

  The build takes about a minute, and each pytest-xdist worker would
  otherwise repeat it: ``native_build.build`` builds it once, under a file
  lock that the other workers (and later runs) wait on, and they reuse it.
  """
  cxx = native_build.compiler()
  if cxx is None:
    pytest.skip("no C++ compiler")
  asan = _runtime_library(cxx, "libasan.so")
  if asan is None:
    pytest.skip("no libasan for this compiler")
  preload = [asan]
  libstdcxx = _runtime_library(cxx, "libstdc++.so")
  if libstdcxx is not None:
    preload.append(libstdcxx)
  # -fno-builtin: at -O1 GCC turns int64_t(floor(x)) into lfloor, whose
  # overflow float-cast-overflow then misses.
  flags = [
      "-std=c++17",
      "-O1",
      "-fno-builtin",
      "-g",
      "-fno-omit-frame-pointer",
      "-fPIC",
      "-fsanitize=address,undefined,float-cast-overflow",
      "-fno-sanitize-recover=all",
  ]
  try:
    library = native_build.build(
        name, sources, flags, include_dirs=include_dirs, root=BUILD_ROOT
    )
  except native_build.BuildFailed as e:
    output = e.output or e.log.read_text()
    if "sanitize" in e.output or "asan" in e.output:
      pytest.skip(f"the compiler cannot build with sanitizers: {output[-500:]}")
    pytest.fail(f"sanitizer build failed:\n{output[-3000:]}")
  return str(library), preload


@pytest.fixture(scope="module")
def sanitized_build():
  return _sanitized("kth_cpu_asan", [native_build.Source(SOURCE)], [INCLUDE])


@pytest.fixture(scope="module")
def sanitized_conv_build():
  return _sanitized(
      "conv_cpu_asan", native_build.conv_sources(), [jax.ffi.include_dir()]
  )


FUZZ_SCRIPT = textwrap.dedent(r"""
    import os, sys, time
    import numpy as np
    import jax, jax.numpy as jnp
    from gbn_jax._selection import native

    library = os.environ["GBN_KTH_LIBRARY"]
    assert native.library_path() == library and native.available(), library
    seed, seconds = int(sys.argv[1]), float(sys.argv[2])
    rng = np.random.default_rng(seed)
    TINY = np.float32(np.finfo(np.float32).tiny)
    NEG_NAN = np.copysign(np.float32(np.nan), np.float32(-1))
    SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, NEG_NAN, 1e-45, -1e-45, 3e-39,
                         -3e-39, TINY, -TINY, 1.0, -1.0, 3.4e38, -3.4e38], np.float32)
    # Values of the key order (``gbn_jax._selection.common.float_to_key``), as unsigned integers:
    # NaNs of each sign beyond the infinities, -0.0 just below +0.0.
    def keys(x):
      u = np.asarray(x, np.float32).view(np.uint32)
      return np.where(u >> 31 == 1, ~u, u | np.uint32(0x80000000)).astype(np.uint32)

    def float_of(key):
      key = np.asarray(key, np.uint32)
      bits = np.where(key >> 31 == 1, key ^ np.uint32(0x80000000), ~key).astype(np.uint32)
      return bits.view(np.float32)

    def daz(x):  # XLA:CPU's float compares read denormals as zero
      x = np.asarray(x, np.float32)
      return np.where(np.abs(x) < TINY, np.float32(0), x)

    def data(kind, n, f):
      x = rng.standard_normal((n, f)).astype(np.float32)
      if kind == "ties":
        x = np.round(x * 2) / 2
      elif kind == "specials":
        mask = rng.random((n, f)) < rng.choice([0.001, 0.05, 0.5])
        x[mask] = rng.choice(SPECIALS, int(mask.sum()))
      elif kind == "denormal":
        x = rng.choice(np.float32([-3e-39, -1e-45, -0.0, 0.0, 1e-45, 2e-45, 5e-39, TINY, -TINY, 1.0]), (n, f))
      elif kind == "constant":
        x[:] = rng.choice(SPECIALS[:4])
      elif kind == "two":
        x = rng.choice(np.float32([-0.0, 0.5]), (n, f))
      elif kind == "huge":
        x = (np.sign(x) * rng.uniform(0.5, 1.0, (n, f)) * 3e38).astype(np.float32)
      elif kind == "relu":
        x = np.maximum(x, 0)
      elif kind == "sorted":
        x = np.sort(x, axis=0)
      elif kind == "nan_low":  # negative NaNs: keys below every number
        x[rng.random((n, f)) < 0.01] = NEG_NAN
      return np.ascontiguousarray(x, np.float32)

    def check(x, k, sigmas, label):
      n, f = x.shape
      kk = np.clip(k, 1, max(n, 1))
      got_keys, got_ties, got_path = (np.asarray(a) for a in native.kth_smallest_keys(jnp.asarray(x), jnp.asarray(k), bracket_sigmas=sigmas))
      sums = [np.asarray(a) for a in native.kth_smallest_sums(jnp.asarray(x), jnp.asarray(k), bracket_sigmas=sigmas)]
      if n == 0:
        return
      want_key = np.sort(keys(x), axis=0)[kk - 1, np.arange(f)]
      for name, got in (("keys", got_keys), ("sums", sums[0])):
        got = got.view(np.uint32) ^ np.uint32(0x80000000)
        assert np.array_equal(got, want_key), (label, name, got, want_key)
      q = float_of(want_key)
      nan_q = np.isnan(q)
      ties = np.where(nan_q, 0, (daz(x) == daz(q)[None]).sum(axis=0))
      above = (~(daz(x) <= daz(q)[None])).sum(axis=0)
      if native.counts_always_known():
        assert np.array_equal(got_ties, ties), (label, got_ties, ties)
        assert np.array_equal(sums[1], ties), (label, sums[1], ties)
        assert np.array_equal(sums[5], above), (label, sums[5], above)
      assert np.all((got_path >= 0) & (got_path < len(native.PATHS))), (label, got_path)
      for path in (got_path, sums[2]):
        for p in path:
          seen[native.PATHS[p]] = seen.get(native.PATHS[p], 0) + 1
      x64 = x.astype(np.float64)
      q64 = q.astype(np.float64)[None]
      with np.errstate(invalid="ignore", over="ignore"):
        mean = x64.mean(axis=0).astype(np.float32)
        excess = np.where(x64 > q64, x64 - q64, 0.0).mean(axis=0)
        excess = np.where(np.isnan(x).any(axis=0), np.nan, excess).astype(np.float32)
      finite = np.abs(x64[np.isfinite(x64)])
      scale = float(finite.max()) if finite.size else 1.0
      # Denormals count as zero in the kernel's float sums (DAZ).
      np.testing.assert_allclose(sums[3], mean, rtol=1e-5, atol=1e-6 * scale + 1e-37, err_msg=label)
      np.testing.assert_allclose(sums[4], excess, rtol=1e-5, atol=1e-6 * scale + 1e-37, err_msg=label)
      assert np.all(~(sums[4] < 0)), (label, sums[4])

    def ranks(n, f):
      pick = rng.integers(0, 4)
      if pick == 0:
        return rng.integers(1, n + 1, f, dtype=np.int32)
      if pick == 1:  # extreme ranks, and out of range (clamped)
        return rng.choice(np.int32([-3, 0, 1, 2, 3, n - 2, n - 1, n, n + 7]), f).astype(np.int32)
      if pick == 2:
        return np.full(f, rng.integers(1, n + 1), np.int32)
      return np.full(f, max(1, int(rng.choice([1e-6, 1e-3, 0.25, 0.5, 0.75, 0.999]) * n)), np.int32)

    seen = {}  # columns per kernel path
    KINDS = ["normal", "ties", "specials", "denormal", "constant", "two", "huge", "relu", "sorted", "nan_low"]
    ROWS = [0, 1, 2, 3, 7, 64, 1000, 16383, 16384, 16385, 16391, 20000, 33000, 70001]
    COLUMNS = [1, 2, 3, 5, 7, 8, 9, 11, 13, 16, 17]

    # Fixed cases: every path (whole column, single key, gathered, missed
    # brackets gathered or by histogram, brackets over atoms by histogram,
    # a bin too large to gather), then random ones until the time is up.
    fixed = [
        ("two", 70001, 1, 3.0), ("two", 70001, 9, 3.0), ("two", 70001, 17, 3.0),
        ("constant", 40000, 3, 3.0), ("constant", 40000, 11, 3.0),
        ("normal", 40000, 3, 0.0), ("normal", 40000, 9, 0.0), ("normal", 40000, 16, 0.0),
        ("specials", 16385, 13, 3.0), ("nan_low", 20000, 5, 3.0), ("denormal", 30000, 9, 0.0),
        ("huge", 30000, 8, 3.0), ("huge", 5000, 9, 3.0), ("relu", 30000, 7, 3.0),
    ]
    cases = 0
    for kind, n, f, sigmas in fixed:
      x = data(kind, n, f)
      for _ in range(3):
        check(x, ranks(n, f), sigmas, f"{kind} {n}x{f} sigmas={sigmas}")
        cases += 1
    # Over a million keys in the target's histogram bin: a second pass.
    one = np.float32(1.0)
    x = np.concatenate([rng.uniform(0.9, 1.0, 50_000).astype(np.float32),
                        np.full(1_100_000, one), np.full(1_100_000, np.nextafter(one, np.float32(2)))])
    x = rng.permutation(x)[:, None]
    check(x, np.int32([50_010]), 3.0, "large bin")
    check(x, np.int32([1_200_000]), 0.0, "large bin, missed")
    # Invalid bracket_sigmas are FFI errors (they were undefined behaviour).
    for bad in (np.inf, 1e17, np.nan, -1.0):
      try:
        jax.block_until_ready(native.kth_smallest_sums(jnp.ones((20000, 2), jnp.float32), jnp.int32([3, 4]), bracket_sigmas=bad))
      except Exception as e:
        assert "bracket_sigmas" in str(e), e
      else:
        raise AssertionError(f"bracket_sigmas={bad} was accepted")
    deadline = time.time() + seconds
    while time.time() < deadline:
      kind, n, f = rng.choice(KINDS), int(rng.choice(ROWS)), int(rng.choice(COLUMNS))
      sigmas = float(rng.choice([3.0, 3.0, 0.0]))
      x = data(kind, n, f)
      for _ in range(2):
        check(x, ranks(max(n, 1), f), sigmas, f"{kind} {n}x{f} sigmas={sigmas}")
        cases += 1
    # Every path was taken (the fixed cases see to it).
    assert set(seen) == set(native.PATHS), seen
    print("FUZZ OK", cases, "cases; columns per path:", seen, flush=True)
    """)


@pytest.mark.parametrize("code", ["avx2", "portable"])
def test_kernel_fuzz_under_sanitizers(sanitized_build, code):
  library, preload = sanitized_build
  env = dict(
      os.environ,
      GBN_KTH_LIBRARY=library,
      LD_PRELOAD=" ".join(preload),
      # Leaks: jaxlib and CPython keep allocations for the process lifetime.
      ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=1:abort_on_error=1"
      ":halt_on_error=1:print_stacktrace=1",
      UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
      JAX_PLATFORMS="cpu",
  )
  env.pop("GBN_KTH_SCALAR", None)
  if code == "portable":
    env["GBN_KTH_SCALAR"] = "1"
  seed = 0 if code == "avx2" else 1
  _run_script(FUZZ_SCRIPT, [str(seed), str(FUZZ_SECONDS[code])], env, "FUZZ OK")


def _run_script(script: str, args: list[str], env: dict, ok: str) -> None:
  """Runs ``script`` in a fresh interpreter; fails on any sanitizer report
  or unless it exits 0 having printed ``ok``."""
  # Compiled here, not read from the suite's cache: the instrumented library
  # must be the one that runs.
  env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  # env is the whole environment: what it lacks of this process's goes.
  drop = [k for k in os.environ if k not in env]
  proc = run_python_result(script, *args, env=env, drop=drop, timeout=600)
  output = proc.stdout[-3000:] + proc.stderr[-8000:]
  reports = [r for r in SANITIZER_REPORTS if r in proc.stderr]
  assert not reports, output
  assert proc.returncode == 0 and ok in proc.stdout, output
  print(proc.stdout.strip().splitlines()[-1])


CONV_SCRIPT = textwrap.dedent(r"""
    import ctypes, sys
    import numpy as np
    import jax, jax.numpy as jnp
    library = ctypes.CDLL(sys.argv[1])
    jax.ffi.register_ffi_target(
        "conv_asan", jax.ffi.pycapsule(library.GbnConvKernelGradF32), platform="cpu")
    jax.ffi.register_ffi_target(
        "conv_forward_asan", jax.ffi.pycapsule(library.GbnConvForwardF32), platform="cpu")
    jax.ffi.register_ffi_target(
        "conv_input_grad_asan", jax.ffi.pycapsule(library.GbnConvInputGradF32), platform="cpu")
    rng = np.random.default_rng(0)
    cases = 0
    for _ in range(60):
      n, h, w, c = rng.integers(1, 6), rng.integers(1, 12), rng.integers(1, 30), rng.integers(1, 20)
      kh, kw, sh, sw = rng.integers(1, 5, size=4)
      f = int(rng.choice([1, 3, 8, 16, 24, 32, 40, 48]))
      top, left = rng.integers(0, kh), rng.integers(0, kw)
      bottom, right = rng.integers(0, kh), rng.integers(0, kw)
      p = (h + top + bottom - kh) // sh + 1
      q = (w + left + right - kw) // sw + 1
      if p < 1 or q < 1:
        continue
      x = rng.standard_normal((n, h, w, c)).astype(np.float32)
      g = rng.standard_normal((n, p, q, f)).astype(np.float32)
      out = jax.ShapeDtypeStruct((int(kh), int(kw), int(c), f), jnp.float32)
      got = jax.ffi.ffi_call("conv_asan", out)(
          x, g, stride_h=np.int64(sh), stride_w=np.int64(sw), top=np.int64(top),
          left=np.int64(left))
      xp = np.pad(x.astype(np.float64), ((0, 0), (top, bottom), (left, right), (0, 0)))
      want = np.zeros(out.shape)
      for i in range(kh):
        for j in range(kw):
          window = xp[:, i : i + sh * (p - 1) + 1 : sh, j : j + sw * (q - 1) + 1 : sw]
          want[i, j] = np.einsum("nhwc,nhwf->cf", window, g)
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
      # The forward pass on the same geometry, with the kernel drawn anew.
      k = rng.standard_normal(out.shape).astype(np.float32)
      y = jax.ffi.ffi_call("conv_forward_asan", jax.ShapeDtypeStruct(g.shape, jnp.float32))(
          x, k, stride_h=np.int64(sh), stride_w=np.int64(sw), top=np.int64(top),
          left=np.int64(left))
      want = np.zeros(g.shape)
      for i in range(kh):
        for j in range(kw):
          window = xp[:, i : i + sh * (p - 1) + 1 : sh, j : j + sw * (q - 1) + 1 : sw]
          want += np.einsum("npqc,cf->npqf", window, k[i, j])
      np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
      # The input gradient: each output's gradient spread over its window.
      dx = jax.ffi.ffi_call("conv_input_grad_asan", jax.ShapeDtypeStruct(x.shape, jnp.float32))(
          g, k, stride_h=np.int64(sh), stride_w=np.int64(sw), top=np.int64(top),
          left=np.int64(left))
      want = np.zeros(xp.shape)
      for i in range(kh):
        for j in range(kw):
          want[:, i : i + sh * (p - 1) + 1 : sh, j : j + sw * (q - 1) + 1 : sw] += np.einsum(
              "npqf,cf->npqc", g.astype(np.float64), k[i, j])
      want = want[:, top : top + h, left : left + w]
      np.testing.assert_allclose(np.asarray(dx), want, rtol=1e-4, atol=1e-4)
      cases += 1
    print(f"CONV OK {cases} cases")
""")


# Each instruction set the CPU has (GBN_CONV_MAX_ISA caps it; "": the widest).
@pytest.mark.parametrize("isa", ["", "avx2", "scalar"])
def test_conv_kernel_under_sanitizers(sanitized_conv_build, isa):
  library, preload = sanitized_conv_build
  # Alike test_kernel_fuzz_under_sanitizers: each
  # kernel's own library switch, instruction-set switch and ASan options.
  env = dict(
      os.environ,
      GBN_CONV_MAX_ISA=isa,
      LD_PRELOAD=" ".join(preload),
      ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1",
      UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
      JAX_PLATFORMS="cpu",
  )
  _run_script(CONV_SCRIPT, [library], env, "CONV OK")
