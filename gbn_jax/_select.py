"""Exact k-th smallest element (order statistic) over some axes, without sorting.

``kth_smallest(x, k, axis)`` returns, for every position of the non-reduced
axes, the k-th smallest (1-based) of ``x`` over ``axis``: an element of ``x``,
bit for bit (``-0.0`` and ``+0.0`` compare equal and come back as ``+0.0``).

Everything works on the order-preserving int32 image of the floats (the
"key"): XLA:CPU flushes denormals to zero in float compares, min/max and
sorts, so only integer operations order all floats exactly.

Sorting is the obvious way, but on XLA:CPU a float sort calls a comparator per
comparison and is ~60x slower than a batch-norm layer. The ``"adaptive"``
method instead narrows, per feature, a bracket ``[lo, hi)`` of keys with
known counts ``#{key < lo} < k <= #{key < hi}``:

1. a strided sample (<= 1024 rows, sorted as int keys) places the first two
   thresholds at sample quantiles around the target; one *counting pass*
   (a chunked compare-and-sum, a ``psum`` of a few integers across devices)
   gives their exact counts;
2. later thresholds come from linear interpolation of the counts inside the
   bracket, or test a value exactly (``<v`` and ``<=v``) where the sample has
   ties at the target (atoms such as the zeros after a ReLU), or bisect the
   key range when a pass did not halve the bracket (bounds the pass count);
3. once the proposed bracket should hold at most ``_FOLD_MAX_WIDTH``
   elements, the pass also *folds* the elements inside it into buckets (row
   index modulo a chunk length) keeping min, max and count per bucket. A
   bucket with at most two elements, or only equal ones, is known exactly, so
   if the counts confirm that the target is inside, the answer is read off the
   recovered elements. Collisions or misses only cost another pass.

Every step is exact; the data only changes the number of passes (typically
three on continuous data, one or two with heavy ties). A fallback to the
sort-based reference runs if ``_MAX_PASSES`` is exceeded, which bisection
makes impossible in practice. ``"bisect"`` is counting passes alone, a 4-way
split of the key range per pass (17 passes): data-independent, no fixed
costs, the default for small batches on a CPU without the native kernel.

On a GPU/TPU each pass of the loop costs a kernel launch and a host sync
rather than memory traffic, so passes there test eight thresholds instead of
two and the fold is one reduction instead of a loop over blocks; batches under
``_ADAPTIVE_MIN_ROWS`` rows are sorted (along the minor axis).

``"native"`` is the C++ kernel of ``gbn_jax/csrc`` (``gbn_jax._native``),
the default on a CPU when it was built: for more than 16384 rows one sweep
that counts below a sampled bracket and packs the few keys inside it, for
fewer a radix select per transposed column. It does not pool devices, so with
``axis_name`` the pure-JAX methods run. Its second entry point
(:func:`kth_smallest_with_sums`) also returns a superquantile's sums from the
same sweep, which is how ``sqd`` gets its statistics on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gbn_jax import _native

Array = jax.Array
AxisIndexGroups = Any

__all__ = ["METHODS", "kth_smallest", "kth_smallest_reference"]

#: Exact methods accepted by ``kth_smallest(..., method=...)``.
#: ``"native"``: the compiled C++ kernel (XLA:CPU, one sweep; see
#: ``gbn_jax._native``), where it applies: built, CPU backend, no
#: ``axis_name``; elsewhere it means ``"adaptive"``.
#: ``"adaptive"``: sample + interpolating counting passes + fold.
#: ``"bisect"``: counting passes that split the int32 key range in four (17
#: passes, data-independent cost). ``"sort"``: sorts int keys (the reference).
#: ``"accelerator"``: radix select, four fixed histogram passes and no loop
#: (``gbn_jax._radix_select``), for GPUs/TPUs; runs anywhere.
#: ``"bracket"``: sampled bracket, one counting-and-compaction pass and a
#: small sort, radix on a miss (``gbn_jax._bracket_select``); a second
#: accelerator candidate, runs anywhere.
METHODS = ("native", "adaptive", "bisect", "sort", "accelerator", "bracket")

#: Overrides the size-based default of ``kth_smallest`` when not ``None``.
DEFAULT_METHOD: str | None = None

_I32 = jnp.int32
_F32 = jnp.float32
# Order-preserving int32 image ("key") of float32: non-negative floats keep
# their bits, negative ones get their magnitude bits flipped.
_FLIP = 0x7FFFFFFF
_FLIP64 = 0x7FFFFFFFFFFFFFFF
_KEY_NEG_INF = int(np.float32(-np.inf).view(np.int32)) ^ _FLIP
_KEY_POS_INF = int(np.float32(np.inf).view(np.int32))
# Exclusive upper bound of the keys of all non-NaN floats.
_KEY_BEYOND = _KEY_POS_INF + 1
_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min
#: Most elements one selection may reduce over (per position, over all
#: devices): ranks, counts and keys are int32.
MAX_ELEMENTS = _INT_MAX

# Tuning constants of the adaptive method (see module docstring).
_SAMPLE_ROWS = 1024  # rows sampled (over all devices) to place the first bracket
_SAMPLE_FRACTION = 8  # ... but at most one row in this many
_SAMPLE_Z = 3.0  # half-width of the first bracket, in sample standard deviations
_INTERP_EPS = 1.0  # later brackets: +-eps*sqrt(width) ranks around the target
_FIRST_INTERP_EPS = 5.0  # first interpolation: the CDF's curvature still shows
_FOLD_MAX_WIDTH = 128  # fold once at most this many elements remain in a bracket
_ADAPTIVE_MIN_ROWS = 16384  # default method: "bisect" below this many rows
# Default at least that many rows on a GPU/TPU: no data-dependent loop, so no
# host sync per pass (the adaptive loop's cost there). Measured on an H100
# (results/h100_methods.json, h100_radix.json): the sampled bracket's sqd
# layers are 2.5-3.9x BatchNorm, the radix select's 4.8-13x (its scatter
# histograms cost 0.66-2.4 ms a pass) and the adaptive loop's 8-11x.
_ACCELERATOR_LARGE_METHOD = "bracket"
_MAX_PASSES = 96  # >= 2 * 33 bisections; beyond it the sort fallback runs
_CHUNK_ELEMENTS = 1 << 18  # elements per chunk of a CPU counting pass
# Thresholds per adaptive counting pass: each costs a compare-and-add per
# element on a CPU, while an accelerator's pass costs its launch and sync.
_COUNT_THRESHOLDS_CPU = 2
_COUNT_THRESHOLDS_ACCELERATOR = 8
_FOLD_ELEMENTS = 1 << 18  # elements per chunk (= buckets) of a CPU fold pass


# --------------------------------------------------------------------------
# Validation and layout.


def _check_axes(ndim: int, axis: Sequence[int]) -> tuple[int, ...]:
  axes = tuple(int(a) for a in axis)
  if not axes:
    raise ValueError("kth_smallest needs at least one axis to reduce over.")
  if any(not 0 <= a < ndim for a in axes) or list(axes) != sorted(set(axes)):
    raise ValueError(
        f"axis must be sorted, unique and in [0, {ndim}), got {tuple(axis)}."
    )
  return axes


def _check_input(x: Any) -> Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"kth_smallest needs a floating-point array, got {x.dtype}.")
  return x


def check_element_count(n: int) -> None:
  """Raises ``ValueError`` unless ``n`` elements fit one selection (int32 ranks)."""
  if n > MAX_ELEMENTS:
    raise ValueError(
        f"kth_smallest reduces over at most 2**31 - 1 = {MAX_ELEMENTS} elements per"
        f" position (ranks and counts are int32), got {n}; reduce over fewer axes or"
        " split the batch."
    )


def _to_rows(x: Array, axes: tuple[int, ...], where: Array | None):
  """Returns ``(rows, mask_rows, kept_shape)``: reduced axes first, flattened.

  ``rows`` has shape ``(N, F)``; masked-out elements are replaced by ``+inf``,
  which every pass below treats as "not counted" (see ``_count_pass``).
  """
  kept = [d for d in range(x.ndim) if d not in axes]
  perm = list(axes) + kept
  kept_shape = tuple(x.shape[d] for d in kept)
  n_rows = math.prod(x.shape[d] for d in axes)
  n_cols = math.prod(kept_shape)
  rows = jnp.transpose(x, perm).reshape(n_rows, n_cols)
  mask = None
  if where is not None:
    mask = jnp.transpose(jnp.broadcast_to(where, x.shape), perm).reshape(n_rows, n_cols)
    rows = jnp.where(mask, rows, jnp.inf)
  return rows, mask, kept_shape


# --------------------------------------------------------------------------
# Keys.


def _float_to_key(v: Array) -> Array:
  # Integer ops only: XLA:CPU flushes denormals to zero in float compares and
  # min/max, so float arithmetic could not order them. -0.0 gets key -1, just
  # below +0.0 with nothing in between; results are canonicalised to +0.0.
  # float64 (only under jax_enable_x64, only on the sort path) keeps its
  # precision in int64 keys; every other float is exact in float32.
  if v.dtype == jnp.float64:
    b = lax.bitcast_convert_type(v, jnp.int64)
    return b ^ ((b >> 63) & jnp.int64(_FLIP64))
  b = lax.bitcast_convert_type(v.astype(_F32), _I32)
  return b ^ ((b >> 31) & _I32(_FLIP))


def _key_to_float(key: Array) -> Array:
  if key.dtype == jnp.int64:
    return lax.bitcast_convert_type(key ^ ((key >> 63) & jnp.int64(_FLIP64)),
                                    jnp.float64)
  return lax.bitcast_convert_type(key ^ ((key >> 31) & _I32(_FLIP)), _F32)


def _key_to_output(key: Array) -> Array:
  return _key_to_float(jnp.where(key == -1, 0, key))  # -0.0 -> +0.0


def _key_midpoint(lo: Array, hi: Array) -> Array:
  # floor((lo + hi) / 2) without int32 overflow.
  return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


# --------------------------------------------------------------------------
# Collectives (no-ops without an axis name).


class _Comm:
  """The named axis over which rows are pooled, or none."""

  def __init__(self, axis_name, groups):
    self.axis_name = axis_name
    self.groups = groups

  def _reduce(self, collective, v):
    if self.axis_name is None:
      return v
    return collective(v, self.axis_name, axis_index_groups=self.groups)

  def psum(self, v):
    return self._reduce(lax.psum, v)

  def pmin(self, v):
    return self._reduce(lax.pmin, v)

  def pmax(self, v):
    return self._reduce(lax.pmax, v)

  def gather_rows(self, v):
    if self.axis_name is None:
      return v
    return lax.all_gather(
        v, self.axis_name, axis=0, tiled=True, axis_index_groups=self.groups
    )

  def gather_keys(self, keys):
    """All devices' int32 ``keys`` stacked along axis 0, identical everywhere.

    A pmax of per-device slots instead of ``all_gather``, so that under
    ``shard_map`` the result is typed device-invariant like the counts.
    """
    if self.axis_name is None:
      return keys
    size = self.size()
    index = lax.axis_index(self.axis_name)
    if self.groups is not None:
      slot = np.zeros(sum(len(g) for g in self.groups), np.int32)
      for group in self.groups:
        for position, member in enumerate(group):
          slot[member] = position
      index = jnp.asarray(slot)[index]
    slots = jnp.full((size,) + keys.shape, _INT_MIN, keys.dtype)
    slots = lax.dynamic_update_index_in_dim(slots, keys, index, axis=0)
    stacked = lax.pmax(slots, self.axis_name, axis_index_groups=self.groups)
    return stacked.reshape((size * keys.shape[0],) + keys.shape[1:])

  def size(self) -> int:
    if self.axis_name is None:
      return 1
    if self.groups is not None:
      return len(self.groups[0])
    return int(lax.psum(1, self.axis_name))


# --------------------------------------------------------------------------
# Passes over the data.


def _chunk_rows(n_rows: int, n_cols: int, elements: int | None) -> int:
  if elements is None:
    return n_rows
  return max(1, min(n_rows, elements // max(n_cols, 1)))


def _reduce_chunks(rows: Array, chunk: int, fn, combine):
  """``combine``-reduces ``fn(block)`` over row blocks of length ``chunk``.

  Chunking keeps the per-threshold temporaries in cache on CPU; with
  ``chunk == N`` it is one fused reduction (GPU/TPU).
  """
  n = rows.shape[0]
  n_full, tail = divmod(n, chunk)
  acc = fn(lax.slice_in_dim(rows, 0, chunk))
  if n_full > 1:
    acc = lax.fori_loop(
        1,
        n_full,
        lambda i, a: combine(a, fn(lax.dynamic_slice_in_dim(rows, i * chunk, chunk))),
        acc,
    )
  if tail:
    acc = combine(acc, fn(lax.slice_in_dim(rows, n_full * chunk, n)))
  return acc


def _count_pass(rows: Array, thresholds: Array, chunk: int, comm: _Comm) -> Array:
  """``#{key(x) < t}`` per threshold key, ``(T, F)`` int32, pooled over devices.

  Masked-out elements are ``+inf`` and no threshold exceeds its key, so they
  are never counted. Float compares are ~2x cheaper than int ones on XLA:CPU
  and exact against a normal (or infinite) threshold even where denormals are
  flushed to zero; thresholds among the denormals and zeros compare keys.
  """
  floats = _key_to_float(thresholds)
  safe = jnp.all(jnp.abs(floats) >= np.finfo(np.float32).tiny)

  def count(compare):
    def block(b):
      hit = compare(b[:, None, :])
      if b.shape[0] < (1 << 24):
        # A float sum of 0/1 is exact below 2**24 and is the fast path on CPU.
        return jnp.sum(jnp.where(hit, 1.0, 0.0), axis=0, dtype=_F32).astype(_I32)
      return jnp.sum(hit, axis=0, dtype=_I32)

    return _reduce_chunks(rows, chunk, block, jnp.add)

  local = lax.cond(
      safe,
      lambda: count(lambda b: b < floats[None]),
      lambda: count(lambda b: _float_to_key(b) < thresholds[None]),
  )
  return comm.psum(local)


def _fold_pass(
    rows: Array, lo: Array, hi: Array, buckets: int, comm: _Comm, loop: bool = True
):
  """Folds the keys in ``[lo, hi)`` into buckets; also counts keys below ``lo``.

  Row ``i`` goes to bucket ``i % buckets``, which keeps the min, max and count
  of its in-bracket keys. Returns ``((mins, maxs, counts), below)``: three
  ``(buckets, F)`` arrays (counts as float32, exact as a bucket holds fewer
  than 2**24 rows) and ``#{key < lo}`` per feature. Across devices, buckets
  of the same index are merged and the counts summed. ``loop``: a loop over
  blocks of rows (XLA:CPU), else one reduction over all of them (one kernel
  on an accelerator).
  """
  n = rows.shape[0]
  n_full, tail = divmod(n, buckets)

  def update(acc, b):
    b = _float_to_key(b)
    inside = (b >= lo) & (b < hi)
    mn, mx, cnt, below = acc
    return (
        jnp.minimum(mn, jnp.where(inside, b, _INT_MAX)),
        jnp.maximum(mx, jnp.where(inside, b, _INT_MIN)),
        cnt + jnp.where(inside, 1.0, 0.0),
        below + jnp.sum(jnp.where(b < lo, 1.0, 0.0), axis=0).astype(_I32),
    )

  shape = (buckets, rows.shape[1])
  acc = (
      jnp.full(shape, _INT_MAX, _I32),
      jnp.full(shape, _INT_MIN, _I32),
      jnp.zeros(shape, _F32),
      jnp.zeros(shape[1:], _I32),
  )
  if not loop and n_full > 1:
    keys = _float_to_key(lax.slice_in_dim(rows, 0, n_full * buckets))
    keys = keys.reshape(n_full, buckets, rows.shape[1])
    inside = (keys >= lo) & (keys < hi)
    mn, mx, cnt, below = lax.reduce(
        (
            jnp.where(inside, keys, _INT_MAX),
            jnp.where(inside, keys, _INT_MIN),
            jnp.where(inside, 1, 0),
            jnp.where(keys < lo, 1, 0),
        ),
        (_I32(_INT_MAX), _I32(_INT_MIN), _I32(0), _I32(0)),
        lambda a, b: (
            jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1]), a[2] + b[2], a[3] + b[3]
        ),
        (0,),
    )
    acc = (mn, mx, cnt.astype(_F32), jnp.sum(below, axis=0))
  else:
    # The first block seeds the accumulators (under shard_map it makes them
    # device-varying, as the loop body's outputs are).
    acc = update(acc, lax.slice_in_dim(rows, 0, buckets))
    acc = lax.fori_loop(
        1,
        n_full,
        lambda i, a: update(a, lax.dynamic_slice_in_dim(rows, i * buckets, buckets)),
        acc,
    )
  if tail:
    head = update(
        tuple(a[:tail] for a in acc[:3]) + (acc[3],), lax.slice_in_dim(rows, n_full * buckets, n)
    )
    acc = tuple(a.at[:tail].set(h) for a, h in zip(acc[:3], head[:3])) + (head[3],)
  mn, mx, cnt, below = acc
  return (comm.pmin(mn), comm.pmax(mx), comm.psum(cnt)), comm.psum(below)


# --------------------------------------------------------------------------
# Sample.


def _sorted_sample(rows: Array, mask: Array | None, per_device: int, comm: _Comm):
  """Sorted strided sample of keys, ``(m, F)``, and its masked-in counts.

  Masked-out elements (``+inf``) sort last. Sorting int32 keys is exact and,
  on XLA:CPU, several times faster than sorting floats (which goes through a
  total-order comparator).
  """
  n = rows.shape[0]
  stride = max(1, n // per_device)
  count = min(per_device, n)
  sample = lax.slice_in_dim(rows, 0, stride * (count - 1) + 1, stride)
  if mask is None:
    valid = jnp.full(rows.shape[1:], count, _I32)
  else:
    smask = lax.slice_in_dim(mask, 0, stride * (count - 1) + 1, stride)
    valid = jnp.sum(smask, axis=0, dtype=_I32)
  sample = _replicate_explicit(comm.gather_keys(_float_to_key(sample)))
  return lax.sort(sample, dimension=0), comm.psum(valid)


def _take_rows(a: Array, idx: Array) -> Array:
  """``a[idx[f], f]`` for every column ``f``."""
  return jnp.take_along_axis(a, idx[None, :], axis=0)[0]


# --------------------------------------------------------------------------
# Threshold proposals.


def _interpolate(klo, khi, clo, chi, rank):
  """Key where the count is predicted to reach ``rank`` (linear in value)."""
  frac = jnp.clip((rank - clo) / jnp.maximum(chi - clo, 1).astype(_F32), 0.0, 1.0)
  vlo = _key_to_float(klo)
  vhi = _key_to_float(jnp.minimum(khi, _KEY_POS_INF))
  span = vhi - vlo
  by_value = _float_to_key(vlo + span * frac)
  use_value = jnp.isfinite(vlo) & jnp.isfinite(vhi) & jnp.isfinite(span)
  # Outside finite values the value scale is useless; interpolate keys.
  flo = klo.astype(_F32)
  by_key = jnp.clip(flo + (khi.astype(_F32) - flo) * frac, float(_INT_MIN), 2.0e9).astype(_I32)
  return jnp.where(use_value, by_value, by_key)


def _adaptive_proposals(state, k, sample, sample_valid, n_thresholds):
  """``n_thresholds`` keys per feature for the next pass, and where they test a tie.

  Returns ``(keys, tied)``: keys ``(T, F)`` spread evenly over the predicted
  bracket (its two ends for ``T == 2``); ``tied`` marks features whose first
  two keys test a tied sample value exactly instead.
  """
  klo, khi, clo, chi = state["klo"], state["khi"], state["clo"], state["chi"]
  spread = jnp.asarray(np.linspace(-1.0, 1.0, n_thresholds), _F32)[:, None]
  kf = k.astype(_F32)
  width = (chi - clo).astype(_F32)
  m = sample.shape[0]
  # Where the target sits in the sample: sample elements in the bracket.
  s_lo = jnp.sum(sample < klo, axis=0, dtype=_I32)
  s_hi = jnp.minimum(jnp.sum(sample < khi, axis=0, dtype=_I32), sample_valid)
  s_in = jnp.maximum(s_hi - s_lo, 0).astype(_F32)
  rel = jnp.clip((kf - 0.5 - clo.astype(_F32)) / jnp.maximum(width, 1.0), 0.0, 1.0)
  centre = s_lo.astype(_F32) + s_in * rel
  last = jnp.maximum(s_hi - 1, 0)

  def sample_key(pos):
    idx = jnp.clip(jnp.floor(pos).astype(_I32), s_lo, last)
    return jnp.take_along_axis(sample, jnp.clip(idx, 0, m - 1), axis=0)

  # (1) First pass: sample quantiles over +-z standard deviations of the target.
  half = _SAMPLE_Z * jnp.sqrt(s_in * rel * (1.0 - rel)) + 1.0
  first = sample_key(centre + half * spread)
  first = first.at[-1].add(1)  # the top sample value itself falls inside
  # (2) Later passes: interpolate the counts linearly in value.
  eps = jnp.where(state["passes"] == 1, _FIRST_INTERP_EPS, _INTERP_EPS) * jnp.sqrt(width)
  interp = _interpolate(klo, khi, clo, chi, kf + (0.5 + eps) * spread)
  # An atom (a value repeated in the sample, e.g. the zeros after a ReLU) at
  # the target: test that value exactly (<v and <=v). Two equal samples can
  # be chance (float32 data repeats values), three are taken as an atom.
  j = jnp.clip(jnp.floor(centre).astype(_I32), 0, m - 1)
  v = _take_rows(sample, j)
  tied = (jnp.sum(sample == v, axis=0) >= 3) & (j >= s_lo) & (j < s_hi)
  is_first = state["passes"] == 0
  keys = jnp.where(is_first, first, interp)
  keys = keys.at[0].set(jnp.where(tied & ~is_first, v, keys[0]))
  keys = keys.at[1].set(jnp.where(tied & ~is_first, v + 1, keys[1]))
  # (3) No halving last time: bisect the key range (bounds the pass count).
  top = jnp.where(state["stalled"] & ~tied, _key_midpoint(klo, khi), keys[-1])
  # Interpolation needs a finite top: after the first pass, test +inf itself.
  top = jnp.where((khi == _KEY_BEYOND) & ~is_first, _KEY_POS_INF, top)
  return keys.at[-1].set(top), tied & ~is_first


def _bisect_proposals(state):
  """Quarter points of each key range, ``(3, F)``."""
  klo, khi = state["klo"], state["khi"]
  mid = _key_midpoint(klo, khi)
  return jnp.stack([_key_midpoint(klo, mid), mid, _key_midpoint(mid, khi)])


# --------------------------------------------------------------------------
# The selection loop.


def _weighted_kth(keys: Array, weights: Array, rank: Array) -> tuple[Array, Array]:
  """The ``rank``-th smallest of a small weighted multiset, per row.

  ``keys``/``weights``: ``(F, C)``; returns the key and whether it exists.
  """
  keys, weights = lax.sort((keys, weights), dimension=1, num_keys=1)
  hit = jnp.cumsum(weights, axis=1) >= rank[:, None]
  found = jnp.any(hit, axis=1)
  return jnp.take_along_axis(keys, jnp.argmax(hit, axis=1)[:, None], axis=1)[:, 0], found


def _resolve_from_fold(fold, lo, hi, below, k):
  """Answers the features whose target the fold of ``[lo, hi)`` recovered.

  ``below = #{key < lo}``. A bucket is exact when it holds at most two keys
  (its min and max) or only equal keys (count times its min). Returns
  ``(resolved, answer, inside, width, bmin, bmax)``: whether the target lies
  in the bracket (``below < k <= below + width``) and the bracket's exact
  extreme keys.
  """
  mn, mx, cnt = (_replicate_explicit(a) for a in fold)  # small: (buckets, F)
  width = jnp.sum(cnt, axis=0).astype(_I32)
  # Below +inf only: the masked-out elements are +inf.
  inside = (hi <= _KEY_POS_INF) & (below <= k - 1) & (k <= below + width)
  single = mn == mx
  ambiguous = jnp.any((cnt >= 3) & ~single, axis=0)
  w_min = jnp.where(cnt == 0, 0.0, jnp.where(single, cnt, 1.0))
  w_max = jnp.where((cnt >= 2) & ~single, 1.0, 0.0)
  keys = jnp.concatenate([mn, mx], axis=0).T  # (F, 2B)
  weights = jnp.concatenate([w_min, w_max], axis=0).T
  # Each non-empty entry holds at least one of the `width` keys, so when the
  # fold is exact and narrow, few entries are non-empty: top_k of the 0/1
  # flags (exact, no key comparison involved) compacts them all.
  size = min(keys.shape[1], _FOLD_MAX_WIDTH)
  _, idx = lax.top_k(jnp.where(weights > 0, 1.0, 0.0), size)
  picked_weights = jnp.take_along_axis(weights, idx, axis=1)
  picked_keys = jnp.where(picked_weights > 0, jnp.take_along_axis(keys, idx, axis=1), _INT_MAX)
  answer, found = _weighted_kth(picked_keys, picked_weights, (k - below).astype(_F32))
  complete = jnp.sum(weights, axis=1) == jnp.sum(picked_weights, axis=1)
  resolved = inside & ~ambiguous & complete & found
  # Without that, a target at either end of the bracket is its min or max.
  bmin, bmax = jnp.min(mn, axis=0), jnp.max(mx, axis=0)
  at_lo, at_hi = below == k - 1, below + width == k
  answer = jnp.where(resolved, answer, jnp.where(at_lo, bmin, bmax))
  resolved |= inside & (at_lo | at_hi | (bmin == bmax))
  return resolved, answer, inside, width, bmin, bmax


def _narrow(state, k, keys, counts):
  """Shrinks each bracket with thresholds ``keys`` whose counts are known."""
  klo, khi, clo, chi = state["klo"], state["khi"], state["clo"], state["chi"]
  below = counts <= (k - 1)[None]
  # Counts grow with the threshold, so the largest threshold below the target
  # comes with the largest count below it (and symmetrically above).
  new_klo = jnp.maximum(klo, jnp.max(jnp.where(below, keys, _INT_MIN), axis=0))
  new_clo = jnp.maximum(clo, jnp.max(jnp.where(below, counts, -1), axis=0))
  new_khi = jnp.minimum(khi, jnp.min(jnp.where(below, _INT_MAX, keys), axis=0))
  new_chi = jnp.minimum(chi, jnp.min(jnp.where(below, _INT_MAX, counts), axis=0))
  old_width, new_width = chi - clo, new_chi - new_clo
  adjacent = new_khi == new_klo + 1  # one key left: it is the answer
  return dict(
      state,
      klo=new_klo,
      khi=new_khi,
      clo=new_clo,
      chi=new_chi,
      known=state["known"] | adjacent,
      answer=jnp.where(state["known"], state["answer"], new_klo),
      stalled=2 * new_width > old_width,
      stuck=4 * new_width > 3 * old_width,
      passes=state["passes"] + 1,
  )


def _fold_current(state) -> Array:
  """Features better served by folding their current bracket."""
  width = state["chi"] - state["clo"]
  # A target at an end of its bracket is the bracket's min or max; a stuck
  # bracket is usually one atom (tied values), which a fold recognises.
  ready = (state["clo"] == state["k"] - 1) | (state["chi"] == state["k"])
  return ready | (state["stuck"] & (width < state["fold_below"]))


def _varying_like(tree, data: Array):
  """Types constant loop carries as device-varying when ``data`` is.

  Inside ``shard_map`` with no ``axis_name`` here (e.g. a user measure on an
  all-gathered batch), everything the loop computes from ``data`` varies per
  device, so carries built from constants must too, or ``while_loop`` rejects
  the mismatch.
  """
  names = _varying_axes(data)
  if not names:
    return tree

  def cast(a):
    missing = tuple(n for n in names if n not in _varying_axes(a))
    return lax.pcast(a, missing, to="varying") if missing else a

  return jax.tree.map(cast, tree)


def _varying_axes(a) -> tuple[str, ...]:
  """Manual mesh axes along which ``a`` differs per device (shard_map typing)."""
  aval = jax.typeof(a)
  names = getattr(aval, "vma", None)  # jax releases that name it so
  if names is None:
    names = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return tuple(sorted(names or ()))


def _select_loop(rows, mask, k, n, comm, *, method, chunk, buckets, on_cpu):
  """Runs the passes; returns the answer keys and which features finished.

  ``on_cpu`` picks the CPU's pass shapes (two thresholds per count, the fold
  as a loop over blocks) over the accelerators' (eight, one reduction).

  State per feature: the bracket ``[klo, khi)`` with ``clo = #{key < klo}``
  and ``chi = #{key < khi}``, ``clo < k <= chi`` (``khi`` starts beyond
  ``+inf`` with ``chi = n``), plus flags steering the proposals.
  """
  n_cols = rows.shape[1]
  n_thresholds = _COUNT_THRESHOLDS_CPU if on_cpu else _COUNT_THRESHOLDS_ACCELERATOR
  bad_k = (k < 1) | (k > n)
  state = dict(
      klo=jnp.full((n_cols,), _KEY_NEG_INF, _I32),
      khi=jnp.full((n_cols,), _KEY_BEYOND, _I32),
      clo=jnp.zeros((n_cols,), _I32),
      chi=n,
      known=bad_k,
      answer=jnp.zeros((n_cols,), _I32),
      stalled=jnp.zeros((n_cols,), bool),
      stuck=jnp.zeros((n_cols,), bool),
      fold_below=jnp.full((n_cols,), _INT_MAX, _I32),
      passes=jnp.int32(0),
      k=k,
  )
  if comm.axis_name is None:
    state = _varying_like(state, rows)
  if method == "adaptive":
    total = max(1, min(_SAMPLE_ROWS, rows.shape[0] * comm.size() // _SAMPLE_FRACTION))
    per_device = max(1, total // comm.size())
    sample, sample_valid = _sorted_sample(rows, mask, per_device, comm)

  def count_step(state):
    klo, khi = state["klo"], state["khi"]
    if method == "adaptive":
      keys, tied = _adaptive_proposals(state, k, sample, sample_valid, n_thresholds)
    else:
      keys, tied = _bisect_proposals(state), jnp.zeros_like(state["stalled"])
    keys = jnp.clip(keys, klo + 1, jnp.maximum(khi - 1, klo + 1))
    state = _narrow(state, k, keys, _count_pass(rows, keys, chunk, comm))
    # A tie test that misses leaves the bracket wide without being a stall:
    # the next pass interpolates rather than bisects.
    return dict(state, stalled=state["stalled"] & ~tied)

  def fold_step(state):
    # Fold the current bracket where the target sits at an end of it or it is
    # stuck (usually one atom of tied values); elsewhere the proposed one,
    # which the counts of this same pass then confirm or reject.
    klo, khi = state["klo"], state["khi"]
    keys, _ = _adaptive_proposals(state, k, sample, sample_valid, 2)
    keys = jnp.clip(keys, klo + 1, jnp.maximum(khi - 1, klo + 1))
    current = _fold_current(state) & (khi <= _KEY_POS_INF)
    lo = jnp.where(current, klo, jnp.min(keys, axis=0))
    hi = jnp.where(current, khi, jnp.maximum(jnp.max(keys, axis=0), lo + 1))
    fold, below = _fold_pass(rows, lo, hi, buckets, comm, loop=on_cpu)
    resolved, answer, inside, width, bmin, bmax = _resolve_from_fold(fold, lo, hi, below, k)
    # The bracket ends double as two counted thresholds.
    state = _narrow(state, k, jnp.stack([lo, hi]), jnp.stack([below, below + width]))
    known = state["known"]
    return dict(
        state,
        # Inside, the bracket shrinks to its exact extremes.
        klo=jnp.where(inside & ~known, jnp.maximum(state["klo"], bmin), state["klo"]),
        khi=jnp.where(inside & ~known, jnp.minimum(state["khi"], bmax + 1), state["khi"]),
        known=known | resolved,
        answer=jnp.where(known, state["answer"], answer),
        # A fold that failed (bucket collisions) is retried only on a bracket
        # at most half as wide, so folds cannot repeat forever.
        fold_below=jnp.where(
            inside & ~resolved & ~known, width // 2 + 1, state["fold_below"]
        ),
    )

  def body(state):
    if method != "adaptive":
      return count_step(state)
    width = (state["chi"] - state["clo"]).astype(_F32)
    eps = jnp.where(state["passes"] == 1, _FIRST_INTERP_EPS, _INTERP_EPS)
    # Width of the bracket this pass would propose (see _adaptive_proposals).
    proposed = 2.0 * eps * jnp.sqrt(width) + 2.0
    foldable = (_fold_current(state) & (state["khi"] <= _KEY_POS_INF)) | (
        (state["passes"] > 0)
        & (proposed <= _FOLD_MAX_WIDTH)
        & (proposed < state["fold_below"].astype(_F32))
    )
    open_ = ~state["known"]
    fold_now = jnp.all(foldable | ~open_) | (
        jnp.any(foldable & open_) & (state["passes"] >= 6)
    )
    return lax.cond(fold_now, fold_step, count_step, state)

  def cond(state):
    return jnp.any(~state["known"]) & (state["passes"] < _MAX_PASSES)

  state = lax.while_loop(cond, body, state)
  return state["answer"], state["known"]


# --------------------------------------------------------------------------
# Public API.


def _default_method(n_rows: int) -> str:
  if _native_applies(None):
    return "native"
  large = n_rows >= _ADAPTIVE_MIN_ROWS
  if not _on_cpu():
    # Measured on an H200 (benchmarks/device_check.sh): each pass of a loop
    # costs a launch and a host sync there, so small batches sort outright.
    return _ACCELERATOR_LARGE_METHOD if large else "sort"
  # The adaptive method's fixed costs (sample sort, fold resolution) only pay
  # off once a pass over the rows costs more than they do.
  return "adaptive" if large else "bisect"


def _compares_keep_denormals() -> bool:
  # XLA:CPU sets denormals-are-zero (see the native kernel's tie counts);
  # XLA:GPU keeps them unless --xla_gpu_ftz; TPUs flush them.
  return jax.default_backend() == "gpu"


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def _native_applies(axis_name) -> bool:
  # The kernel sees one device's rows: pooling across devices stays in JAX.
  return axis_name is None and _on_cpu() and _native.available()


def _prepare_k(k: Any, kept_shape: tuple[int, ...]) -> Array:
  k = jnp.asarray(k)
  if not jnp.issubdtype(k.dtype, jnp.integer):
    raise TypeError(f"k must be an integer or integer array, got {k.dtype}.")
  return jnp.broadcast_to(k.astype(_I32), kept_shape).reshape(-1)


def _replicate_explicit(a: Array) -> Array:
  """Gathers an array sharded over an Explicit mesh axis onto every device.

  Under Explicit axes (``jax.make_mesh``'s default) a sort along a sharded
  dimension is a type error, not an implicit all-gather as with Auto axes.
  """
  sharding = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(s is None for s in spec):
    return a
  explicit = jax.sharding.AxisType.Explicit
  if explicit not in getattr(sharding.mesh, "axis_types", ()):
    return a
  replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return jax.sharding.reshard(a, replicated)


def native_sums_apply(x: Array, where: Array | None, axis_name: str | None) -> bool:
  """Whether :func:`kth_smallest_with_sums` serves this call: the kernel applies,
  nothing is masked, ``x`` is float32 and no method other than native is forced."""
  return (
      where is None
      and jnp.result_type(x) == _F32
      and DEFAULT_METHOD in (None, "native")
      and _native_applies(axis_name)
  )


def kth_smallest_with_sums(x: Array, k: int, axis: tuple[int, ...]) -> tuple[Array, ...]:
  """The ``k``-th smallest and a superquantile's sums, in one native sweep.

  For unmasked float32 ``x`` where :func:`native_sums_apply`; ``1 <= k <= n``.
  Returns, each of the non-reduced shape: the value (as :func:`kth_smallest`),
  the tie count (int32, as ``return_ties``), the mean, the mean of
  ``(x - value)^+`` (NaN if any element is NaN), and how many elements are not
  ``<= value`` (int32, -1 where the tie count is). Not differentiable.
  """
  x = _check_input(lax.stop_gradient(x))
  axes = _check_axes(x.ndim, axis)
  rows, _, kept_shape = _to_rows(x, axes, None)
  check_element_count(rows.shape[0])
  k = _prepare_k(k, kept_shape)
  keys, ties, _, mean, mean_excess, above = _native.kth_smallest_sums(
      _replicate_explicit(rows), k
  )
  value = _key_to_output(keys)
  return tuple(a.reshape(kept_shape) for a in (value, ties, mean, mean_excess, above))


def kth_smallest_reference(
    x: Array,
    k: int | Array,
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """Sort-based k-th smallest: the oracle of :func:`kth_smallest`.

  Same contract as :func:`kth_smallest`; masked-out elements are sorted last
  as ``+inf`` and with ``axis_name`` every device's rows are all-gathered.
  """
  x = _check_input(x)
  axes = _check_axes(x.ndim, axis)
  rows, _, kept_shape = _to_rows(x, axes, where)
  comm = _Comm(axis_name, axis_index_groups)
  check_element_count(rows.shape[0] * comm.size())
  rows = comm.gather_rows(_float_to_key(lax.stop_gradient(rows)))
  k = _prepare_k(k, kept_shape)
  index = jnp.clip(k - 1, 0, rows.shape[0] - 1)
  rows = _replicate_explicit(rows)
  # Sorting int keys, not floats: XLA:CPU's float compare flushes denormals.
  if _on_cpu():
    answer = _take_rows(jnp.sort(rows, axis=0), index)
  else:
    # Along the minor axis, where XLA:GPU sorts with a radix sort (CUB).
    ordered = jnp.sort(rows.T, axis=1)
    answer = jnp.take_along_axis(ordered, index[:, None], axis=1)[:, 0]
  return _key_to_output(answer).reshape(kept_shape)


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
      the sort-based reference. At most :data:`MAX_ELEMENTS` (2**31 - 1)
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
    return_ties: also return, per position, how many masked-in elements
      equal the answer, where the native kernel knows it at no cost: a
      float32 count as ``x == answer`` counts it, or ``-1`` for a zero or
      denormal answer where the kernel cannot read the CPU's denormal mode
      (``_native.counts_always_known()`` is False; count those yourself);
      ``None`` from the other methods.
    method: one of :data:`METHODS`; default :data:`DEFAULT_METHOD` or else
      ``"native"`` where it applies, otherwise ``"adaptive"`` for at least
      ``_ADAPTIVE_MIN_ROWS`` reduced rows (over all devices) and ``"bisect"``
      below.

  Returns:
    Array of the non-reduced shape, float32 (float64 for float64 ``x``, under
    ``jax_enable_x64``), holding elements of ``x`` (``-0.0`` returned as
    ``+0.0``), and the tie counts if ``return_ties``.
    Not differentiable (gradient zero): the caller defines the derivative.
  """
  x = _check_input(x)
  axes = _check_axes(x.ndim, axis)
  method = method or DEFAULT_METHOD
  if method is not None and method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  x = lax.stop_gradient(x)
  if where is not None:
    where = lax.stop_gradient(jnp.asarray(where, bool))
  if method == "sort" or x.dtype != _F32:
    # Other dtypes (the caller upcasts half precision) take the exact sort.
    value = kth_smallest_reference(
        x, k, axes, where=where, axis_name=axis_name, axis_index_groups=axis_index_groups
    )
    return (value, None) if return_ties else value
  comm = _Comm(axis_name, axis_index_groups)
  rows, mask, kept_shape = _to_rows(x, axes, where)
  n_rows, n_cols = rows.shape
  check_element_count(n_rows * comm.size())
  method = method or _default_method(n_rows * comm.size())
  if method in ("accelerator", "bracket"):
    # pylint: disable-next=g-import-not-at-top
    from gbn_jax import _bracket_select, _radix_select
    select = (_radix_select.kth_smallest_accelerator if method == "accelerator"
              else _bracket_select.kth_smallest_bracket)
    result = select(
        x, k, axes, where=where, axis_name=axis_name,
        axis_index_groups=axis_index_groups, return_ties=return_ties)
    if return_ties and not _compares_keep_denormals():
      # Its integer counts tell denormals from zero; XLA:CPU's float compares
      # (which the caller's tie split uses) do not: let the caller count.
      return result[0], None
    return result
  if method == "native" and not _native_applies(axis_name):
    method = "adaptive"
  k = _prepare_k(k, kept_shape)
  if mask is None:
    n = jnp.full((n_cols,), n_rows * comm.size(), _I32)
  else:
    n = comm.psum(jnp.sum(mask, axis=0, dtype=_I32))
  bad_k = (k < 1) | (k > n)
  if method == "native":
    # Masked-out elements are +inf and k <= n: the answer is masked in. The
    # kernel counted them among the ties of a +inf answer.
    answer, ties, _ = _native.kth_smallest_keys(_replicate_explicit(rows), k)
    if mask is not None:
      masked_inf = (answer == _float_to_key(jnp.float32(jnp.inf))) & (ties >= 0)
      ties = jnp.where(masked_inf, ties - (n_rows * comm.size() - n), ties)
    value = jnp.where(bad_k, jnp.nan, _key_to_output(answer)).reshape(kept_shape)
    if return_ties:
      return value, ties.astype(_F32).reshape(kept_shape)
    return value
  # XLA:CPU materialises compare/select temporaries of a reduction; blocks of
  # rows keep them in cache. GPU/TPU fuse the whole pass into one kernel.
  on_cpu = _on_cpu()
  chunk = _chunk_rows(n_rows, n_cols, _CHUNK_ELEMENTS if on_cpu else None)
  buckets = _chunk_rows(n_rows, n_cols, _FOLD_ELEMENTS)
  answer, known = _select_loop(
      rows, mask, k, n, comm, method=method, chunk=chunk, buckets=buckets, on_cpu=on_cpu
  )

  def fallback(_):
    ref = kth_smallest_reference(
        x, k.reshape(kept_shape), axes, where=where, axis_name=axis_name,
        axis_index_groups=axis_index_groups,
    ).reshape(-1)
    # pmax of identical values: types the all-gathered result device-invariant
    # under shard_map, like the other branch.
    return jnp.where(known, _key_to_output(answer), comm.pmax(ref))

  value = lax.cond(jnp.all(known), lambda _: _key_to_output(answer), fallback, None)
  value = jnp.where(bad_k, jnp.nan, value).reshape(kept_shape)
  return (value, None) if return_ties else value
