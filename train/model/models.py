"""LeNet and ResNet20 with a swappable normalization layer.

Both models build every normalization layer through one factory, the ``norm``
field: `train.model.norms.make_norm`'s ``functools.partial`` of
``flax.linen.BatchNorm`` (``--norm bn``, the baseline) or of
``gbn_jax.GBatchNorm(measure=...)``, or of a group norm (``--norm gn``,
``gn:<measure>``). That factory is the only thing that differs between norms,
and every norm layer has an explicit name, so the parameter and
``batch_stats`` trees are identical for all batch norms (a group norm has the
same parameters and no ``batch_stats``).

Architectures (as in the GBN paper, Yuan et al., AAAI 2019):

* LeNet (Caffe's MNIST LeNet with a norm after each conv): conv 5x5x20 ->
  norm -> ReLU -> max-pool 2 -> conv 5x5x50 -> norm -> ReLU -> max-pool 2 ->
  dense 500 -> ReLU -> dense(classes). Convolutions use VALID padding, as in
  Caffe's LeNet, so a 28x28 input gives a 4x4x50 feature map before the dense
  layers (5x5x50 for 32x32 inputs). On a CPU its convolutions run as im2col
  matmuls and its pools as a reshape and a max (:class:`PatchConv`,
  :func:`max_pool_2x2`): the same parameters and function, and faster train
  steps on XLA:CPU (``results/benchmarks/lenet_step_cpu*.json``).
* ResNet20 (He et al. 2016, CIFAR variant): 3x3 conv 16 -> norm -> ReLU, then
  3 stages x 3 basic blocks with 16/32/64 channels (stride 2 at the start of
  stages 2 and 3), global average pooling and a dense classifier. Shortcuts
  are He et al.'s option A: identity, and where the shape changes, spatial
  subsampling by 2 with zero-padded extra channels. Option A has no
  parameters, so "a norm after every conv" holds without a projection conv,
  and the CIFAR-10 model has 0.27M parameters as in the paper. On a CPU its
  convolutions run in the training suite's compiled kernels (forward pass,
  kernel gradient and input gradient, :func:`train.native.convolution.conv`),
  every convolution's input is computed once (:class:`ResNetConv`), and the
  norm layers' backward pass recomputes their elementwise work
  (:func:`recompute_elementwise`): the same parameters and function, up to
  float32 summation order (``benchmarks/step/bench_resnet_step.py``).

Convolutions followed by a norm have no bias: every GBN statistic S is
translation-equivariant (S(x + c) = S(x) + c) and every deviation D is
translation-invariant, so a conv bias would be cancelled by the norm and the
norm's own learned bias takes its place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from train.model.layers import PatchConv
from train.model.layers import im2col
from train.model.layers import max_pool_2x2

# Re-exported: callers, tests and docs name these as train.model.models.*.
from train.model.norms import CALIBRATIONS as CALIBRATIONS
from train.model.norms import DEFAULT_GROUPS as DEFAULT_GROUPS
from train.model.norms import RENORM_REFUSAL as RENORM_REFUSAL
from train.model.norms import ModuleDef
from train.model.norms import NormSpec as NormSpec
from train.model.norms import make_norm as make_norm
from train.model.norms import norm_names as norm_names
from train.model.norms import parse_norm as parse_norm
from train.model.norms import recompute_elementwise
from train.native.convolution import conv as gbn_conv
from train.native.convolution import conv_kernel_gradient


def conv_same(x: jax.Array, kernel: jax.Array, strides: int) -> jax.Array:
  """``nn.Conv``'s SAME convolution of NHWC ``x`` with an HWIO kernel."""
  return lax.conv_general_dilated(
      x,
      kernel,
      (strides, strides),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def conv_col2im_dgrad(
    x: jax.Array, kernel: jax.Array, strides: int
) -> jax.Array:
  """:func:`conv_same` whose input gradient is a matmul and a col2im.

  The forward pass and the kernel gradient are XLA's. The input gradient is
  ``col2im(g @ kernel^T)`` (the transpose of :func:`im2col`: each patch's
  gradient summed back into place) instead of XLA's transposed convolution,
  which for ``strides > 1`` convolves a zero-dilated gradient (4 times the
  positions at stride 2) and runs slower on XLA:CPU.
  """
  return conv_same(x, kernel, strides)


def _col2im_dgrad_fwd(x, kernel, strides):
  return conv_same(x, kernel, strides), (x, kernel)


def _col2im_input_gradient(x, kernel, strides, g):
  kh, kw, _, features = kernel.shape
  dpatches = lax.dot_general(
      g, kernel.reshape(-1, features), (((3,), (1,)), ((), ()))
  )
  _, col2im = jax.vjp(
      lambda v: im2col(v, kh, kw, strides=strides, padding="SAME"), x
  )
  return col2im(dpatches)[0]


def _col2im_dgrad_bwd(strides, res, g):
  x, kernel = res
  _, kernel_vjp = jax.vjp(lambda k: conv_same(x, k, strides), kernel)
  return _col2im_input_gradient(x, kernel, strides, g), kernel_vjp(g)[0]


conv_col2im_dgrad.defvjp(_col2im_dgrad_fwd, _col2im_dgrad_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def conv_matmul_grads(
    x: jax.Array, kernel: jax.Array, strides: int
) -> jax.Array:
  """:func:`conv_same` whose kernel gradient is a compiled matrix product.

  The forward pass is XLA's. The kernel gradient is
  :func:`train.native.convolution.conv_kernel_gradient` (on XLA:CPU with the
  compiled kernel: the sum of each patch times the output gradient, without
  XLA's batch-minor copies); the input gradient is XLA's for ``strides ==
  1`` and :func:`conv_col2im_dgrad`'s col2im otherwise. Equal to
  :func:`conv_same`'s gradients up to float32 summation order.
  """
  return conv_same(x, kernel, strides)


def _matmul_grads_bwd(strides, res, g):
  x, kernel = res
  if strides == 1:
    _, input_vjp = jax.vjp(lambda v: conv_same(v, kernel, 1), x)
    dx = input_vjp(g)[0]
  else:
    dx = _col2im_input_gradient(x, kernel, strides, g)
  return dx, conv_kernel_gradient(x, g, kernel.shape[:2], strides, "SAME")


conv_matmul_grads.defvjp(_col2im_dgrad_fwd, _matmul_grads_bwd)


def conv_compiled(x: jax.Array, kernel: jax.Array, strides: int) -> jax.Array:
  """:func:`conv_same` with its forward pass and gradients compiled.

  :func:`train.native.convolution.conv` (on XLA:CPU with the compiled kernels:
  the forward pass, the kernel gradient, and the input gradient, as a
  forward convolution of the output gradient at stride 1 and as each
  window's gradient added into place when strided). Equal to
  :func:`conv_same` and its gradients up to float32 summation order.
  """
  return gbn_conv(x, kernel, strides, "SAME")


def computed_once(x: jax.Array) -> jax.Array:
  """``x`` itself, which XLA:CPU then computes once, not in every consumer.

  For finite ``x`` the result is ``x`` exactly and so is the gradient, up to
  the backend's flushing of subnormals, as after any arithmetic; an infinite
  element becomes NaN.

  Args:
    x: Any array.

  Returns:
    ``x / ones``, with ones XLA can't fold.
  """
  # XLA:CPU fuses cheap elementwise producers into each of their consumers,
  # duplicating them. In ResNet20 a convolution's input is a chain of them
  # (the norm, shortcut addition and ReLU of the blocks before it), and the
  # kernel gradient's batch-minor copy of that input recomputes the whole
  # chain, reading one image apart per element written, back to the stem
  # (docs/performance.md). XLA does not duplicate a division, so dividing by
  # ones it can't fold ends the chain where it is first computed. The
  # divisor is whole-shape (a broadcast scalar divisor becomes a
  # multiplication by its reciprocal) and a constant to autodiff.
  return x / lax.stop_gradient(1 + 0 * x)


class ResNetConv(nn.Module):
  """``nn.Conv(features, kernel_size, strides, use_bias=False)`` for XLA:CPU.

  The same parameter (``kernel``, HWIO, from ``kernel_init``: the same
  values from the same key), the same SAME padding and the same function up
  to float32 summation order: computed by :func:`conv_compiled` (the
  compiled forward pass, kernel gradient and input gradient of
  :mod:`train.native.convolution`), with the input through
  :func:`computed_once`. ResNet's formulation on a CPU
  (``benchmarks/step/bench_resnet_step.py``).

  Attributes:
    features: Output channels.
    kernel_size: ``(height, width)`` of the kernel.
    strides: Stride of both spatial dimensions (an int or an equal pair).
    use_bias: Must be False (nn.Conv's argument, accepted for its
      signature).
    kernel_init: The kernel's initializer (``nn.Conv``'s default).
    compute_input_once: Pass the input through :func:`computed_once` (the
      default; ``False``: the input as given, a formulation the benchmark
      compares).
    matmul_kernel_gradient: Take the gradients from
      :func:`conv_matmul_grads` (the default; ``False``: XLA's kernel
      gradient, :func:`conv_col2im_dgrad` for strided convolutions, a
      formulation the benchmark compares).
    compiled_forward: With ``matmul_kernel_gradient``, compute the forward
      pass and the input gradients by the compiled kernels too
      (:func:`conv_compiled`, the default; ``False``: XLA's forward pass and
      stride-1 input gradient, :func:`conv_col2im_dgrad`'s when strided, a
      formulation the benchmark compares).
  """

  features: int
  kernel_size: tuple[int, int]
  strides: int | tuple[int, int] = 1
  use_bias: bool = False
  kernel_init: Callable[..., jax.Array] = nn.initializers.lecun_normal()
  compute_input_once: bool = True
  matmul_kernel_gradient: bool = True
  compiled_forward: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.use_bias:
      raise ValueError("ResNetConv has no bias")
    strides = self.strides
    if not isinstance(strides, int):
      if len(set(strides)) != 1:
        raise ValueError(f"unequal strides {strides!r}")
      strides = strides[0]
    kh, kw = self.kernel_size
    kernel = self.param(
        "kernel",
        self.kernel_init,
        (kh, kw, x.shape[-1], self.features),
        jnp.float32,
    )
    if self.compute_input_once:
      x = computed_once(x)
    if self.matmul_kernel_gradient and self.compiled_forward:
      return conv_compiled(x, kernel, strides)
    if self.matmul_kernel_gradient:
      return conv_matmul_grads(x, kernel, strides)
    if strides == 1:
      return conv_same(x, kernel, 1)
    return conv_col2im_dgrad(x, kernel, strides)


class LeNet(nn.Module):
  """Caffe-style LeNet with a norm after each convolution.

  Attributes:
    num_classes: Number of output logits.
    norm: Norm factory from :func:`make_norm`.
    conv_as_matmul: Convolutions as im2col matmuls (:class:`PatchConv`)
      instead of ``nn.Conv``: the same parameters and function, faster on
      XLA:CPU. ``None`` (default): ``nn.Conv`` computing the matmuls where
      it is lowered for the CPU and XLA's convolution elsewhere (per
      lowering, so one trace exports for any platform).
  """

  num_classes: int
  norm: ModuleDef
  conv_as_matmul: bool | None = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = functools.partial(self.norm, use_running_average=not train)
    as_matmul = self.conv_as_matmul
    per_platform = None
    if as_matmul is None:
      # Per lowering, not per process (jax.default_backend()): a LeNet
      # traced here and lowered for a GPU gets XLA's convolution there.
      # PatchConv's matmul for VALID, stride-1 convolutions, LeNet's only.
      def per_platform(lhs, rhs, window_strides, padding, **kwargs):
        kh, kw, _, out = rhs.shape
        return lax.platform_dependent(
            lhs,
            rhs,
            cpu=lambda a, b: im2col(a, kh, kw) @ b.reshape(-1, out),
            default=lambda a, b: lax.conv_general_dilated(
                a, b, window_strides, padding, **kwargs
            ),
        )

    for i, features in enumerate((20, 50), start=1):
      if as_matmul:
        x = PatchConv(features, (5, 5), name=f"conv{i}")(x)
      else:
        x = nn.Conv(
            features,
            (5, 5),
            padding="VALID",
            use_bias=False,
            name=f"conv{i}",
            conv_general_dilated=per_platform,
        )(x)
      x = norm(name=f"norm{i}")(x)
      x = nn.relu(x)
      x = max_pool_2x2(x)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(500, name="fc1")(x))
    return nn.Dense(self.num_classes, name="fc2")(x)


def _option_a_shortcut(x: jax.Array, features: int, strides: int) -> jax.Array:
  """He et al.'s parameter-free shortcut: subsample, zero-pad channels."""
  if strides != 1:
    x = x[:, ::strides, ::strides, :]
  extra = features - x.shape[-1]
  if extra:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
  return x


class BasicBlock(nn.Module):
  """3x3 conv -> norm -> ReLU -> 3x3 conv -> norm, + shortcut, ReLU.

  Attributes:
    features: Output channels.
    strides: Stride of the first convolution (and of the shortcut).
    norm: Norm factory with ``use_running_average`` already bound.
    conv: The convolution module (``nn.Conv`` or :class:`ResNetConv`).
  """

  features: int
  strides: int
  norm: ModuleDef
  conv: ModuleDef = nn.Conv

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    conv = functools.partial(
        self.conv,
        self.features,
        (3, 3),
        use_bias=False,
        kernel_init=nn.initializers.kaiming_normal(),
    )
    y = conv(strides=self.strides, name="conv1")(x)
    y = nn.relu(self.norm(name="norm1")(y))
    y = conv(name="conv2")(y)
    y = self.norm(name="norm2")(y)
    return nn.relu(y + _option_a_shortcut(x, self.features, self.strides))


class ResNet(nn.Module):
  """CIFAR ResNet of He et al. (2016): 6n + 2 layers.

  Attributes:
    num_classes: Number of output logits.
    norm: Norm factory from :func:`make_norm`.
    blocks_per_stage: n (3 for ResNet20).
    stage_features: Channels of the three stages.
    conv: The convolution module, called like ``nn.Conv`` (features,
      kernel size, ``strides``, ``use_bias``, ``kernel_init``, ``name``).
      ``None`` (default): :class:`ResNetConv` where the default backend is
      the CPU, else ``nn.Conv``: the same parameters and function.
    recompute_norm: Pass the norm through :func:`recompute_elementwise`.
      ``None`` (default): where the default backend is the CPU. The same
      parameters and function either way.
  """

  num_classes: int
  norm: ModuleDef
  blocks_per_stage: int = 3
  stage_features: Sequence[int] = (16, 32, 64)
  conv: ModuleDef | None = None
  recompute_norm: bool | None = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    # A process-level choice on purpose: both choices have the same
    # parameters and function, so a ResNet traced here is right on any
    # platform, only tuned for this process's backend. Per lowering it
    # would take lax.platform_dependent around flax modules: the remat
    # (a lifted transform of the norm, with its batch_stats) and ResNetConv
    # (whose convolutions already choose per lowering, train.native.convolution)
    # traced once per platform inside flax's lifted control flow.
    on_cpu = jax.default_backend() == "cpu"
    norm = self.norm
    if on_cpu if self.recompute_norm is None else self.recompute_norm:
      norm = recompute_elementwise(norm)
    norm = functools.partial(norm, use_running_average=not train)
    conv = self.conv
    if conv is None:
      conv = ResNetConv if on_cpu else nn.Conv
    x = conv(
        self.stage_features[0],
        (3, 3),
        use_bias=False,
        kernel_init=nn.initializers.kaiming_normal(),
        name="conv1",
    )(x)
    x = nn.relu(norm(name="norm1")(x))
    for stage, features in enumerate(self.stage_features):
      for block in range(self.blocks_per_stage):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(
            features,
            strides,
            norm,
            conv,
            name=f"stage{stage + 1}_block{block + 1}",
        )(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="fc")(x)


ResNet20 = functools.partial(ResNet, blocks_per_stage=3)

#: ``--model`` name -> constructor taking ``num_classes`` and ``norm``.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "lenet": LeNet,
    "resnet20": ResNet20,
}


def create_model(
    name: str, *, num_classes: int, norm: ModuleDef, **kwargs: Any
) -> nn.Module:
  """Builds a model by ``--model`` name.

  Args:
    name: One of :data:`MODELS`.
    num_classes: Number of output logits.
    norm: Norm factory from :func:`make_norm`.
    **kwargs: Extra module fields.

  Returns:
    The (unbound) flax module.

  Raises:
    ValueError: For an unknown name.
  """
  if name not in MODELS:
    raise ValueError(
        f"unknown model {name!r}; choose one of: {', '.join(MODELS)}"
    )
  return MODELS[name](num_classes=num_classes, norm=norm, **kwargs)


def with_forward_mode(model: nn.Module) -> nn.Module:
  """``model`` with layers that forward-mode autodiff goes through.

  :class:`ResNetConv`'s compiled kernels (ResNet's convolution where the
  default backend is the CPU) have reverse-mode rules only; ``nn.Conv``
  has the same parameters and function. A Hessian-vector product
  (``jax.jvp`` of ``jax.grad``) needs the latter.
  """
  if isinstance(model, ResNet) and model.conv is None:
    return model.clone(conv=nn.Conv)
  return model
