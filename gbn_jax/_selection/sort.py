"""The sort-based k-th smallest (method ``"sort"``): the oracle of the others.

Sorts int keys, not floats: XLA:CPU's float compare flushes denormals, and a
float sort there calls a comparator per comparison. Every other backend falls
back to it for dtypes other than float32 (float64 keeps int64 keys).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax._selection import common
from gbn_jax._selection.common import AxisIndexGroups

Array = jax.Array


# Alike gbn_jax/_selection/dispatch.py::kth_smallest: the methods' one contract.
def kth_smallest_reference(
    x: Array,
    k: int | Array,
    axis: tuple[int, ...],
    *,
    where: Array | None = None,
    axis_name: str | None = None,
    axis_index_groups: AxisIndexGroups = None,
) -> Array:
  """Sort-based k-th smallest: the oracle of ``dispatch.kth_smallest``.

  Same contract as ``dispatch.kth_smallest``; masked-out elements are sorted
  last as ``+inf`` and with ``axis_name`` every device's rows are
  all-gathered.

  >>> import jax.numpy as jnp
  >>> kth_smallest_reference(jnp.array([[3., 1.], [-0., 2.], [1., 5.]]), 2, (0,))
  Array([1., 2.], dtype=float32)
  """
  x = common.check_input(x)
  axes = common.check_sorted_axes(x.ndim, axis)
  rows, _, kept_shape = common.to_rows(x, axes, where)
  comm = common.Comm(axis_name, axis_index_groups)
  common.check_element_count(rows.shape[0] * comm.size())
  rows = comm.gather_rows(common.float_to_key(lax.stop_gradient(rows)))
  k = common.prepare_k(k, kept_shape)
  index = jnp.clip(k - 1, 0, rows.shape[0] - 1)
  rows = common.replicate_explicit(rows)
  if common.on_cpu():
    answer = common.take_rows(jnp.sort(rows, axis=0), index)
  else:
    # Along the minor axis, where XLA:GPU sorts with a radix sort (CUB).
    ordered = jnp.sort(rows.T, axis=1)
    answer = jnp.take_along_axis(ordered, index[:, None], axis=1)[:, 0]
  return common.key_to_output(answer).reshape(kept_shape)
