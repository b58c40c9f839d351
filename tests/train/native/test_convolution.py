"""train.native.convolution.conv and its gradients against the definition.

The references are numpy in float64, written from the definition
(``tests.helpers.conv``): the input zero-padded, each output the sum over the
window and the input channels of input times kernel; the input gradient
each output gradient spread back over its window; the kernel gradient the
windows times the output gradient. Shapes cover the compiled kernels'
vector paths (features a multiple of 16 or 8, blocks of 12 or 6 positions
and their remainder) and their plain loops, strides, SAME/VALID/asymmetric
padding, windows larger than the image, and repeated values; each
instruction set is run in a process of its own.
"""

import os

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from train.model import models
from train.native import convolution
from train.native.convolution import conv

from tests.helpers.conv import CASES
from tests.helpers.conv import DIMENSIONS
from tests.helpers.conv import conv_case as _case
from tests.helpers.conv import forward_reference
from tests.helpers.conv import input_gradient_reference
from tests.helpers.conv import kernel_gradient_reference
from tests.helpers.conv import pads_of
from tests.helpers.process import ProcessFailed
from tests.helpers.process import run_python


def _close(got, want, scale_of):
  scale = float(np.max(np.abs(scale_of))) or 1.0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


def _require_compiled_kernels():
  if not convolution.native_available() or jax.default_backend() != "cpu":
    pytest.skip("the compiled kernels are not built, or this is not a CPU")


@pytest.mark.parametrize("kind", ["normal", "repeated"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_equal_the_definition(case, kind):
  x, k, g, strides, pads = _case(*case, kind)

  @jax.jit
  def forward_and_gradients(x, k, g):
    y, vjp = jax.vjp(lambda x, k: conv(x, k, strides, pads), x, k)
    return y, *vjp(g)

  y, dx, dk = forward_and_gradients(x, k, g)
  want_y = forward_reference(x, k, strides, pads)
  want_dx = input_gradient_reference(x, k, g, strides, pads)
  want_dk = kernel_gradient_reference(x, g, k.shape[:2], strides, pads)
  if kind == "repeated":
    # Half-integers times integers: every partial sum is exact in float32,
    # so any summation order gives the definition's value exactly.
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(dk, want_dk)
  else:
    _close(y, want_y, want_y)
    _close(dx, want_dx, want_dx)
    _close(dk, want_dk, want_dk)


def test_string_padding_and_int_strides():
  x, k, _, _, _ = _case((2, 7, 7, 8), (3, 3), 2, "VALID", 8, "normal")
  want = forward_reference(x, k, (2, 2), ((0, 0), (0, 0)))
  _close(conv(x, k, 2, "VALID"), want, want)


def test_the_compiled_kernels_are_what_runs_on_a_cpu():
  if os.environ.get("GBN_EXPECT_NATIVE") == "1":
    assert convolution.native_available()
  _require_compiled_kernels()
  x = jnp.ones((2, 8, 8, 16))
  k = jnp.ones((3, 3, 16, 16))
  step = jax.jit(jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), (0, 1)))
  text = step.lower(x, k).compile().as_text()
  # The forward pass and the stride-1 input gradient, and the kernel
  # gradient; no XLA convolution left.
  assert text.count('custom_call_target="gbn_conv_forward_f32"') == 2
  assert 'custom_call_target="gbn_conv_kernel_grad_f32"' in text
  assert " convolution(" not in text
  # Strided: the input gradient has a kernel of its own.
  strided = jax.jit(jax.grad(lambda x, k: jnp.sum(conv(x, k, 2) ** 2), (0, 1)))
  text = strided.lower(x, k).compile().as_text()
  for target in ("forward", "input_grad", "kernel_grad"):
    assert text.count(f'custom_call_target="gbn_conv_{target}_f32"') == 1
  assert " convolution(" not in text


def test_resnet20_s_cpu_train_step_convolves_only_in_the_compiled_kernels():
  _require_compiled_kernels()
  model = models.ResNet20(num_classes=10, norm=models.make_norm("bn"))
  x = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32)
  # Shapes are all the compiler needs: nothing here runs.
  variables = jax.eval_shape(
      lambda x: model.init(jax.random.key(0), x, train=False), x
  )

  def loss(params, stats, x):
    y, _ = model.apply(
        {"params": params, "batch_stats": stats},
        x,
        train=True,
        mutable=["batch_stats"],
    )
    return y.sum()

  step = (
      jax.jit(jax.grad(loss))
      .lower(variables["params"], variables["batch_stats"], x)
      .compile()
  )
  text = step.as_text()
  assert " convolution(" not in text
  # 19 convolutions: as many forward passes and kernel gradients; input
  # gradients for all but the stem's, 16 at stride 1 (forward passes of the
  # output gradient) and 2 strided.
  count = lambda t: text.count(f'custom_call_target="gbn_conv_{t}_f32"')
  assert count("kernel_grad") == 19
  assert (count("forward"), count("input_grad")) == (19 + 16, 2)


def test_repeated_calls_are_bit_identical():
  x, k, _, strides, pads = _case(
      (4, 16, 16, 16), (3, 3), 1, "SAME", 32, "normal"
  )
  fn = jax.jit(lambda x, k: conv(x, k, strides, pads))
  first = np.asarray(fn(x, k))
  for _ in range(3):
    np.testing.assert_array_equal(fn(x, k), first)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_is_xla_s_and_keeps_the_dtype(dtype):
  x = jax.random.normal(jax.random.key(0), (2, 6, 6, 8), dtype)
  k = jax.random.normal(jax.random.key(1), (3, 3, 8, 8), dtype)
  want = lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=DIMENSIONS
  )
  got = conv(x, k)
  assert got.dtype == dtype
  np.testing.assert_array_equal(got, want)


def test_non_finite_values_spread_as_in_the_zero_padded_sum():
  x = np.ones((1, 4, 4, 8), np.float32)
  x[0, 0, 0, 0] = np.inf
  x[0, 3, 3, 1] = np.nan
  k = np.ones((3, 3, 8, 8), np.float32)
  want = forward_reference(x, k, (1, 1), ((1, 1), (1, 1)))
  np.testing.assert_array_equal(conv(x, k), want.astype(np.float32))


def test_bad_shapes_are_errors():
  with pytest.raises(ValueError, match="NHWC"):
    conv(jnp.ones((4, 4, 3)), jnp.ones((3, 3, 3, 8)))
  with pytest.raises(ValueError, match="channels"):
    conv(jnp.ones((1, 4, 4, 3)), jnp.ones((3, 3, 4, 8)))


@pytest.mark.parametrize(
    "target, operands, out",
    [
        ("forward", ((1, 4, 4, 8), (3, 3, 8, 16)), (1, 4, 4, 16)),
        ("kernel_grad", ((1, 4, 4, 8), (1, 4, 4, 16)), (3, 3, 8, 16)),
        ("input_grad", ((1, 2, 2, 16), (3, 3, 8, 16)), (1, 4, 4, 8)),
    ],
)
def test_the_compiled_handlers_refuse_a_bad_geometry(target, operands, out):
  _require_compiled_kernels()

  def call(a, b, out=out, **changes):
    attrs = dict(stride_h=1, stride_w=1, top=1, left=1) | changes
    target_call = jax.ffi.ffi_call(
        f"gbn_conv_{target}_f32", jax.ShapeDtypeStruct(out, jnp.float32)
    )
    attrs = {k: np.int64(v) for k, v in attrs.items()}
    return target_call(jnp.ones(a), jnp.ones(b), **attrs)

  np.asarray(call(*operands, stride_h=2 if target == "input_grad" else 1))
  # The XLA FFI error's message is the handler's.
  with pytest.raises(Exception, match="must be >= 0"):
    np.asarray(call(*operands, top=-1))
  with pytest.raises(Exception, match="strides must be positive"):
    np.asarray(call(*operands, stride_w=0))
  with pytest.raises(Exception, match="do not agree"):
    np.asarray(call(*operands, out=(*out[:-1], out[-1] + 1)))


def test_gradients_match_finite_differences():
  x, k, _, strides, pads = _case((2, 5, 5, 8), (3, 3), 1, "SAME", 8, "normal")
  x, k = x.astype(np.float64), k.astype(np.float64)
  loss = lambda x, k: jnp.sum(jnp.sin(conv(x, k, strides, pads)))
  dx, dk = jax.grad(loss, (0, 1))(x.astype(np.float32), k.astype(np.float32))
  ref_loss = lambda x, k: np.sum(np.sin(forward_reference(x, k, strides, pads)))
  eps = 1e-6
  rng = np.random.default_rng(1)
  for grad, arg in ((dx, 0), (dk, 1)):
    for index in map(tuple, rng.integers(0, (x, k)[arg].shape, (4, 4))):
      args = [x.copy(), k.copy()]
      args[arg][index] += eps
      up = ref_loss(*args)
      args[arg][index] -= 2 * eps
      down = ref_loss(*args)
      np.testing.assert_allclose(
          grad[index], (up - down) / (2 * eps), rtol=2e-3, atol=2e-3
      )


@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0), (0, None)], ids=str)
def test_vmap_convolves_each_pair(in_axes, strides):
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((3, 2, 6, 6, 8)).astype(np.float32)
  ks = rng.standard_normal((3, 3, 3, 8, 16)).astype(np.float32)
  gs = rng.standard_normal((3, 2, 6 // strides, 6 // strides, 16))
  gs = gs.astype(np.float32)
  x = xs if in_axes[0] == 0 else xs[0]
  k = ks if in_axes[1] == 0 else ks[0]

  def forward_and_gradients(x, k, g):
    y, vjp = jax.vjp(lambda x, k: conv(x, k, strides), x, k)
    return y, *vjp(g)

  got = jax.jit(jax.vmap(forward_and_gradients, (*in_axes, 0)))(x, k, gs)
  pads = pads_of(xs.shape[1:], (3, 3), (strides, strides), "SAME")
  for i in range(3):
    xi = xs[i if in_axes[0] == 0 else 0]
    ki = ks[i if in_axes[1] == 0 else 0]
    strides_hw = (strides, strides)
    want = (
        forward_reference(xi, ki, strides_hw, pads),
        input_gradient_reference(xi, ki, gs[i], strides_hw, pads),
        kernel_gradient_reference(xi, gs[i], (3, 3), strides_hw, pads),
    )
    for a, b in zip(got, want):
      _close(a[i], b, b)


# Forward pass and both gradients of CASES' float32 convolutions, saved to
# argv[1]: a child per instruction set (GBN_CONV_MAX_ISA is read once).
_ISA_CHILD = """
import sys
import jax
import numpy as np
from train.native.convolution import conv
from tests.helpers.conv import CASES, conv_case

out = {}
for n, case in enumerate(CASES):
  x, k, g, strides, pads = conv_case(*case, "normal")
  y, vjp = jax.vjp(lambda x, k: conv(x, k, strides, pads), x, k)
  for name, a in zip("y dx dk".split(), (y, *vjp(g))):
    out[f"{n}/{name}"] = np.asarray(a)
np.savez(sys.argv[1], **out)
"""


def _convolutions_under(isa, path):
  run_python(_ISA_CHILD, {"GBN_CONV_MAX_ISA": isa}, args=[str(path)])
  return dict(np.load(path))


def test_every_instruction_set_gives_the_same_bits(tmp_path):
  _require_compiled_kernels()
  # AVX-512 and AVX2 (+ FMA) sum each output in the same order with one
  # rounding per term: the same bits (on a CPU without AVX-512, both caps
  # give AVX2). The plain loops round twice per term: close.
  widest = _convolutions_under("", tmp_path / "widest.npz")
  for isa in ("avx512", "avx2"):
    got = _convolutions_under(isa, tmp_path / f"{isa}.npz")
    for key, want in widest.items():
      np.testing.assert_array_equal(got[key], want, err_msg=f"{isa} {key}")
  plain = _convolutions_under("scalar", tmp_path / "scalar.npz")
  for n, case in enumerate(CASES):
    x, k, g, strides, pads = _case(*case, "normal")
    want = (
        forward_reference(x, k, strides, pads),
        input_gradient_reference(x, k, g, strides, pads),
        kernel_gradient_reference(x, g, k.shape[:2], strides, pads),
    )
    for name, w in zip("y dx dk".split(), want):
      _close(plain[f"{n}/{name}"], w, w)


def test_an_unknown_instruction_set_is_an_error():
  _require_compiled_kernels()
  code = (
      "import jax.numpy as jnp\n"
      "from train.native.convolution import conv\n"
      "conv(jnp.ones((1, 4, 4, 8)), jnp.ones((3, 3, 8, 8))).block_until_ready()"
  )
  with pytest.raises(ProcessFailed) as error:
    run_python(code, {"GBN_CONV_MAX_ISA": "sse9"})
  assert "GBN_CONV_MAX_ISA must be scalar, avx2, avx512 or unset" in (
      error.value.stderr
  )
