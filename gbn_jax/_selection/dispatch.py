"""Exact k-th smallest element (order statistic) over some axes: the entry points.

``kth_smallest(x, k, axis)`` returns, for every position of the non-reduced
axes, the k-th smallest (1-based) of ``x`` over ``axis``: an element of ``x``,
bit for bit (``-0.0`` and ``+0.0`` compare equal and come back as ``+0.0``).
Sorting is the obvious way, but on XLA:CPU a float sort calls a comparator per
comparison, which makes it many times the cost of a batch-norm layer; the
backends below select without sorting the batch. This module validates, lays the input out
(``common``) and picks a backend; :func:`gbn_jax.selection.selection_config`
scopes the choice.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax._selection import bracket
from gbn_jax._selection import common
from gbn_jax._selection import config
from gbn_jax._selection import loop
from gbn_jax._selection import native
from gbn_jax._selection import pallas
from gbn_jax._selection import radix
from gbn_jax._selection import sort
from gbn_jax._selection.common import F32
from gbn_jax._selection.common import I32
from gbn_jax._selection.common import AxisIndexGroups
from gbn_jax._selection.common import check_element_count
from gbn_jax._selection.reductions import count_true
from gbn_jax._selection.reductions import expand

Array = jax.Array

__all__ = ["METHODS", "kth_smallest"]

# Backends with the drop-in contract of kth_smallest (return_ties counts this
# device's key ties), for accelerators but running anywhere. A new backend is
# a module and an entry here.
_BACKENDS = {
    # Radix select: fixed histogram passes, no loop.
    "accelerator": radix.kth_smallest_accelerator,
    # Sampled bracket: one counting-and-compaction pass, a small sort, radix
    # on a miss.
    "bracket": bracket.kth_smallest_bracket,
    # Radix select as a Pallas kernel (Triton on GPUs, interpreted elsewhere):
    # experimental, never a default until a GPU times it.
    "pallas_experimental": pallas.kth_smallest_pallas,
}

#: Exact methods accepted by ``kth_smallest(..., method=...)`` and
#: :func:`gbn_jax.selection.selection_config`. ``"native"``: the compiled C++
#: kernel (XLA:CPU, one sweep; ``native``): forcing it without the kernel built,
#: or with an ``axis_name``, raises ``ValueError``; a lowering for other
#: platforms too (``jax.export(..., platforms=["cpu", "cuda"])``) runs it on the
#: CPU and each other platform's default method there. ``"adaptive"``: sample +
#: interpolating counting passes + fold; ``"bisect"``: counting passes that
#: split the int32 key range in four (17 passes, data-independent cost) (both
#: ``loop``). ``"sort"``: sorts int keys (the reference, ``sort``).
#: ``"accelerator"``: radix select (``radix``). ``"bracket"``: sampled bracket
#: (``bracket``). ``"pallas_experimental"``: radix select in a Pallas kernel
#: (``pallas``), experimental (never a default, its GPU speed unmeasured):
#: compiled on GPUs, run in Pallas's interpret mode (exact, but the slowest
#: method) on CPUs and TPUs; a lowering for the CPU and a GPU at once fails (JAX
#: lowers a compiled kernel's every per-platform branch for the CPU too).
#: Where the row count is symbolic (``jax.export``), ``"adaptive"`` runs as
#: ``"bisect"`` and ``"bracket"`` and ``"pallas_experimental"`` as
#: ``"accelerator"``: they size a sample or a buffer from it.
METHODS = ("native",) + loop.METHODS + ("sort",) + tuple(_BACKENDS)

_ADAPTIVE_MIN_ROWS = (
    16384  # default method: "bisect" below this many rows (CPU)
)
# Default at least that many rows on a GPU/TPU: no data-dependent loop, so no
# host sync per pass (the adaptive loop's cost there), and of the exact
# methods the fastest on the GPUs measured (docs/performance.md): one counting
# pass and a small sort, where the radix select makes several histogram
# passes.
_ACCELERATOR_LARGE_METHOD = "bracket"


# Methods that size a sample or a buffer from the row count, and what runs
# for them when it is symbolic (``jax.export``): the same answers, by passes
# whose shapes follow the rows for any count.
_FOR_SYMBOLIC_ROWS = {
    "adaptive": "bisect",
    "bracket": "accelerator",
    "pallas_experimental": "accelerator",
}


def sized_method(method: str, n_rows: Any) -> str:
  """``method``, or what runs for it where the row count ``n_rows`` is symbolic."""
  if common.is_symbolic(n_rows):
    return _FOR_SYMBOLIC_ROWS.get(method, method)
  return method


def default_method(n_rows: Any) -> str:
  """The method for ``n_rows`` reduced rows (over all devices).

  For the platform being traced for (``common.per_platform``; outside one,
  the default backend). A symbolic ``n_rows`` (``jax.export``) may be large:
  off the native kernel it gets the fixed passes valid for any size, the
  radix select on accelerators and bisection on a CPU.
  """
  if native.applies(None):
    return "native"
  if common.is_symbolic(n_rows):
    return "bisect" if common.on_cpu() else "accelerator"
  large = n_rows >= _ADAPTIVE_MIN_ROWS
  if not common.on_cpu():
    # Each pass of a loop costs a kernel launch and a host sync on an
    # accelerator, so small batches sort outright (docs/performance.md).
    return _ACCELERATOR_LARGE_METHOD if large else "sort"
  # The adaptive method's fixed costs (sample sort, fold resolution) only pay
  # off once a pass over the rows costs more than they do.
  return "adaptive" if large else "bisect"


def fused_sums_backend(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None,
    axis_name: str | None,
    axis_index_groups: AxisIndexGroups,
) -> str | None:
  """Which backend gives a superquantile's sums in its selection's sweep.

  Read per platform (inside ``common.per_platform``, as
  ``fused.superquantile_parts`` does). ``"native"`` where
  ``native.sums_apply``; ``"accelerator"`` (``"pallas_experimental"``) where
  :func:`kth_smallest` would select with the radix select (its Pallas
  kernel) -- the method in scope, else the default for the pooled row count
  -- and ``x`` is float32 or half precision (upcast exactly; float64 keeps its
  float64 selection and sums, since the radix sums are float32); else
  ``None``.
  """
  if native.sums_apply(x, where, axis_name):
    return "native"
  if jnp.result_type(x) not in (F32, jnp.bfloat16, jnp.float16):
    return None
  method = config.current().method
  rows = math.prod(x.shape[a] for a in axes)
  rows *= common.axis_size(axis_name, axis_index_groups)
  if method is None:
    method = default_method(rows)
  # A method replaced for a symbolic row count keeps its sums as they were:
  # fused for "pallas_experimental", apart for "bracket".
  if method in ("accelerator", "pallas_experimental"):
    return sized_method(method, rows)
  return None


def check_forced_native(axis_name: str | None) -> None:
  """Raises ``ValueError`` where a forced ``method="native"`` can never run."""
  if axis_name is not None:
    raise ValueError(
        f"method='native' was forced with axis_name={axis_name!r}: the native"
        " kernel sees one device's rows and cannot pool them across devices;"
        " force another method (e.g. 'adaptive') or leave method unset."
    )
  if not native.available():
    raise ValueError(
        "method='native' was forced, but the compiled kernel (extension"
        f" gbn_jax._kth_cpu, or ${native.LIBRARY_ENV}) is not built or did not"
        " load; reinstall gbn_jax with a C++17 compiler present, force another"
        " method or leave method unset."
    )


def _flags(x, value, axes, where):
  equal = x == expand(value, axes)
  return equal if where is None else equal & where


def _tie_count(x, value, axes, where):
  """How many masked-in ``x`` equal ``value``, as this platform's compares count."""
  return count_true(_flags(x, value, axes, where), axes)


def kth_smallest(
    x: Array,
    k: int | Array,
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
    method: str | None = None,
    return_ties: bool = False,
) -> Array | tuple[Array, Array | None]:
  """Exact k-th smallest (1-based) of ``x`` over ``axis``, without sorting.

  Args:
    x: float32 array without NaN (``+-inf`` allowed). Other float dtypes use
      the sort-based reference. At most ``common.MAX_ELEMENTS`` (2**31 - 1)
      reduced elements per position, over all devices (``ValueError``
      otherwise, when tracing; a symbolic count only where its constraints
      decide it).
    k: Python int or int32 array broadcastable to the reduced shape (may differ
      per position and be traced); must satisfy ``1 <= k <= n``, the number of
      masked-in elements. Positions violating it get NaN.
    axis: sorted, unique, non-empty tuple of axes to reduce over.
    where: optional boolean mask broadcastable to ``x``; masked-out elements
      are ignored.
    axis_name: optional named axis (``shard_map``/``pmap``); the selection is
      over the union of the rows of all devices along it (exact: only counts,
      a 1024-row sample and per-bucket extremes cross devices).
    axis_index_groups: optional groups within ``axis_name``.
    method: one of :data:`METHODS`; default: the one in scope
      (:func:`gbn_jax.selection.selection_config`), else
      :func:`default_method`'s for each platform the computation is lowered
      for. ``"native"`` raises
      ``ValueError`` where it can never run (see :data:`METHODS`).
    return_ties: also return, per position, how many of this device's
      masked-in elements equal the answer, as ``x == answer`` counts them on
      the platform it runs on (XLA:CPU and TPUs read denormals as zero):
      float32 below 2**24 reduced elements, else int32 (``count_true``'s).
      From the backend where it knows them at no cost (the native kernel;
      ``accelerator`` and ``bracket`` on a GPU, whose compares keep
      denormals as their key counts do), counted here otherwise; a
      computation that does not use them does not count them.

  Returns:
    Array of the non-reduced shape, float32 (float64 for float64 ``x``, under
    ``jax_enable_x64``), holding elements of ``x`` (``-0.0`` returned as
    ``+0.0``), and the tie counts if ``return_ties``.
    Not differentiable (gradient zero): the caller defines the derivative.
    The backend is chosen per platform the computation is lowered for
    (``common.per_platform``): a CPU lowering runs the CPU's, a GPU's
    contains no CPU-only kernel.

  Raises:
    ValueError: bad axes or method; ``method="native"`` where it can never
      run.

  >>> import jax.numpy as jnp
  >>> kth_smallest(jnp.array([[4., 1.], [2., 8.], [3., 5.]]), 2, (0,))
  Array([3., 5.], dtype=float32)
  """
  x = common.check_input(x)
  axes = common.check_sorted_axes(x.ndim, axis)
  method = method or config.current().method
  if method is not None and method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  if method == "native":
    check_forced_native(axis_name)
  x = lax.stop_gradient(x)
  if where is not None:
    where = lax.stop_gradient(jnp.asarray(where, bool))
  select = lambda: _select(
      x, k, axes, where, axis_name, axis_index_groups, method, return_ties
  )
  # Tie counts differ between GPUs and TPUs (denormals), values do not.
  return common.per_platform(select, denormals=return_ties)


def _select(x, k, axes, where, axis_name, groups, method, return_ties):
  """:func:`kth_smallest` for the platform being traced for (validated input)."""
  if method == "native" and not native.applies(axis_name):
    # Only off the CPU (checked before): that platform's own default.
    method = None
  if method == "sort" or x.dtype != F32:
    # Other dtypes (the caller upcasts half precision) take the exact sort.
    value = sort.kth_smallest_reference(
        x, k, axes, where=where, axis_name=axis_name, axis_index_groups=groups
    )
    return (value, _tie_count(x, value, axes, where)) if return_ties else value
  comm = common.Comm(axis_name, groups)
  rows, mask, kept_shape = common.to_rows(x, axes, where)
  n_rows, n_cols = rows.shape
  n_total = n_rows * comm.size()
  check_element_count(n_total)
  if method is None:
    method = default_method(n_total)
    if method == "native" and not native.applies(axis_name):
      method = "adaptive"  # the kernel cannot pool devices
  method = sized_method(method, n_total)
  if method in _BACKENDS:
    result = _BACKENDS[method](
        x,
        k,
        axes,
        where=where,
        axis_name=axis_name,
        axis_index_groups=groups,
        return_ties=return_ties,
    )
    if not return_ties:
      return result
    value, ties = result
    count = lambda: _tie_count(x, value, axes, where)
    if not common.compares_keep_denormals():
      # Its integer counts tell denormals from zero; XLA:CPU's and TPUs'
      # float compares (which the caller's tie split uses) do not.
      return value, count()
    return value, ties.astype(jax.eval_shape(count).dtype)
  k = common.prepare_k(k, kept_shape)
  if mask is None:
    n = jnp.full((n_cols,), n_total, I32)
  else:
    n = comm.psum(jnp.sum(mask, axis=0, dtype=I32))
  if method == "native":
    result = native.kth_smallest_native(
        rows, mask, k, n, n_total, kept_shape, return_ties
    )
    if not return_ties:
      return result
    value, known = result
    equal = lambda: _flags(x, value, axes, where)
    return value, native.known_or_counted(known, equal, axes)
  value = loop.kth_smallest_loop(
      x, axes, where, rows, mask, k, n, kept_shape, comm, method=method
  )
  bad_k = (k < 1) | (k > n)
  value = jnp.where(bad_k, jnp.nan, value).reshape(kept_shape)
  return (value, _tie_count(x, value, axes, where)) if return_ties else value
