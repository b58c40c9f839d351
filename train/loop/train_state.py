"""The train state: the model, its optimizer and the state a run starts from.

:func:`create_model` builds the config's model with the config's norm (the one
norm factory), :func:`create_optimizer` its SGD, :func:`create_train_state`
the parameters, norm statistics and optimizer state a run starts from (jitted
by :mod:`train.loop.programs`), and :func:`state_dict` the pytree a checkpoint
holds.
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
from flax.training import train_state as flax_train_state
import jax
import jax.numpy as jnp
import optax

from train import configs
from train.model import models


class TrainState(flax_train_state.TrainState):
  batch_stats: Any


def create_model(
    config: configs.Config, num_classes: int, *, forward_mode: bool = False
) -> nn.Module:
  """The config's model with the config's norm (the one norm factory);
  ``forward_mode``: with layers that ``jax.jvp`` goes through
  (``models.with_forward_mode``), the same parameters and function."""
  clipping = (
      {"rmax": config.renorm_rmax, "dmax": config.renorm_dmax}
      if config.renorm
      else None
  )
  norm = models.make_norm(
      config.norm,
      momentum=config.norm_momentum,
      epsilon=config.norm_epsilon,
      renorm_clipping=clipping,
      calibration=config.calibration,
      bias=config.norm_bias,
      groups=config.norm_groups,
  )
  model = models.create_model(config.model, num_classes=num_classes, norm=norm)
  return models.with_forward_mode(model) if forward_mode else model


def create_optimizer(config: configs.Config) -> optax.GradientTransformation:
  """SGD (momentum optional) at a constant rate, with coupled L2 decay."""
  return optax.chain(
      optax.add_decayed_weights(config.weight_decay),
      optax.sgd(config.learning_rate, momentum=config.momentum or None),
  )


def create_train_state(
    rng: jax.Array,
    model: nn.Module,
    image_shape: tuple[int, ...],
    tx: optax.GradientTransformation,
) -> TrainState:
  """Initializes parameters, norm statistics and optimizer state."""
  variables = model.init(
      rng, jnp.zeros((1, *image_shape), jnp.float32), train=False
  )
  return TrainState.create(
      apply_fn=model.apply,
      params=variables["params"],
      # A group norm keeps no running statistics: none to hold.
      batch_stats=variables.get("batch_stats", {}),
      tx=tx,
  )


def state_dict(state: TrainState) -> dict[str, Any]:
  """The pytree a checkpoint holds: ``Checkpointer.restore``'s target."""
  return flax.serialization.to_state_dict(state)
