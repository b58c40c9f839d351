"""The optional C++ k-th smallest kernel for XLA:CPU (``csrc/kth_smallest_cpu.cc``).

``pip install`` compiles it when a C++17 compiler is present (``setup.py``); it
is an XLA FFI handler, loaded here with ctypes and registered for the CPU.
Without it, :mod:`gbn_jax._select` runs its pure-JAX selection: same answers,
several counting passes instead of one sweep.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_LIBRARY = "gbn_jax._kth_cpu"
# Names a compiled kernel to load instead of the installed one (e.g. a
# sanitizer build, see tests/test_native_sanitizers.py). A library named
# there that does not load is an error, not a silent fall back to pure JAX.
LIBRARY_ENV = "GBN_KTH_LIBRARY"
_TARGET = "gbn_kth_smallest_f32"
_SUMS_TARGET = "gbn_kth_smallest_sums_f32"
# Half-width of the kernel's sampled bracket, in binomial standard deviations:
# a column misses it with probability ~0.3% (then it is selected whole).
# Measured fastest of 3 and 4 on the development CPU; 0 makes misses common
# (the tests use that to exercise the fallback).
BRACKET_SIGMAS = 3.0


def library_path() -> str | None:
  """Where the kernel is loaded from: ``$GBN_KTH_LIBRARY`` if set, else the
  installed ``gbn_jax._kth_cpu`` extension; None if neither."""
  override = os.environ.get(LIBRARY_ENV)
  if override:
    return override
  spec = importlib.util.find_spec(_LIBRARY)
  return spec.origin if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
  """The compiled kernel, its targets registered with XLA (CPU); None if absent."""
  path = library_path()
  if path is None:
    return None
  try:
    library = ctypes.CDLL(path)
    handlers = {_TARGET: library.GbnKthSmallestF32, _SUMS_TARGET: library.GbnKthSmallestSumsF32}
    library.GbnKthCountsAlwaysKnown.restype = ctypes.c_int
  except (OSError, AttributeError) as e:
    if os.environ.get(LIBRARY_ENV):
      raise ImportError(f"{LIBRARY_ENV}={path!r} is not a loadable gbn_jax kernel: {e}") from e
    return None
  for target, handler in handlers.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
  return library


def available() -> bool:
  """Whether the compiled kernel was found and registered with XLA (CPU)."""
  return _library() is not None


def counts_always_known() -> bool:
  """Whether the kernel's tie and above counts are never -1 on this machine.

  True where it reads the CPU's denormal mode (x86): it then counts as the
  caller's float comparisons do, zeros and denormals included, and the
  callers skip their fallback count (a ``lax.cond`` costs tens of
  microseconds on XLA:CPU, more than a small layer's selection).
  """
  library = _library()
  return library is not None and bool(library.GbnKthCountsAlwaysKnown())


#: Values of the kernel's per-column ``path`` output. ``"histogram"``: the
#: bracket held the target but more keys than the sweep may gather (a large
#: atom), so histogram passes over the column selected it.
PATHS = ("whole_column", "single_key", "gathered", "missed_bracket", "histogram")


def kth_smallest_keys(rows: Array, k: Array) -> tuple[Array, Array, Array]:
  """Per column of float32 ``rows`` ``(N, F)``, the key of the ``k``-th smallest.

  ``N < 2**31`` (the kernel returns an error otherwise); ``k``: ``(F,)``
  int32, clamped to ``[1, N]`` by the kernel. Returns three ``(F,)`` int32
  arrays: the order-preserving keys of :mod:`gbn_jax._select`;
  how many elements equal the answer as XLA:CPU's float comparisons see it
  (denormals read as zero where the CPU's flag says so; -1 for a zero or
  denormal answer where the kernel cannot read that flag, see
  :func:`counts_always_known`); and the index in :data:`PATHS` of the way
  each column was solved. CPU only; call :func:`available` first.
  """
  out = jax.ShapeDtypeStruct(k.shape, jnp.int32)
  none = (jax.ShapeDtypeStruct((0,), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((0,), jnp.int32),)
  call = jax.ffi.ffi_call(_TARGET, (out, out, out) + none, vmap_method="sequential")
  return call(rows, k, bracket_sigmas=np.float64(BRACKET_SIGMAS))[:3]


def kth_smallest_sums(rows: Array, k: Array) -> tuple[Array, ...]:
  """:func:`kth_smallest_keys` plus what a superquantile needs, in the same sweep.

  Returns ``(keys, ties, path, mean, mean_excess, above)``: the first three as
  in :func:`kth_smallest_keys`; per column, float32, the mean of all ``N``
  rows and ``E[(x - q)^+]`` (sums of non-negative terms, float32 within
  short blocks of rows and float64 across, a block whose float32 sum
  overflows summed again in float64; NaN if any element is NaN), ``q`` the
  selected value; and, int32, how many elements are not ``<= q`` as float
  comparisons see them (NaN included; -1 where ``ties`` is). An allocation
  failure in the kernel raises (``RESOURCE_EXHAUSTED``) rather than abort.
  """
  out = jax.ShapeDtypeStruct(k.shape, jnp.int32)
  value = jax.ShapeDtypeStruct(k.shape, jnp.float32)
  call = jax.ffi.ffi_call(
      _SUMS_TARGET, (out, out, out, value, value, out), vmap_method="sequential"
  )
  return call(rows, k, bracket_sigmas=np.float64(BRACKET_SIGMAS))
