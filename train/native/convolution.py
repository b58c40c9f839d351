"""A convolution and its gradients, fast on XLA:CPU (the training suite's).

GBN layers sit between convolutions, and on a CPU a convolutional network's
train step is mostly its convolutions. XLA:CPU (jaxlib 0.10) computes a
convolution's kernel gradient as a convolution whose contracted dimension is
the batch: it copies the input and the output gradient batch-minor first and
runs at a fraction of the forward convolution's speed.
:func:`conv_kernel_gradient` computes it instead as the matrix product it
is, with a compiled kernel. :func:`conv` is the whole convolution,
differentiable: its forward pass, kernel gradient and input gradient (at any
stride) run in compiled kernels of the same kind (the input windows, read
where they lie in a zero-padded image, times the kernel, in AVX-512 or AVX2
registers where the CPU has them), faster than XLA:CPU's own convolutions on
ResNet20's shapes (``docs/performance.md``). ``GBN_CONV_MAX_ISA``
(``avx512``, ``avx2`` or ``scalar``, read once per process) caps the
instruction set: AVX-512 and AVX2 give the same bits; ``scalar``'s plain
loops round twice per term, not once.

The kernels (``train/native/csrc/conv_cpu.cc``) are compiled on first use with
the system's C++ compiler and cached per user (:mod:`train.native.build`: a few
seconds, once). Without a compiler, with ``GBN_CONV_NATIVE=0``, and on every
other backend, XLA computes the same things; a compiler that fails warns once,
naming its log. Under ``jit`` with the batch sharded over devices, each device
convolves its own images, and for the kernel gradient the devices' parts are
summed (``custom_partitioning``): the results are the whole batch's. Under
``vmap`` the kernels run once per mapped pair. A CPU ``jax.export`` of a program
that uses them needs :func:`export_disabled_checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
import ctypes
import functools
import subprocess
import warnings

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
import jax.numpy as jnp
import numpy as np

from train.native import build as native_build

Array = jax.Array
Padding = str | Sequence[tuple[int, int]]

_TARGET = "gbn_conv_kernel_grad_f32"
_FORWARD_TARGET = "gbn_conv_forward_f32"
_INPUT_GRADIENT_TARGET = "gbn_conv_input_grad_f32"
_DIMENSIONS = ("NHWC", "HWIO", "NHWC")

#: The custom-call targets of the compiled kernels (XLA:CPU only).
TARGETS = (_TARGET, _FORWARD_TARGET, _INPUT_GRADIENT_TARGET)


def _warn(problem: str) -> None:
  # Everything still works, only slower: say why.
  warnings.warn(
      f"gbn_jax training suite: the compiled convolution kernels {problem};"
      " XLA computes the convolutions instead.",
      RuntimeWarning,
      stacklevel=3,
  )


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
  """Whether the compiled kernels are built and registered with XLA:CPU.

  The first call builds them if need be
  (:func:`train.native.build.conv_library`). A build that fails, or a
  library that does not load, warns (once: the result is cached), and XLA
  computes the convolutions.
  """
  try:
    built = native_build.conv_library()
  except native_build.BuildFailed as e:
    _warn(f"failed to build ({e}; see {e.log})")
    return False
  except (OSError, subprocess.SubprocessError) as e:
    _warn(f"could not be built ({e})")
    return False
  if built is None:
    return False
  path = str(built)
  try:
    library = ctypes.CDLL(path)
    handlers = {
        _TARGET: library.GbnConvKernelGradF32,
        _FORWARD_TARGET: library.GbnConvForwardF32,
        _INPUT_GRADIENT_TARGET: library.GbnConvInputGradF32,
    }
  except (OSError, AttributeError) as e:
    _warn(f"{path!r} were found but do not load ({e})")
    return False
  for target, handler in handlers.items():
    jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(handler), platform="cpu"
    )
  return True


def export_disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
  """The ``jax.export`` checks a CPU lowering that calls the kernels needs.

  One ``DisabledSafetyCheck.custom_call`` per target in :data:`TARGETS`, to
  add to ``gbn_jax.export_disabled_checks()`` for a model that convolves with
  :func:`conv`. A process that only deserializes such an export calls
  :func:`native_available` first, which registers the kernels.

  Returns:
    A new list of ``jax.export.DisabledSafetyCheck``.
  """
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]


def _strides_and_pads(strides, padding, in_hw, kernel_hw):
  strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
  if isinstance(padding, str):
    pads = lax.padtype_to_pads(in_hw, kernel_hw, strides, padding)
  else:
    pads = padding
  return strides, tuple(tuple(int(p) for p in pair) for pair in pads)


def _native_applies(*operands, pads) -> bool:
  return (
      all(a.dtype == jnp.float32 for a in operands)
      and min(pad for pair in pads for pad in pair) >= 0
      and native_available()
  )


def _one_at_a_time(native):
  """``native`` under vmap: each mapped pair in turn, the others shared."""

  @jax.custom_batching.custom_vmap
  def call(a, b):
    return native(a, b)

  @call.def_vmap
  def _rule(axis_size, in_batched, a, b):
    a, b = (
        v if batched else jnp.broadcast_to(v, (axis_size, *v.shape))
        for v, batched in zip((a, b), in_batched)
    )
    return lax.map(lambda pair: call(*pair), (a, b)), True

  return call


def _xla_forward(x, kernel, strides, pads):
  return lax.conv_general_dilated(
      x, kernel, strides, pads, dimension_numbers=_DIMENSIONS
  )


def _xla_kernel_gradient(x, g, kernel_shape, strides, pads):
  kernel = jnp.zeros(kernel_shape, x.dtype)
  conv = lambda k: _xla_forward(x, k, strides, pads)
  return jax.vjp(conv, kernel)[1](g)[0]


def _ffi(target, out, a, b, strides, tops):
  """Both compiled kernels' call: two operands, the strides, leading pads."""
  return jax.ffi.ffi_call(target, out)(
      a,
      b,
      stride_h=np.int64(strides[0]),
      stride_w=np.int64(strides[1]),
      top=np.int64(tops[0]),
      left=np.int64(tops[1]),
  )


def _native_call(x, g, kernel_shape, strides, tops):
  out = jax.ShapeDtypeStruct(kernel_shape, jnp.float32)
  return _ffi(_TARGET, out, x, g, strides, tops)


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


def _partitioned(call, partition, result_sharding, sharding_rule):
  # Built on first use, only where the kernels are, so that importing this
  # module needs nothing of custom_partitioning's API elsewhere (e.g. on an
  # accelerator's image).
  native = custom_partitioning(call, static_argnums=(2, 3, 4))
  native.def_partition(
      partition,
      infer_sharding_from_operands=result_sharding,
      sharding_rule=sharding_rule,
  )
  return native


@functools.lru_cache(maxsize=None)
def _native_kernel_gradient():
  """The native kernel gradient, partitioned per device."""
  return _partitioned(
      _native_call, _partition, _result_sharding, "n h w c, n p q f -> i j c f"
  )


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
  kernel_shape = (*kernel_size, x.shape[-1], g.shape[-1])
  strides, pads = _strides_and_pads(strides, padding, x.shape[1:3], kernel_size)
  expected = jax.eval_shape(
      lambda k: _xla_forward(x, k, strides, pads),
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
  if not _native_applies(x, g, pads=pads):
    return xla(x, g)
  tops = (pads[0][0], pads[1][0])
  native = _one_at_a_time(
      lambda x, g: _native_kernel_gradient()(x, g, kernel_shape, strides, tops)
  )
  return lax.platform_dependent(x, g, cpu=native, default=xla)


# --- The forward convolution.


def _native_forward_call(x, kernel, out_hw, strides, tops):
  out = jax.ShapeDtypeStruct((x.shape[0], *out_hw, kernel.shape[-1]), x.dtype)
  return _ffi(_FORWARD_TARGET, out, x, kernel, strides, tops)


def _native_input_gradient_call(g, kernel, in_hw, strides, tops):
  out = jax.ShapeDtypeStruct((g.shape[0], *in_hw, kernel.shape[2]), g.dtype)
  return _ffi(_INPUT_GRADIENT_TARGET, out, g, kernel, strides, tops)


def _per_image_partition(call):
  """A partition for ``call(images, kernel, hw, strides, tops)``, per image."""

  def partition(hw, strides, tops, mesh, arg_shapes, result_shape):
    # Each device takes its images (any other sharding of them is gathered
    # first) and the whole kernel.
    del result_shape
    axes = _batch_axes(arg_shapes[0].sharding)
    batch_sharded = jax.sharding.NamedSharding(mesh, jax.P(axes))
    replicated = jax.sharding.NamedSharding(mesh, jax.P())

    def lower(images, kernel):
      return call(images, kernel, hw, strides, tops)

    return mesh, lower, batch_sharded, (batch_sharded, replicated)

  return partition


def _per_image_result_sharding(
    hw, strides, tops, mesh, arg_shapes, result_shape
):
  del hw, strides, tops, result_shape
  axes = _batch_axes(arg_shapes[0].sharding)
  return jax.sharding.NamedSharding(mesh, jax.P(axes))


def _partitioned_per_image(call, sharding_rule):
  """``call(images, kernel, hw, strides, tops)``, partitioned per image."""
  return _partitioned(
      call,
      _per_image_partition(call),
      _per_image_result_sharding,
      sharding_rule,
  )


@functools.lru_cache(maxsize=None)
def _native_forward():
  """The native forward pass, partitioned per device."""
  return _partitioned_per_image(
      _native_forward_call, "n h w c, i j c f -> n p q f"
  )


@functools.lru_cache(maxsize=None)
def _native_input_gradient():
  """The native input gradient at any stride, partitioned per device."""
  return _partitioned_per_image(
      _native_input_gradient_call, "n p q f, i j c f -> n h w c"
  )


def _forward(x, kernel, strides, pads):
  xla = functools.partial(_xla_forward, strides=strides, pads=pads)
  if not _native_applies(x, kernel, pads=pads):
    return xla(x, kernel)
  out_hw = jax.eval_shape(xla, x, kernel).shape[1:3]
  tops = (pads[0][0], pads[1][0])
  native = _one_at_a_time(
      lambda x, k: _native_forward()(x, k, out_hw, strides, tops)
  )
  return lax.platform_dependent(x, kernel, cpu=native, default=xla)


def _input_gradient(x, kernel, strides, pads, g):
  kh, kw = kernel.shape[:2]
  # At stride 1 the input gradient is a forward convolution of g with the
  # kernel turned half round and its channels swapped; padded so that its
  # output is x's shape.
  flipped_pads = (
      (kh - 1 - pads[0][0], kh - 1 - pads[0][1]),
      (kw - 1 - pads[1][0], kw - 1 - pads[1][1]),
  )
  if strides == (1, 1) and min(p for pair in flipped_pads for p in pair) >= 0:
    flipped = jnp.swapaxes(kernel[::-1, ::-1], 2, 3)
    return _forward(g, flipped, (1, 1), flipped_pads)
  xla = lambda g, kernel: jax.vjp(
      lambda v: _xla_forward(v, kernel, strides, pads), x
  )[1](g)[0]
  if not _native_applies(g, kernel, pads=pads):
    return xla(g, kernel)
  # Elsewhere (strided): each window's gradient, g times the kernel
  # transposed, added into the input's shape.
  tops = (pads[0][0], pads[1][0])
  native = _one_at_a_time(
      lambda g, k: _native_input_gradient()(g, k, x.shape[1:3], strides, tops)
  )
  return lax.platform_dependent(g, kernel, cpu=native, default=xla)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x, kernel, strides, pads):
  return _forward(x, kernel, strides, pads)


def _conv_fwd(x, kernel, strides, pads):
  return _forward(x, kernel, strides, pads), (x, kernel)


def _conv_bwd(strides, pads, residuals, g):
  x, kernel = residuals
  return (
      _input_gradient(x, kernel, strides, pads, g),
      conv_kernel_gradient(x, g, kernel.shape[:2], strides, pads),
  )


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv(
    x: Array,
    kernel: Array,
    strides: int | tuple[int, int] = 1,
    padding: Padding = "SAME",
) -> Array:
  """A 2-D convolution whose forward pass and gradients are compiled on XLA:CPU.

  The convolution is ``lax.conv_general_dilated(x, kernel, strides, padding,
  dimension_numbers=('NHWC', 'HWIO', 'NHWC'))`` (``flax.linen.Conv``'s, no
  dilation, one feature group, no bias). On XLA:CPU with the compiled kernels
  and float32 operands all three run there, the same sums in another order: the
  forward pass, the kernel gradient (:func:`conv_kernel_gradient`) and the input
  gradient, which at stride 1 is a forward convolution of the output gradient
  with the kernel turned half round and otherwise (strided, or padded wider than
  the kernel) a kernel of its own (each window's gradient, the output gradient
  times the transposed kernel, added into place). Elsewhere (other backends and
  dtypes, negative padding) XLA computes them. Differentiable once (reverse
  mode, a ``custom_vjp``).

  Args:
    x: ``(N, H, W, C)``.
    kernel: ``(kh, kw, C, F)``.
    strides: An int or a pair.
    padding: ``'SAME'``, ``'VALID'`` or ``((top, bottom), (left, right))``.

  Returns:
    ``(N, P, Q, F)``, in ``x``'s dtype.

  >>> x = jnp.ones((1, 3, 3, 1))
  >>> conv(x, jnp.ones((3, 3, 1, 1)))[0, :, :, 0]
  Array([[4., 6., 4.],
         [6., 9., 6.],
         [4., 6., 4.]], dtype=float32)
  """
  if x.ndim != 4 or kernel.ndim != 4 or x.shape[-1] != kernel.shape[2]:
    raise ValueError(
        f"x must be NHWC and kernel HWIO with x's channels, got {x.shape} and"
        f" {kernel.shape}"
    )
  strides, pads = _strides_and_pads(
      strides, padding, x.shape[1:3], kernel.shape[:2]
  )
  return _conv(x, kernel, strides, pads)
