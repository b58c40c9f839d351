"""Exact k-th smallest by radix select: a fixed number of passes, no data-dependent loop.

For accelerators. The ``"adaptive"`` method (``loop``) runs a
``lax.while_loop`` whose predicate is data-dependent: on a GPU every pass costs
a kernel launch *and* a device-to-host copy of the predicate, so the device
idles while the host decides. Radix select needs no decision on the host:

* Work on the order-preserving int32 keys (``common.merged_keys``: ``-0.0``
  merged into ``+0.0``). Flipping the sign bit (``u = key ^ INT_MIN``) makes
  the unsigned order of ``u`` the key order.
* ``32 / digit_bits`` passes (4 with 8-bit digits, the CPU's default; 8 with
  the 4-bit digits of accelerators, see :func:`default_histogram`), most
  significant digit first. Pass ``p`` histograms, per feature, digit ``p`` of
  the elements whose higher digits equal the prefix chosen so far (and that are
  masked in): ``2**digit_bits`` bins x ``F`` int32 counts. The histograms are
  ``psum``-ed over ``axis_name`` (exact: integer counts), cumulatively summed,
  and the bin holding the remaining rank is chosen; it extends the prefix and
  the counts below it leave the rank. After the last pass the prefix *is* the
  answer's key. The pass count is static: the first pass (which also counts
  the masked-in elements) is traced on its own, the others as one
  ``lax.fori_loop`` body of static trip count, so the program to trace and
  compile holds two passes, not every one. Nothing is data-dependent: XLA knows the trip
  count (the tests check it in the CPU's compiled module), and XLA:GPU's
  ``WhileThunk`` runs a loop of known trip count without copying a predicate
  back to the host.
* The last histogram also gives the tie count (the chosen bin) and, with the
  counts below the chosen bins of every pass, ``#{not x <= answer}``, both for
  the pooled rows and for this device's rows alone (the quantile's custom JVP
  sums its local tie counts across devices itself).

Comparisons are integer ones on keys: a denormal is distinct from zero and from
other denormals (as in ``kth_smallest_reference`` and ``np.sort``). XLA:GPU's
float32 compares do not flush denormals by default, so there the counts equal
``x == answer`` / ``~(x <= answer)`` as XLA evaluates them; XLA:CPU (and
TPUs) read denormals as zero in float compares, so for a zero or denormal
answer such a count can differ from the key counts returned here.

Histogram kernels (``histogram=``):

* ``"scatter"`` (the default on CPUs): one scatter-add
  (``jax.ops.segment_sum``) of the 0/1 "matches the prefix" flags to bin
  ``digit * F + feature``. XLA lowers it on GPU to one kernel of atomic adds
  into the ``256 x F`` counters (without a hand-written kernel's
  shared-memory privatisation). Elements off the prefix add 0 to a bin spread
  by their row index, not to one dump bin, so they do not all contend for one
  address. On the GPUs measured such a pass costs several BatchNorm
  statistics passes (docs/performance.md). TPUs serialise scatters
  (unmeasured).
* ``"compare"`` (the default elsewhere, with 4-bit digits): cumulative counts
  ``#{match & digit <= t}`` for every bin ``t`` as one fused compare-and-sum
  reduction over the rows (no atomics, but ``2**digit_bits`` compare-adds per
  element: with 8-bit digits compute-bound; ``digit_bits=4`` gives 16 per
  element over 8 passes, each about a BatchNorm statistics pass on the GPUs
  measured). On XLA:CPU
  the ``N x 2**digit_bits x F`` temporary may be materialised: small inputs
  only.

``jnp.bincount`` per feature is the same scatter as ``"scatter"`` (under
``vmap`` over features), so it is not a separate option.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection import common
from gbn_jax._selection import sort
from gbn_jax._selection.common import Comm
from gbn_jax._selection.common import check_element_count
from gbn_jax._selection.common import check_input
from gbn_jax._selection.common import check_sorted_axes
from gbn_jax._selection.common import key_to_output
from gbn_jax._selection.common import merged_keys
from gbn_jax._selection.common import prepare_k
from gbn_jax._selection.common import replicate_explicit
from gbn_jax._selection.common import to_rows

Array = jax.Array

__all__ = [
    "HISTOGRAMS",
    "RadixSelection",
    "kth_smallest_accelerator",
    "kth_smallest_with_sums_accelerator",
    "radix_kth_smallest",
    "radix_sums",
]

#: Histogram kernels accepted by ``radix_kth_smallest(..., histogram=...)``.
HISTOGRAMS = ("scatter", "compare")


def default_histogram() -> tuple[str, int]:
  """``(histogram, digit_bits)`` for the platform being traced for.

  Off the CPU, 4-bit compare digits: on the GPUs measured the whole select
  is faster with them than with 8-bit scatter digits, whose atomic
  histogram passes cost several compare passes each (docs/performance.md).
  XLA:CPU may materialise the compare pass's ``N x 16 x F`` temporary, so the
  CPU keeps the scatter. TPUs (unmeasured) serialise scatters: compare there.
  """
  return ("scatter", 8) if common.on_cpu() else ("compare", 4)


def _resolve_histogram(
    histogram: str | None, digit_bits: int | None
) -> tuple[str, int]:
  default_kind, default_bits = default_histogram()
  if histogram is None:
    histogram = default_kind
  if digit_bits is None:
    digit_bits = default_bits if histogram == default_kind else 8
  return histogram, digit_bits


_I32 = jnp.int32
_F32 = jnp.float32
_SIGN = np.int32(np.iinfo(np.int32).min)  # 0x80000000


class RadixSelection(NamedTuple):
  """Result of :func:`radix_kth_smallest`, per feature (all ``[F]`` int32).

  ``keys``: the k-th smallest key (``-0.0`` merged into ``+0.0``: key ``0``);
  ``common.key_to_output(keys)`` is the float. ``n``: masked-in elements;
  ``ties``: of them, how many have the answer's key; ``above``: how many have
  a larger key, i.e. are not ``<= answer``. ``n``, ``ties`` and ``above`` count
  all devices along ``axis_name``; ``local_*`` only this device's rows.
  """

  keys: Array
  n: Array
  ties: Array
  above: Array
  local_n: Array
  local_ties: Array
  local_above: Array


def _histogram_scatter(digit: Array, match: Array, n_bins: int) -> Array:
  """``[n_bins, F]`` counts of ``digit`` over the rows where ``match``."""
  n_rows, n_cols = digit.shape
  col = lax.broadcasted_iota(_I32, digit.shape, 1)
  # Off-prefix elements add 0, to a bin spread by row index (no hot dump bin).
  spread = lax.broadcasted_iota(_I32, digit.shape, 0) & _I32(n_bins - 1)
  ids = jnp.where(match, digit, spread) * _I32(n_cols) + col
  counts = jax.ops.segment_sum(
      match.astype(_I32).reshape(-1),
      ids.reshape(-1),
      num_segments=n_bins * n_cols,
  )
  return counts.reshape(n_bins, n_cols)


def _histogram_compare(digit: Array, match: Array, n_bins: int) -> Array:
  """Same counts from cumulative compare-and-sum counts (no scatter)."""
  bins = jnp.arange(n_bins, dtype=_I32)[None, :, None]
  at_most = (digit[:, None, :] <= bins) & match[:, None, :]
  cum = jnp.sum(at_most, axis=0, dtype=_I32)  # [n_bins, F]: #{digit <= t}
  return jnp.diff(cum, axis=0, prepend=jnp.zeros_like(cum[:1]))


_HISTOGRAM_FNS = {"scatter": _histogram_scatter, "compare": _histogram_compare}


class Descent(NamedTuple):
  """The state between radix passes, per feature (all ``[F]`` int32).

  ``prefix``: the digits chosen so far, low bits; ``rank``: the rank left
  within the prefix; ``below``/``local_below``: elements (all devices / this
  device's) whose keys fall below the prefix; ``ties``/``local_ties``: those in
  the last chosen bin; ``n``/``local_n``: the masked-in counts (first pass).
  """

  prefix: Array
  rank: Array
  below: Array
  local_below: Array
  ties: Array
  local_ties: Array
  n: Array
  local_n: Array

  def selection(self) -> RadixSelection:
    """The answer once the last pass has chosen its bin."""
    return RadixSelection(
        keys=self.prefix ^ _SIGN,
        n=self.n,
        ties=self.ties,
        above=self.n - self.below - self.ties,
        local_n=self.local_n,
        local_ties=self.local_ties,
        local_above=self.local_n - self.local_below - self.local_ties,
    )


def _narrow(state: Descent, local_hist: Array, hist: Array) -> Descent:
  """One pass's choice: the bin of ``hist`` holding the remaining rank.

  ``local_hist``: ``[2**digit_bits, F]`` counts, over this device's rows, of
  the elements on the prefix; ``hist`` the same pooled over devices.
  """
  n_bins = hist.shape[0]
  cum = jnp.cumsum(hist, axis=0)
  local_cum = jnp.cumsum(local_hist, axis=0)
  # The chosen bin: the first whose inclusive count reaches the rank.
  chosen = jnp.minimum(
      jnp.sum(cum < state.rank[None], axis=0, dtype=_I32), n_bins - 1
  )
  ties = common.take_rows(hist, chosen)
  local_ties = common.take_rows(local_hist, chosen)
  before = common.take_rows(cum, chosen) - ties
  return state._replace(
      prefix=(state.prefix << (n_bins.bit_length() - 1)) | chosen,
      rank=state.rank - before,
      below=state.below + before,
      local_below=state.local_below
      + common.take_rows(local_cum, chosen)
      - local_ties,
      ties=ties,
      local_ties=local_ties,
  )


def first_descent(
    local_hist: Array, k: Array | Callable[[Array], Array], comm: Comm
) -> Descent:
  """The state after the first pass (the whole key range), which counts ``n``.

  ``k``: int32 ``[F]`` ranks, or a function of the pooled count ``n``
  returning them (see :func:`radix_kth_smallest`).
  """
  hist = comm.psum(local_hist)
  n = jnp.sum(hist, axis=0, dtype=_I32)
  local_n = jnp.sum(local_hist, axis=0, dtype=_I32)
  if callable(k):
    k = k(n)
  zero, local_zero = jnp.zeros_like(n), jnp.zeros_like(local_n)
  start = Descent(
      prefix=zero,
      rank=jnp.clip(k, 1, jnp.maximum(n, 1)),
      below=zero,
      local_below=local_zero,
      ties=zero,
      local_ties=local_zero,
      n=n,
      local_n=local_n,
  )
  return _narrow(start, local_hist, hist)


def next_descent(state: Descent, local_hist: Array, comm: Comm) -> Descent:
  """The state after a later pass, on the prefix ``state`` chose."""
  return _narrow(state, local_hist, comm.psum(local_hist))


def radix_kth_smallest(
    rows: Array,
    mask: Array | None,
    k: Array | Callable[[Array], Array],
    comm: Comm,
    *,
    digit_bits: int | None = None,
    histogram: str | None = None,
) -> RadixSelection:
  """Exact k-th smallest key per column of ``rows``, in ``32 / digit_bits`` passes.

  Args:
    rows: float32 ``[N, F]`` (``common.to_rows``); masked-out entries may hold
      anything (``to_rows`` puts ``+inf`` there): ``mask`` decides.
    mask: bool ``[N, F]`` or ``None`` (all masked in).
    k: int32 ``[F]`` 1-based ranks over the masked-in elements of all devices,
      or a function of the pooled count ``n`` (int32 ``[F]``) returning them:
      the first pass counts ``n``, which spares a caller that derives ``k``
      from ``n`` (a quantile of a masked batch) its own pass over the mask.
      Out of ``[1, n]`` the key returned is meaningless (callers put NaN).
    comm: ``common.Comm``: histograms are ``psum``-ed along its axis.
    digit_bits: bits per pass, dividing 32 (8: 4 passes of 256 bins);
      default: :func:`default_histogram`'s for its histogram, else 8.
    histogram: one of :data:`HISTOGRAMS`; default: :func:`default_histogram`
      (scatter on CPUs, 16-bin compare elsewhere).

  Returns:
    :class:`RadixSelection`. Any int32 key is handled (NaN ones sort by their
    key, as in the reference).
  """
  histogram, digit_bits = _resolve_histogram(histogram, digit_bits)
  if digit_bits not in (1, 2, 4, 8, 16):
    raise ValueError(
        f"digit_bits must divide 32 (1, 2, 4, 8 or 16), got {digit_bits}."
    )
  if histogram not in HISTOGRAMS:
    raise ValueError(
        f"histogram must be one of {HISTOGRAMS}, got {histogram!r}."
    )
  hist_fn = functools.partial(_HISTOGRAM_FNS[histogram], n_bins=1 << digit_bits)
  # Unsigned order of u (as bits) is the key order.
  u = merged_keys(rows) ^ _SIGN
  digit = lambda shift: lax.shift_right_logical(u, shift) & _I32(
      (1 << digit_bits) - 1
  )
  every = jnp.ones(rows.shape, bool) if mask is None else mask
  state = first_descent(hist_fn(digit(_I32(32 - digit_bits)), every), k, comm)

  def next_pass(p: Array, state: Descent) -> Descent:
    # Pass p reads digit p of the elements whose higher digits are the prefix.
    higher = _I32(32) - p * _I32(digit_bits)
    match = lax.shift_right_logical(u, higher) == state.prefix[None]
    if mask is not None:
      match = match & mask
    return next_descent(state, hist_fn(digit(higher - digit_bits), match), comm)

  # One traced pass body: the trip count is static (no host sync on a GPU).
  state = lax.fori_loop(1, 32 // digit_bits, next_pass, state)
  return state.selection()


def radix_sums(
    rows: Array, mask: Array | None, keys: Array, n: Array, comm: Comm
):
  """``(mean, mean_excess)`` per column: ``E[x]`` and ``E[(x - q)^+]``, ``q`` the answer.

  One fused reduction over the rows after the selection (a fifth pass: the
  excess needs ``q``). ``(x - q)`` is summed relative to ``q`` for precision,
  over the elements that are not ``<= q`` as a float compare says (so a NaN
  makes the excess NaN, as in ``quantiles._quantile_and_mean_excess``). float32
  sums (XLA's tree reductions), ``psum``-ed over devices; divided by the pooled
  count ``n`` (NaN where it is 0).
  """
  q = key_to_output(keys)[None]
  x = rows.astype(_F32)
  inside = jnp.ones(x.shape, bool) if mask is None else mask
  total = jnp.sum(jnp.where(inside, x, 0.0), axis=0)
  excess = jnp.sum(jnp.where(inside & ~(x <= q), x - q, 0.0), axis=0)
  total, excess = comm.psum((total, excess))
  count = n.astype(_F32)
  return total / count, excess / count


# --------------------------------------------------------------------------
# Drop-in entry points with the contract of dispatch.kth_smallest.


class SelectionRows(NamedTuple):
  """A selection's input laid out for a rows kernel (radix, Pallas, bracket).

  ``rows``: float32 ``[N, F]`` and ``mask`` (bool or ``None``), replicated
  (``common.replicate_explicit``); ``kept_shape``: the non-reduced shape the
  outputs take; ``comm``: pools over ``axis_name``; ``ranks``: int32 ``[F]``
  1-based ranks, or a function of the pooled count ``n`` returning them.
  """

  rows: Array
  mask: Array | None
  kept_shape: tuple[int, ...]
  comm: Comm
  ranks: Array | Callable[[Array], Array]

  def value(self, keys: Array, n: Array) -> Array:
    """The answer as a float, NaN where the rank is not in ``[1, n]``."""
    # A function of n is called again: [F] arithmetic, the same as inside
    # the selection.
    k = self.ranks(n) if callable(self.ranks) else self.ranks
    return jnp.where((k < 1) | (k > n), jnp.nan, key_to_output(keys))

  def outputs(self, *flat: Array) -> tuple[Array, ...]:
    """``[F]`` results in the non-reduced shape."""
    return tuple(a.reshape(self.kept_shape) for a in flat)


def prepare_input(x, axis, where, axis_name, axis_index_groups):
  """Validated ``(x, axes, where, comm)``, no gradient, half precision upcast."""
  x = check_input(x)
  axes = check_sorted_axes(x.ndim, axis)
  x = lax.stop_gradient(x)
  if x.dtype in (jnp.bfloat16, jnp.float16):
    x = x.astype(_F32)  # exact and order-preserving
  if where is not None:
    where = lax.stop_gradient(jnp.asarray(where, bool))
  comm = Comm(axis_name, axis_index_groups)
  return x, axes, where, comm


def selection_rows(
    x: Array,
    axes: tuple[int, ...],
    where: Array | None,
    comm: Comm,
    k: int | Array | Callable[[Array], Array],
) -> SelectionRows:
  """:class:`SelectionRows` of :func:`prepare_input`'s outputs and the ranks ``k``.

  ``k``: ranks broadcastable to the non-reduced shape, or a function of the
  pooled masked-in count (int32, flat ``[F]``) returning them. Raises
  ``ValueError`` where the rows hold too many elements for int32 ranks.
  """
  rows, mask, kept_shape = to_rows(x.astype(_F32), axes, where)
  check_element_count(rows.shape[0] * comm.size())
  if callable(k):
    ranks = lambda n: prepare_k(k(n), kept_shape)
  else:
    ranks = prepare_k(k, kept_shape)
  return SelectionRows(
      rows=replicate_explicit(rows),
      mask=None if mask is None else replicate_explicit(mask),
      kept_shape=kept_shape,
      comm=comm,
      ranks=ranks,
  )


def sums_outputs(
    prepared: SelectionRows,
    sel: RadixSelection,
    mean: Array,
    mean_excess: Array,
    return_count: bool,
) -> tuple[Array, ...]:
  """The with-sums entry points' outputs (see :func:`kth_smallest_with_sums_accelerator`)."""
  out = (prepared.value(sel.keys, sel.n), sel.ties, mean, mean_excess)
  out += (sel.above,) + ((sel.n,) if return_count else ())
  return prepared.outputs(*out)


# Alike gbn_jax/_selection/dispatch.py::kth_smallest: the methods' one contract.
def kth_smallest_accelerator(
    x: Array,
    k: int | Array,
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    return_ties: bool = False,
    digit_bits: int | None = None,
    histogram: str | None = None,
) -> Array | tuple[Array, Array | None]:
  """``dispatch.kth_smallest`` by radix select: a fixed number of passes, no while loop.

  Same contract: the k-th smallest (1-based) over ``axis`` of the masked-in
  elements of all devices along ``axis_name``, float32, an element of ``x``
  bit for bit (``-0.0`` as ``+0.0``), NaN where ``k`` is not in ``[1, n]``.
  float16/bfloat16 are upcast (exactly); float64 takes the sort reference.

  ``return_ties``: also return, as float32, how many masked-in elements of
  *this device's* rows equal the answer (key equality, ``-0.0 == +0.0``; see
  the module docstring for denormals) -- what the quantile's JVP counts before
  its own ``psum``. Without ``axis_name`` that is the whole count. ``None``
  for float64 input.
  """
  select = functools.partial(
      radix_kth_smallest, digit_bits=digit_bits, histogram=histogram
  )
  return drop_in_selection(
      select,
      x,
      k,
      axis,
      where=where,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      return_ties=return_ties,
  )


def drop_in_selection(
    select_rows, x, k, axis, *, where, axis_name, axis_index_groups, return_ties
):
  """``dispatch.kth_smallest``'s contract around a rows selection.

  ``select_rows(rows, mask, k, comm)`` returns the answer's ``keys``, the
  pooled count ``n`` and this device's ``local_ties`` (as
  :class:`RadixSelection` does); this handles dtypes, masks, ranks, sharding
  and out-of-range ``k`` for every accelerator method.
  """
  x, axes, where, comm = prepare_input(
      x, axis, where, axis_name, axis_index_groups
  )
  if x.dtype != _F32:
    value = sort.kth_smallest_reference(
        x,
        k,
        axes,
        where=where,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
    )
    return (value, None) if return_ties else value
  prepared = selection_rows(x, axes, where, comm, k)
  sel = select_rows(prepared.rows, prepared.mask, prepared.ranks, comm)
  value = prepared.value(sel.keys, sel.n)
  if return_ties:
    return prepared.outputs(value, sel.local_ties.astype(_F32))
  return prepared.outputs(value)[0]


def kth_smallest_with_sums_accelerator(
    x: Array,
    k: int | Array | Callable[[Array], Array],
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    digit_bits: int | None = None,
    histogram: str | None = None,
    return_count: bool = False,
) -> tuple[Array, ...]:
  """The k-th smallest and a superquantile's sums (as ``native.kth_smallest_with_sums``).

  For float32 ``x`` (others upcast to float32); may be masked and pooled over
  ``axis_name``. Returns, each of the non-reduced shape: the value (as
  :func:`kth_smallest_accelerator`, NaN where ``k`` is out of range), the tie
  count, the mean, the mean of ``(x - value)^+`` and ``#{not x <= value}``.
  Counts are int32 over all devices (key comparisons, see the module
  docstring); the means are over the pooled masked-in elements. Not
  differentiable.

  ``k`` may also be a function of the pooled masked-in count (int32, flat
  ``[F]``) returning the ranks, as in :func:`radix_kth_smallest`: a masked
  quantile then needs no count of its own. ``return_count``: also return that
  count (int32), sixth.
  """
  prepared = selection_rows(
      *prepare_input(x, axis, where, axis_name, axis_index_groups), k
  )
  rows, mask, comm = prepared.rows, prepared.mask, prepared.comm
  sel = radix_kth_smallest(
      rows,
      mask,
      prepared.ranks,
      comm,
      digit_bits=digit_bits,
      histogram=histogram,
  )
  mean, mean_excess = radix_sums(rows, mask, sel.keys, sel.n, comm)
  return sums_outputs(prepared, sel, mean, mean_excess, return_count)
