"""The passes over the data of the pure-JAX selection loop (:mod:`.loop`).

Each pass reads every element once and pools its few results over devices
(``Comm``): a *counting pass* gives ``#{key < t}`` per threshold key, a
*fold pass* folds the keys inside a bracket ``[lo, hi)`` into buckets (row
index modulo a chunk length) keeping min, max and count per bucket, and the
strided *sample* (sorted int keys) places the loop's first thresholds.
Which thresholds and brackets to test, and when to stop, is :mod:`.loop`'s.

On XLA:CPU a pass runs over blocks of rows that keep its temporaries in
cache; on a GPU/TPU it is one fused reduction (one kernel).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection.common import F32
from gbn_jax._selection.common import I32
from gbn_jax._selection.common import INT_MAX
from gbn_jax._selection.common import INT_MIN
from gbn_jax._selection.common import Comm
from gbn_jax._selection.common import float_to_key
from gbn_jax._selection.common import is_symbolic
from gbn_jax._selection.common import key_to_float
from gbn_jax._selection.common import replicate_explicit
from gbn_jax._selection.common import surely

Array = jax.Array


# --------------------------------------------------------------------------
# Counting and folding.


def chunk_rows(n_rows: int, n_cols: int, elements: int | None) -> int:
  """Rows per block holding about ``elements`` elements (all rows: None).

  All rows too for a symbolic ``n_rows`` (``jax.export``), which a static
  block length need not divide, nor fit in.
  """
  if elements is None or is_symbolic(n_rows):
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
        lambda i, a: combine(
            a, fn(lax.dynamic_slice_in_dim(rows, i * chunk, chunk))
        ),
        acc,
    )
  if tail:
    acc = combine(acc, fn(lax.slice_in_dim(rows, n_full * chunk, n)))
  return acc


def count_pass(rows: Array, thresholds: Array, chunk: int, comm: Comm) -> Array:
  """``#{key(x) < t}`` per threshold key, ``(T, F)`` int32, pooled over devices.

  Masked-out elements are ``+inf`` and no threshold exceeds its key, so they
  are never counted. Float compares are ~2x cheaper than int ones on XLA:CPU
  and exact against a normal (or infinite) threshold even where denormals are
  flushed to zero; thresholds among the denormals and zeros compare keys.
  """
  floats = key_to_float(thresholds)
  safe = jnp.all(jnp.abs(floats) >= np.finfo(np.float32).tiny)

  def count(compare):
    def block(b):
      hit = compare(b[:, None, :])
      if surely(lambda: b.shape[0] < (1 << 24)):
        # A float sum of 0/1 is exact below 2**24 and is the fast path on CPU.
        return jnp.sum(jnp.where(hit, 1.0, 0.0), axis=0, dtype=F32).astype(I32)
      return jnp.sum(hit, axis=0, dtype=I32)

    return _reduce_chunks(rows, chunk, block, jnp.add)

  local = lax.cond(
      safe,
      lambda: count(lambda b: b < floats[None]),
      lambda: count(lambda b: float_to_key(b) < thresholds[None]),
  )
  return comm.psum(local)


def fold_pass(
    rows: Array,
    lo: Array,
    hi: Array,
    buckets: int,
    comm: Comm,
    loop: bool = True,
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
    b = float_to_key(b)
    inside = (b >= lo) & (b < hi)
    mn, mx, cnt, below = acc
    return (
        jnp.minimum(mn, jnp.where(inside, b, INT_MAX)),
        jnp.maximum(mx, jnp.where(inside, b, INT_MIN)),
        cnt + jnp.where(inside, 1.0, 0.0),
        below + jnp.sum(jnp.where(b < lo, 1.0, 0.0), axis=0).astype(I32),
    )

  shape = (buckets, rows.shape[1])
  acc = (
      jnp.full(shape, INT_MAX, I32),
      jnp.full(shape, INT_MIN, I32),
      jnp.zeros(shape, F32),
      jnp.zeros(shape[1:], I32),
  )
  if not loop and n_full > 1:
    keys = float_to_key(lax.slice_in_dim(rows, 0, n_full * buckets))
    keys = keys.reshape(n_full, buckets, rows.shape[1])
    inside = (keys >= lo) & (keys < hi)
    mn, mx, cnt, below = lax.reduce(
        (
            jnp.where(inside, keys, INT_MAX),
            jnp.where(inside, keys, INT_MIN),
            jnp.where(inside, 1, 0),
            jnp.where(keys < lo, 1, 0),
        ),
        (I32(INT_MAX), I32(INT_MIN), I32(0), I32(0)),
        lambda a, b: (
            jnp.minimum(a[0], b[0]),
            jnp.maximum(a[1], b[1]),
            a[2] + b[2],
            a[3] + b[3],
        ),
        (0,),
    )
    acc = (mn, mx, cnt.astype(F32), jnp.sum(below, axis=0))
  else:
    # The first block seeds the accumulators (under shard_map it makes them
    # device-varying, as the loop body's outputs are).
    acc = update(acc, lax.slice_in_dim(rows, 0, buckets))
    acc = lax.fori_loop(
        1,
        n_full,
        lambda i, a: update(
            a, lax.dynamic_slice_in_dim(rows, i * buckets, buckets)
        ),
        acc,
    )
  if tail:
    head = update(
        tuple(a[:tail] for a in acc[:3]) + (acc[3],),
        lax.slice_in_dim(rows, n_full * buckets, n),
    )
    acc = tuple(a.at[:tail].set(h) for a, h in zip(acc[:3], head[:3])) + (
        head[3],
    )
  mn, mx, cnt, below = acc
  return (comm.pmin(mn), comm.pmax(mx), comm.psum(cnt)), comm.psum(below)


# --------------------------------------------------------------------------
# Sample.


def sorted_sample(rows: Array, mask: Array | None, per_device: int, comm: Comm):
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
    valid = jnp.full(rows.shape[1:], count, I32)
  else:
    smask = lax.slice_in_dim(mask, 0, stride * (count - 1) + 1, stride)
    valid = jnp.sum(smask, axis=0, dtype=I32)
  sample = replicate_explicit(comm.gather_keys(float_to_key(sample)))
  return lax.sort(sample, dimension=0), comm.psum(valid)
