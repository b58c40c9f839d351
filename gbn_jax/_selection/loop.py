"""Pure-JAX k-th smallest by counting and folding passes (``"adaptive"``, ``"bisect"``).

The ``"adaptive"`` method narrows, per feature, a bracket ``[lo, hi)`` of keys
(``common.float_to_key``) with known counts ``#{key < lo} < k <= #{key < hi}``:

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
costs.

On a GPU/TPU each pass costs a kernel launch and a host sync rather than
memory traffic, so passes there test eight thresholds instead of two and the
fold is one reduction instead of a loop over blocks. This module steers the
loop (proposals, narrowing, reading answers off a fold); the passes
themselves are :mod:`.passes`.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection import common
from gbn_jax._selection import passes
from gbn_jax._selection import sort
from gbn_jax._selection.common import F32
from gbn_jax._selection.common import I32
from gbn_jax._selection.common import INT_MAX
from gbn_jax._selection.common import INT_MIN
from gbn_jax._selection.common import KEY_BEYOND
from gbn_jax._selection.common import KEY_NEG_INF
from gbn_jax._selection.common import KEY_POS_INF
from gbn_jax._selection.common import float_to_key
from gbn_jax._selection.common import key_midpoint
from gbn_jax._selection.common import key_to_float
from gbn_jax._selection.common import key_to_output
from gbn_jax._selection.common import replicate_explicit
from gbn_jax._selection.common import take_rows
from gbn_jax._selection.common import varying_like

Array = jax.Array

#: Methods this module implements.
METHODS = ("adaptive", "bisect")

_SAMPLE_ROWS = (
    1024  # rows sampled (over all devices) to place the first bracket
)
_SAMPLE_FRACTION = 8  # ... but at most one row in this many
_SAMPLE_Z = (
    3.0  # half-width of the first bracket, in sample standard deviations
)
_INTERP_EPS = 1.0  # later brackets: +-eps*sqrt(width) ranks around the target
_FIRST_INTERP_EPS = 5.0  # first interpolation: the CDF's curvature still shows
_FOLD_MAX_WIDTH = (
    128  # fold once at most this many elements remain in a bracket
)
_MAX_PASSES = 96  # >= 2 * 33 bisections; beyond it the sort fallback runs
_CHUNK_ELEMENTS = 1 << 18  # elements per chunk of a CPU counting pass
# Thresholds per adaptive counting pass: each costs a compare-and-add per
# element on a CPU, while an accelerator's pass costs its launch and sync.
_COUNT_THRESHOLDS_CPU = 2
_COUNT_THRESHOLDS_ACCELERATOR = 8
_FOLD_ELEMENTS = 1 << 18  # elements per chunk (= buckets) of a CPU fold pass


# --------------------------------------------------------------------------
# Threshold proposals.


def _interpolate(klo, khi, clo, chi, rank):
  """Key where the count is predicted to reach ``rank`` (linear in value)."""
  frac = jnp.clip(
      (rank - clo) / jnp.maximum(chi - clo, 1).astype(F32), 0.0, 1.0
  )
  vlo = key_to_float(klo)
  vhi = key_to_float(jnp.minimum(khi, KEY_POS_INF))
  span = vhi - vlo
  by_value = float_to_key(vlo + span * frac)
  use_value = jnp.isfinite(vlo) & jnp.isfinite(vhi) & jnp.isfinite(span)
  # Outside finite values the value scale is useless; interpolate keys.
  flo = klo.astype(F32)
  by_key = jnp.clip(
      flo + (khi.astype(F32) - flo) * frac, float(INT_MIN), 2.0e9
  ).astype(I32)
  return jnp.where(use_value, by_value, by_key)


def _adaptive_proposals(state, k, sample, sample_valid, n_thresholds):
  """``n_thresholds`` keys per feature for the next pass, and where they test a tie.

  Returns ``(keys, tied)``: keys ``(T, F)`` spread evenly over the predicted
  bracket (its two ends for ``T == 2``); ``tied`` marks features whose first
  two keys test a tied sample value exactly instead.
  """
  klo, khi, clo, chi = state["klo"], state["khi"], state["clo"], state["chi"]
  spread = jnp.asarray(np.linspace(-1.0, 1.0, n_thresholds), F32)[:, None]
  kf = k.astype(F32)
  width = (chi - clo).astype(F32)
  m = sample.shape[0]
  # Where the target sits in the sample: sample elements in the bracket.
  s_lo = jnp.sum(sample < klo, axis=0, dtype=I32)
  s_hi = jnp.minimum(jnp.sum(sample < khi, axis=0, dtype=I32), sample_valid)
  s_in = jnp.maximum(s_hi - s_lo, 0).astype(F32)
  rel = jnp.clip(
      (kf - 0.5 - clo.astype(F32)) / jnp.maximum(width, 1.0), 0.0, 1.0
  )
  centre = s_lo.astype(F32) + s_in * rel
  last = jnp.maximum(s_hi - 1, 0)

  def sample_key(pos):
    idx = jnp.clip(jnp.floor(pos).astype(I32), s_lo, last)
    return jnp.take_along_axis(sample, jnp.clip(idx, 0, m - 1), axis=0)

  # (1) First pass: sample quantiles over +-z standard deviations of the target.
  half = _SAMPLE_Z * jnp.sqrt(s_in * rel * (1.0 - rel)) + 1.0
  first = sample_key(centre + half * spread)
  first = first.at[-1].add(1)  # the top sample value itself falls inside
  # (2) Later passes: interpolate the counts linearly in value.
  eps = jnp.where(
      state["passes"] == 1, _FIRST_INTERP_EPS, _INTERP_EPS
  ) * jnp.sqrt(width)
  interp = _interpolate(klo, khi, clo, chi, kf + (0.5 + eps) * spread)
  # An atom (a value repeated in the sample, e.g. the zeros after a ReLU) at
  # the target: test that value exactly (<v and <=v). Two equal samples can
  # be chance (float32 data repeats values), three are taken as an atom.
  j = jnp.clip(jnp.floor(centre).astype(I32), 0, m - 1)
  v = take_rows(sample, j)
  tied = (jnp.sum(sample == v, axis=0) >= 3) & (j >= s_lo) & (j < s_hi)
  is_first = state["passes"] == 0
  keys = jnp.where(is_first, first, interp)
  keys = keys.at[0].set(jnp.where(tied & ~is_first, v, keys[0]))
  keys = keys.at[1].set(jnp.where(tied & ~is_first, v + 1, keys[1]))
  # (3) No halving last time: bisect the key range (bounds the pass count).
  top = jnp.where(state["stalled"] & ~tied, key_midpoint(klo, khi), keys[-1])
  # Interpolation needs a finite top: after the first pass, test +inf itself.
  top = jnp.where((khi == KEY_BEYOND) & ~is_first, KEY_POS_INF, top)
  return keys.at[-1].set(top), tied & ~is_first


def _bisect_proposals(state):
  """Quarter points of each key range, ``(3, F)``."""
  klo, khi = state["klo"], state["khi"]
  mid = key_midpoint(klo, khi)
  return jnp.stack([key_midpoint(klo, mid), mid, key_midpoint(mid, khi)])


# --------------------------------------------------------------------------
# The selection loop.


def _weighted_kth(
    keys: Array, weights: Array, rank: Array
) -> tuple[Array, Array]:
  """The ``rank``-th smallest of a small weighted multiset, per row.

  ``keys``/``weights``: ``(F, C)``; returns the key and whether it exists.
  """
  keys, weights = lax.sort((keys, weights), dimension=1, num_keys=1)
  hit = jnp.cumsum(weights, axis=1) >= rank[:, None]
  found = jnp.any(hit, axis=1)
  return (
      jnp.take_along_axis(keys, jnp.argmax(hit, axis=1)[:, None], axis=1)[:, 0],
      found,
  )


def _resolve_from_fold(fold, lo, hi, below, k):
  """Answers the features whose target the fold of ``[lo, hi)`` recovered.

  ``below = #{key < lo}``. A bucket is exact when it holds at most two keys
  (its min and max) or only equal keys (count times its min). Returns
  ``(resolved, answer, inside, width, bmin, bmax)``: whether the target lies
  in the bracket (``below < k <= below + width``) and the bracket's exact
  extreme keys.
  """
  mn, mx, cnt = (replicate_explicit(a) for a in fold)  # small: (buckets, F)
  width = jnp.sum(cnt, axis=0).astype(I32)
  # Below +inf only: the masked-out elements are +inf.
  inside = (hi <= KEY_POS_INF) & (below <= k - 1) & (k <= below + width)
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
  picked_keys = jnp.where(
      picked_weights > 0, jnp.take_along_axis(keys, idx, axis=1), INT_MAX
  )
  answer, found = _weighted_kth(
      picked_keys, picked_weights, (k - below).astype(F32)
  )
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
  new_klo = jnp.maximum(klo, jnp.max(jnp.where(below, keys, INT_MIN), axis=0))
  new_clo = jnp.maximum(clo, jnp.max(jnp.where(below, counts, -1), axis=0))
  new_khi = jnp.minimum(khi, jnp.min(jnp.where(below, INT_MAX, keys), axis=0))
  new_chi = jnp.minimum(chi, jnp.min(jnp.where(below, INT_MAX, counts), axis=0))
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


def _select_loop(rows, mask, k, n, comm, *, method, chunk, buckets, on_cpu):
  """Runs the passes; returns the answer keys and which features finished.

  ``on_cpu`` picks the CPU's pass shapes (two thresholds per count, the fold
  as a loop over blocks) over the accelerators' (eight, one reduction).

  State per feature: the bracket ``[klo, khi)`` with ``clo = #{key < klo}``
  and ``chi = #{key < khi}``, ``clo < k <= chi`` (``khi`` starts beyond
  ``+inf`` with ``chi = n``), plus flags steering the proposals.
  """
  n_cols = rows.shape[1]
  n_thresholds = (
      _COUNT_THRESHOLDS_CPU if on_cpu else _COUNT_THRESHOLDS_ACCELERATOR
  )
  bad_k = (k < 1) | (k > n)
  state = dict(
      klo=jnp.full((n_cols,), KEY_NEG_INF, I32),
      khi=jnp.full((n_cols,), KEY_BEYOND, I32),
      clo=jnp.zeros((n_cols,), I32),
      chi=n,
      known=bad_k,
      answer=jnp.zeros((n_cols,), I32),
      stalled=jnp.zeros((n_cols,), bool),
      stuck=jnp.zeros((n_cols,), bool),
      fold_below=jnp.full((n_cols,), INT_MAX, I32),
      passes=jnp.int32(0),
      k=k,
  )
  if comm.axis_name is None:
    state = varying_like(state, rows)
  if method == "adaptive":
    total = max(
        1, min(_SAMPLE_ROWS, rows.shape[0] * comm.size() // _SAMPLE_FRACTION)
    )
    per_device = max(1, total // comm.size())
    sample, sample_valid = passes.sorted_sample(rows, mask, per_device, comm)

  def count_step(state):
    klo, khi = state["klo"], state["khi"]
    if method == "adaptive":
      keys, tied = _adaptive_proposals(
          state, k, sample, sample_valid, n_thresholds
      )
    else:
      keys, tied = _bisect_proposals(state), jnp.zeros_like(state["stalled"])
    keys = jnp.clip(keys, klo + 1, jnp.maximum(khi - 1, klo + 1))
    state = _narrow(state, k, keys, passes.count_pass(rows, keys, chunk, comm))
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
    current = _fold_current(state) & (khi <= KEY_POS_INF)
    lo = jnp.where(current, klo, jnp.min(keys, axis=0))
    hi = jnp.where(current, khi, jnp.maximum(jnp.max(keys, axis=0), lo + 1))
    fold, below = passes.fold_pass(rows, lo, hi, buckets, comm, loop=on_cpu)
    resolved, answer, inside, width, bmin, bmax = _resolve_from_fold(
        fold, lo, hi, below, k
    )
    # The bracket ends double as two counted thresholds.
    state = _narrow(
        state, k, jnp.stack([lo, hi]), jnp.stack([below, below + width])
    )
    known = state["known"]
    return dict(
        state,
        # Inside, the bracket shrinks to its exact extremes.
        klo=jnp.where(
            inside & ~known, jnp.maximum(state["klo"], bmin), state["klo"]
        ),
        khi=jnp.where(
            inside & ~known, jnp.minimum(state["khi"], bmax + 1), state["khi"]
        ),
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
    width = (state["chi"] - state["clo"]).astype(F32)
    eps = jnp.where(state["passes"] == 1, _FIRST_INTERP_EPS, _INTERP_EPS)
    # Width of the bracket this pass would propose (see _adaptive_proposals).
    proposed = 2.0 * eps * jnp.sqrt(width) + 2.0
    foldable = (_fold_current(state) & (state["khi"] <= KEY_POS_INF)) | (
        (state["passes"] > 0)
        & (proposed <= _FOLD_MAX_WIDTH)
        & (proposed < state["fold_below"].astype(F32))
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
# Entry point.


def kth_smallest_loop(
    x, axes, where, rows, mask, k, n, kept_shape, comm, *, method
):
  """The k-th smallest keys' floats ``(F,)`` of prepared float32 ``rows``.

  ``x``, ``axes``, ``where``: the caller's input (for the sort fallback);
  ``rows``, ``mask``, ``kept_shape``: ``common.to_rows`` of them; ``k``: flat
  int32 ranks; ``n``: pooled masked-in counts; ``method``: one of
  :data:`METHODS`. Positions with ``k`` outside ``[1, n]`` hold garbage.
  """
  n_rows, n_cols = rows.shape
  # XLA:CPU materialises compare/select temporaries of a reduction; blocks of
  # rows keep them in cache. GPU/TPU fuse the whole pass into one kernel.
  on_cpu = common.on_cpu()
  chunk = passes.chunk_rows(n_rows, n_cols, _CHUNK_ELEMENTS if on_cpu else None)
  buckets = passes.chunk_rows(n_rows, n_cols, _FOLD_ELEMENTS)
  answer, known = _select_loop(
      rows,
      mask,
      k,
      n,
      comm,
      method=method,
      chunk=chunk,
      buckets=buckets,
      on_cpu=on_cpu,
  )

  def fallback(_):
    ref = sort.kth_smallest_reference(
        x,
        k.reshape(kept_shape),
        axes,
        where=where,
        axis_name=comm.axis_name,
        axis_index_groups=comm.groups,
    ).reshape(-1)
    # pmax of identical values: types the all-gathered result device-invariant
    # under shard_map, like the other branch.
    return jnp.where(known, key_to_output(answer), comm.pmax(ref))

  return lax.cond(
      jnp.all(known), lambda _: key_to_output(answer), fallback, None
  )
