"""Exact k-th smallest by radix select in a Pallas kernel (experimental).

The ``radix`` backend's passes are XLA ops: a scatter-add histogram (atomics
into ``256 x F`` global counters, the costliest pass on a GPU) or a
compare-and-sum whose ``N x 16 x F`` temporary XLA must fuse. Here each pass
is one call of a ``pallas_call`` (Triton lowering on GPUs) in which every
program owns a block of feature columns, walks their rows in chunks and keeps
the block's histogram in registers: one read of the column per pass, no
atomics, no temporary in memory.

* Keys as in ``radix``: ``common.merged_keys`` (``-0.0`` merged into
  ``+0.0``), sign bit flipped so that their unsigned order is the key order;
  computed in the kernel from the float rows (no key array in memory).
* ``32 / digit_bits`` passes (default 8 of 4 bits: 16 bins, each counted by a
  compare per element, which a GPU does in registers). Pass ``p`` counts, per
  column, digit ``p`` of the masked-in elements whose higher digits equal the
  prefix chosen so far. The kernel does one pass per call; between calls JAX
  chooses the bins (``radix.first_descent``/``next_descent``), where the
  per-device histograms are ``psum``-ed over ``axis_name`` (exact: integer
  counts). As in ``radix``, the first pass is traced on its own and
  the passes after it as one ``lax.fori_loop`` body of static trip count (no
  data-dependent ``while``), calling one kernel whose digit's shift is a
  traced operand; with ``sums`` the last pass, which also sums, is a third
  kernel. A program holds 2 or 3 kernels per selection, not one per pass
  (each one compiled by Triton). After the last pass the prefix is the
  answer's key; the histograms give the tie and "above" counts as in
  ``radix``.
* With ``sums=True`` the last pass's reads also give ``sum(x)`` and, for each
  of the ``2**digit_bits`` candidates ``q_b`` the last digit can still choose,
  ``sum((x - q_b)`` over ``x`` not ``<= q_b``): the chosen bin's is the
  superquantile's excess, summed relative to the answer as ``radix.radix_sums``
  sums it, with no pass after the selection.

Masked-out elements (``where``) and the padding of the rows to whole chunks
are never counted. Comparisons are integer ones on keys (denormals distinct
from zero, as in ``radix`` and ``np.sort``); the excess uses float compares,
as ``radix.radix_sums`` does.

**Where it runs.** On a CUDA lowering (``common.per_platform``'s GPU branch)
the kernel is compiled by Pallas's Triton lowering; anywhere else (XLA:CPU,
TPUs) it runs in Pallas's *interpret mode*: the same kernel evaluated as
ordinary XLA ops, exact but much slower than every other method (for tests).
Under ``shard_map`` (device-varying rows) the interpreter fails JAX's
``check_vma`` typing, so there the same loop body runs as plain JAX on the
whole arrays. A lowering for the CPU and CUDA at once fails: JAX lowers every
``platform_dependent`` branch for every platform, and Pallas has no CPU
lowering of a compiled kernel.
It is experimental: selectable as ``method="pallas_experimental"`` and never
a default, since its speed on a GPU is not yet measured
(``benchmarks/device/device_check.sh`` measures it).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import inspect
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp
import numpy as np

from gbn_jax._selection import common
from gbn_jax._selection import radix
from gbn_jax._selection.common import Comm

Array = jax.Array

__all__ = [
    "PallasSelection",
    "kth_smallest_pallas",
    "kth_smallest_with_sums_pallas",
    "pallas_kth_smallest",
]

_I32 = jnp.int32
_F32 = jnp.float32
_SIGN = np.int32(np.iinfo(np.int32).min)
_FLIP = np.int32(0x7FFFFFFF)
#: Digit widths the kernel accepts (its one-hot histogram is 2**bits wide).
DIGIT_BITS = (2, 4, 8)


class PallasSelection(NamedTuple):
  """:class:`radix.RadixSelection`'s fields, plus the sums when asked for.

  ``total`` and ``excess`` (float32 ``[F]``, pooled over devices):
  ``sum(x)`` and ``sum(x - q)`` over the masked-in ``x`` not ``<= q``;
  ``None`` unless ``sums=True``.
  """

  keys: Array
  n: Array
  ties: Array
  above: Array
  local_n: Array
  local_ties: Array
  local_above: Array
  total: Array | None
  excess: Array | None


def use_interpret() -> bool:
  """Whether the platform being traced for runs the kernel in interpret mode.

  Only GPUs compile it (Triton); the CPU and TPUs (whose Pallas lowering,
  Mosaic, this kernel does not target) interpret it.
  """
  return common.lowering_platform() != common.GPU


def _flipped_keys(x: Array) -> Array:
  """``merged_keys(x) ^ INT_MIN`` from integer ops the Triton lowering has."""
  b = lax.bitcast_convert_type(x, _I32)
  key = b ^ ((b >> 31) & _FLIP)
  key = jnp.where(key == -1, _I32(0), key)  # -0.0 as +0.0
  return key ^ _SIGN


def _pass_kernel(*refs, masked: bool, **options):
  """One radix pass over a block of columns: histogram (and sums) in registers."""
  if masked:
    rows_ref, mask_ref, prefix_ref, shift_ref, *out_refs = refs
  else:
    rows_ref, prefix_ref, shift_ref, *out_refs = refs
    mask_ref = None
  rows = lambda start, size: rows_ref[pl.ds(start, size), :]
  mask = None
  if mask_ref is not None:
    mask = lambda start, size: mask_ref[pl.ds(start, size), :]
  result = _pass_body(rows, mask, prefix_ref[...], shift_ref[...], **options)
  for ref, value in zip(out_refs, result):
    ref[...] = value


def _pass_body(
    load_rows: Callable[[Array, int], Array],
    load_mask: Callable[[Array, int], Array] | None,
    prefix: Array,
    shift: Array,
    *,
    first: bool,
    digit_bits: int,
    n_rows: int,
    block_rows: int,
    n_chunks: int,
    sums: bool,
) -> tuple[Array, ...]:
  """The kernel's loop over row chunks, on whatever ``load_*`` read from.

  ``prefix``: ``[1, BF]``, the digits chosen so far; ``shift``: int32
  ``[1, 1]``, the lowest bit of this pass's digit (traced: one kernel serves
  the middle passes); ``first``: the first pass, which has no prefix to match.
  Returns the histogram ``[n_bins, BF]`` and, with ``sums``, ``sum(x)``
  ``[1, BF]`` and the excess over each bin's candidate answer
  ``[n_bins, BF]``.
  """
  n_bins = 1 << digit_bits
  block_cols = prefix.shape[1]
  bins = lax.broadcasted_iota(_I32, (1, n_bins, block_cols), 1)
  if sums:
    # The last pass's candidate answers, one per bin: flipped key -> float.
    cand = ((prefix[:, None, :] << digit_bits) | bins) ^ _SIGN
    cand = jnp.where(cand == -1, _I32(0), cand)
    q = lax.bitcast_convert_type(cand ^ ((cand >> 31) & _FLIP), _F32)

  def body(i, carry):
    start = pl.multiple_of(i * block_rows, block_rows)
    x = load_rows(start, block_rows)
    u = _flipped_keys(x)
    low = jnp.broadcast_to(shift, x.shape)
    row = start + lax.broadcasted_iota(_I32, x.shape, 0)
    valid = row < n_rows  # the padding to whole chunks is never counted
    if load_mask is not None:
      valid = valid & (load_mask(start, block_rows) != 0)
    match = valid
    # The first pass has no prefix yet; matching one would shift by 32,
    # which Triton (as LLVM) leaves undefined.
    if not first:
      match = match & (
          lax.shift_right_logical(u, low + _I32(digit_bits)) == prefix
      )
    digit = lax.shift_right_logical(u, low) & _I32(n_bins - 1)
    hit = (digit[:, None, :] == bins) & match[:, None, :]
    out = (carry[0] + jnp.sum(hit.astype(_I32), axis=0),)
    if sums:
      total = carry[1] + jnp.sum(jnp.where(valid, x, 0.0), axis=0)[None]
      xb = x[:, None, :]
      # As radix_sums: relative to q, over the elements not <= q (NaN too).
      above = valid[:, None, :] & ~(xb <= q)
      excess = carry[2] + jnp.sum(jnp.where(above, xb - q, 0.0), axis=0)
      out += (total, excess)
    return out

  init = (jnp.zeros((n_bins, block_cols), _I32),)
  if sums:
    init += (
        jnp.zeros((1, block_cols), _F32),
        jnp.zeros((n_bins, block_cols), _F32),
    )
  # Under shard_map (plain-JAX path) the carries vary per device as the rows.
  init = common.varying_like(init, prefix)
  return lax.fori_loop(0, n_chunks, body, init)


def _block_sizes(
    n_rows: int, n_cols: int, block_rows: int | None, block_cols: int | None
) -> tuple[int, int]:
  """Powers of two (Triton's loads need them), no larger than needed."""
  if block_rows is None:
    # Interpret mode pays per chunk: long chunks. Registers bound a GPU's.
    block_rows = 512 if use_interpret() else 32
  if block_cols is None:
    block_cols = 16
  for name, b in (("block_rows", block_rows), ("block_cols", block_cols)):
    if b < 1 or b & (b - 1):
      raise ValueError(f"{name} must be a power of two, got {b}.")
  return (
      min(block_rows, pl.next_power_of_2(n_rows)),
      min(block_cols, pl.next_power_of_2(n_cols)),
  )


def _pad_to(a: Array, rows: int, cols: int, value: Any) -> Array:
  pad = ((0, rows - a.shape[0]), (0, cols - a.shape[1]))
  if not any(p for _, p in pad):
    return a
  return jnp.pad(a, pad, constant_values=value)


def _out_struct(shape: tuple[int, ...], dtype: Any, like: Array) -> Any:
  """An output type, device-varying under ``shard_map`` where ``like`` is.

  ``check_vma`` needs the type of a ``pallas_call``'s outputs spelled out;
  JAX releases name it ``manual_axis_type`` (the aval's ``mat``) or ``vma``.
  """
  params = inspect.signature(jax.ShapeDtypeStruct).parameters
  aval = jax.typeof(like)
  if "manual_axis_type" in params and getattr(aval, "mat", None) is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
  if "vma" in params:
    return jax.ShapeDtypeStruct(
        shape, dtype, vma=frozenset(common.varying_axes(like))
    )
  return jax.ShapeDtypeStruct(shape, dtype)


def _run_pass(
    rows, mask, prefix, shift, *, first, digit_bits, blocks, sums, interpret
):
  """One ``pallas_call``: per-column histogram ``[n_bins, F]`` (and sums).

  ``shift`` (int32 scalar, may be traced): the lowest bit of the pass's digit,
  an operand of the kernel, so that every pass but the first and a last one
  with ``sums`` calls the same kernel.
  """
  n_rows, n_cols = rows.shape
  block_rows, block_cols = blocks
  padded_rows = pl.cdiv(n_rows, block_rows) * block_rows
  padded_cols = pl.cdiv(n_cols, block_cols) * block_cols
  n_bins = 1 << digit_bits
  operands = [_pad_to(rows, padded_rows, padded_cols, 0.0)]
  column_block = pl.BlockSpec((padded_rows, block_cols), lambda j: (0, j))
  in_specs = [column_block]
  if mask is not None:
    operands.append(_pad_to(mask.astype(jnp.int8), padded_rows, padded_cols, 0))
    in_specs.append(column_block)
  operands.append(_pad_to(prefix[None], 1, padded_cols, 0))
  in_specs.append(pl.BlockSpec((1, block_cols), lambda j: (0, j)))
  operands.append(jnp.reshape(shift, (1, 1)).astype(_I32))
  in_specs.append(pl.BlockSpec((1, 1), lambda j: (0, 0)))
  out_shape = [_out_struct((n_bins, padded_cols), _I32, operands[0])]
  out_specs = [pl.BlockSpec((n_bins, block_cols), lambda j: (0, j))]
  if sums:
    out_shape += [
        _out_struct((1, padded_cols), _F32, operands[0]),
        _out_struct((n_bins, padded_cols), _F32, operands[0]),
    ]
    out_specs += [
        pl.BlockSpec((1, block_cols), lambda j: (0, j)),
        pl.BlockSpec((n_bins, block_cols), lambda j: (0, j)),
    ]
  options = dict(
      first=first,
      digit_bits=digit_bits,
      n_rows=n_rows,
      block_rows=block_rows,
      n_chunks=padded_rows // block_rows,
      sums=sums,
  )
  kernel = functools.partial(_pass_kernel, masked=mask is not None, **options)
  call = functools.partial(
      pl.pallas_call,
      kernel,
      grid=(padded_cols // block_cols,),
      in_specs=in_specs,
      out_specs=out_specs,
      interpret=interpret,
      # Triton explicitly: jax's GPU default may be the Mosaic GPU lowering,
      # which this kernel (register histograms, no async copies) is not for.
      compiler_params=(
          None if interpret else pltriton.CompilerParams(num_warps=4)
      ),
      name="gbn_radix_" + ("first" if first else "last" if sums else "pass"),
  )
  if interpret and common.varying_axes(operands[0]):
    # Pallas's interpreter types the kernel's buffers device-invariant and
    # fails on shard_map's device-varying rows (check_vma): the same loop on
    # the whole arrays instead, in plain JAX.
    load = lambda a: lambda start, size: lax.dynamic_slice_in_dim(
        a, start, size
    )
    mask_load = load(operands[1]) if mask is not None else None
    prefix = common.varying_like(operands[-2], operands[0])
    out = _pass_body(
        load(operands[0]), mask_load, prefix, operands[-1], **options
    )
  else:
    out = call(out_shape=out_shape)(*operands)
  return [o[:, :n_cols] for o in out]


def pallas_kth_smallest(
    rows: Array,
    mask: Array | None,
    k: Array | Callable[[Array], Array],
    comm: Comm,
    *,
    digit_bits: int = 4,
    block_rows: int | None = None,
    block_cols: int | None = None,
    interpret: bool | None = None,
    sums: bool = False,
) -> PallasSelection:
  """Exact k-th smallest key per column of ``rows``: radix passes, 2-3 kernels.

  The first pass is one kernel; the passes after it are one ``lax.fori_loop``
  body of static trip count calling a second kernel whose digit's shift is a
  traced operand; with ``sums`` the last pass, which also sums, is a third
  kernel. A program thus holds 2 kernels (3 with ``sums``) whatever
  ``digit_bits``, not one per pass.

  Args:
    rows: float32 ``[N, F]`` (``common.to_rows``); ``mask`` decides which
      entries count, whatever they hold.
    mask: bool ``[N, F]`` or ``None`` (all masked in).
    k: int32 ``[F]`` 1-based ranks over the masked-in elements of all devices,
      or a function of the pooled count ``n`` returning them (as in
      ``radix.radix_kth_smallest``). Out of ``[1, n]`` the key is meaningless.
    comm: histograms (and sums) are ``psum``-ed along its axis.
    digit_bits: bits per pass, one of :data:`DIGIT_BITS` (4: 8 passes of 16
      bins).
    block_rows: rows per chunk a program reads at a time, a power of two
      (default: 32 compiled, 512 interpreted; capped at the row count).
    block_cols: columns per program, a power of two (default 16).
    interpret: run the kernel in Pallas's interpret mode; default: everywhere
      but on a GPU (:func:`use_interpret`).
    sums: also return the superquantile's sums from the last pass.

  Returns:
    :class:`PallasSelection`.

  Raises:
    ValueError: a bad ``digit_bits``, ``block_rows`` or ``block_cols``.
  """
  if digit_bits not in DIGIT_BITS:
    raise ValueError(
        f"digit_bits must be one of {DIGIT_BITS}, got {digit_bits}."
    )
  if interpret is None:
    interpret = use_interpret()
  blocks = _block_sizes(*rows.shape, block_rows, block_cols)
  n_passes = 32 // digit_bits
  rows = rows.astype(_F32)
  run = functools.partial(
      _run_pass,
      rows,
      mask,
      digit_bits=digit_bits,
      blocks=blocks,
      interpret=interpret,
  )
  zero = jnp.zeros(rows.shape[1:], _I32)
  out = run(zero, _I32(32 - digit_bits), first=True, sums=False)
  state = radix.first_descent(out[0], k, comm)

  def next_pass(p: Array, state: radix.Descent) -> radix.Descent:
    # Pass p reads digit p, the bits from 32 - (p + 1) * digit_bits up.
    shift = _I32(32) - (p + 1) * _I32(digit_bits)
    out = run(state.prefix, shift, first=False, sums=False)
    return radix.next_descent(state, out[0], comm)

  # One traced body for the middle passes: a static trip count, as radix's.
  state = lax.fori_loop(1, n_passes - 1 if sums else n_passes, next_pass, state)
  total = excess = None
  if sums:
    out = run(state.prefix, _I32(0), first=False, sums=True)
    state = radix.next_descent(state, out[0], comm)
    chosen = state.prefix & _I32((1 << digit_bits) - 1)  # the last digit
    total, excess = comm.psum((out[1][0], common.take_rows(out[2], chosen)))
  return PallasSelection(*state.selection(), total=total, excess=excess)


def _per_platform_select(interpret, **options):
  """A rows selection for ``radix.drop_in_selection``, interpreted or not per platform.

  GPUs and TPUs may share a trace (``common.ACCELERATOR``); the kernel is
  compiled on one and interpreted on the other, so split them again.
  """

  def select_rows(rows, mask, k, comm):
    traced = lambda: pallas_kth_smallest(
        rows, mask, k, comm, interpret=interpret, **options
    )
    return common.per_platform(traced, denormals=True)

  return select_rows


# Alike gbn_jax/_selection/dispatch.py::kth_smallest: the methods' one contract.
def kth_smallest_pallas(
    x: Array,
    k: int | Array,
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    return_ties: bool = False,
    digit_bits: int = 4,
    block_rows: int | None = None,
    block_cols: int | None = None,
    interpret: bool | None = None,
) -> Array | tuple[Array, Array | None]:
  """``dispatch.kth_smallest`` by the Pallas radix kernel (experimental).

  Selected by ``method="pallas_experimental"``.

  The contract of ``radix.kth_smallest_accelerator``: the k-th smallest
  (1-based) over ``axis`` of the masked-in elements of all devices along
  ``axis_name``, float32, an element of ``x`` bit for bit (``-0.0`` as
  ``+0.0``), NaN where ``k`` is not in ``[1, n]``; half precision upcast,
  float64 to the sort reference. ``return_ties``: also this device's key tie
  counts, float32 (``None`` for float64). The kernel options are
  :func:`pallas_kth_smallest`'s.
  """
  return radix.drop_in_selection(
      _per_platform_select(
          interpret,
          digit_bits=digit_bits,
          block_rows=block_rows,
          block_cols=block_cols,
      ),
      x,
      k,
      axis,
      where=where,
      axis_name=axis_name,
      axis_index_groups=axis_index_groups,
      return_ties=return_ties,
  )


# Alike gbn_jax/_selection/pallas.py::kth_smallest_pallas: each entry point
# spells out its own keyword contract.
def kth_smallest_with_sums_pallas(
    x: Array,
    k: int | Array | Callable[[Array], Array],
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: Any = None,
    return_count: bool = False,
    digit_bits: int = 4,
    block_rows: int | None = None,
    block_cols: int | None = None,
    interpret: bool | None = None,
) -> tuple[Array, ...]:
  """``radix.kth_smallest_with_sums_accelerator``'s outputs, sums from the last pass.

  Returns, each of the non-reduced shape: the value (NaN where ``k`` is out of
  range), the pooled tie count, the mean, the mean of ``(x - value)^+``, the
  pooled ``#{not x <= value}`` (int32 key counts) and, if ``return_count``,
  the pooled masked-in count. ``k`` may be a function of that count.
  """
  prepared = radix.selection_rows(
      *radix.prepare_input(x, axis, where, axis_name, axis_index_groups), k
  )
  select = _per_platform_select(
      interpret,
      digit_bits=digit_bits,
      block_rows=block_rows,
      block_cols=block_cols,
      sums=True,
  )
  sel = select(prepared.rows, prepared.mask, prepared.ranks, prepared.comm)
  count = sel.n.astype(_F32)
  return radix.sums_outputs(
      prepared, sel, sel.total / count, sel.excess / count, return_count
  )
