"""The optional C++ k-th smallest kernel for XLA:CPU (method ``"native"``).

The kernel (``gbn_jax/csrc/kth_smallest_cpu.cc``) is compiled by ``pip
install`` when a C++17 compiler is present (``setup.py``, extension
``gbn_jax._kth_cpu``); it is an XLA FFI handler, loaded here with ctypes and
registered for the CPU. Without it the pure-JAX selection runs
(:mod:`gbn_jax._selection.loop`): same answers, several counting passes
instead of one sweep.

For more than 16384 rows the kernel makes one sweep that counts below a
sampled bracket and packs the few keys inside it, for fewer a radix select per
transposed column. It sees one device's rows, so with ``axis_name`` the
pure-JAX methods run. Its second entry point (:func:`kth_smallest_with_sums`)
also returns a superquantile's sums from the same sweep, which is how ``sqd``
gets its statistics on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
import ctypes
import functools
import importlib.util
import os
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection import common
from gbn_jax._selection import config
from gbn_jax._selection.common import F32
from gbn_jax._selection.reductions import count_true

Array = jax.Array

_LIBRARY = "gbn_jax._kth_cpu"
# Names a compiled kernel to load instead of the installed one (e.g. a
# sanitizer build, see tests/train/native/test_sanitizers.py). A library named
# there that does not load is an error, not a silent fall back to pure JAX.
LIBRARY_ENV = "GBN_KTH_LIBRARY"
_TARGET = "gbn_kth_smallest_f32"
_SUMS_TARGET = "gbn_kth_smallest_sums_f32"
#: The kernel's custom-call targets (XLA:CPU only).
TARGETS = (_TARGET, _SUMS_TARGET)


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
  """The compiled kernel, its targets registered with XLA (CPU); None if absent.

  An installed extension that is found but does not load warns (once: the
  result is cached) and the pure-JAX selection runs; one named by
  ``$GBN_KTH_LIBRARY`` raises ``ImportError``.
  """
  path = library_path()
  if path is None:
    return None
  try:
    library = ctypes.CDLL(path)
    handlers = {
        _TARGET: library.GbnKthSmallestF32,
        _SUMS_TARGET: library.GbnKthSmallestSumsF32,
    }
    library.GbnKthCountsAlwaysKnown.restype = ctypes.c_int
  except (OSError, AttributeError) as e:
    if os.environ.get(LIBRARY_ENV):
      raise ImportError(
          f"{LIBRARY_ENV}={path!r} is not a loadable gbn_jax kernel: {e}"
      ) from e
    # A broken build or a library for another Python/CPU: say so, since
    # everything still works, only several times slower.
    warnings.warn(
        f"gbn_jax: the compiled selection kernel {path!r} was found but does"
        f" not load ({e}); the pure-JAX selection runs instead.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None
  for target, handler in handlers.items():
    jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(handler), platform="cpu"
    )
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


def known_or_counted(
    known: Array | None, flags: Callable[[], Array], axes: tuple[int, ...]
) -> Array:
  """Per position, how many of ``flags()`` are true: ``known`` where it is (>= 0).

  The native kernel (one device, no axis_name) counts as ``flags`` would,
  except where it says -1 (only on CPUs whose denormal mode it cannot read);
  counting here is a pass over the data, so only then, behind a ``lax.cond``
  that is left out where the kernel never says -1 (a cond costs tens of
  microseconds on XLA:CPU). ``flags`` is a function so that the flags are
  computed inside the branch that counts: a full-size operand of
  ``lax.cond`` would be materialized on every call. The result has
  ``count_true``'s dtype.
  """
  count = lambda: count_true(flags(), axes)
  if known is None:
    return count()
  dtype = jax.eval_shape(count).dtype
  if counts_always_known():
    return known.astype(dtype)
  return lax.cond(jnp.all(known >= 0), lambda: known.astype(dtype), count)


#: Values of the kernel's per-column ``path`` output. ``"histogram"``: the
#: bracket held the target but more keys than the sweep may gather (a large
#: atom), so histogram passes over the column selected it.
PATHS = (
    "whole_column",
    "single_key",
    "gathered",
    "missed_bracket",
    "histogram",
)


def kth_smallest_keys(
    rows: Array, k: Array, *, bracket_sigmas: float | None = None
) -> tuple[Array, Array, Array]:
  """Per column of float32 ``rows`` ``(N, F)``, the key of the ``k``-th smallest.

  ``N < 2**31`` (the kernel returns an error otherwise); ``k``: ``(F,)``
  int32, clamped to ``[1, N]`` by the kernel. Returns three ``(F,)`` int32
  arrays: the order-preserving keys of ``common.float_to_key``;
  how many elements equal the answer as XLA:CPU's float comparisons see it
  (denormals read as zero where the CPU's flag says so; -1 for a zero or
  denormal answer where the kernel cannot read that flag, see
  :func:`counts_always_known`); and the index in :data:`PATHS` of the way
  each column was solved. CPU only; call :func:`available` first.
  """
  out = jax.ShapeDtypeStruct(k.shape, jnp.int32)
  none = (jax.ShapeDtypeStruct((0,), jnp.float32),) * 2 + (
      jax.ShapeDtypeStruct((0,), jnp.int32),
  )
  call = jax.ffi.ffi_call(
      _TARGET, (out, out, out) + none, vmap_method="sequential"
  )
  out = call(rows, k, bracket_sigmas=_bracket_sigmas(bracket_sigmas))[:3]
  return _varying_like_rows(out, rows)


def kth_smallest_sums(
    rows: Array, k: Array, *, bracket_sigmas: float | None = None
) -> tuple[Array, ...]:
  """:func:`kth_smallest_keys` plus what a superquantile needs, in the same sweep.

  Returns ``(keys, ties, path, mean, mean_excess, above)``: the first three as
  in :func:`kth_smallest_keys`; per column, float32, the mean of all ``N``
  rows and ``E[(x - q)^+]`` (sums of non-negative terms, float32 within
  short blocks of rows and float64 across, a block whose float32 sum
  overflows summed again in float64; NaN if any element is NaN), ``q`` the
  selected value; and, int32, how many elements are not ``<= q`` as float
  comparisons see them (NaN included; -1 where ``ties`` is). An allocation
  failure in the kernel raises (``RESOURCE_EXHAUSTED``) rather than abort.
  ``bracket_sigmas`` as in :func:`kth_smallest_keys`.
  """
  out = jax.ShapeDtypeStruct(k.shape, jnp.int32)
  value = jax.ShapeDtypeStruct(k.shape, jnp.float32)
  call = jax.ffi.ffi_call(
      _SUMS_TARGET, (out, out, out, value, value, out), vmap_method="sequential"
  )
  out = call(rows, k, bracket_sigmas=_bracket_sigmas(bracket_sigmas))
  return _varying_like_rows(out, rows)


def _varying_like_rows(outputs, rows):
  # An FFI call's results are typed device-invariant under shard_map; they
  # vary as its rows do (the pure-JAX branches of the same selection, which
  # must return the same types, say so).
  return tuple(common.varying_like(list(outputs), rows))


def _bracket_sigmas(explicit: float | None) -> np.float64:
  if explicit is not None:
    return np.float64(explicit)
  # Read while tracing; the setting is part of the jit cache key.
  return np.float64(config.current().bracket_sigmas)


# --------------------------------------------------------------------------
# Where the kernel serves a selection.


def applies(axis_name: str | None) -> bool:
  """Whether the kernel can serve a selection: built, CPU, no pooling.

  CPU: the platform being traced for (``common.per_platform``). The kernel
  sees one device's rows: pooling across devices stays in JAX.
  """
  return axis_name is None and common.on_cpu() and available()


def sums_apply(x: Array, where: Array | None, axis_name: str | None) -> bool:
  """Whether :func:`kth_smallest_with_sums` serves a superquantile of ``x``.

  The kernel applies, nothing is masked, ``x`` is float32 and no method other
  than native is forced (``config.current().method``).
  """
  return (
      where is None
      and jnp.result_type(x) == F32
      and config.current().method in (None, "native")
      and applies(axis_name)
  )


def kth_smallest_native(rows, mask, k, n, n_total, kept_shape, return_ties):
  """The kernel's answer with ``dispatch.kth_smallest``'s contract.

  ``rows``, ``mask``, ``kept_shape``: ``common.to_rows``'s; ``k``: flat
  int32 ranks; ``n``: masked-in counts; ``n_total``: all rows (static).
  """
  bad_k = (k < 1) | (k > n)
  # Masked-out elements are +inf and k <= n: the answer is masked in. The
  # kernel counted them among the ties of a +inf answer.
  answer, ties, _ = kth_smallest_keys(common.replicate_explicit(rows), k)
  if mask is not None:
    masked_inf = (answer == common.float_to_key(jnp.float32(jnp.inf))) & (
        ties >= 0
    )
    ties = jnp.where(masked_inf, ties - (n_total - n), ties)
  value = jnp.where(bad_k, jnp.nan, common.key_to_output(answer)).reshape(
      kept_shape
  )
  if return_ties:
    return value, ties.astype(F32).reshape(kept_shape)
  return value


def kth_smallest_with_sums(
    x: Array, k: int, axis: tuple[int, ...]
) -> tuple[Array, ...]:
  """The ``k``-th smallest and a superquantile's sums, in one native sweep.

  For unmasked float32 ``x`` where :func:`sums_apply`; ``1 <= k <= n``.
  Returns, each of the non-reduced shape: the value (as
  ``dispatch.kth_smallest``), the tie count (int32, as ``return_ties``), the
  mean, the mean of ``(x - value)^+`` (NaN if any element is NaN), and how
  many elements are not ``<= value`` (int32, -1 where the tie count is). Not
  differentiable.
  """
  x = common.check_input(lax.stop_gradient(x))
  axes = common.check_sorted_axes(x.ndim, axis)
  rows, _, kept_shape = common.to_rows(x, axes, None)
  common.check_element_count(rows.shape[0])
  k = common.prepare_k(k, kept_shape)
  keys, ties, _, mean, mean_excess, above = kth_smallest_sums(
      common.replicate_explicit(rows), k
  )
  value = common.key_to_output(keys)
  return tuple(
      a.reshape(kept_shape) for a in (value, ties, mean, mean_excess, above)
  )
