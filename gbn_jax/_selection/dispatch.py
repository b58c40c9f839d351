"""Exact k-th smallest element (order statistic) over some axes: the entry points.

``kth_smallest(x, k, axis)`` returns, for every position of the non-reduced
axes, the k-th smallest (1-based) of ``x`` over ``axis``: an element of ``x``,
bit for bit (``-0.0`` and ``+0.0`` compare equal and come back as ``+0.0``).
Sorting is the obvious way, but on XLA:CPU a float sort calls a comparator per
comparison and is ~60x slower than a batch-norm layer; the backends below
select without sorting the batch. This module validates, lays the input out
(``common``) and picks a backend; :func:`selection_config` scopes the choice.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
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
from gbn_jax._selection import radix
from gbn_jax._selection import sort
from gbn_jax._selection.common import F32
from gbn_jax._selection.common import I32
from gbn_jax._selection.common import AxisIndexGroups
from gbn_jax._selection.common import check_element_count

Array = jax.Array

__all__ = ["METHODS", "kth_smallest", "selection_config"]

# Backends with the drop-in contract of kth_smallest (return_ties counts this
# device's key ties), for accelerators but running anywhere. A new backend is
# a module and an entry here.
_BACKENDS = {
    # Radix select: fixed histogram passes, no loop.
    "accelerator": radix.kth_smallest_accelerator,
    # Sampled bracket: one counting-and-compaction pass, a small sort, radix
    # on a miss.
    "bracket": bracket.kth_smallest_bracket,
}

#: Exact methods accepted by ``kth_smallest(..., method=...)`` and
#: :func:`selection_config`. ``"native"``: the compiled C++ kernel (XLA:CPU,
#: one sweep; ``native``) where it applies: built, CPU backend, no
#: ``axis_name``; elsewhere it means ``"adaptive"``. ``"adaptive"``: sample +
#: interpolating counting passes + fold; ``"bisect"``: counting passes that
#: split the int32 key range in four (17 passes, data-independent cost) (both
#: ``loop``). ``"sort"``: sorts int keys (the reference, ``sort``).
#: ``"accelerator"``: radix select (``radix``). ``"bracket"``: sampled
#: bracket (``bracket``).
METHODS = ("native",) + loop.METHODS + ("sort",) + tuple(_BACKENDS)

_ADAPTIVE_MIN_ROWS = (
    16384  # default method: "bisect" below this many rows (CPU)
)
# Default at least that many rows on a GPU/TPU: no data-dependent loop, so no
# host sync per pass (the adaptive loop's cost there). Measured on an H100
# (results/benchmarks/h100_methods.json, h100_radix.json): the sampled
# bracket's sqd layers are 2.5-3.9x BatchNorm, the radix select's 4.8-13x (its
# scatter histograms cost 0.66-2.4 ms a pass) and the adaptive loop's 8-11x.
_ACCELERATOR_LARGE_METHOD = "bracket"

_UNSET = object()


@contextlib.contextmanager
def selection_config(
    *, method: Any = _UNSET, bracket_sigmas: Any = _UNSET
) -> Iterator[config.SelectionConfig]:
  """Scopes the selection's tunables to a ``with`` block, trace-correctly.

  The setting is part of JAX's trace context (``jax.make_user_context``): a
  jitted function called inside the block is traced for it, not served from
  a trace made under another setting. Arguments left out keep the enclosing
  block's value. Like JAX's own config contexts, the scope is the current
  thread's.

  Args:
    method: one of :data:`METHODS` to force on every selection (quantiles,
      superquantiles, measures such as ``sqd``) traced in scope, or ``None``
      for the default: the native kernel where it applies, else by batch size
      and backend. For benchmarks and tests; every method is exact.
    bracket_sigmas: half-width of the native kernel's sampled bracket, in
      binomial standard deviations (default 3.0; 0 makes misses, and so its
      fallback path, common).

  Yields:
    The :class:`~gbn_jax._selection.config.SelectionConfig` in scope.

  >>> import gbn_jax, jax.numpy as jnp
  >>> with gbn_jax.selection_config(method="sort"):
  ...   gbn_jax.quantile(jnp.array([3., 1., 2.]), 0.5)
  Array(2., dtype=float32)
  """
  current = config.current()
  if method is _UNSET:
    method = current.method
  elif method is not None and method not in METHODS:
    raise ValueError(
        f"method must be one of {METHODS} or None, got {method!r}."
    )
  if bracket_sigmas is _UNSET:
    bracket_sigmas = current.bracket_sigmas
  else:
    bracket_sigmas = float(bracket_sigmas)
    if not bracket_sigmas >= 0.0 or math.isinf(bracket_sigmas):
      raise ValueError(
          f"bracket_sigmas must be finite and >= 0, got {bracket_sigmas!r}."
      )
  new = config.SelectionConfig(method=method, bracket_sigmas=bracket_sigmas)
  with config.scope(new):
    yield new


def default_method(n_rows: int) -> str:
  """The method for ``n_rows`` reduced rows (over all devices) on this backend."""
  if native.applies(None):
    return "native"
  large = n_rows >= _ADAPTIVE_MIN_ROWS
  if not common.on_cpu():
    # Measured on an H200 (benchmarks/device_check.sh): each pass of a loop
    # costs a launch and a host sync there, so small batches sort outright.
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

  ``"native"`` where ``native.sums_apply``; ``"accelerator"`` where
  :func:`kth_smallest` would select with the radix select (the method in
  scope, else the default for the pooled row count) and ``x`` is float32 or
  half precision (upcast exactly; float64 keeps its float64 selection and
  sums, since the radix sums are float32); else ``None``.
  """
  if native.sums_apply(x, where, axis_name):
    return "native"
  if jnp.result_type(x) not in (F32, jnp.bfloat16, jnp.float16):
    return None
  method = config.current().method
  if method is None:
    rows = math.prod(x.shape[a] for a in axes)
    method = default_method(
        rows * common.axis_size(axis_name, axis_index_groups)
    )
  return "accelerator" if method == "accelerator" else None


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
      otherwise, when tracing).
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
      (:func:`selection_config`), else :func:`default_method`'s.
    return_ties: also return, per position, how many masked-in elements
      equal the answer, where the native kernel knows it at no cost: a
      float32 count as ``x == answer`` counts it, or ``-1`` for a zero or
      denormal answer where the kernel cannot read the CPU's denormal mode
      (``native.counts_always_known()`` is False; count those yourself);
      from ``accelerator`` and ``bracket`` on a GPU, their own key counts
      (other backends flush denormals in compares, so there ``None``);
      ``None`` from the other methods.

  Returns:
    Array of the non-reduced shape, float32 (float64 for float64 ``x``, under
    ``jax_enable_x64``), holding elements of ``x`` (``-0.0`` returned as
    ``+0.0``), and the tie counts if ``return_ties``.
    Not differentiable (gradient zero): the caller defines the derivative.

  >>> import jax.numpy as jnp
  >>> kth_smallest(jnp.array([[4., 1.], [2., 8.], [3., 5.]]), 2, (0,))
  Array([3., 5.], dtype=float32)
  """
  x = common.check_input(x)
  axes = common.check_sorted_axes(x.ndim, axis)
  method = method or config.current().method
  if method is not None and method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  x = lax.stop_gradient(x)
  if where is not None:
    where = lax.stop_gradient(jnp.asarray(where, bool))
  if method == "sort" or x.dtype != F32:
    # Other dtypes (the caller upcasts half precision) take the exact sort.
    value = sort.kth_smallest_reference(
        x,
        k,
        axes,
        where=where,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
    )
    return (value, None) if return_ties else value
  comm = common.Comm(axis_name, axis_index_groups)
  rows, mask, kept_shape = common.to_rows(x, axes, where)
  n_rows, n_cols = rows.shape
  n_total = n_rows * comm.size()
  check_element_count(n_total)
  method = method or default_method(n_total)
  if method in _BACKENDS:
    result = _BACKENDS[method](
        x,
        k,
        axes,
        where=where,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        return_ties=return_ties,
    )
    if return_ties and not common.compares_keep_denormals():
      # Its integer counts tell denormals from zero; XLA:CPU's float compares
      # (which the caller's tie split uses) do not: let the caller count.
      return result[0], None
    return result
  if method == "native" and not native.applies(axis_name):
    method = "adaptive"
  k = common.prepare_k(k, kept_shape)
  if mask is None:
    n = jnp.full((n_cols,), n_total, I32)
  else:
    n = comm.psum(jnp.sum(mask, axis=0, dtype=I32))
  if method == "native":
    return native.kth_smallest_native(
        rows, mask, k, n, n_total, kept_shape, return_ties
    )
  value = loop.kth_smallest_loop(
      x, axes, where, rows, mask, k, n, kept_shape, comm, method=method
  )
  bad_k = (k < 1) | (k > n)
  value = jnp.where(bad_k, jnp.nan, value).reshape(kept_shape)
  return (value, None) if return_ties else value
