"""The layer cases the layer benchmarks share: shapes, modules, one step.

A case is one normalization layer (flax's BatchNorm for ``"bn"``, else a
GBatchNorm by measure name) on a random input of one shape; its step is the
jit'ed forward and backward that :mod:`benchmarks.timing` times. A family case
is a per-example layer (GroupNorm, LayerNorm or InstanceNorm, flax's or
gbn_jax's by measure name) given as ``kind:shape[:groups]``
(:func:`parse_family`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import gbn_jax
from gbn_jax import linen

DEFAULT_SHAPES = ("256x32x32x16", "1024x32x32x16", "1000x8x8x50", "512x256")
#: The per-example cases: many short rows, GroupNorm's groups of 2,048 values
#: (2 channels over 32x32) and LayerNorm's tokens of 768.
DEFAULT_FAMILY = ("group:256x32x32x64:32", "layer:64x128x768")
#: flax's per-example layers, and gbn_jax's drop-ins for them, by kind.
FAMILY = {
    "group": (nn.GroupNorm, linen.GGroupNorm),
    "layer": (nn.LayerNorm, linen.GLayerNorm),
    "instance": (nn.InstanceNorm, linen.GInstanceNorm),
}


def parse_shape(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.lower().split("x"))


def parse_family(text: str) -> tuple[str, tuple[int, ...], int | None]:
  """``"group:256x32x32x64:32"`` -> ``("group", (256, 32, 32, 64), 32)``.

  The kind (a key of :data:`FAMILY`), the input shape, and the number of
  groups: required for ``group``, absent for the other kinds.
  """
  kind, _, rest = text.lower().partition(":")
  shape_text, _, groups = rest.partition(":")
  if kind not in FAMILY or not shape_text:
    raise ValueError(
        f"family case {text!r}: want kind:shape[:groups], kind one of"
        f" {', '.join(FAMILY)}"
    )
  if (kind == "group") != bool(groups):
    raise ValueError(
        f"family case {text!r}: groups are given for group and only for it"
    )
  return kind, parse_shape(shape_text), int(groups) if groups else None


def make_family_module(
    kind: str, norm: str, num_groups: int | None = None
) -> nn.Module:
  """flax's per-example layer of ``kind`` for ``"flax"``, else gbn_jax's
  with the measure named ``norm``; default fields otherwise."""
  flax_cls, gbn_cls = FAMILY[kind]
  fields = {"num_groups": num_groups} if kind == "group" else {}
  if norm == "flax":
    return flax_cls(**fields)
  name, params = gbn_jax.parse_measure_name(norm)
  return gbn_cls(measure=name, **params, **fields)


def make_module(norm: str) -> nn.Module:
  if norm == "bn":
    return nn.BatchNorm(use_running_average=False)
  name, params = gbn_jax.parse_measure_name(norm)  # "sqd:0.05" too
  return gbn_jax.GBatchNorm(use_running_average=False, measure=name, **params)


def layer_step(module: nn.Module, x: jax.Array):
  """jit'ed forward+backward (input and parameter gradients) of one layer."""
  variables = module.init(jax.random.key(0), x)
  cotangent = jax.random.normal(jax.random.key(1), x.shape, x.dtype)

  def loss(params, inp):
    y, updates = module.apply(
        {**variables, "params": params}, inp, mutable=["batch_stats"]
    )
    return jnp.vdot(y, cotangent), updates

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  return lambda: step(variables["params"], x)
