"""Where the LeNet step's time goes: its XLA ops by layer, and layers alone.

:func:`categorize` names the LeNet layer of a traced op (for
:mod:`benchmarks.step.step_profile`'s trace attribution); :func:`layer_costs`
times each layer's forward and forward+backward jitted alone on its step
shape, for every formulation (the trace only sees the launch of Eigen's
asynchronous convolution and dot thunks).
"""

from __future__ import annotations

from collections.abc import Sequence
import statistics
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.step import step_profile
from benchmarks.step.lenet_variants import NUM_CLASSES
from benchmarks.step.lenet_variants import VariantConv
from benchmarks.step.lenet_variants import max_pool_2x2
from benchmarks.step.lenet_variants import max_pool_2x2_mask
from benchmarks.timing import interleaved_samples
from train.model import models

LAYERS = ("conv1", "conv2", "norm1", "norm2", "fc1", "fc2")
_POOL_OPCODES = {"reduce-window", "select-and-scatter"}


def categorize(
    op_name: str | None, opcodes: frozenset[str] = frozenset()
) -> tuple[str, str]:
  """``(part, phase)`` of an op_name such as ``.../transpose(jvp(LeNet))/conv2/...``.

  ``opcodes``: the HLO opcodes of the op (and of what it calls); a
  reduce-window or select-and-scatter in the model is ``pool``.
  """
  if not op_name:
    return "unattributed", "-"
  phase = step_profile.phase(op_name)
  for layer in LAYERS:
    if f"/{layer}/" in op_name:
      return layer, phase
  in_model = "LeNet" in op_name
  if in_model and (
      opcodes & _POOL_OPCODES
      or any(
          k in op_name
          for k in (
              "reduce_window",
              "select_and_scatter",
              "max_pool",
              "reduce_max",
          )
      )
  ):
    return "pool", phase
  if in_model and (
      "relu" in op_name
      or "/gt" in op_name
      or "/ge" in op_name
      or "select_n" in op_name
  ):
    return "relu", phase
  if in_model:
    return "model-other", phase
  if "jvp(" in op_name or "transpose(" in op_name:
    return "loss", phase
  return "input/update/metrics", phase


def hlo_index(text: str) -> dict[str, dict[str, Any]]:
  """:func:`step_profile.hlo_index` with LeNet's layers and parts."""
  return step_profile.hlo_index(text, categorize, LAYERS)


def layer_pieces(norm: str, batch: int) -> dict[str, tuple]:
  """LeNet's layers on their step shapes: ``name -> (fn, params, x, wrt_x)``.

  ``fn(params, x)`` is the layer's training-mode forward; ``wrt_x`` says
  whether the train step needs the gradient with respect to ``x`` (not for
  conv1, whose input is the data). Alternatives are named ``layer/method``.
  """
  factory = models.make_norm(norm)
  shapes = {
      "x": (batch, 28, 28, 1),
      "a1": (batch, 24, 24, 20),
      "p1": (batch, 12, 12, 20),
      "a2": (batch, 8, 8, 50),
      "flat": (batch, 800),
      "h": (batch, 500),
      "logits": (batch, 10),
  }
  keys = iter(jax.random.split(jax.random.key(5), 64))
  data = {k: jax.random.normal(next(keys), v) for k, v in shapes.items()}
  labels = jax.random.randint(next(keys), (batch,), 0, NUM_CLASSES)

  def module(mod, x, mutable=False):
    variables = mod.init(next(keys), x)
    if mutable:
      fn = lambda p, x: mod.apply(
          {**variables, "params": p}, x, mutable=["batch_stats"]
      )[0]
    else:
      fn = lambda p, x: mod.apply({"params": p}, x)
    return fn, variables["params"]

  def pool(method):
    fn = {
        "window": lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)),
        "reshape": max_pool_2x2,
        "mask": max_pool_2x2_mask,
    }[method]
    return lambda p, x: fn(nn.relu(x))

  pieces = {}
  # Block i: conv i (from the data, which needs no gradient, or from pool
  # i-1) to a_i, norm i, then ReLU and pool i.
  blocks = (
      (20, "x", "a1", ("conv", "im2col", "wgrad")),
      (50, "p1", "a2", ("conv", "im2col", "wgrad", "mm_bwd")),
  )
  for i, (features, inp, out, methods) in enumerate(blocks, start=1):
    for method in methods:
      pieces[f"conv{i}/{method}"] = (
          *module(VariantConv(features, method), data[inp]),
          data[inp],
          i > 1,
      )
    pieces[f"norm{i}"] = (
        *module(factory(use_running_average=False), data[out], mutable=True),
        data[out],
        True,
    )
    for method in ("window", "reshape", "mask"):
      pieces[f"relu+pool{i}/{method}"] = (pool(method), {}, data[out], True)
  pieces["fc1+relu"] = (
      *(lambda f, p: (lambda p_, x: nn.relu(f(p_, x)), p))(
          *module(nn.Dense(500), data["flat"])
      ),
      data["flat"],
      True,
  )
  pieces["fc2"] = (*module(nn.Dense(NUM_CLASSES), data["h"]), data["h"], True)
  pieces["loss"] = (
      lambda p, x: optax.softmax_cross_entropy_with_integer_labels(
          x, labels
      ).mean(),
      {},
      data["logits"],
      True,
  )
  return pieces


def layer_costs(
    norm: str,
    batch: int,
    runs: int,
    warmup: int,
    names: Sequence[str] | None = None,
) -> dict[str, Any]:
  """Forward and forward+backward ms of each layer piece, jitted alone."""
  out = {}
  for name, (fn, params, x, wrt_x) in layer_pieces(norm, batch).items():
    if names is not None and name not in names:
      continue
    y = jax.eval_shape(fn, params, x)
    cot = jax.random.normal(jax.random.key(9), y.shape, y.dtype)
    argnums = (
        (0, 1) if wrt_x and jax.tree.leaves(params) else (1 if wrt_x else 0)
    )
    fwd = jax.jit(fn)
    bwd = jax.jit(
        jax.value_and_grad(
            lambda p, x: jnp.vdot(fn(p, x), cot), argnums=argnums
        )
    )
    try:
      samples = interleaved_samples(
          {"fwd": lambda: fwd(params, x), "fwd+bwd": lambda: bwd(params, x)},
          runs,
          warmup,
      )
      out[name] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
  return out
