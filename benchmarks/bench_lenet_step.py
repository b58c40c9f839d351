"""Where the LeNet train step's time goes on XLA:CPU, and what makes it faster.

Times the training suite's real jitted step (``train.train.train_step``, with
``train.train.create_train_state``/``create_optimizer`` and the mesh and
shardings of ``train.train.compile_program``) on Fashion-MNIST-shaped random
data (batch 1000, 28x28x1), ``--norm bn`` and ``sqd2``. Each section runs in
fresh subprocesses (XLA flags and the host device count are fixed when JAX
starts):

1. ``variants``: exact reformulations of the model with the same parameter
   tree, fed through the same ``train_step`` (``state.apply_fn`` swapped):
   max-pool as reshape + max or with a mask backward instead of
   ``select_and_scatter``, convolutions (or only their backward passes) as
   im2col matmuls, NCHW layout. Timed interleaved with the real model in one
   process; the fastest for the first norm is the "winner".
2. ``profile``: a traced step (``jax.profiler``) of the real model and the
   winner, XLA op times by layer and phase; and each layer's forward and
   forward+backward jitted alone on its step shape, for every formulation
   (``layers``; the trace only sees the launch of Eigen's asynchronous
   convolution and dot thunks, these timings see everything).
3. ``flags``: XLA:CPU flags and intra-op thread-pool sizes (``PJRT_NPROC``),
   one process each, timing the winner; ratios are to the median of the
   default-flag processes run first and last.
4. ``final``: 1 vs 2 host devices x default vs the best exact flag set, real
   model and winner, both norms.
5. ``--torch-python``: the peer's (``peers/torch_sqd.py``) LeNet
   step with ``BatchNorm2d`` (and its kthvalue SQD with ``--torch-sqd``) in
   that interpreter, first and last; every step time is also given as a
   ratio to PyTorch's BatchNorm step.

Each variant's loss and parameter update are compared with the real model's
on the same batch (``loss_rel``, ``update_rel``), each flag set's loss with
the default flags'. Medians after warm-up. On a shared machine the ms are
noisy: read the ratios, and run it when the cores are idle (about 6 minutes
on 2 idle cores).

  python -m benchmarks.bench_lenet_step --out results/bench_lenet_step.json \\
      --torch-python /work/torchvenv/bin/python
  python -m benchmarks.bench_lenet_step --quick      # smoke check
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable, Sequence
import datetime
import functools
import json
import os
from pathlib import Path
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks.bench_gbn import interleaved_samples
from train import models
from train.models import im2col

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER = REPO / "peers" / "torch_sqd.py"
DATASET = "fashion_mnist"
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
_RESULT = "RESULT "

# ---------------------------------------------------------------------------
# Model reformulations. Same parameter tree as train.models.LeNet (conv1/kernel
# (5,5,1,20), norm1, conv2/kernel (5,5,20,50), norm2, fc1, fc2), same math.


def max_pool_2x2(x: jax.Array, layout: str = "nhwc") -> jax.Array:
  """2x2 stride-2 VALID max-pool as a reshape and a max over two axes.

  NHWC is ``train.models.max_pool_2x2`` (see there for its gradient on
  ties); NCHW is the same on the other axes.
  """
  if layout == "nhwc":
    return models.max_pool_2x2(x)
  n, c, h, w = x.shape
  x = x[:, :, : h // 2 * 2, : w // 2 * 2]
  return jnp.max(x.reshape(n, c, h // 2, 2, w // 2, 2), axis=(3, 5))


@jax.custom_vjp
def max_pool_2x2_mask(x: jax.Array) -> jax.Array:
  """NHWC 2x2 max-pool: reduce_window forward, mask-and-broadcast backward.

  The backward pass is :func:`max_pool_2x2`'s (the gradient spread equally
  over a window's tied maxima), as elementwise ops on a reshaped view
  instead of the argmax indices and scatter of ``select_and_scatter``.
  """
  return nn.max_pool(x, (2, 2), strides=(2, 2))


def _pool_mask_fwd(x):
  y = max_pool_2x2_mask(x)
  return y, (x, y)


def _pool_mask_bwd(res, g):
  with jax.named_scope("max_pool"):
    return _pool_mask_bwd_ops(res, g)


def _pool_mask_bwd_ops(res, g):
  x, y = res
  n, h, w, c = x.shape
  hh, ww = h // 2, w // 2
  view = x[:, : 2 * hh, : 2 * ww, :].reshape(n, hh, 2, ww, 2, c)
  hit = (view == y[:, :, None, :, None, :]).astype(g.dtype)
  share = g / jnp.sum(hit, axis=(2, 4))
  dx = (hit * share[:, :, None, :, None, :]).reshape(n, 2 * hh, 2 * ww, c)
  if (2 * hh, 2 * ww) != (h, w):
    dx = jnp.pad(dx, ((0, 0), (0, h - 2 * hh), (0, w - 2 * ww), (0, 0)))
  return (dx,)


max_pool_2x2_mask.defvjp(_pool_mask_fwd, _pool_mask_bwd)


def _conv_nhwc(x, kernel):
  return lax.conv_general_dilated(
      x, kernel, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


@jax.custom_vjp
def conv_im2col_wgrad(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """VALID NHWC conv; its kernel gradient as one im2col matmul.

  Forward and input gradient are XLA's convolutions; the kernel gradient
  ``patches^T @ g`` replaces XLA's weight-gradient convolution (a conv with
  the batch as its contracting feature dimension).
  """
  return _conv_nhwc(x, kernel)


def _wgrad_fwd(x, kernel):
  return _conv_nhwc(x, kernel), (x, kernel)


def _wgrad_bwd(res, g):
  x, kernel = res
  kh, kw, cin, cout = kernel.shape
  _, vjp = jax.vjp(lambda x_: _conv_nhwc(x_, kernel), x)
  (dx,) = vjp(g)  # dead code (removed by XLA) where x needs no gradient
  patches = im2col(x, kh, kw)
  dk = lax.dot_general(patches, g, (((0, 1, 2), (0, 1, 2)), ((), ())))
  return dx, dk.reshape(kh, kw, cin, cout).astype(kernel.dtype)


conv_im2col_wgrad.defvjp(_wgrad_fwd, _wgrad_bwd)


def col2im(dpatches: jax.Array, kh: int, kw: int) -> jax.Array:
  """The transpose of :func:`im2col`: sums each patch back into place."""
  n, oh, ow, k = dpatches.shape
  cin = k // (kh * kw)
  dp = dpatches.reshape(n, oh, ow, kh, kw, cin)
  return sum(
      jnp.pad(
          dp[:, :, :, i, j, :],
          ((0, 0), (i, kh - 1 - i), (j, kw - 1 - j), (0, 0)),
      )
      for i in range(kh)
      for j in range(kw)
  )


@jax.custom_vjp
def conv_matmul_bwd(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """VALID NHWC conv whose backward pass is two im2col matmuls.

  Forward: XLA's convolution. Backward: ``patches^T @ g`` for the kernel and
  ``col2im(g @ kernel^T)`` for the input (instead of a padded convolution
  with the flipped kernel, which computes 144 instead of 64 positions for
  LeNet's conv2).
  """
  return _conv_nhwc(x, kernel)


def _mm_bwd(res, g):
  x, kernel = res
  kh, kw, cin, cout = kernel.shape
  patches = im2col(x, kh, kw)
  dk = lax.dot_general(patches, g, (((0, 1, 2), (0, 1, 2)), ((), ())))
  flat = kernel.reshape(kh * kw * cin, cout)
  dp = lax.dot_general(g, flat, (((3,), (1,)), ((), ())))
  dx = col2im(dp, kh, kw)
  return dx.astype(x.dtype), dk.reshape(kernel.shape).astype(kernel.dtype)


conv_matmul_bwd.defvjp(_wgrad_fwd, _mm_bwd)


class VariantConv(nn.Module):
  """nn.Conv(features, (5, 5), padding='VALID', use_bias=False), reformulated.

  Attributes:
    features: Output channels.
    method: ``conv`` (lax.conv, NHWC), ``im2col`` (patches @ kernel),
      ``shift`` (sum of 25 shifted inputs times a kernel row; 1 input
      channel only), ``wgrad`` (lax.conv, kernel gradient by im2col:
      :func:`conv_im2col_wgrad`), ``mm_bwd`` (lax.conv, backward by im2col
      matmuls: :func:`conv_matmul_bwd`) or ``nchw`` (lax.conv on NCHW
      activations).
  """

  features: int
  method: str = "conv"
  kernel_size: tuple[int, int] = (5, 5)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kh, kw = self.kernel_size
    cin = x.shape[1] if self.method == "nchw" else x.shape[-1]
    kernel = self.param(
        "kernel",
        nn.initializers.lecun_normal(),
        (kh, kw, cin, self.features),
        jnp.float32,
    )
    if self.method in ("conv", "nchw"):
      layout = "NCHW" if self.method == "nchw" else "NHWC"
      return lax.conv_general_dilated(
          x, kernel, (1, 1), "VALID", dimension_numbers=(layout, "HWIO", layout)
      )
    if self.method == "wgrad":
      return conv_im2col_wgrad(x, kernel)
    if self.method == "mm_bwd":
      return conv_matmul_bwd(x, kernel)
    if self.method == "im2col":
      patches = im2col(x, kh, kw)
      return lax.dot_general(
          patches,
          kernel.reshape(kh * kw * cin, self.features),
          (((patches.ndim - 1,), (0,)), ((), ())),
      )
    if self.method == "shift":
      if cin != 1:
        raise ValueError("the shift formulation needs 1 input channel")
      _, h, w, _ = x.shape
      oh, ow = h - kh + 1, w - kw + 1
      out = None
      for i in range(kh):
        for j in range(kw):
          term = x[:, i : i + oh, j : j + ow, :] * kernel[i, j, 0]
          out = term if out is None else out + term
      return out
    raise ValueError(f"unknown conv method {self.method!r}")


class LeNetVariant(nn.Module):
  """train.models.LeNet with swappable formulations of its ops.

  Attributes:
    num_classes: Number of output logits.
    norm: Norm factory from ``train.models.make_norm``.
    conv1: ``conv``, ``im2col``, ``wgrad``, ``mm_bwd`` or ``shift``.
    conv2: ``conv``, ``im2col``, ``wgrad`` or ``mm_bwd``.
    pool: ``window`` (flax ``nn.max_pool``), ``reshape``
      (:func:`max_pool_2x2`) or ``mask`` (:func:`max_pool_2x2_mask`).
    layout: ``nhwc`` or ``nchw`` (convs, norms and pools on NCHW; the input
      and the flatten stay NHWC, so fc1's weights mean the same).
  """

  num_classes: int
  norm: Callable[..., nn.Module]
  conv1: str = "conv"
  conv2: str = "conv"
  pool: str = "window"
  layout: str = "nhwc"

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = functools.partial(self.norm, use_running_average=not train)
    nchw = self.layout == "nchw"
    if nchw:
      if (self.conv1, self.conv2) != ("conv", "conv"):
        raise ValueError("nchw goes with conv1=conv2=conv")
      x = jnp.transpose(x, (0, 3, 1, 2))
    for i, (features, method) in enumerate(
        ((20, self.conv1), (50, self.conv2)), start=1
    ):
      x = VariantConv(features, "nchw" if nchw else method, name=f"conv{i}")(x)
      x = norm(name=f"norm{i}", **({"axis": 1} if nchw else {}))(x)
      x = nn.relu(x)
      if self.pool == "reshape":
        x = max_pool_2x2(x, self.layout)
      elif self.pool == "mask":
        if nchw:
          raise ValueError("pool=mask is NHWC only")
        x = max_pool_2x2_mask(x)
      elif nchw:
        x = lax.reduce_window(
            x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"
        )
      else:
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
    if nchw:
      x = jnp.transpose(x, (0, 2, 3, 1))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(500, name="fc1")(x))
    return nn.Dense(self.num_classes, name="fc2")(x)


#: Variant name -> LeNetVariant fields (``base`` is train.models.LeNet).
VARIANTS: dict[str, dict[str, str] | None] = {
    "base": None,
    # nn.Conv and nn.max_pool: train.models.LeNet until it took the fastest
    # variant below (pool+im2col) as its CPU formulation.
    "flax_ops": {},
    "pool": {"pool": "reshape"},
    "pool_mask": {"pool": "mask"},
    "conv1_im2col": {"conv1": "im2col"},
    "conv1_shift": {"conv1": "shift"},
    "conv2_im2col": {"conv2": "im2col"},
    "wgrad": {"conv1": "wgrad", "conv2": "wgrad"},
    "nchw": {"layout": "nchw"},
    "nchw+pool": {"layout": "nchw", "pool": "reshape"},
    "pool+conv1_im2col": {"pool": "reshape", "conv1": "im2col"},
    "pool+im2col": {"pool": "reshape", "conv1": "im2col", "conv2": "im2col"},
    "pool+wgrad": {"pool": "reshape", "conv1": "wgrad", "conv2": "wgrad"},
    "pool_mask+wgrad": {"pool": "mask", "conv1": "wgrad", "conv2": "wgrad"},
    "mm_bwd": {"conv1": "wgrad", "conv2": "mm_bwd"},
    "pool_mask+mm_bwd": {"pool": "mask", "conv1": "wgrad", "conv2": "mm_bwd"},
    "pool_mask+conv1_im2col+conv2_wgrad": {
        "pool": "mask",
        "conv1": "im2col",
        "conv2": "wgrad",
    },
}
DEFAULT_VARIANTS = (
    "base",
    "flax_ops",
    "pool",
    "pool_mask",
    "conv1_im2col",
    "conv2_im2col",
    "wgrad",
    "mm_bwd",
    "nchw",
    "pool+im2col",
    "pool_mask+wgrad",
    "pool_mask+mm_bwd",
)

#: Flag set name -> (extra XLA_FLAGS, extra environment). All flags exist in
#: jaxlib 0.10.2 (an unknown flag aborts the process).
FLAG_SETS: dict[str, tuple[str, dict[str, str]]] = {
    "default": ("", {}),
    # YNNPACK fusions (on by default for convs, dots, reductions) off / fewer
    # / more.
    "ynn_off": ("--xla_cpu_experimental_ynn_fusion_type=", {}),
    "ynn_no_conv": (
        "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",
        {},
    ),
    "ynn_no_dot": (
        "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
        {},
    ),
    "ynn_plus_eltwise": ("--xla_cpu_experimental_ynn_fusion_type=+eltwise", {}),
    "onednn_dot": (
        "--xla_cpu_use_onednn=true "
        "--xla_cpu_experimental_onednn_fusion_type=dot,eltwise",
        {},
    ),
    "eigen_1thread": ("--xla_cpu_multi_thread_eigen=false", {}),
    "no_concurrency_sched": (
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
        {},
    ),
    "vector_512": ("--xla_cpu_prefer_vector_width=512", {}),
    "fast_runtime": ("--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_RUNTIME", {}),
    "fast_math": ("--xla_cpu_enable_fast_math=true", {}),  # not exact
    "nproc1": ("", {"PJRT_NPROC": "1"}),  # intra-op thread pool size
    "nproc4": ("", {"PJRT_NPROC": "4"}),
}
DEFAULT_FLAG_SETS = (
    "ynn_off",
    "ynn_no_conv",
    "ynn_no_dot",
    "ynn_plus_eltwise",
    "onednn_dot",
    "eigen_1thread",
    "no_concurrency_sched",
    "vector_512",
    "fast_math",
    "nproc1",
    "nproc4",
)
#: Flag sets that may change results (never picked as "best" automatically).
INEXACT_FLAG_SETS = frozenset({"fast_math"})


def make_model(variant: str, config) -> nn.Module:
  """The config's LeNet (``base``) or a LeNetVariant with the config's norm."""
  from train import models
  from train import train as trainlib

  fields = VARIANTS[variant]
  if fields is None:
    return trainlib.create_model(config, NUM_CLASSES)
  norm = models.make_norm(
      config.norm, momentum=config.norm_momentum, epsilon=config.norm_epsilon
  )
  return LeNetVariant(num_classes=NUM_CLASSES, norm=norm, **fields)


# ---------------------------------------------------------------------------
# The real step.


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
    from train import configs
    from train import train as trainlib

    self.trainlib = trainlib
    self.config = trainlib.resolve(
        configs.MNIST.replace(dataset=DATASET, norm=norm, batch_size=batch)
    )
    chosen = trainlib.data_parallel_devices(batch)
    if devices is not None:
      chosen = chosen[:devices]
    self.mesh = trainlib.make_mesh(chosen)
    self.replicated = NamedSharding(self.mesh, P())
    batched = NamedSharding(self.mesh, P(None, trainlib.DATA_AXIS))
    base = make_model("base", self.config)
    self.tx = trainlib.create_optimizer(self.config)
    init = jax.jit(
        functools.partial(
            trainlib.create_train_state,
            model=base,
            image_shape=IMAGE_SHAPE,
            tx=self.tx,
        ),
        out_shardings=self.replicated,
    )
    self.state = init(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    self.images = jax.device_put(
        rng.integers(0, 256, (steps, batch, *IMAGE_SHAPE), dtype=np.uint8),
        batched,
    )
    self.labels = jax.device_put(
        rng.integers(0, NUM_CLASSES, (steps, batch)).astype(np.int32), batched
    )
    self.steps = steps
    # As train.compile_program builds it (no donation on CPU).
    self.step = jax.jit(
        functools.partial(trainlib.train_step, dataset=self.config.dataset),
        out_shardings=(self.replicated, self.replicated),
    )

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
  trainlib = setup.trainlib
  from train import input_pipeline

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


# ---------------------------------------------------------------------------
# Profile: XLA op times from a jax.profiler trace.

_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(")
_LAYERS = ("conv1", "conv2", "norm1", "norm2", "fc1", "fc2")
_POOL_OPCODES = {"reduce-window", "select-and-scatter"}


def _phase(op_name: str) -> str:
  return (
      "backward"
      if "transpose(" in op_name
      else "forward"
      if "jvp(" in op_name
      else "update/other"
  )


def categorize(
    op_name: str | None, opcodes: frozenset[str] = frozenset()
) -> tuple[str, str]:
  """``(part, phase)`` of an op_name such as ``.../transpose(jvp(LeNet))/conv2/...``.

  ``opcodes``: the HLO opcodes of the op (and of what it calls); a
  reduce-window or select-and-scatter in the model is ``pool``.
  """
  if not op_name:
    return "unattributed", "-"
  phase = _phase(op_name)
  for layer in _LAYERS:
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
  """Instruction name -> op_name, opcodes, operands, part and phase.

  A fusion's op_name is the first of its instructions' (recursively) that
  names a layer, else its root's, else any. An op with none (iotas, copies,
  weight-gradient convolutions) takes its part from its users: a parameter
  update (``state.params['conv2']...`` + ...) makes it that layer's
  backward, otherwise the nearest user's part.
  """
  index, computation = {}, None
  roots, members = {}, collections.defaultdict(list)
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      root, name, rhs = m.groups()
      head = re.split(
          r", (?:metadata|backend_config|calls|to_apply|body|"
          r"condition|branch_computations|frontend_attributes)=",
          rhs,
          maxsplit=1,
      )[0]
      op = re.search(r'op_name="([^"]*)"', rhs)
      opcode = _OPCODE.match(rhs)
      index[name] = {
          "op_name": op.group(1) if op else None,
          "opcode": opcode.group(1) if opcode else None,
          "operands": re.findall(r"%([\w.\-]+)", head),
          "calls": re.findall(
              r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", rhs
          ),
      }
      members[computation].append(name)
      if root:
        roots[computation] = name
      continue
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("{")[0]:
      computation = m.group(2)

  def inside(name, seen):
    """Instructions of ``name``'s called computations, recursively."""
    for comp in index[name]["calls"]:
      if comp in seen:
        continue
      seen.add(comp)
      for member in members.get(comp, ()):
        yield member
        yield from inside(member, seen)

  for name, info in index.items():
    nested = list(inside(name, set()))
    info["opcodes"] = frozenset(
        [info["opcode"]] + [index[n]["opcode"] for n in nested]
    ) - {None}
    if info["op_name"] is None and nested:
      named = [index[n]["op_name"] for n in nested if index[n]["op_name"]]
      rooted = [
          index[roots[c]]["op_name"]
          for c in info["calls"]
          if c in roots and index[roots[c]]["op_name"]
      ]
      layered = [n for n in named if any(f"/{l}/" in n for l in _LAYERS)]
      pick = layered or rooted or named
      info["op_name"] = pick[0] if pick else None
  users = collections.defaultdict(list)
  for name, info in index.items():
    for operand in info["operands"]:
      users[operand].append(name)
  for name, info in index.items():
    info["part"], info["phase"] = (
        categorize(info["op_name"], info["opcodes"])
        if info["op_name"]
        else (None, None)
    )

  def param_layer(name):
    for operand in index[name]["operands"]:
      m = re.match(
          r"state\.params\[\\?'(\w+)\\?'\]",
          index.get(operand, {}).get("op_name") or "",
      )
      if m:
        return m.group(1)
    return None

  for name, info in index.items():
    if info["part"] is not None:
      continue
    frontier, seen = list(users.get(name, ())), set()
    while frontier:
      user = frontier.pop(0)
      if user in seen:
        continue
      seen.add(user)
      layer = param_layer(user)
      if layer and index[user]["phase"] == "update/other":
        info["part"], info["phase"] = layer, "backward"
        info["op_name"] = (
            f"(gradient of {layer}, feeds {index[user]['op_name']})"
        )
        break
      if index[user]["part"] is not None and index[user]["op_name"]:
        info["part"], info["phase"] = index[user]["part"], index[user]["phase"]
        info["op_name"] = f"(feeds {index[user]['op_name']})"
        break
      frontier.extend(users.get(user, ()))
    if info["part"] is None:
      info["part"], info["phase"] = "unattributed", "-"
  return index


def _union_ns(intervals: list[tuple[int, int]]) -> int:
  """Total length of the union of ``(start, end)`` intervals."""
  total, end = 0, None
  for a, b in sorted(intervals):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def profile_compiled(
    compiled, run: Callable[[], Any], steps: int, top: int = 15
) -> dict[str, Any]:
  """Each XLA op's traced time over ``steps`` steps, by layer and phase.

  ``wall_ms``: how long the op was running on any thread (the union of its
  events' intervals); ``thread_ms``: the sum over threads (an op split
  over the thread pool counts once per thread). Ops of one step may run
  concurrently, so the ops' wall times can add up to more than the step's.
  """
  index = hlo_index(compiled.as_text())
  with tempfile.TemporaryDirectory() as tmp:
    t = time.perf_counter()
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        jax.block_until_ready(run())
      traced = time.perf_counter() - t
    files = sorted(Path(tmp).rglob("*.xplane.pb"))
    if not files:
      return {"error": "no trace written"}
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    thread_ns = collections.Counter()
    spans = collections.defaultdict(list)
    for plane in data.planes:
      for line in plane.lines:
        for event in line.events:
          if event.name in index:
            thread_ns[event.name] += event.duration_ns
            spans[event.name].append((event.start_ns, event.end_ns))
  wall_ns = {name: _union_ns(iv) for name, iv in spans.items()}
  total = sum(wall_ns.values()) or 1
  parts_wall, parts_thread = collections.Counter(), collections.Counter()
  for name in wall_ns:
    part = f"{index[name]['part']}/{index[name]['phase']}"
    parts_wall[part] += wall_ns[name]
    parts_thread[part] += thread_ns[name]
  per = lambda ns: round(ns / 1e6 / steps, 3)
  return {
      "steps": steps,
      "traced_step_ms": traced * 1e3 / steps,
      "op_wall_ms_per_step": per(total),
      "op_thread_ms_per_step": per(sum(thread_ns.values())),
      "by_part": {
          k: {
              "wall_ms": per(v),
              "share": v / total,
              "thread_ms": per(parts_thread[k]),
          }
          for k, v in parts_wall.most_common()
      },
      "top_ops": [
          {
              "op": name,
              "wall_ms": per(ns),
              "share": ns / total,
              "thread_ms": per(thread_ns[name]),
              "part": f"{index[name]['part']}/{index[name]['phase']}",
              "op_name": index[name]["op_name"],
          }
          for name, ns in sorted(wall_ns.items(), key=lambda kv: -kv[1])[:top]
      ],
  }


def layer_pieces(norm: str, batch: int) -> dict[str, tuple]:
  """LeNet's layers on their step shapes: ``name -> (fn, params, x, wrt_x)``.

  ``fn(params, x)`` is the layer's training-mode forward; ``wrt_x`` says
  whether the train step needs the gradient with respect to ``x`` (not for
  conv1, whose input is the data). Alternatives are named ``layer/method``.
  """
  from train import models

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
  for method in ("conv", "im2col", "wgrad"):
    pieces[f"conv1/{method}"] = (
        *module(VariantConv(20, method), data["x"]),
        data["x"],
        False,
    )
  pieces["norm1"] = (
      *module(factory(use_running_average=False), data["a1"], mutable=True),
      data["a1"],
      True,
  )
  for method in ("window", "reshape", "mask"):
    pieces[f"relu+pool1/{method}"] = (pool(method), {}, data["a1"], True)
  for method in ("conv", "im2col", "wgrad", "mm_bwd"):
    pieces[f"conv2/{method}"] = (
        *module(VariantConv(50, method), data["p1"]),
        data["p1"],
        True,
    )
  pieces["norm2"] = (
      *module(factory(use_running_average=False), data["a2"], mutable=True),
      data["a2"],
      True,
  )
  for method in ("window", "reshape", "mask"):
    pieces[f"relu+pool2/{method}"] = (pool(method), {}, data["a2"], True)
  pieces["fc1+relu"] = (
      *(lambda f, p: (lambda p_, x: nn.relu(f(p_, x)), p))(
          *module(nn.Dense(500), data["flat"])
      ),
      data["flat"],
      True,
  )
  pieces["fc2"] = (*module(nn.Dense(NUM_CLASSES), data["h"]), data["h"], True)
  import optax

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
      samples = time_interleaved(
          {"fwd": lambda: fwd(params, x), "fwd+bwd": lambda: bwd(params, x)},
          runs,
          warmup,
      )
      out[name] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
  return out


# ---------------------------------------------------------------------------
# Child processes.


def machine_info() -> dict[str, Any]:
  import flax

  return {
      "date": (
          datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="seconds"
          )
      ),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "devices": len(jax.devices()),
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
      "PJRT_NPROC": os.environ.get("PJRT_NPROC"),
  }


def child_time(spec: dict[str, Any]) -> dict[str, Any]:
  """Times ``spec['variants']`` for each norm in one process.

  ``spec``: norms, variants, batch, runs, warmup, and optionally
  ``adaptive``: time all variants for the first norm, then only base and the
  ``adaptive`` fastest ones for the others.
  """
  out = {"machine": machine_info(), "norms": {}}
  variants = list(spec["variants"])
  for k, norm in enumerate(spec["norms"]):
    setup = Setup(norm, spec["batch"])
    names = variants
    if k and spec.get("adaptive"):
      first = out["norms"][spec["norms"][0]]["variants"]
      ranked = sorted(
          (v for v in first if v != "base" and "median_ms" in first[v]),
          key=lambda v: first[v]["median_ms"],
      )
      names = ["base"] + ranked[: spec["adaptive"]]
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
      except Exception as e:  # pylint: disable=broad-except
        row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    if "base" in outs:
      for name in outs:
        if name != "base":
          row["variants"][name].update(
              compare_outputs(setup.state, outs["base"], outs[name])
          )
    samples = time_interleaved(fns, spec["runs"], spec["warmup"])
    for name, s in samples.items():
      row["variants"][name].update(summarize(s))
    if "base" in samples:
      base = statistics.median(samples["base"])
      for name, s in samples.items():
        row["variants"][name]["ratio_to_base"] = statistics.median(s) / base
    out["norms"][norm] = row
  return out


def child_profile(spec: dict[str, Any]) -> dict[str, Any]:
  out = {"machine": machine_info(), "profiles": {}}
  for norm in spec["norms"]:
    setup = Setup(norm, spec["batch"])
    for variant in spec["variants"]:
      try:
        compiled, state, _ = setup.compile(variant)
        run = setup.runner(compiled, state)
        for _ in range(spec["warmup"]):
          jax.block_until_ready(run())
        out["profiles"][f"{norm}/{variant}"] = profile_compiled(
            compiled, run, spec["steps"]
        )
      except Exception as e:  # pylint: disable=broad-except
        out["profiles"][f"{norm}/{variant}"] = {
            "error": f"{type(e).__name__}: {e}"[:500]
        }
    if spec.get("layers"):  # the other norms: only their norm layers
      out.setdefault("layers", {})[norm] = layer_costs(
          norm,
          spec["batch"],
          spec["layer_runs"],
          spec["warmup"],
          names=None if norm == spec["norms"][0] else ("norm1", "norm2"),
      )
  return out


_TORCH_CHILD = r"""
import json, os, sys, time, statistics
import torch, torch.nn as nn, torch.nn.functional as F
peer_path, runs, warm, threads, norms, alpha, batch = sys.argv[1:8]
sys.path.insert(0, os.path.dirname(peer_path))
peer = __import__(os.path.splitext(os.path.basename(peer_path))[0])
if int(threads):
  torch.set_num_threads(int(threads))
dev = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(int(batch), 1, 28, 28, device=dev)
y = torch.randint(0, 10, (int(batch),), device=dev)
res = {"torch": torch.__version__, "threads": torch.get_num_threads(),
       "batch": int(batch)}
for name in norms.split(","):
  norm = nn.BatchNorm2d if name == "bn" else (lambda c: peer.SQD(c, float(alpha)))
  model = peer.lenet(norm).to(dev)
  opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=5e-4)
  def f():
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
  res[name + "_ms"] = peer.timed(f, dev, int(runs), int(warm))
print("RESULT " + json.dumps(res))
"""


def run_child(
    kind: str,
    spec: dict[str, Any],
    *,
    devices: int,
    flag_set: str = "default",
    timeout: float = 900,
) -> dict:
  """Runs ``kind`` (time/profile) in a fresh interpreter with the flag set."""
  flags, env_extra = FLAG_SETS[flag_set]
  env = {
      k: v
      for k, v in os.environ.items()
      if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")
  }
  env.update(
      env_extra,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=(
          f"--xla_force_host_platform_device_count={devices} {flags}"
      ).strip(),
  )
  t = time.perf_counter()
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "benchmarks.bench_lenet_step",
          "--child",
          kind,
          json.dumps(spec),
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  wall = time.perf_counter() - t
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT):
      result = json.loads(line[len(_RESULT) :])
      result["wall_s"] = round(wall, 1)
      result["flag_set"] = flag_set
      return result
  return {
      "error": (
          f"child {kind} ({flag_set}, {devices} devices) exited "
          f"{proc.returncode}: {proc.stderr[-2000:]}"
      ),
      "flag_set": flag_set,
      "wall_s": round(wall, 1),
  }


def run_torch(args) -> dict[str, Any]:
  norms = "bn,sqd" if args.torch_sqd else "bn"
  cmd = [
      args.torch_python,
      "-c",
      _TORCH_CHILD,
      str(args.torch_peer),
      str(args.torch_runs),
      str(max(args.warmup, 3)),
      str(args.torch_threads),
      norms,
      "0.5",
      str(args.batch),
  ]
  t = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT):
      result = json.loads(line[len(_RESULT) :])
      result["wall_s"] = round(time.perf_counter() - t, 1)
      return result
  return {
      "error": (
          f"torch child exited {proc.returncode}: " f"{proc.stderr[-2000:]}"
      )
  }


# ---------------------------------------------------------------------------
# The parent.


def _ms(result: dict, norm: str, variant: str) -> float | None:
  try:
    return result["norms"][norm]["variants"][variant]["median_ms"]
  except (KeyError, TypeError):
    return None


def _fmt(ms: float | None) -> str:
  return "   failed" if ms is None else f"{ms:8.1f} ms"


def git_commit() -> str | None:
  """The checkout's commit, ``+dirty`` if tracked files differ from it."""
  try:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


class Report:
  """Collects the sections, printing as it goes and saving after each."""

  def __init__(self, args, argv):
    self.path = args.out
    self.data = {
        "command": " ".join(["python -m benchmarks.bench_lenet_step", *argv]),
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "code": git_commit(),
        "complete": False,
    }

  def put(self, key, value):
    self.data[key] = value
    self.save()

  def save(self):
    if self.path:
      Path(self.path).parent.mkdir(parents=True, exist_ok=True)
      with open(self.path, "w") as f:
        json.dump(self.data, f, indent=1)


def torch_bn(report: Report) -> float | None:
  vals = [r["bn_ms"] for r in report.data.get("torch", []) if "bn_ms" in r]
  return statistics.median(vals) if vals else None


def print_ratio_line(label: str, ms: float | None, torch_ms: float | None):
  extra = f"  = {ms / torch_ms:.2f}x PyTorch BN" if ms and torch_ms else ""
  print(f"  {label:<44} {_fmt(ms)}{extra}", flush=True)


def _print_profile(result: dict) -> None:
  for key, prof in result.get("profiles", {}).items():
    if "by_part" not in prof:
      print(f"  {key}: {prof}")
      continue
    print(
        f"  {key}: traced step {prof['traced_step_ms']:.0f} ms; ops "
        f"{prof['op_wall_ms_per_step']:.0f} ms; share of op time by "
        "layer/phase (Eigen conv/dot thunks run asynchronously: only their "
        "launch is traced, see 'layers'):"
    )
    for part, v in list(prof["by_part"].items())[:12]:
      print(f"    {part:<32} {100 * v['share']:5.1f}%  {v['wall_ms']:7.1f} ms")
    print(
        "    top ops: "
        + ", ".join(
            f"{o['op']} ({o['part']}) {100 * o['share']:.0f}%"
            for o in prof["top_ops"][:6]
        )
    )
  for norm, layers in result.get("layers", {}).items():
    print(f"  {norm}: each layer jitted alone, fwd / fwd+bwd ms:")
    for name, v in layers.items():
      if "error" in v:
        print(f"    {name:<22} {v['error'][:150]}")
      else:
        print(f"    {name:<22} {v['fwd']:8.1f} {v['fwd+bwd']:8.1f}")
  if "error" in result:
    print("  " + result["error"])


def main(argv: Sequence[str] | None = None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--child"]:
    kind, spec = argv[1], json.loads(argv[2])
    result = {"time": child_time, "profile": child_profile}[kind](spec)
    print(_RESULT + json.dumps(result), flush=True)
    return result

  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      "--runs", type=int, default=7, help="timed steps per variant (median)"
  )
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch", type=int, default=1000)
  parser.add_argument("--norms", nargs="+", default=["bn", "sqd2"])
  sections = ["variants", "profile", "flags", "final"]
  parser.add_argument(
      "--sections", nargs="+", default=sections, choices=sections
  )
  parser.add_argument(
      "--variants",
      nargs="+",
      default=list(DEFAULT_VARIANTS),
      choices=list(VARIANTS),
  )
  parser.add_argument(
      "--adaptive",
      type=int,
      default=2,
      help="after the first norm, time only base and this "
      "many of its fastest variants (0: all)",
  )
  parser.add_argument(
      "--winner",
      choices=list(VARIANTS),
      help="the variant for profile/flags/final (default: the "
      "fastest bn variant of the variants section)",
  )
  parser.add_argument(
      "--flag-sets",
      nargs="+",
      default=list(DEFAULT_FLAG_SETS),
      choices=[f for f in FLAG_SETS if f != "default"],
  )
  parser.add_argument(
      "--flag-variants",
      nargs="+",
      default=["winner"],
      help="variants timed in each flags process ('winner' "
      "is replaced by the winner)",
  )
  parser.add_argument(
      "--flag-runs",
      type=int,
      default=7,
      help="timed steps per variant in each flags process",
  )
  parser.add_argument(
      "--best-flags",
      choices=list(FLAG_SETS),
      help="flag set for the final section (default: the "
      "fastest exact one of the flags section)",
  )
  parser.add_argument(
      "--devices",
      type=int,
      nargs="+",
      default=[1, os.cpu_count() or 1],
      help="host device counts for the final section",
  )
  parser.add_argument("--profile-steps", type=int, default=2)
  parser.add_argument(
      "--layer-runs",
      type=int,
      default=5,
      help="timed runs per layer piece (0: no layer timing)",
  )
  parser.add_argument(
      "--torch-python",
      help="python of a venv with torch: also time the "
      "peer's LeNet BatchNorm step (at --batch)",
  )
  parser.add_argument("--torch-peer", type=Path, default=DEFAULT_PEER)
  parser.add_argument("--torch-runs", type=int, default=11)
  parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
  parser.add_argument(
      "--torch-sqd",
      action="store_true",
      help="also time the peer's kthvalue-SQD step",
  )
  parser.add_argument(
      "--quick",
      action="store_true",
      help="smoke check: batch 64, 1-2 runs, few variants, "
      "one flag set, 2 devices only in final",
  )
  parser.add_argument("--out", help="write the results as JSON here")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch, args.runs, args.flag_runs, args.warmup = 64, 2, 2, 1
    args.torch_runs, args.profile_steps, args.layer_runs = 2, 1, 1
    args.variants = ["base", "pool_mask", "pool_mask+wgrad"]
    args.flag_sets = ["ynn_off"]
    args.devices = [max(args.devices)]
  report = Report(args, argv)
  t_start = time.perf_counter()
  common = dict(batch=args.batch, warmup=args.warmup)

  if args.torch_python:
    print(
        f"PyTorch peer ({args.torch_peer.name}, {args.torch_threads} "
        f"threads, batch {args.batch})...",
        flush=True,
    )
    report.put("torch", [run_torch(args)])
    print(f"  {report.data['torch'][0]}", flush=True)

  winner = args.winner
  if "variants" in args.sections:
    print(
        f"variants (1 device, default flags, {args.runs} runs)...", flush=True
    )
    result = run_child(
        "time",
        dict(
            common,
            norms=args.norms,
            variants=args.variants,
            runs=args.runs,
            adaptive=args.adaptive,
        ),
        devices=1,
    )
    report.put("variants", result)
    if "error" in result:
      print("  " + result["error"])
    for norm, row in result.get("norms", {}).items():
      for name, v in row["variants"].items():
        if "error" in v:
          print(f"  {norm:>5} {name:<20} {v['error'][:200]}")
          continue
        diff = (
            f"  loss_rel {v['loss_rel']:.1e} update_rel "
            f"{v['update_rel']:.1e}"
            if "loss_rel" in v
            else ""
        )
        print(
            f"  {norm:>5} {name:<20} {_fmt(v.get('median_ms'))}  "
            f"x{v.get('ratio_to_base', float('nan')):.2f} of base{diff}",
            flush=True,
        )
    first = result.get("norms", {}).get(args.norms[0], {}).get("variants", {})
    timed = {
        k: v["median_ms"]
        for k, v in first.items()
        if k not in ("base", "flax_ops") and "median_ms" in v
    }
    if winner is None and timed:
      winner = min(timed, key=timed.get)
  winner = winner or "base"  # nothing else timed: the later sections time base
  report.data["winner"] = winner
  print(f"winner: {winner}", flush=True)

  if "profile" in args.sections:
    print("profile (1 device, default flags)...", flush=True)
    result = run_child(
        "profile",
        dict(
            common,
            norms=args.norms,
            variants=list(dict.fromkeys(["base", winner])),
            steps=args.profile_steps,
            layers=args.layer_runs > 0,
            layer_runs=args.layer_runs,
        ),
        devices=1,
    )
    report.put("profile", result)
    _print_profile(result)

  best_flags = args.best_flags
  if "flags" in args.sections:
    norm = args.norms[0]
    fvars = list(
        dict.fromkeys(
            winner if v == "winner" else v for v in args.flag_variants
        )
    )
    print(
        f"flags (1 device, {norm}, {', '.join(fvars)}, {args.flag_runs} "
        "runs)...",
        flush=True,
    )
    spec = dict(common, norms=[norm], variants=fvars, runs=args.flag_runs)
    order = ["default", *args.flag_sets] + (
        ["default"] if args.flag_sets else []
    )
    results = []
    for flag_set in order:
      results.append(run_child("time", spec, devices=1, flag_set=flag_set))
      report.put("flags", results)
    defaults = [r for r in results if r["flag_set"] == "default"]
    ref = {
        v: statistics.median(
            [_ms(r, norm, v) for r in defaults if _ms(r, norm, v)]
            or [float("nan")]
        )
        for v in fvars
    }
    ref_loss = next(
        (
            r["norms"][norm]["variants"][fvars[0]].get("loss")
            for r in defaults
            if "norms" in r
        ),
        None,
    )
    summary = {}
    for r in results:
      if "error" in r:
        print(f"  {r['flag_set']:<22} {r['error'][:300]}")
        continue
      row = r["norms"][norm]["variants"]
      loss = row.get(fvars[0], {}).get("loss")
      entry = {
          v: {
              "median_ms": _ms(r, norm, v),
              "ratio_to_default": (_ms(r, norm, v) or float("nan")) / ref[v],
          }
          for v in fvars
      }
      entry["loss_rel_to_default"] = (
          abs(loss - ref_loss) / abs(ref_loss)
          if loss is not None and ref_loss
          else float("nan")
      )
      summary.setdefault(r["flag_set"], []).append(entry)
      print(
          f"  {r['flag_set']:<22} "
          + "   ".join(
              f"{v} {_fmt(entry[v]['median_ms'])} "
              f"(x{entry[v]['ratio_to_default']:.2f})"
              for v in fvars
          )
          + f"   loss_rel {entry['loss_rel_to_default']:.1e}",
          flush=True,
      )
    report.data["flags_summary"] = summary
    if winner in fvars:
      candidates = {
          f: e[0][winner]["median_ms"]
          for f, e in summary.items()
          if f != "default"
          and f not in INEXACT_FLAG_SETS
          and e[0][winner]["median_ms"]
      }
      if best_flags is None and candidates:
        best = min(candidates, key=candidates.get)
        best_flags = best if candidates[best] < ref[winner] else "default"
  best_flags = best_flags or "default"
  report.data["best_flags"] = best_flags
  report.save()

  if "final" in args.sections:
    print(
        f"final: devices {args.devices} x flags default/{best_flags}, "
        f"base and {winner}, {', '.join(args.norms)}, {args.runs} runs...",
        flush=True,
    )
    spec = dict(
        common,
        norms=args.norms,
        variants=list(dict.fromkeys(["base", winner])),
        runs=args.runs,
    )
    finals = []
    for devices in args.devices:
      for flag_set in dict.fromkeys(["default", best_flags]):
        if (
            devices == 1
            and flag_set == "default"
            and "norms" in report.data.get("variants", {})
        ):
          continue  # measured in the variants section
        finals.append(
            dict(
                run_child("time", spec, devices=devices, flag_set=flag_set),
                devices=devices,
            )
        )
        report.put("final", finals)
        if "error" in finals[-1]:
          print("  " + finals[-1]["error"][:300])

  if args.torch_python:
    report.data["torch"].append(run_torch(args))
    report.save()
    print(f"  PyTorch again: {report.data['torch'][-1]}", flush=True)

  # Summary: every measured configuration against PyTorch's BatchNorm step.
  tbn = torch_bn(report)
  print(
      "summary"
      + (
          f" (PyTorch {report.data['torch'][0].get('torch')} "
          f"BatchNorm step {tbn:.1f} ms, median of "
          f"{len(report.data['torch'])} processes)"
          if tbn
          else ""
      )
      + ":"
  )
  rows, sources = [], []
  if "norms" in report.data.get("variants", {}):
    sources.append((1, "default", report.data["variants"]))
  for r in report.data.get("final", []):
    if "norms" in r:
      sources.append((r["devices"], r["flag_set"], r))
  for devices, flag_set, r in sources:
    for norm in args.norms:
      for variant in dict.fromkeys(("base", winner)):
        ms = _ms(r, norm, variant)
        if ms is None:
          continue
        rows.append(
            {
                "devices": devices,
                "flags": flag_set,
                "norm": norm,
                "variant": variant,
                "median_ms": ms,
                "ratio_to_torch_bn": ms / tbn if tbn else None,
            }
        )
        print_ratio_line(
            f"{norm} {variant}, {devices} dev, {flag_set}", ms, tbn
        )
  sq = [t["sqd_ms"] for t in report.data.get("torch", []) if "sqd_ms" in t]
  if sq:
    print(f"  PyTorch kthvalue-SQD step {statistics.median(sq):.1f} ms")
  report.data["summary"] = rows
  report.data["seconds"] = round(time.perf_counter() - t_start, 1)
  report.data["complete"] = True
  report.save()
  print(f"done in {report.data['seconds']:.0f} s", flush=True)
  return report.data


if __name__ == "__main__":
  main()
