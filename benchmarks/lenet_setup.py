"""The real LeNet train step of ``bench_lenet_step``, and its variants' checks.

:class:`Setup` lays out ``train.train.train_step`` for one norm as training
does (``create_train_state``/``create_optimizer``, the mesh and shardings of
``compile_program``) on Fashion-MNIST-shaped random data; a variant of
:mod:`benchmarks.lenet_variants` swaps ``state.apply_fn``, parameters kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks.bench_gbn import interleaved_samples
from benchmarks.lenet_variants import DATASET
from benchmarks.lenet_variants import IMAGE_SHAPE
from benchmarks.lenet_variants import make_model
from train import configs
from train import datasets
from train import input_pipeline
from train import train as trainlib


def random_train_step(
    config: configs.Config,
    model: Any,
    mesh: jax.sharding.Mesh,
    *,
    steps: int,
    seed: int,
) -> tuple[Any, jax.Array, jax.Array, Callable[..., Any]]:
  """``train.train_step``'s inputs on random data, laid out as training does.

  Shared by the LeNet and ResNet20 step benchmarks: ``config``'s dataset
  gives the image shape and classes, its batch size the batch, and its
  optimizer the state's.

  Returns:
    ``(state, images, labels, step)``: the replicated initial state, ``steps``
    batches of uint8 images and int32 labels split over ``mesh``'s data axis,
    and the step jitted as ``train.compile_program`` builds it (no donation
    on CPU).
  """
  info = datasets.dataset_info(config.dataset)
  image_shape, batch = info.image_shape, config.batch_size
  replicated = NamedSharding(mesh, P())
  batched = NamedSharding(mesh, P(None, trainlib.DATA_AXIS))
  init = jax.jit(
      functools.partial(
          trainlib.create_train_state,
          model=model,
          image_shape=image_shape,
          tx=trainlib.create_optimizer(config),
      ),
      out_shardings=replicated,
  )
  state = init(jax.random.key(seed))
  rng = np.random.default_rng(seed)
  images = jax.device_put(
      rng.integers(0, 256, (steps, batch, *image_shape), dtype=np.uint8),
      batched,
  )
  labels = jax.device_put(
      rng.integers(0, info.num_classes, (steps, batch)).astype(np.int32),
      batched,
  )
  step = jax.jit(
      functools.partial(trainlib.train_step, dataset=config.dataset),
      out_shardings=(replicated, replicated),
  )
  return state, images, labels, step


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
    chosen = trainlib.data_parallel_devices(batch)
    if devices is not None:
      chosen = chosen[:devices]
    self.mesh = trainlib.make_mesh(chosen)
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


def _rel(a, b) -> float:
  """Max over leaves of ||a - b|| / ||b|| (0 where both are 0)."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    den = np.linalg.norm(y)
    num = np.linalg.norm(x - y)
    worst = max(worst, num / den if den else num)
  return float(worst)


def compare_outputs(before, base_out, variant_out) -> dict[str, float]:
  """Loss and parameter-update (and batch_stats) differences of two steps."""
  (s_b, m_b), (s_v, m_v) = base_out, variant_out
  upd = lambda s: jax.tree.map(lambda n, o: n - o, s.params, before.params)
  return {
      "loss_rel": _rel(m_v["loss"], m_b["loss"]),
      "update_rel": _rel(upd(s_v), upd(s_b)),
      "batch_stats_rel": _rel(s_v.batch_stats, s_b.batch_stats),
  }


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
    return jnp.mean(trainlib.cross_entropy(logits, y)), updates

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
        "loss_rel": _rel(lv, lb),
        "grad_rel": _rel(gv, gb),
        "batch_stats_rel": _rel(sv, sb),
    }
  return rows


def time_interleaved(
    fns: dict[str, Callable[[], Any]], runs: int, warmup: int
) -> dict[str, list[float]]:
  """Seconds per call of each fn (blocked), round-robin after warm-up."""
  return interleaved_samples(fns, runs, warmup)


def summarize(samples: Sequence[float]) -> dict[str, float]:
  return {
      "median_ms": statistics.median(samples) * 1e3,
      "min_ms": min(samples) * 1e3,
      "runs_ms": [round(s * 1e3, 2) for s in samples],
  }
