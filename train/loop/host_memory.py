"""Reuse host memory between steps: glibc malloc settings, set before JAX starts.

XLA:CPU allocates each step's temporaries as one buffer (hundreds of MB for
a ResNet20 step at batch 256) and frees it when the step ends. glibc serves
an allocation that large from a fresh ``mmap`` (always, from a worker
thread's arena, whose heaps cannot exceed 64 MB), so every step maps fresh
pages, and the kernel faults in and zeroes each one. Three ``mallopt``
settings make the buffer come from the process heap and stay there for the
next step: one arena for every thread, no ``mmap`` for large blocks, no
trimming of the heap's top. The price is resident memory: the freed buffers
stay in the heap. Figures and the commands that measure them:
``docs/performance.md``, "Host memory".

``GBN_HOST_MALLOC`` controls it: ``reuse`` (default) applies the settings,
``default`` leaves glibc's own. Nothing happens where the C library is not
glibc, or where ``GLIBC_TUNABLES`` already sets a ``glibc.malloc`` tunable
(the user's choice wins). The settings are the same as starting Python with
``GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647``,
which is how to get them in a program that does not use this module. Threads
that already allocated keep their own arenas, so call :func:`configure` before
JAX's first computation; it changes how memory is found, never a result.
"""

from __future__ import annotations

import ctypes
import os

ENV_VAR = "GBN_HOST_MALLOC"
TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
    "glibc.malloc.trim_threshold=2147483647"
)
# mallopt's parameter numbers (glibc's malloc.h) and the values set.
_SETTINGS = (
    (-8, 1),  # M_ARENA_MAX: every thread allocates from the main arena
    (-4, 0),  # M_MMAP_MAX: no mmap for large blocks, the heap grows instead
    (-1, 2**31 - 1),  # M_TRIM_THRESHOLD: never give the heap's top back
)


def choose(setting: str | None = None) -> bool:
  """Whether ``GBN_HOST_MALLOC`` (or ``setting``) asks for the reuse."""
  setting = (
      os.environ.get(ENV_VAR, "reuse") if setting is None else setting
  ).strip()
  if setting not in ("reuse", "default"):
    raise SystemExit(f"{ENV_VAR} must be 'reuse' or 'default', got {setting!r}")
  return setting == "reuse"


def _glibc() -> bool:
  try:
    return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
  except (AttributeError, ValueError, OSError):  # not POSIX, or not glibc
    return False


def configure() -> bool:
  """Applies the settings if :func:`choose` asks and glibc is the C library.

  Returns:
    Whether every setting was applied.
  """
  if not choose() or not _glibc():
    return False
  if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
    return False
  mallopt = ctypes.CDLL(None).mallopt
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return all([mallopt(param, value) == 1 for param, value in _SETTINGS])
