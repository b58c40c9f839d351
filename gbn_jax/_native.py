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

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_LIBRARY = "gbn_jax._kth_cpu"
_TARGET = "gbn_kth_smallest_f32"
_SUMS_TARGET = "gbn_kth_smallest_sums_f32"
# Half-width of the kernel's sampled bracket, in binomial standard deviations:
# a column misses it with probability ~0.3% (then it is selected whole).
# Measured fastest of 3 and 4 on the development CPU; 0 makes misses common
# (the tests use that to exercise the fallback).
BRACKET_SIGMAS = 3.0


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the compiled kernel was found and registered with XLA (CPU)."""
  spec = importlib.util.find_spec(_LIBRARY)
  if spec is None or not spec.origin:
    return False
  try:
    library = ctypes.CDLL(spec.origin)
    handlers = {_TARGET: library.GbnKthSmallestF32, _SUMS_TARGET: library.GbnKthSmallestSumsF32}
  except (OSError, AttributeError):
    return False
  for target, handler in handlers.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
  return True


#: Values of the kernel's per-column ``path`` output.
PATHS = ("whole_column", "single_key", "gathered", "missed_bracket")


def kth_smallest_keys(rows: Array, k: Array) -> tuple[Array, Array, Array]:
  """Per column of float32 ``rows`` ``(N, F)``, the key of the ``k``-th smallest.

  ``k``: ``(F,)`` int32, clamped to ``[1, N]`` by the kernel. Returns three
  ``(F,)`` int32 arrays: the order-preserving keys of :mod:`gbn_jax._select`;
  how many elements equal the answer when it is a normal nonzero float (-1
  for zeros, denormals and infinities, whose float equality depends on the
  backend's denormal flushing or on masked-out ``+inf``); and the index in
  :data:`PATHS` of the way each column was solved. CPU only; call
  :func:`available` first.
  """
  out = jax.ShapeDtypeStruct(k.shape, jnp.int32)
  none = (jax.ShapeDtypeStruct((0,), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((0,), jnp.int32),)
  call = jax.ffi.ffi_call(_TARGET, (out, out, out) + none, vmap_method="sequential")
  return call(rows, k, bracket_sigmas=np.float64(BRACKET_SIGMAS))[:3]


def kth_smallest_sums(rows: Array, k: Array) -> tuple[Array, ...]:
  """:func:`kth_smallest_keys` plus what a superquantile needs, in the same sweep.

  Returns ``(keys, ties, path, mean, mean_excess, above)``: the first three as
  in :func:`kth_smallest_keys`; per column, float32, the mean of all ``N``
  rows and ``E[(x - q)^+]`` (summed in float64; NaN if any element is NaN),
  ``q`` the selected value; and, int32, how many elements exceed ``q`` where
  that is exact as a float comparison (as for ``ties``), else -1.
  """
  out = jax.ShapeDtypeStruct(k.shape, jnp.int32)
  value = jax.ShapeDtypeStruct(k.shape, jnp.float32)
  call = jax.ffi.ffi_call(
      _SUMS_TARGET, (out, out, out, value, value, out), vmap_method="sequential"
  )
  return call(rows, k, bracket_sigmas=np.float64(BRACKET_SIGMAS))
