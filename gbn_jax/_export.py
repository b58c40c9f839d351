"""Serializing GBN models with :mod:`jax.export`: the compiled CPU kernels.

A GBN layer's selection, and the training suite's convolutions, lower per
platform (``lax.platform_dependent``): a lowering for GPUs or TPUs holds only
XLA's own operations and exports with no special flags. A CPU lowering calls
gbn_jax's compiled kernels where they are built, as XLA FFI custom calls,
which ``jax.export`` refuses by default: an FFI target's operands and
attributes carry no compatibility guarantee. Exporting them is a promise that
the artifact runs where the same gbn_jax build is installed (see
``docs/export.md``).
"""

from __future__ import annotations

import jax

from gbn_jax import convolution
from gbn_jax._selection import native

__all__ = ["export_disabled_checks", "register_native_kernels"]


def export_disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
  """The ``jax.export`` safety checks a CPU lowering of a GBN model must disable.

  One ``DisabledSafetyCheck.custom_call`` per custom-call target of
  gbn_jax's compiled CPU kernels (the k-th smallest selection, its
  superquantile sums, the convolution's three kernels), built or not: pass
  them as ``jax.export.export(f, platforms=["cpu"],
  disabled_checks=gbn_jax.export_disabled_checks())``. Lowerings for other
  platforms contain none of them and need none.

  Returns:
    A new list of ``jax.export.DisabledSafetyCheck``.
  """
  targets = native.TARGETS + convolution.TARGETS
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]


def register_native_kernels() -> bool:
  """Loads gbn_jax's compiled CPU kernels and registers them with XLA.

  The first selection or convolution traced does this by itself; a process
  that only deserializes a CPU export (``jax.export.deserialize``) and calls
  it traces neither, so it calls this first, or XLA finds no implementation
  of the kernels' custom calls.

  Returns:
    Whether the selection kernel is available (the convolution kernels are
    registered too where they are built).
  """
  convolution.native_available()
  return native.available()
