"""A convolution's kernel gradient, fast on XLA:CPU.

GBN layers sit between convolutions, and on a CPU a convolutional network's
train step is mostly its convolutions. XLA:CPU (jaxlib 0.10) computes a
convolution's kernel gradient as a convolution whose contracted dimension is
the batch: it copies the input and the output gradient batch-minor first and
runs at a fraction of the forward convolution's speed.
:func:`conv_kernel_gradient` computes it instead as the matrix product it
is, with a compiled kernel (``gbn_jax/csrc/conv_kernel_grad_cpu.cc``, built
by ``pip install`` when a C++17 compiler is present): ResNet20's 19
convolutions at batch 256, forward and backward, took 456 ms with it against
823 ms with XLA's kernel gradient on a 2-core CPU (``docs/performance.md``).

Where the kernel is not built, and on every other backend, the result is
XLA's own kernel gradient. Under ``jit`` with the batch sharded over devices,
each device computes the gradient of its part of the batch and the parts are
summed (``custom_partitioning``): the result is the whole batch's. Under
``vmap`` the kernel runs once per mapped pair.
"""

from __future__ import annotations

from collections.abc import Sequence
import ctypes
import functools
import importlib.util

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Padding = str | Sequence[tuple[int, int]]

_LIBRARY = "gbn_jax._conv_cpu"
_TARGET = "gbn_conv_kernel_grad_f32"
_DIMENSIONS = ("NHWC", "HWIO", "NHWC")


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
  """Whether the compiled kernel is installed and registered with XLA:CPU."""
  spec = importlib.util.find_spec(_LIBRARY)
  if spec is None or not spec.origin:
    return False
  try:
    handler = ctypes.CDLL(spec.origin).GbnConvKernelGradF32
  except (OSError, AttributeError):
    return False
  jax.ffi.register_ffi_target(
      _TARGET, jax.ffi.pycapsule(handler), platform="cpu"
  )
  return True


def _xla_kernel_gradient(x, g, kernel_shape, strides, pads):
  kernel = jnp.zeros(kernel_shape, x.dtype)
  conv = lambda k: lax.conv_general_dilated(
      x, k, strides, pads, dimension_numbers=_DIMENSIONS
  )
  return jax.vjp(conv, kernel)[1](g)[0]


def _native_call(x, g, kernel_shape, strides, tops):
  out = jax.ShapeDtypeStruct(kernel_shape, jnp.float32)
  return jax.ffi.ffi_call(_TARGET, out)(
      x,
      g,
      stride_h=np.int64(strides[0]),
      stride_w=np.int64(strides[1]),
      top=np.int64(tops[0]),
      left=np.int64(tops[1]),
  )


def _batch_axes(sharding):
  spec = getattr(sharding, "spec", None)
  return spec[0] if spec else None


def _partition(kernel_shape, strides, tops, mesh, arg_shapes, result_shape):
  # Each device takes its images (any other sharding is gathered first) and
  # the per-device gradients are summed.
  del result_shape
  axes = _batch_axes(arg_shapes[0].sharding)
  batch_sharded = jax.sharding.NamedSharding(mesh, jax.P(axes))

  def lower(x, g):
    dk = _native_call(x, g, kernel_shape, strides, tops)
    return dk if axes is None else lax.psum(dk, axes)

  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  return mesh, lower, replicated, (batch_sharded, batch_sharded)


def _result_sharding(
    kernel_shape, strides, tops, mesh, arg_shapes, result_shape
):
  del kernel_shape, strides, tops, arg_shapes, result_shape
  return jax.sharding.NamedSharding(mesh, jax.P())


@functools.lru_cache(maxsize=None)
def _native_kernel_gradient():
  """The native call, partitioned per device (built on first use: only where
  the kernel is, so that importing this module needs nothing of
  custom_partitioning's API elsewhere, e.g. on an accelerator's image)."""
  native = custom_partitioning(_native_call, static_argnums=(2, 3, 4))
  native.def_partition(
      _partition,
      infer_sharding_from_operands=_result_sharding,
      sharding_rule="n h w c, n p q f -> i j c f",
  )
  return native


def conv_kernel_gradient(
    x: Array,
    g: Array,
    kernel_size: tuple[int, int],
    strides: int | tuple[int, int] = 1,
    padding: Padding = "SAME",
) -> Array:
  """The gradient with respect to the kernel of a 2-D convolution.

  The convolution is ``lax.conv_general_dilated(x, kernel, strides, padding,
  dimension_numbers=('NHWC', 'HWIO', 'NHWC'))`` (``flax.linen.Conv``'s, no
  dilation, one feature group), ``g`` the gradient of a loss with respect to
  its output; the result is the gradient with respect to ``kernel``,
  ``(kh, kw, C, F)``: the sum over images and output positions of each
  window of ``x`` times ``g`` there. On XLA:CPU with the compiled kernel and
  float32 operands it is computed by that kernel (the same sums in another
  order), elsewhere by XLA.

  Args:
    x: The convolution's input, ``(N, H, W, C)``.
    g: The gradient with respect to its output, ``(N, P, Q, F)``.
    kernel_size: ``(kh, kw)``.
    strides: An int or a pair.
    padding: ``'SAME'``, ``'VALID'`` or ``((top, bottom), (left, right))``.

  Returns:
    ``(kh, kw, C, F)``, in ``x``'s dtype.

  >>> x = jnp.ones((2, 4, 4, 1))
  >>> g = jnp.ones((2, 4, 4, 1))
  >>> conv_kernel_gradient(x, g, (3, 3))[:, :, 0, 0]
  Array([[18., 24., 18.],
         [24., 32., 24.],
         [18., 24., 18.]], dtype=float32)
  """
  if x.ndim != 4 or g.ndim != 4:
    raise ValueError(f"x and g must be NHWC, got {x.shape} and {g.shape}")
  strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
  kernel_shape = (*kernel_size, x.shape[-1], g.shape[-1])
  if isinstance(padding, str):
    pads = lax.padtype_to_pads(x.shape[1:3], kernel_size, strides, padding)
  else:
    pads = padding
  pads = tuple(tuple(int(p) for p in pair) for pair in pads)
  expected = jax.eval_shape(
      lambda k: lax.conv_general_dilated(
          x, k, strides, pads, dimension_numbers=_DIMENSIONS
      ),
      jax.ShapeDtypeStruct(kernel_shape, x.dtype),
  ).shape
  if g.shape != expected:
    raise ValueError(
        f"g has shape {g.shape}; the convolution's output is {expected}"
    )
  xla = functools.partial(
      _xla_kernel_gradient,
      kernel_shape=kernel_shape,
      strides=strides,
      pads=pads,
  )
  if not (
      x.dtype == g.dtype == jnp.float32
      and min(pad for pair in pads for pad in pair) >= 0
      and native_available()
  ):
    return xla(x, g)
  tops = (pads[0][0], pads[1][0])

  @jax.custom_batching.custom_vmap
  def native(x, g):
    return _native_kernel_gradient()(x, g, kernel_shape, strides, tops)

  @native.def_vmap
  def _one_pair_at_a_time(axis_size, in_batched, x, g):
    # Under vmap: each (x, g) pair in turn, unbatched operands shared.
    x, g = (
        a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
        for a, batched in zip((x, g), in_batched)
    )
    return lax.map(lambda pair: native(*pair), (x, g)), True

  return lax.platform_dependent(x, g, cpu=native, default=xla)
