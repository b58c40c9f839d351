"""The layer cases the layer benchmarks share: shapes, modules, one step.

A case is one normalization layer (flax's BatchNorm for ``"bn"``, else a
GBatchNorm by measure name) on a random input of one shape; its step is the
jit'ed forward and backward that :mod:`benchmarks.timing` times.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import gbn_jax

DEFAULT_SHAPES = ("256x32x32x16", "1024x32x32x16", "1000x8x8x50", "512x256")


def parse_shape(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.lower().split("x"))


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
