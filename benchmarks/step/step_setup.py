"""The real train step on random data, and timing its variants against it.

Shared by ``bench_lenet_step`` and ``bench_resnet_step``:
:func:`random_train_step` lays out ``train.loop.train_steps.train_step`` for a
config as training does (``create_train_state``/``create_optimizer``, the mesh
and shardings of ``compile_program``); :func:`time_variants` times a model's
variants (each a ``state.apply_fn`` with the same parameters) interleaved,
each compared with ``base`` on the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import statistics
from typing import Any, Protocol

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks.timing import interleaved_samples
from train import configs
from train.data import datasets
from train.loop import sharding
from train.loop import train_state
from train.loop import train_steps


def random_train_step(
    config: configs.Config,
    model: Any,
    mesh: jax.sharding.Mesh,
    *,
    steps: int,
    seed: int,
) -> tuple[Any, jax.Array, jax.Array, Callable[..., Any]]:
  """``train_step``'s inputs on random data, laid out as training does.

  ``config``'s dataset gives the image shape and classes, its batch size the
  batch, and its optimizer the state's.

  Returns:
    ``(state, images, labels, step)``: the replicated initial state, ``steps``
    batches of uint8 images and int32 labels split over ``mesh``'s data axis,
    and the step jitted as ``train.loop.programs.compile_program`` builds it (no
    donation on CPU).
  """
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  info = datasets.dataset_info(config.dataset)
  image_shape, batch = info.image_shape, config.batch_size
  replicated = NamedSharding(mesh, P())
  batched = NamedSharding(mesh, P(None, sharding.DATA_AXIS))
  init = jax.jit(
      functools.partial(
          train_state.create_train_state,
          model=model,
          image_shape=image_shape,
          tx=train_state.create_optimizer(config),
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
      functools.partial(train_steps.train_step, dataset=config.dataset),
      out_shardings=(replicated, replicated),
  )
  return state, images, labels, step


def rel_diff(a, b) -> float:
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
      "loss_rel": rel_diff(m_v["loss"], m_b["loss"]),
      "update_rel": rel_diff(upd(s_v), upd(s_b)),
      "batch_stats_rel": rel_diff(s_v.batch_stats, s_b.batch_stats),
  }


def summarize(samples: Sequence[float]) -> dict[str, Any]:
  """Median, minimum and every sample of ``samples`` seconds, in ms."""
  return {
      "median_ms": statistics.median(samples) * 1e3,
      "min_ms": min(samples) * 1e3,
      "runs_ms": [round(s * 1e3, 2) for s in samples],
  }


class StepSetup(Protocol):
  """What :func:`time_variants` needs of a benchmark's ``Setup``."""

  mesh: jax.sharding.Mesh
  state: Any
  images: jax.Array
  labels: jax.Array

  def compile(self, variant: str) -> tuple[Any, Any, float]:
    ...

  def runner(self, compiled, state) -> Callable[[], Any]:
    ...


def time_variants(
    setup: StepSetup,
    names: Sequence[str],
    runs: int,
    warmup: int,
    *,
    profile: Callable[[str, Any, Callable[[], Any]], None] | None = None,
) -> dict[str, Any]:
  """One norm's row: each variant's step compiled, checked and timed.

  Every variant's step on the first batch is compared with ``base``'s
  (:func:`compare_outputs`); then all are timed interleaved, ``runs`` steps
  each after ``warmup`` (``runs=0``: not timed), with ``ratio_to_base``
  where ``base`` was timed. A variant that fails to compile or run gets an
  ``error`` instead. ``profile(name, compiled, run)``, if given, is called
  after each variant's first step.
  """
  row = {"devices": setup.mesh.size, "variants": {}}
  fns, outs = {}, {}
  for name in names:
    try:
      compiled, state, seconds = setup.compile(name)
      outs[name] = jax.device_get(
          compiled(state, setup.images, setup.labels, np.int32(0))
      )
      fns[name] = setup.runner(compiled, state)
      row["variants"][name] = {
          "compile_s": round(seconds, 2),
          "loss": float(outs[name][1]["loss"]),
      }
      if profile is not None:
        profile(name, compiled, fns[name])
    except Exception as e:  # pylint: disable=broad-except
      row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
  if "base" in outs:
    for name in outs:
      if name != "base":
        row["variants"][name].update(
            compare_outputs(setup.state, outs["base"], outs[name])
        )
  samples = interleaved_samples(fns, runs, warmup)
  base = samples.get("base")
  for name, s in samples.items():
    if not s:
      continue
    row["variants"][name].update(summarize(s))
    if base:
      ratio = statistics.median(s) / statistics.median(base)
      row["variants"][name]["ratio_to_base"] = ratio
  return row
