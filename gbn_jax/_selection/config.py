"""Tunables of the selection, scoped to a ``with`` block and part of JAX's trace context.

The value lives in a :func:`jax.make_user_context` context, which JAX includes
in its jit cache keys: a function traced under one setting is traced again
under another, instead of silently keeping the setting it was first traced
with (which module-level globals did). Set it with
:func:`gbn_jax.selection.selection_config` (which validates the method names
against ``dispatch.METHODS``); the backends read :func:`current` while
tracing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class SelectionConfig(NamedTuple):
  """The selection's tunables (hashable: part of the jit cache key).

  ``method``: a method of ``dispatch.METHODS`` forced on every selection
  traced in scope, or ``None`` for the size- and backend-based default.
  ``bracket_sigmas``: half-width of the native kernel's sampled bracket, in
  binomial standard deviations: a column misses it with probability ~0.3% at
  3 (then it is selected whole). Measured fastest of 3 and 4 on the
  development CPU; 0 makes misses common (the tests use that to exercise the
  fallback).
  """

  method: str | None = None
  bracket_sigmas: float = 3.0


_CONTEXT = jax.make_user_context(default_value=SelectionConfig())


def current() -> SelectionConfig:
  """The setting in scope (read at trace time)."""
  return _CONTEXT.value


def scope(config: SelectionConfig):
  """A context manager that puts ``config`` in scope (no validation)."""
  return _CONTEXT(config)
