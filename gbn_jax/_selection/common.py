"""What every selection backend shares: keys, row layout, devices, validation.

Keys: everything orders the order-preserving int32 image of the floats (the
"key"): XLA:CPU flushes denormals to zero in float compares, min/max and
sorts, so only integer operations order all floats exactly. Non-negative
floats keep their bits, negative ones get their magnitude bits flipped;
``-0.0`` gets key ``-1``, just below ``+0.0``, and results come back as
``+0.0``.

Rows: a selection over ``axes`` works on ``(N, F)`` rows, the reduced axes
first and flattened, masked-out elements replaced by ``+inf``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
AxisIndexGroups = Any

I32 = jnp.int32
F32 = jnp.float32
_FLIP = 0x7FFFFFFF
_FLIP64 = 0x7FFFFFFFFFFFFFFF
KEY_NEG_INF = int(np.float32(-np.inf).view(np.int32)) ^ _FLIP
KEY_POS_INF = int(np.float32(np.inf).view(np.int32))
#: Exclusive upper bound of the keys of all non-NaN floats.
KEY_BEYOND = KEY_POS_INF + 1
INT_MAX = np.iinfo(np.int32).max
INT_MIN = np.iinfo(np.int32).min
#: Most elements one selection may reduce over (per position, over all
#: devices): ranks, counts and keys are int32.
MAX_ELEMENTS = INT_MAX


# --------------------------------------------------------------------------
# Keys.


def float_to_key(v: Array) -> Array:
  """Order-preserving integer key of ``v`` (int64 for float64, else int32).

  Integer ops only, so denormals keep their order on XLA:CPU. float64 (only
  under ``jax_enable_x64``, only on the sort path) keeps its precision in
  int64 keys; every other float is exact in float32.

  >>> import jax.numpy as jnp
  >>> [int(k) for k in float_to_key(jnp.array([-1.0, -0.0, 0.0, 1.0]))]
  [-1065353217, -1, 0, 1065353216]
  """
  if v.dtype == jnp.float64:
    b = lax.bitcast_convert_type(v, jnp.int64)
    return b ^ ((b >> 63) & jnp.int64(_FLIP64))
  b = lax.bitcast_convert_type(v.astype(F32), I32)
  return b ^ ((b >> 31) & I32(_FLIP))


def key_to_float(key: Array) -> Array:
  """Inverse of :func:`float_to_key`."""
  if key.dtype == jnp.int64:
    return lax.bitcast_convert_type(
        key ^ ((key >> 63) & jnp.int64(_FLIP64)), jnp.float64
    )
  return lax.bitcast_convert_type(key ^ ((key >> 31) & I32(_FLIP)), F32)


def key_to_output(key: Array) -> Array:
  """The float of ``key``, ``-0.0`` returned as ``+0.0`` (the selection's contract)."""
  return key_to_float(jnp.where(key == -1, 0, key))


def merged_keys(rows: Array) -> Array:
  """Keys with ``-0.0`` (key ``-1``) merged into ``+0.0`` (key ``0``).

  Adjacent keys: the k-th smallest only changes from ``-0.0`` to ``+0.0``,
  which the contract returns anyway, and ties count both zeros, as
  ``x == 0.0`` does.
  """
  key = float_to_key(rows)
  return jnp.where(key == -1, I32(0), key)


def key_midpoint(lo: Array, hi: Array) -> Array:
  """``floor((lo + hi) / 2)`` without int32 overflow."""
  return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


# --------------------------------------------------------------------------
# Validation and layout.


def check_sorted_axes(ndim: int, axis: Sequence[int]) -> tuple[int, ...]:
  """``axis`` as a tuple, which must already be sorted, unique, in range and non-empty.

  The strict contract of the selection entry points; users' axes (``None``,
  negative, unsorted) go through :func:`reduction_axes` first.
  """
  axes = tuple(int(a) for a in axis)
  if not axes:
    raise ValueError("kth_smallest needs at least one axis to reduce over.")
  if any(not 0 <= a < ndim for a in axes) or list(axes) != sorted(set(axes)):
    raise ValueError(
        f"axis must be sorted, unique and in [0, {ndim}), got {tuple(axis)}."
    )
  return axes


def reduction_axes(
    ndim: int, axis: int | Sequence[int] | None
) -> tuple[int, ...]:
  """A user's reduction axes as sorted, deduplicated, non-negative ones.

  ``None`` means every axis. Raises ``ValueError`` for out-of-range or empty
  axes, since reducing over nothing has no batch statistic.

  >>> reduction_axes(4, -1), reduction_axes(3, None), reduction_axes(3, (2, 0, -1))
  ((3,), (0, 1, 2), (0, 2))
  """
  if axis is None:
    axes = tuple(range(ndim))
  elif isinstance(axis, int):
    axes = (axis,)
  else:
    axes = tuple(int(a) for a in axis)
  for a in axes:
    if not -ndim <= a < ndim:
      raise ValueError(f"axis {a} is out of range for an array of rank {ndim}.")
  axes = tuple(sorted({a % ndim for a in axes})) if ndim else ()
  if not axes:
    raise ValueError("at least one axis to reduce over is required.")
  return axes


def check_input(x: Any) -> Array:
  """``x`` as an array; ``TypeError`` unless it is floating point."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f"kth_smallest needs a floating-point array, got {x.dtype}."
    )
  return x


def is_symbolic(n: Any) -> bool:
  """Whether the size ``n`` is symbolic (``jax.export.symbolic_shape``), not an int."""
  return jax.export.is_symbolic_dim(n)


def surely(predicate: Callable[[], Any]) -> bool:
  """Whether ``predicate()``, a comparison of shapes, holds for every size.

  With concrete shapes it is the comparison itself. A symbolic dimension
  (``jax.export.symbolic_shape``) decides it only where its constraints do;
  elsewhere it is ``False``: the caller takes the path that is valid for
  any size.

  >>> surely(lambda: 3 < 4), surely(lambda: 5 < 4)
  (True, False)
  """
  try:
    return bool(predicate())
  except jax.errors.InconclusiveDimensionOperation:
    return False


def check_element_count(n: Any) -> None:
  """Raises ``ValueError`` unless ``n`` elements fit one selection (int32 ranks).

  A symbolic ``n`` that its constraints do not bound is not checked: the
  caller promises a size that fits (see ``docs/export.md``).
  """
  if surely(lambda: n > MAX_ELEMENTS):
    raise ValueError(
        f"kth_smallest reduces over at most 2**31 - 1 = {MAX_ELEMENTS} elements per"
        f" position (ranks and counts are int32), got {n}; reduce over fewer axes or"
        " split the batch."
    )


def prepare_k(k: Any, kept_shape: tuple[int, ...]) -> Array:
  """Ranks ``k`` as flat int32 ``(F,)``; ``TypeError`` unless integer."""
  k = jnp.asarray(k)
  if not jnp.issubdtype(k.dtype, jnp.integer):
    raise TypeError(f"k must be an integer or integer array, got {k.dtype}.")
  return jnp.broadcast_to(k.astype(I32), kept_shape).reshape(-1)


def to_rows(x: Array, axes: tuple[int, ...], where: Array | None):
  """Returns ``(rows, mask_rows, kept_shape)``: reduced axes first, flattened.

  ``rows`` has shape ``(N, F)``; masked-out elements are replaced by ``+inf``,
  which the counting passes treat as "not counted".
  """
  kept = [d for d in range(x.ndim) if d not in axes]
  perm = list(axes) + kept
  kept_shape = tuple(x.shape[d] for d in kept)
  n_rows = math.prod(x.shape[d] for d in axes)
  n_cols = math.prod(kept_shape)
  rows = jnp.transpose(x, perm).reshape(n_rows, n_cols)
  mask = None
  if where is not None:
    mask = jnp.transpose(jnp.broadcast_to(where, x.shape), perm).reshape(
        n_rows, n_cols
    )
    rows = jnp.where(mask, rows, jnp.inf)
  return rows, mask, kept_shape


def take_rows(a: Array, idx: Array) -> Array:
  """``a[idx[f], f]`` for every column ``f``."""
  return jnp.take_along_axis(a, idx[None, :], axis=0)[0]


def replicate_explicit(a: Array) -> Array:
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
  replicated = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec()
  )
  return jax.sharding.reshard(a, replicated)


# --------------------------------------------------------------------------
# Backend facts, per lowering.
#
# A jitted function is traced once and may be lowered for several platforms
# (``jax.export``, a CPU computation in a GPU process), so the platform is not
# the process's ``jax.default_backend()``. :func:`per_platform` traces its
# function once per kind of platform, each under that kind (a trace context,
# so JAX's caches tell the traces apart), and ``lax.platform_dependent``
# lowers the one of the platform being lowered.

CPU = "cpu"
#: XLA:GPU (CUDA, ROCm): keeps denormals in float compares.
GPU = "gpu"
#: TPUs and any other platform: flush denormals like XLA:CPU.
TPU = "tpu"
#: A GPU or a TPU, traced once for both where denormals make no difference.
ACCELERATOR = "accelerator"

_PLATFORM = jax.make_user_context(default_value=None)


def lowering_platform() -> str:
  """The kind of platform being traced for: ``CPU``, ``GPU``, ``TPU`` or ``ACCELERATOR``.

  Inside :func:`per_platform` the kind its branch is traced for; elsewhere
  (a backend called directly) the default backend's.
  """
  kind = _PLATFORM.value
  if kind is not None:
    return kind
  backend = jax.default_backend()
  return {"cpu": CPU, "gpu": GPU, "cuda": GPU, "rocm": GPU}.get(backend, TPU)


def platform_scope(kind: str):
  """A context manager tracing everything in it for platforms of ``kind`` only."""
  if kind not in (CPU, GPU, TPU, ACCELERATOR):
    raise ValueError(
        f"kind must be one of {(CPU, GPU, TPU, ACCELERATOR)}, got {kind!r}."
    )
  return _PLATFORM(kind)


def on_cpu() -> bool:
  """Whether the code being traced is for XLA:CPU (see :func:`per_platform`)."""
  return lowering_platform() == CPU


def compares_keep_denormals() -> bool:
  """Whether float compares order denormals (so key counts equal float counts).

  XLA:CPU sets denormals-are-zero (see the native kernel's tie counts);
  XLA:GPU keeps them unless ``--xla_gpu_ftz``; TPUs flush them. Only
  meaningful under a :func:`per_platform` that tells GPUs from TPUs.
  """
  kind = lowering_platform()
  if kind == ACCELERATOR:
    raise RuntimeError(
        "compares_keep_denormals() read in code traced for GPUs and TPUs at"
        " once: trace it with per_platform(..., denormals=True)."
    )
  return kind == GPU


def per_platform(fn: Any, *operands: Any, denormals: bool = True) -> Any:
  """``fn(*operands)``, traced per kind of platform and lowered per platform.

  ``fn`` reads :func:`on_cpu` and :func:`compares_keep_denormals` (and
  everything built on them) while tracing; each trace must return the same
  structure, shapes and dtypes. A single-platform lowering keeps only its
  platform's trace (the CPU's speed is the CPU trace's); a multi-platform
  one (``jax.export(..., platforms=[...])``) keeps one per platform, chosen
  when compiled. ``denormals=False``: ``fn`` does not read
  :func:`compares_keep_denormals`, and GPUs and TPUs share one trace.
  Within a branch already traced for one kind, ``fn`` is simply called.
  """
  current = _PLATFORM.value
  if current in (CPU, GPU, TPU) or (current == ACCELERATOR and not denormals):
    return fn(*operands)

  def branch(kind):
    def traced(*args):
      with _PLATFORM(kind):
        return fn(*args)

    return traced

  if denormals:
    gpu = branch(GPU)
    accelerators = dict(cuda=gpu, rocm=gpu, default=branch(TPU))
  else:
    accelerators = dict(default=branch(ACCELERATOR))
  if current == ACCELERATOR:  # the CPU is not among this branch's platforms
    return lax.platform_dependent(*operands, **accelerators)
  return lax.platform_dependent(*operands, cpu=branch(CPU), **accelerators)


# --------------------------------------------------------------------------
# Devices (no-ops without an axis name).


def axis_size(axis_name: str | None, groups: AxisIndexGroups) -> int:
  """Devices pooled along ``axis_name`` (within a group), static; 1 without it."""
  if axis_name is None:
    return 1
  if groups is not None:
    return len(groups[0])
  return int(lax.psum(1, axis_name))


def global_sum(
    value: Any, axis_name: str | None, groups: AxisIndexGroups
) -> Any:
  """``psum`` of a pytree over ``axis_name``; ``value`` itself without one."""
  if axis_name is None:
    return value
  return lax.psum(value, axis_name, axis_index_groups=groups)


class Comm:
  """The named axis over which rows are pooled, or none."""

  def __init__(self, axis_name: str | None, groups: AxisIndexGroups):
    self.axis_name = axis_name
    self.groups = groups

  def _reduce(self, collective, v):
    if self.axis_name is None:
      return v
    return collective(v, self.axis_name, axis_index_groups=self.groups)

  def psum(self, v):
    return global_sum(v, self.axis_name, self.groups)

  def pmin(self, v):
    return self._reduce(lax.pmin, v)

  def pmax(self, v):
    return self._reduce(lax.pmax, v)

  def size(self) -> int:
    return axis_size(self.axis_name, self.groups)

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
    slots = jnp.full((size,) + keys.shape, INT_MIN, keys.dtype)
    slots = lax.dynamic_update_index_in_dim(slots, keys, index, axis=0)
    stacked = lax.pmax(slots, self.axis_name, axis_index_groups=self.groups)
    return stacked.reshape((size * keys.shape[0],) + keys.shape[1:])


def varying_axes(a: Any) -> tuple[Any, ...]:
  """Manual mesh axes along which ``a`` differs per device (shard_map typing).

  Empty outside ``shard_map``. Older jax releases name the set ``aval.vma``,
  newer ones keep it on the manual axis type (``aval.mat.varying``).
  """
  aval = jax.typeof(a)
  names = getattr(aval, "vma", None)
  if names is None:
    names = getattr(getattr(aval, "mat", None), "varying", None)
  return tuple(sorted(names or (), key=str))


def varying_like(tree: Any, data: Array) -> Any:
  """Types constant arrays of ``tree`` as device-varying where ``data`` is.

  Inside ``shard_map`` with no ``axis_name`` here (e.g. a user measure on an
  all-gathered batch), everything a loop computes from ``data`` varies per
  device, so carries built from constants must too, or ``while_loop`` rejects
  the mismatch.
  """
  names = varying_axes(data)
  if not names:
    return tree

  def cast(a):
    missing = tuple(n for n in names if n not in varying_axes(a))
    return lax.pcast(a, missing, to="varying") if missing else a

  return jax.tree.map(cast, tree)
