"""The selection's tunables: an advanced knob, for benchmarks and tests.

Every order statistic (:func:`gbn_jax.quantile`, the measures built on it
such as ``'sqd'``) selects the k-th smallest value exactly; which backend does
it is picked by batch size and platform. :func:`selection_config` forces a
backend (one of :data:`METHODS`) or tunes one inside a ``with`` block, as a
:class:`SelectionConfig`. Results do not depend on it: every method is exact;
speed does.

``"pallas_experimental"`` (radix select as a Pallas kernel) is experimental:
it is exact everywhere, but never a default, since its speed on a GPU, where
it is meant to run, is not yet measured.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import math
from typing import Any

from gbn_jax._selection import config
from gbn_jax._selection.config import SelectionConfig
from gbn_jax._selection.dispatch import METHODS

__all__ = ["METHODS", "SelectionConfig", "selection_config"]

_UNSET = object()


@contextlib.contextmanager
def selection_config(
    *, method: Any = _UNSET, bracket_sigmas: Any = _UNSET
) -> Iterator[SelectionConfig]:
  """Scopes the selection's tunables to a ``with`` block, trace-correctly.

  The setting is part of JAX's trace context (``jax.make_user_context``): a
  jitted function called inside the block is traced for it, not served from
  a trace made under another setting. Arguments left out keep the enclosing
  block's value. Like JAX's own config contexts, the scope is the current
  thread's.

  Args:
    method: one of :data:`METHODS` to force on every selection (quantiles,
      superquantiles, measures such as ``sqd``) traced in scope, or ``None``
      for the default: the native kernel where it applies, else by batch size
      and backend. Every method is exact.
    bracket_sigmas: half-width of the native kernel's sampled bracket, in
      binomial standard deviations (default 3.0; 0 makes misses, and so its
      fallback path, common).

  Yields:
    The :class:`SelectionConfig` in scope.

  Raises:
    ValueError: a ``method`` not in :data:`METHODS`, or a negative or
      non-finite ``bracket_sigmas``.

  >>> import jax.numpy as jnp
  >>> import gbn_jax
  >>> from gbn_jax import selection
  >>> with selection.selection_config(method="sort") as scoped:
  ...   gbn_jax.quantile(jnp.array([3., 1., 2.]), 0.5)
  Array(2., dtype=float32)
  >>> scoped
  SelectionConfig(method='sort', bracket_sigmas=3.0)
  """
  current = config.current()
  if method is _UNSET:
    method = current.method
  elif method is not None and method not in METHODS:
    raise ValueError(
        f"method must be one of {METHODS} or None, got {method!r}."
    )
  if bracket_sigmas is _UNSET:
    bracket_sigmas = current.bracket_sigmas
  else:
    bracket_sigmas = float(bracket_sigmas)
    if not bracket_sigmas >= 0.0 or math.isinf(bracket_sigmas):
      raise ValueError(
          f"bracket_sigmas must be finite and >= 0, got {bracket_sigmas!r}."
      )
  scoped = SelectionConfig(method=method, bracket_sigmas=bracket_sigmas)
  with config.scope(scoped):
    yield scoped
