"""Generalized batch renormalization (Ioffe, 2017): pure helpers.

The clipping a module is given (validated and frozen at construction), its
limits, the constants ``(r, d)`` that correct the batch statistics towards
the running ones, and the training-mode output built on them. The affine
part is :func:`gbn_jax._normalization.normalize` with a correction, so that
``r = 1, d = 0`` gives plain GBN bit for bit.

The correction is its settings (``epsilon`` and the limits that are Python
numbers, hashed by value) applied to traced arrays (the running statistics
and any limit given as a JAX array), so that under a staging trace a
renormalization layer nests as one ``jax.jit`` like a plain GBN layer (see
:func:`gbn_jax._normalization.normalize_batch`): traced once per measure,
reduction, settings and shapes, not once per layer. Eagerly it runs op by
op; a limit that does not hash (a numpy array) traces the layer inline.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import numbers
from typing import NamedTuple

from flax.core import FrozenDict
import jax
from jax import lax
import jax.numpy as jnp

from gbn_jax import _normalization
from gbn_jax import measures as measures_lib

Array = jax.Array


class RenormLimits(NamedTuple):
  """Clipping limits of batch renormalization; ``None`` leaves a side open."""

  rmin: float | None
  rmax: float | None
  dmax: float | None


_RENORM_KEYS = ("rmax", "rmin", "dmax")


def freeze_renorm_clipping(
    renorm: bool, renorm_clipping: Mapping[str, float] | None
) -> FrozenDict | None:
  """Validates a module's ``renorm_clipping`` and returns it hashable.

  The mapping takes Keras' keys: ``rmax`` (at least 1), ``rmin`` (in (0, 1],
  default ``1 / rmax``) and ``dmax`` (at least 0); a key left out leaves that
  side unclipped, and ``None`` clips nothing.

  Raises:
    ValueError: unknown keys, limits out of range, or clipping without
      ``renorm=True``.
    TypeError: not a mapping of real numbers.
  """
  if renorm_clipping is None:
    return None
  if not renorm:
    raise ValueError(
        "renorm_clipping only applies to batch renormalization; pass"
        " renorm=True as well (or drop renorm_clipping)."
    )
  if not isinstance(renorm_clipping, Mapping):
    raise TypeError(
        "renorm_clipping must be a dict with keys 'rmax', 'rmin', 'dmax' or"
        f" None, got {renorm_clipping!r}."
    )
  unknown = sorted(set(renorm_clipping) - set(_RENORM_KEYS), key=str)
  if unknown:
    raise ValueError(
        f"renorm_clipping has unknown key(s) {unknown}; valid keys:"
        " 'rmax', 'rmin', 'dmax'."
    )
  limits = {}
  for key, value in renorm_clipping.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise TypeError(
          f"renorm_clipping[{key!r}] must be a real number, got {value!r}."
      )
    limits[key] = float(value)
  rmax, rmin, dmax = (limits.get(k) for k in _RENORM_KEYS)
  if rmax is not None and not rmax >= 1:
    raise ValueError(f"renorm_clipping['rmax'] must be >= 1, got {rmax}.")
  if rmin is not None and not 0 < rmin <= 1:
    raise ValueError(f"renorm_clipping['rmin'] must be in (0, 1], got {rmin}.")
  if dmax is not None and not dmax >= 0:
    raise ValueError(f"renorm_clipping['dmax'] must be >= 0, got {dmax}.")
  return FrozenDict(limits)


def renorm_limits(renorm_clipping: Mapping[str, float] | None) -> RenormLimits:
  """``(rmin, rmax, dmax)`` of a validated clipping; ``rmin`` is ``1/rmax``
  unless given."""
  if renorm_clipping is None:
    return RenormLimits(None, None, None)
  rmax = renorm_clipping.get("rmax")
  rmin = renorm_clipping.get("rmin")
  if rmin is None and rmax is not None:
    rmin = 1 / rmax
  return RenormLimits(rmin, rmax, renorm_clipping.get("dmax"))


def renorm_correction(
    statistic: Array,
    deviation_sq: Array,
    running_statistic: Array,
    running_deviation_sq: Array,
    epsilon: float,
    limits: RenormLimits,
) -> tuple[Array, Array]:
  """Batch renormalization's ``(r, d)``, constants for autodiff.

  ``r = clip(D_B / D_run, rmin, rmax)`` and ``d = clip((S_B - S_run) /
  D_run, -dmax, dmax)`` with ``D = sqrt(D^2 + eps)`` for both (Ioffe, 2017).
  """
  dtype = jnp.result_type(statistic)
  running_statistic = jnp.asarray(running_statistic, dtype)
  running_deviation = jnp.sqrt(
      jnp.asarray(running_deviation_sq, dtype) + epsilon
  )
  r = jnp.sqrt(deviation_sq + epsilon) / running_deviation
  d = (statistic - running_statistic) / running_deviation
  if limits.rmin is not None or limits.rmax is not None:
    r = jnp.clip(r, limits.rmin, limits.rmax)
  if limits.dmax is not None:
    d = jnp.clip(d, -limits.dmax, limits.dmax)
  return lax.stop_gradient(r), lax.stop_gradient(d)


def renormalize_batch(
    measure: measures_lib.Measure,
    x: Array,
    scale: Array | None,
    bias: Array | None,
    running_statistic: Array,
    running_deviation_sq: Array,
    mask: Array | None,
    reduction: _normalization.Reduction,
    limits: RenormLimits,
) -> tuple[Array, Array, Array]:
  """Generalized batch renormalization in training: ``(y, S, D^2)``.

  The batch's ``(S, D^2)``, corrected towards the running ones by the
  constants ``(r, d)`` of :func:`renorm_correction`; gradients flow through
  the measure by autodiff (with or without ``reduction.axis_name``).
  """
  if jnp.iscomplexobj(x):
    raise TypeError(
        "renorm=True is not defined for complex input: its correction d is"
        " clipped to [-dmax, dmax], which has no meaning for complex numbers."
    )

  # A limit that is a JAX array is traced with the running statistics; the
  # rest (numbers, None) are settings, static in the nested jit.
  traced_limits = RenormLimits(
      *(v if isinstance(v, jax.Array) else None for v in limits)
  )
  static_limits = RenormLimits(
      *(None if isinstance(v, jax.Array) else v for v in limits)
  )
  return _normalization.normalize_batch(
      measure,
      x,
      scale,
      bias,
      mask,
      reduction,
      _RenormCorrection(reduction.epsilon, static_limits),
      (running_statistic, running_deviation_sq, traced_limits),
  )


@dataclasses.dataclass(frozen=True)
class _RenormCorrection:
  """:func:`renorm_correction` with its settings bound: the nested jit's
  static argument, so equal settings hash equal (a closure would not).

  Called with ``(S, D^2, (running_statistic, running_deviation_sq,
  traced_limits))``; a limit in ``traced_limits`` (not None) stands for the
  ``None`` in ``static_limits`` at its place.
  """

  epsilon: float
  static_limits: RenormLimits

  def __call__(
      self,
      statistic: Array,
      deviation_sq: Array,
      operands: tuple[Array, Array, RenormLimits],
  ) -> tuple[Array, Array]:
    running_statistic, running_deviation_sq, traced_limits = operands
    limits = RenormLimits(
        *(
            static if traced is None else traced
            for static, traced in zip(self.static_limits, traced_limits)
        )
    )
    return renorm_correction(
        statistic,
        deviation_sq,
        running_statistic,
        running_deviation_sq,
        self.epsilon,
        limits,
    )
