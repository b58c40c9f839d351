"""Exact k-th smallest by a sampled bracket and one compaction pass, for accelerators.

A second accelerator candidate next to ``radix`` (four scatter-add
histogram passes, whose atomics may serialise on XLA:GPU: 256 bins per feature
against a million rows per feature on the conv shapes). This one touches the
rows in one counting-and-compaction pass, with a fixed number of steps and no
``while`` loop:

1. **Sample.** Per feature, a fixed jittered-strided sample of ``S`` rows per
   device (static indices, one per stratum of ``N / S`` rows, offset inside the
   stratum by a low-discrepancy sequence so the sample does not lock onto a
   period of the layout, e.g. the image border of an NHWC batch). Its int32
   keys (``common.merged_keys``, ``-0.0`` merged into ``+0.0`` as in
   ``radix``) are gathered over ``axis_name`` (so every device derives
   the same bracket) and sorted: a small ``S x F`` sort.
2. **Bracket.** The target rank ``k`` of ``n`` sits near sample position
   ``t = k m / n`` (``m`` masked-in sample keys); its sampling error is about
   ``sqrt(m p (1 - p))`` sample ranks, ``p = k / n``. The bracket is the pair
   of sample keys ``lo <= hi`` at ``t -+ (4 sqrt(m p (1 - p)) + 2)`` (the key
   range's ends past the sample's ends).
3. **Count and compact**, one pass over the rows: ``#{key < lo}``,
   ``#{key == lo}``, ``#{key == hi}`` (``hi != lo``) and ``#{lo < key < hi}``
   (``psum``-ed: exact integer counts); the strictly interior keys are
   compacted into a fixed ``[B, F]`` buffer per device, at their running
   count along the rows (a cumulative sum), by a flat 1-D scatter *set* whose
   indices are all distinct (dropped elements get distinct out-of-range
   indices), so XLA may lower it without atomics: no contention, unlike a
   histogram. In memory traffic that is about three sweeps over ``[N, F]``
   (the fused counts, the cumulative sum, the scatter), against radix's four
   histogram passes; whether it is faster is for the GPU timing
   (``benchmarks/device/device_check_radix.py``, variant ``bracket``) to say.
4. **Small sort.** The buffers are gathered over ``axis_name`` (fixed size)
   and sorted (unused slots hold ``INT_MAX`` and sort last); the answer is
   ``lo`` or ``hi`` if the rank falls on their ties, else the interior rank's
   key. The endpoints are counted apart from the interior so that heavy ties
   (ReLU zeros) on an endpoint never fill the buffer.

``B`` is static: 1.25 times the expected interior count at the widest
bracket (``p = 1/2``), plus 64. The sample size ``S ~ (2.6 N)**(2/3)``
balances the two sorts (``S`` against ``B ~ 5 N / sqrt(S)``): about 19000 and
40000 of a million rows.

**Misses.** If, for some feature, the rank is outside the bracket (a sample
far from the data's distribution) or falls in the interior while some device's
interior overflows its buffer (heavy ties inside the bracket), the *whole
batch* is selected again by ``radix.radix_kth_smallest`` inside a
``lax.cond`` on the pooled "any miss" flag. Exactness never depends on the
sample, only the cost does. A per-feature ``jnp.where`` would run the radix
passes on every call (both sides of a select are computed), so it would only
ever be slower than radix alone; the ``cond`` runs them only on a miss, which
on Gaussian-like data is rare (about 6e-5 per feature from the sampling error
at 4 standard deviations, less with the stratified sample). The cost: XLA:GPU
(without conditional CUDA-graph nodes) reads a ``cond``'s predicate on the
host, one device-to-host copy of a bool per call -- one host decision per call,
where the adaptive method takes one per pass; the tests check that the jaxpr
has exactly one ``cond`` and no ``while``.

Comparisons are integer ones on keys, as in ``radix`` (see its module
docstring on denormals): results are bit for bit those of the radix select and
of ``sort.kth_smallest_reference``; ``return_ties`` counts this device's
masked-in elements with the answer's key.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection import common
from gbn_jax._selection import radix
from gbn_jax._selection.common import I32
from gbn_jax._selection.common import INT_MAX
from gbn_jax._selection.common import INT_MIN
from gbn_jax._selection.common import Comm
from gbn_jax._selection.common import merged_keys
from gbn_jax._selection.common import replicate_explicit
from gbn_jax._selection.common import take_rows

Array = jax.Array

__all__ = ["BracketSelection", "bracket_kth_smallest", "kth_smallest_bracket"]

_F32 = jnp.float32

# Half-width of the bracket in sample standard deviations of the target's
# sample rank, plus a few ranks for the rounding and tiny p.
_Z = 4.0
_EXTRA_RANKS = 2.0
_MIN_SAMPLE = 256  # rows per device; all rows below this
_MAX_SAMPLE = 1 << 16
_BUFFER_SAFETY = 1.25  # the interior count's spread is ~1/sqrt(bracket ranks)
_BUFFER_PAD = 64
_GOLDEN = 0.6180339887498949  # jitter of the stratified sample (Weyl sequence)


class BracketSelection(NamedTuple):
  """Result of :func:`bracket_kth_smallest`, per feature (``[F]`` int32) but ``missed``.

  ``keys``: the k-th smallest key (``-0.0`` merged into ``+0.0``); ``n``:
  masked-in elements over all devices; ``local_ties``: this device's masked-in
  elements with the answer's key. ``missed``: scalar bool, the same on every
  device: the bracket missed for some feature and the radix select ran.
  """

  keys: Array
  n: Array
  local_ties: Array
  missed: Array


def sample_size(n_rows: int) -> int:
  """Rows sampled per device out of ``n_rows`` (static)."""
  s = math.ceil((0.65 * _Z * n_rows) ** (2.0 / 3.0))
  return min(n_rows, max(_MIN_SAMPLE, min(_MAX_SAMPLE, s)))


def sample_rows(n_rows: int) -> np.ndarray:
  """Static, strictly increasing sample row indices: one per stratum, jittered."""
  s = sample_size(n_rows)
  if s == n_rows:
    return np.arange(n_rows, dtype=np.int32)
  i = np.arange(s + 1, dtype=np.int64)
  start = i * n_rows // s  # integer strata: widths >= 1, no rounding overlap
  width = np.diff(start)
  jitter = np.modf(i[:-1] * _GOLDEN + 0.5)[0]
  idx = start[:-1] + np.minimum(
      np.floor(jitter * width).astype(np.int64), width - 1
  )
  return idx.astype(np.int32)


def buffer_size(n_rows: int, n_devices: int = 1) -> int:
  """Interior keys each device can hold (static); at most ``n_rows``."""
  s = sample_size(n_rows)
  if s == n_rows:
    return n_rows
  m = s * n_devices  # pooled sample
  half = _Z * math.sqrt(m) / 2 + _EXTRA_RANKS  # p (1 - p) <= 1/4
  per_rank = n_rows / s  # elements of one device per pooled sample rank / D
  expected = (2 * half + 2) * per_rank / n_devices
  return min(n_rows, math.ceil(_BUFFER_SAFETY * expected) + _BUFFER_PAD)


def _sorted_columns(a: Array) -> Array:
  """``a`` sorted along axis 0."""
  if common.on_cpu():
    return jnp.sort(a, axis=0)
  # Along the minor axis, where XLA:GPU sorts with a radix sort (CUB), as in
  # sort.kth_smallest_reference.
  return jnp.sort(a.T, axis=1).T


def _bracket(rows, mask, k, n, comm):
  """``(lo, hi)`` keys per feature, identical on all devices."""
  n_rows = rows.shape[0]
  idx = sample_rows(n_rows)
  sample = merged_keys(jnp.take(rows, jnp.asarray(idx), axis=0))
  if mask is None:
    valid = jnp.full(rows.shape[1:], idx.size, I32)
  else:
    smask = jnp.take(mask, jnp.asarray(idx), axis=0)
    sample = jnp.where(smask, sample, INT_MAX)  # masked out: sorted last
    valid = jnp.sum(smask, axis=0, dtype=I32)
  ordered = _sorted_columns(replicate_explicit(comm.gather_keys(sample)))
  m = comm.psum(valid)
  mf = m.astype(_F32)
  p = k.astype(_F32) / jnp.maximum(n, 1).astype(_F32)
  t = p * mf  # sample keys below the target, expected: k m / n
  half = _Z * jnp.sqrt(mf * p * (1 - p)) + _EXTRA_RANKS
  i_lo = jnp.floor(t - half).astype(I32) - 1
  i_hi = jnp.ceil(t + half).astype(I32)
  size = ordered.shape[0]
  lo = jnp.where(
      i_lo < 0, INT_MIN, take_rows(ordered, jnp.clip(i_lo, 0, size - 1))
  )
  hi = jnp.where(
      i_hi >= m, INT_MAX, take_rows(ordered, jnp.clip(i_hi, 0, size - 1))
  )
  return lo, jnp.maximum(lo, hi)


def _compact(keys, interior, buffer, unique=None):
  """The ``interior`` keys of each column, in row order, into ``[buffer, F]``.

  Returns the buffer (``INT_MAX`` past the end) and the interior counts.
  ``unique`` (default: whether the indices fit int32) promises XLA distinct
  scatter indices.
  """
  n_rows, n_cols = keys.shape
  position = jnp.cumsum(interior.astype(I32), axis=0) - 1
  count = position[-1] + 1
  row = lax.broadcasted_iota(I32, keys.shape, 0)
  col = lax.broadcasted_iota(I32, keys.shape, 1)
  # One flat index per element (a 1-D scatter: no [N*F, 2] index tensor).
  # Exterior elements go to distinct rows past every interior position, so all
  # indices differ and XLA may scatter without atomics; rows >= buffer drop.
  if unique is None:
    unique = 2 * n_rows * n_cols <= np.iinfo(np.int32).max
  dropped = (n_rows + row) * n_cols + col if unique else buffer * n_cols
  flat = jnp.where(
      interior & (position < buffer), position * n_cols + col, dropped
  )
  out = jnp.full((buffer * n_cols,), INT_MAX, I32)
  out = out.at[flat.reshape(-1)].set(
      keys.reshape(-1), mode="drop", unique_indices=unique
  )
  return out.reshape(buffer, n_cols), count


def bracket_kth_smallest(
    rows: Array, mask: Array | None, k: Array, comm: Comm
) -> BracketSelection:
  """Exact k-th smallest key per column of ``rows``: bracket, compaction, small sort.

  Args:
    rows: float32 ``[N, F]`` (``common.to_rows``); ``mask`` decides what is
      masked in.
    mask: bool ``[N, F]`` or ``None``.
    k: int32 ``[F]`` 1-based ranks over the masked-in elements of all devices.
      Out of ``[1, n]`` the key returned is meaningless (callers put NaN).
    comm: ``_select.Comm`` along which rows are pooled.

  Returns:
    :class:`BracketSelection`, with keys equal to
    ``radix.radix_kth_smallest``'s for any int32 keys.
  """
  n_rows = rows.shape[0]
  buffer = buffer_size(n_rows, comm.size())
  keys = merged_keys(rows)
  inside = jnp.ones(rows.shape, bool) if mask is None else mask
  local_n = jnp.sum(inside, axis=0, dtype=I32)
  n = comm.psum(local_n)
  bad_k = (k < 1) | (k > n)
  rank = jnp.clip(k, 1, jnp.maximum(n, 1))
  lo, hi = _bracket(rows, mask, rank, n, comm)

  # The one pass over the rows (XLA fuses the counts with the flags).
  is_lo = inside & (keys == lo[None])
  is_hi = inside & (keys == hi[None]) & (hi != lo)[None]
  interior = inside & (keys > lo[None]) & (keys < hi[None])
  local_counts = jnp.stack(
      [
          jnp.sum(inside & (keys < lo[None]), axis=0, dtype=I32),
          jnp.sum(is_lo, axis=0, dtype=I32),
          jnp.sum(is_hi, axis=0, dtype=I32),
      ]
  )
  local_buf, local_in = _compact(keys, interior, buffer)
  below, eq_lo, eq_hi = comm.psum(local_counts)
  n_in = comm.psum(local_in)
  overflow = comm.psum((local_in > buffer).astype(I32)) > 0

  r = rank - below  # rank within the bracket
  on_lo = (r >= 1) & (r <= eq_lo)
  on_interior = (r > eq_lo) & (r <= eq_lo + n_in)
  on_hi = (r > eq_lo + n_in) & (r <= eq_lo + n_in + eq_hi)
  hit = on_lo | on_hi | (on_interior & ~overflow)
  missed = jnp.any(~hit & ~bad_k)

  def from_bracket(_):
    pooled = _sorted_columns(replicate_explicit(comm.gather_keys(local_buf)))
    index = jnp.clip(r - eq_lo - 1, 0, pooled.shape[0] - 1)
    middle = take_rows(pooled, index)
    answer = jnp.where(on_lo, lo, jnp.where(on_hi, hi, middle))
    local_ties = jnp.where(
        on_lo,
        local_counts[1],
        jnp.where(
            on_hi,
            local_counts[2],
            jnp.sum(local_buf == middle[None], axis=0, dtype=I32),
        ),
    )
    return answer, local_ties

  def from_radix(_):
    sel = radix.radix_kth_smallest(rows, mask, k, comm)
    return sel.keys, sel.local_ties

  answer, local_ties = lax.cond(missed, from_radix, from_bracket, None)
  return BracketSelection(
      keys=answer, n=n, local_ties=local_ties, missed=missed
  )


# Alike gbn_jax/_selection/dispatch.py::kth_smallest: the methods' one contract.
def kth_smallest_bracket(
    x: Array,
    k: int | Array,
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    return_ties: bool = False,
) -> Array | tuple[Array, Array | None]:
  """``dispatch.kth_smallest`` by a sampled bracket: one pass, no while loop.

  The contract of ``radix.kth_smallest_accelerator``: the k-th
  smallest (1-based) over ``axis`` of the masked-in elements of all devices
  along ``axis_name``, float32, an element of ``x`` bit for bit (``-0.0`` as
  ``+0.0``), NaN where ``k`` is not in ``[1, n]``. float16/bfloat16 are
  upcast (exactly); float64 takes the sort reference.

  ``return_ties``: also return, as float32, how many masked-in elements of
  *this device's* rows have the answer's key (``None`` for float64 input).
  """
  return radix.drop_in_selection(
      bracket_kth_smallest,
      x,
      k,
      axis,
      where=where,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      return_ties=return_ties,
  )
