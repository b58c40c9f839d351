"""Serializing GBN models with :mod:`jax.export`: the compiled CPU kernels.

A GBN layer's selection lowers per platform (``lax.platform_dependent``): a
lowering for GPUs or TPUs holds only XLA's own operations and exports with
no special flags. A CPU lowering calls gbn_jax's compiled kernel where it is
built, as XLA FFI custom calls, which ``jax.export`` refuses by default: an
FFI target's operands and attributes carry no compatibility guarantee.
Exporting them is a promise that the artifact runs where the same gbn_jax
build is installed (see ``docs/export.md``).
"""

from __future__ import annotations

import jax

from gbn_jax._selection import native

__all__ = ["export_disabled_checks", "register_native_kernels"]


def export_disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
  """The ``jax.export`` safety checks a CPU lowering of a GBN model must disable.

  One ``DisabledSafetyCheck.custom_call`` per custom-call target of
  gbn_jax's compiled CPU kernel (the k-th smallest selection and its
  superquantile sums), built or not: pass them as
  ``jax.export.export(f, platforms=["cpu"],
  disabled_checks=gbn_jax.export_disabled_checks())``. Lowerings for other
  platforms contain none of them and need none.

  Returns:
    A new list of ``jax.export.DisabledSafetyCheck``.
  """
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in native.TARGETS]


def register_native_kernels() -> bool:
  """Loads gbn_jax's compiled CPU kernel and registers it with XLA.

  The first selection traced does this by itself; a process that only
  deserializes a CPU export (``jax.export.deserialize``) and calls it traces
  none, so it calls this first, or XLA finds no implementation of the
  kernel's custom calls.

  Returns:
    Whether the selection kernel is available.
  """
  return native.available()
