"""The LeNet train step's exact reformulations, timed by ``bench_lenet_step``.

Same parameter tree as ``train.model.models.LeNet`` (conv1/kernel (5,5,1,20), norm1,
conv2/kernel (5,5,20,50), norm2, fc1, fc2), same math: max-pool as reshape +
max or with a mask backward instead of ``select_and_scatter``, convolutions
(or only their backward passes) as im2col matmuls, NCHW layout.
"""

from __future__ import annotations

from collections.abc import Callable
import functools

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from train.loop import train_state
from train.model import models
from train.model.models import im2col

DATASET = "fashion_mnist"
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


def max_pool_2x2(x: jax.Array, layout: str = "nhwc") -> jax.Array:
  """2x2 stride-2 VALID max-pool as a reshape and a max over two axes.

  NHWC is ``train.model.models.max_pool_2x2`` (see there for its gradient on
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
  """train.model.models.LeNet with swappable formulations of its ops.

  Attributes:
    num_classes: Number of output logits.
    norm: Norm factory from ``train.model.models.make_norm``.
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


#: Variant name -> LeNetVariant fields (``base`` is train.model.models.LeNet).
VARIANTS: dict[str, dict[str, str] | None] = {
    "base": None,
    # nn.Conv and nn.max_pool: train.model.models.LeNet until it took the fastest
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


def make_model(variant: str, config) -> nn.Module:
  """The config's LeNet (``base``) or a LeNetVariant with the config's norm."""
  fields = VARIANTS[variant]
  if fields is None:
    return train_state.create_model(config, NUM_CLASSES)
  norm = models.make_norm(
      config.norm, momentum=config.norm_momentum, epsilon=config.norm_epsilon
  )
  return LeNetVariant(num_classes=NUM_CLASSES, norm=norm, **fields)
