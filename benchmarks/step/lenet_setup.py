"""The real LeNet train step of ``bench_lenet_step``, and its variants' checks.

:class:`Setup` lays out ``train.loop.train_steps.train_step`` for one norm as
training does (:func:`benchmarks.step.step_setup.random_train_step`) on
Fashion-MNIST-shaped random data; a variant of :mod:`benchmarks.step.lenet_variants`
swaps ``state.apply_fn``, parameters kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks.step.lenet_variants import DATASET
from benchmarks.step.lenet_variants import IMAGE_SHAPE
from benchmarks.step.lenet_variants import make_model
from benchmarks.step.step_setup import random_train_step
from benchmarks.step.step_setup import rel_diff
from train import configs
from train.data import input_pipeline
from train.loop import sharding
from train.loop import train_steps
from train.loop import trainer as trainlib


class Setup:
  """The real train step's inputs for one norm, laid out as in training."""

  def __init__(
      self,
      norm: str,
      batch: int,
      *,
      seed: int = 0,
      steps: int = 2,
      devices: int | None = None,
  ):
    self.config = trainlib.resolve(
        configs.MNIST.replace(dataset=DATASET, norm=norm, batch_size=batch)
    )
    chosen = sharding.data_parallel_devices(batch)
    if devices is not None:
      chosen = chosen[:devices]
    self.mesh = sharding.make_mesh(chosen)
    self.replicated = NamedSharding(self.mesh, P())
    base = make_model("base", self.config)
    self.state, self.images, self.labels, self.step = random_train_step(
        self.config, base, self.mesh, steps=steps, seed=seed
    )
    self.steps = steps

  def state_for(self, variant: str):
    """The initial state with ``variant``'s apply_fn (same parameters)."""
    model = make_model(variant, self.config)
    shapes = jax.eval_shape(
        functools.partial(model.init, train=False),
        jax.random.key(0),
        jnp.zeros((1, *IMAGE_SHAPE), jnp.float32),
    )
    want = jax.tree.map(
        lambda a: (a.shape, a.dtype),
        {"params": self.state.params, "batch_stats": self.state.batch_stats},
    )
    got = jax.tree.map(lambda a: (a.shape, a.dtype), dict(shapes))
    if got != want:
      raise ValueError(f"variant {variant!r} has another parameter tree")
    return self.state.replace(apply_fn=model.apply)

  def compile(self, variant: str):
    """``(compiled step, its state, compile seconds)``."""
    state = self.state_for(variant)
    t = time.perf_counter()
    compiled = self.step.lower(
        state, self.images, self.labels, np.int32(0)
    ).compile()
    return compiled, state, time.perf_counter() - t

  def runner(self, compiled, state) -> Callable[[], Any]:
    """One dispatch per call, cycling over the batches, not blocked."""
    counter = [0]

    def run():
      i = counter[0] % self.steps
      counter[0] += 1
      return compiled(state, self.images, self.labels, np.int32(i))

    return run


def loss_and_grads(setup: Setup, variant: str, params=None, step: int = 0):
  """train_step's loss, gradients and batch_stats for ``variant`` (traceable)."""
  state = setup.state_for(variant)
  x = input_pipeline.normalize_images(setup.images[step], DATASET)
  y = setup.labels[step]

  def loss_fn(params):
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats},
        x,
        train=True,
        mutable=["batch_stats"],
    )
    return jnp.mean(train_steps.cross_entropy(logits, y)), updates

  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params if params is None else params
  )
  return loss, grads, updates["batch_stats"]


def check_variants(
    norm: str, variants: Sequence[str], *, batch: int = 8, seed: int = 0
) -> dict[str, dict[str, float]]:
  """Relative differences of each variant's loss/grads/stats from ``base``'s.

  All in one jitted program (one compilation instead of one per variant).
  """
  setup = Setup(norm, batch, seed=seed, steps=1)
  names = ["base", *[v for v in variants if v != "base"]]
  outs = jax.jit(lambda p: [loss_and_grads(setup, v, p) for v in names])(
      setup.state.params
  )
  (lb, gb, sb), rows = outs[0], {}
  for name, (lv, gv, sv) in zip(names[1:], outs[1:]):
    if jax.tree.structure(gv) != jax.tree.structure(gb):
      raise ValueError(f"variant {name!r} has another gradient tree")
    rows[name] = {
        "loss_rel": rel_diff(lv, lb),
        "grad_rel": rel_diff(gv, gb),
        "batch_stats_rel": rel_diff(sv, sb),
    }
  return rows
