"""ResNet20's exact convolution formulations and the step variants built on them.

``bench_resnet_step``'s catalogue: each formulation computes
``nn.Conv(features, (3, 3), strides, use_bias=False)`` on NHWC ``x`` and an
HWIO kernel, and each variant is a set of ``train.model.models.ResNet`` fields
that swaps one part of the real model for an earlier or other formulation.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from train.model.models import ResNetConv
from train.model.models import conv_col2im_dgrad
from train.model.models import conv_compiled
from train.model.models import conv_matmul_grads
from train.model.models import conv_same
from train.model.models import im2col


def _patches(x, kernel, strides):
  kh, kw = kernel.shape[:2]
  return im2col(x, kh, kw, strides=strides, padding="SAME")


def conv_im2col(x, kernel, strides):
  """Patches times the flattened kernel; autodiff gives matmul gradients."""
  flat = kernel.reshape(-1, kernel.shape[-1])
  return lax.dot_general(
      _patches(x, kernel, strides), flat, (((3,), (0,)), ((), ()))
  )


def _kernel_grad_mm(x, kernel, strides, g):
  """``patches^T @ g``: the kernel gradient as one matmul."""
  dk = lax.dot_general(
      _patches(x, kernel, strides), g, (((0, 1, 2), (0, 1, 2)), ((), ()))
  )
  return dk.reshape(kernel.shape)


def _input_grad_col2im(x, kernel, strides, g):
  flat = kernel.reshape(-1, kernel.shape[-1])
  dp = lax.dot_general(g, flat, (((3,), (1,)), ((), ())))
  return jax.vjp(lambda v: _patches(v, kernel, strides), x)[1](dp)[0]


def _input_grad_xla(x, kernel, strides, g):
  return jax.vjp(lambda v: conv_same(v, kernel, strides), x)[1](g)[0]


def _custom(input_grad, kernel_grad):
  """XLA's forward convolution with the given gradient formulations."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def conv(x, kernel, strides):
    return conv_same(x, kernel, strides)

  def fwd(x, kernel, strides):
    return conv_same(x, kernel, strides), (x, kernel)

  def bwd(strides, res, g):
    x, kernel = res
    return input_grad(x, kernel, strides, g), kernel_grad(x, kernel, strides, g)

  conv.defvjp(fwd, bwd)
  return conv


def _per_stride(strided, plain=conv_same):
  return lambda x, k, s: (strided if s > 1 else plain)(x, k, s)


def conv_nchw(x, kernel, strides):
  """XLA's convolution on NCHW activations (transposed in and out here)."""
  x = jnp.transpose(x, (0, 3, 1, 2))
  dims = ("NCHW", "HWIO", "NCHW")
  y = lax.conv_general_dilated(
      x, kernel, (strides,) * 2, "SAME", None, None, dims
  )
  return jnp.transpose(y, (0, 2, 3, 1))


#: Formulation -> fn(x, kernel, strides). ``flax`` is nn.Conv's; ``resnet``
#: train.model.models.ResNetConv's (the CPU default), ``resnet_xla_forward`` its
#: formulation before the compiled forward pass, ``resnet_xla_kernel_grad``
#: before the compiled kernel gradient.
FORMULATIONS: dict[str, Callable[..., jax.Array]] = {
    "flax": conv_same,
    "resnet": conv_compiled,
    "resnet_xla_forward": conv_matmul_grads,
    "resnet_xla_kernel_grad": _per_stride(conv_col2im_dgrad),
    "im2col": conv_im2col,
    "im2col_strided": _per_stride(conv_im2col),
    "mm_bwd": _custom(_input_grad_col2im, _kernel_grad_mm),
    "wgrad_mm": _custom(_input_grad_xla, _kernel_grad_mm),
    "dgrad_col2im": conv_col2im_dgrad,
    "nchw": conv_nchw,
}


class FormulationConv(nn.Module):
  """``nn.Conv`` (no bias, SAME) computed by ``FORMULATIONS[method]``."""

  features: int
  kernel_size: tuple[int, int]
  strides: int = 1
  use_bias: bool = False
  kernel_init: Callable[..., jax.Array] = nn.initializers.lecun_normal()
  method: str = "flax"

  @nn.compact
  def __call__(self, x):
    kh, kw = self.kernel_size
    shape = (kh, kw, x.shape[-1], self.features)
    kernel = self.param("kernel", self.kernel_init, shape, jnp.float32)
    return FORMULATIONS[self.method](x, kernel, self.strides)


# ``flax`` and ``resnet*`` are variants of their own; ``nchw`` is timed in
# the convs section only.
_FORMULATIONS_OF_OTHER_VARIANTS = (
    "flax",
    "resnet",
    "resnet_xla_forward",
    "resnet_xla_kernel_grad",
    "nchw",
)
#: Variant -> ResNet fields (``base``: the real model as train builds it).
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "flax": {"conv": nn.Conv, "recompute_norm": False},
    "chained": {
        "conv": functools.partial(ResNetConv, compute_input_once=False)
    },
    "xla_kernel_grad": {
        "conv": functools.partial(ResNetConv, matmul_kernel_gradient=False)
    },
    "stored_norm": {"recompute_norm": False},
    "xla_forward": {
        "conv": functools.partial(ResNetConv, compiled_forward=False)
    },
} | {
    f: {"conv": functools.partial(FormulationConv, method=f)}
    for f in FORMULATIONS
    if f not in _FORMULATIONS_OF_OTHER_VARIANTS
}
#: The final section's variants (``--final-variants``).
FINAL_VARIANTS = [
    "base",
    "xla_forward",
    "stored_norm",
    "xla_kernel_grad",
    "chained",
    "flax",
]
#: ResNet20's convolutions: (height, in, out, stride, how many per step).
# fmt: off
CONV_SHAPES = ((32, 3, 16, 1, 1), (32, 16, 16, 1, 6), (32, 16, 32, 2, 1),
               (16, 32, 32, 1, 5), (16, 32, 64, 2, 1), (8, 64, 64, 1, 5))
# fmt: on
