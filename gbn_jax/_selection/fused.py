"""A superquantile's sums from the selection's own sweep, with their derivatives.

``qbar_alpha = q_alpha + E[(x - q_alpha)^+] / (1 - alpha)`` needs the quantile
and two means. Where a backend offers the means next to the selection
(``dispatch.fused_sums_backend``: the native kernel in its one sweep, the radix
select with one more pass, its Pallas kernel in its last pass), :func:`superquantile_parts` takes them from there;
the custom JVPs differentiate them as the separate computation would be: the
quantile's tangent split among its ties, the excess's over the elements not
``<= q``.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import native
from gbn_jax._selection import pallas
from gbn_jax._selection import radix
from gbn_jax._selection.reductions import count_true
from gbn_jax._selection.reductions import element_count
from gbn_jax._selection.reductions import expand
from gbn_jax._selection.reductions import quantile_rank
from gbn_jax._selection.reductions import zero_tangent

Array = jax.Array


#: Re-exported: the native kernel's counts, or counted where it does not know.
known_or_counted = native.known_or_counted


def _native_sums(alpha, axes, x):
  n = math.prod(x.shape[a] for a in axes)
  return native.kth_smallest_with_sums(x, quantile_rank(alpha, n), axes)


def _native_parts(alpha, axes, x) -> tuple[Array, Array, Array]:
  """``(q_alpha, E[x], E[(x - q_alpha)^+])`` of unmasked float32 ``x``, one sweep."""
  q, _, mean, mean_excess, _ = _native_all(alpha, axes, x)
  return q, mean, mean_excess


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _native_all(alpha, axes, x) -> tuple[Array, ...]:
  """The kernel's ``(q, ties, mean, mean_excess, above)``, differentiable."""
  return _native_sums(alpha, axes, x)


@_native_all.defjvp
def _native_all_jvp(alpha, axes, primals, tangents):
  (x,), (x_dot,) = primals, tangents
  # Through _native_all itself: differentiated again (forward over reverse)
  # its outputs have this rule's tangents; the kernel's would have none.
  out = _native_all(alpha, axes, x)
  q, known_ties, mean, mean_excess, known_above = out
  n = math.prod(x.shape[a] for a in axes)
  selected = lambda: x == expand(q, axes)
  above = lambda: ~(
      x <= expand(q, axes)
  )  # as in the unfused path: NaN is above
  ties = known_or_counted(known_ties, selected, axes)
  n_above = known_or_counted(known_above, above, axes)
  q_dot = jnp.sum(jnp.where(selected(), x_dot, 0), axes) / jnp.maximum(
      ties, 1
  ).astype(x.dtype)
  mean_dot = jnp.sum(x_dot, axes) / n
  excess_dot = (
      jnp.sum(jnp.where(above(), x_dot, 0), axes)
      - q_dot * n_above.astype(x.dtype)
  ) / n
  counts = zero_tangent(known_ties), zero_tangent(known_above)
  return out, (q_dot, counts[0], mean_dot, excess_dot, counts[1])


#: ``dispatch.fused_sums_backend``'s names of the radix selections with sums.
_RADIX_BACKENDS = ("accelerator", "pallas_experimental")


def _with_sums(backend: str) -> Callable[..., tuple[Array, ...]]:
  # Looked up when traced, so that tests may wrap the module functions.
  if backend == "pallas_experimental":
    return pallas.kth_smallest_with_sums_pallas
  return radix.kth_smallest_with_sums_accelerator


def _accelerator_sums(alpha, axes, axis_name, groups, backend, x, where):
  """``backend``'s selection with sums at ``q_alpha``'s rank, and the count."""
  if where is None:
    # Static, as element_count gives it to the unfused path (exact for any
    # alpha; the traced rank may round in float32).
    k = quantile_rank(alpha, element_count(x, axes, None, axis_name, groups))
  else:
    # The rank from the radix's own pooled count: no pass over the mask here.
    k = functools.partial(quantile_rank, alpha)
  return _with_sums(backend)(
      x,
      k,
      axes,
      where=where,
      axis_name=axis_name,
      axis_index_groups=groups,
      return_count=True,
  )


def _accelerator_parts(
    alpha, axes, axis_name, groups, backend, x, where
) -> tuple[Array, Array, Array]:
  """``(q_alpha, E[x], E[(x - q_alpha)^+])`` from the radix passes and one sums pass.

  ``x`` float32 or half precision (selected and summed in float32: ``q`` and
  the excess are float32, the mean has ``x``'s dtype, as in the unfused path),
  masked by ``where`` and pooled over ``axis_name``.
  """
  q, _, mean, mean_excess, _, _ = _accelerator_all(
      alpha, axes, axis_name, groups, backend, x, where
  )
  return q, mean.astype(x.dtype), mean_excess


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4))
def _accelerator_all(alpha, axes, axis_name, groups, backend, x, where):
  """:func:`_accelerator_sums`, differentiable."""
  return _accelerator_sums(alpha, axes, axis_name, groups, backend, x, where)


@_accelerator_all.defjvp
def _accelerator_all_jvp(
    alpha, axes, axis_name, groups, backend, primals, tangents
):
  x, where = primals
  x_dot, _ = tangents
  # Traced after the primal's platform branch is done: choose per platform
  # again (key counts are the compares' only on a GPU). The counts' zero
  # tangents (float0) are made outside the platform branches.
  out, (q_dot, mean_dot, excess_dot) = common.per_platform(
      lambda: _accelerator_all_jvp_traced(
          alpha, axes, axis_name, groups, backend, x, where, x_dot
      )
  )
  zero_ties, zero_above, zero_n = map(zero_tangent, (out[1], out[4], out[5]))
  return out, (q_dot, zero_ties, mean_dot, excess_dot, zero_above, zero_n)


def _accelerator_all_jvp_traced(
    alpha, axes, axis_name, groups, backend, x, where, x_dot
):
  # Through _accelerator_all itself: differentiated again its outputs have
  # this rule's tangents; the radix passes' would have none.
  out = _accelerator_all(alpha, axes, axis_name, groups, backend, x, where)
  q, ties, mean, mean_excess, n_above, n = out
  q_full = expand(q, axes)
  selected = x == q_full
  above = ~(x <= q_full)  # as in the unfused path: NaN is above
  if where is not None:
    selected, above = selected & where, above & where
  x_dot = x_dot.astype(jnp.float32)
  sums = (
      jnp.sum(jnp.where(selected, x_dot, 0), axes),
      jnp.sum(jnp.where(above, x_dot, 0), axes),
      jnp.sum(x_dot, axes, where=where),
  )
  if common.compares_keep_denormals():
    # The radix's key counts (pooled already) are what these float compares
    # count: XLA:GPU keeps denormals (unless run with --xla_gpu_ftz), and
    # -0.0 == +0.0 either way. Only a NaN with its sign bit set differs (its
    # key is below -inf, yet it is not <= q); qbar is NaN there anyway.
    moved, above_dot, total_dot = common.global_sum(sums, axis_name, groups)
  else:
    # XLA:CPU and TPUs read denormals as zero in float compares, where the
    # keys tell them apart: for a zero or denormal q the key counts are not
    # the compares' counts. Count as the unfused path's JVP does, next to
    # the tangent sums (a lax.cond counting only for such q, as
    # known_or_counted does, would cost a host sync per step on a TPU).
    sums += (count_true(selected, axes), count_true(above, axes))
    moved, above_dot, total_dot, ties, n_above = common.global_sum(
        sums, axis_name, groups
    )
  count = n.astype(jnp.float32)
  q_dot = moved / jnp.maximum(ties, 1).astype(jnp.float32)
  # The fraction above first: qbar's q-derivative 1 - fraction / (1 - alpha)
  # is then 0 in float32 too when alpha * N is whole and q untied, rather
  # than an ulp of the O(1) terms that cancel there.
  excess_dot = above_dot / count - q_dot * (n_above.astype(jnp.float32) / count)
  mean_dot = total_dot / count
  return out, (q_dot, mean_dot.astype(mean.dtype), excess_dot)


def superquantile_parts(
    x, alpha, axes, where, axis_name, groups, unfused: Callable[[], Any]
) -> tuple[Array, ...]:
  """``(q_alpha, E[x], E[(x - q_alpha)^+])``, per platform lowered for.

  From a fused backend where one applies on that platform
  (``dispatch.fused_sums_backend``), else ``unfused()`` (the caller's
  selection and sums, which must return the same dtypes). ``x``: a prepared
  float array; ``groups``: hashable axis index groups.
  """

  def parts():
    backend = dispatch.fused_sums_backend(x, axes, where, axis_name, groups)
    if backend == "native":
      return _native_parts(alpha, axes, x)
    if backend in _RADIX_BACKENDS:
      return _accelerator_parts(
          alpha, axes, axis_name, groups, backend, x, where
      )
    return unfused()

  return common.per_platform(parts, denormals=False)
