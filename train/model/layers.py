"""LeNet's layers as XLA:CPU runs them fastest: the same functions as flax's.

:func:`max_pool_2x2` and :class:`PatchConv` compute ``nn.max_pool`` and
``nn.Conv`` (VALID, no bias) with the same parameters, as a reshape and a max
and as an im2col matmul (:func:`im2col`); `train.model.models`' LeNet uses them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp


def max_pool_2x2(x: jax.Array) -> jax.Array:
  """2x2 stride-2 VALID max-pool of NHWC ``x``, as a reshape and a max.

  The values are ``nn.max_pool(x, (2, 2), strides=(2, 2))``'s. The gradient
  goes to each window's maximum, split equally over tied maxima, where
  ``nn.max_pool``'s (``select_and_scatter``) gives it all to one of them; the
  two agree wherever a window's maximum is unique, and after a ReLU the ties
  are zeros, whose ReLU gradient is zero either way.

  >>> x = jnp.arange(16.).reshape(1, 4, 4, 1)
  >>> max_pool_2x2(x)[0, :, :, 0]
  Array([[ 5.,  7.],
         [13., 15.]], dtype=float32)
  """
  # Not nn.max_pool: on XLA:CPU its gradient builds index arrays and a
  # scatter, a large part of a LeNet step (benchmarks/step/bench_lenet_step.py
  # profiles it).
  n, h, w, c = x.shape
  x = x[:, : h // 2 * 2, : w // 2 * 2, :]
  return jnp.max(x.reshape(n, h // 2, 2, w // 2, 2, c), axis=(2, 4))


def im2col(
    x: jax.Array,
    kh: int,
    kw: int,
    *,
    strides: int = 1,
    padding: str = "VALID",
) -> jax.Array:
  """``kh x kw`` patches ``(n, oh, ow, kh*kw*c)`` of NHWC ``x``.

  Ordered like a flattened HWIO kernel, so ``im2col(x, kh, kw, strides=s,
  padding=p) @ kernel.reshape(-1, features)`` is ``lax.conv_general_dilated``
  with window strides ``(s, s)`` and padding ``p`` (``'VALID'`` or
  ``'SAME'``, as in ``nn.Conv``).
  """
  if padding != "VALID":
    pads = lax.padtype_to_pads(x.shape[1:3], (kh, kw), (strides,) * 2, padding)
    x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
  _, h, w, _ = x.shape
  oh, ow = (h - kh) // strides + 1, (w - kw) // strides + 1
  rows, cols = strides * (oh - 1) + 1, strides * (ow - 1) + 1
  return jnp.concatenate(
      [
          x[:, i : i + rows : strides, j : j + cols : strides, :]
          for i in range(kh)
          for j in range(kw)
      ],
      axis=-1,
  )


class PatchConv(nn.Module):
  """``nn.Conv`` (VALID padding, no bias) as an im2col matmul.

  The same parameter (``kernel``, HWIO, flax's default LeCun-normal init, so
  the same values from the same key) and the same function up to float32
  summation order, computed as an im2col matmul: the patches side by side,
  times the flattened kernel.

  Attributes:
    features: Output channels.
    kernel_size: ``(height, width)`` of the kernel.
  """

  features: int
  kernel_size: tuple[int, int]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # On XLA:CPU LeNet's convolutions, and above all their gradients, run
    # slower than these matmuls (benchmarks/step/bench_lenet_step.py).
    kh, kw = self.kernel_size
    kernel = self.param(
        "kernel",
        nn.initializers.lecun_normal(),
        (kh, kw, x.shape[-1], self.features),
        jnp.float32,
    )
    return im2col(x, kh, kw) @ kernel.reshape(-1, self.features)
