"""train.native.convolution.conv_kernel_gradient against the definition.

The reference is numpy in float64, written from the definition
(``tests.helpers.conv.kernel_gradient_reference``): the input zero-padded, and for
each kernel offset the sum over images and output positions of the shifted
input times the output gradient. Shapes cover the
compiled kernel's vector path (features a multiple of 8, row blocks of 6 and
their remainder) and its plain loops (other feature counts), strides,
SAME/VALID/asymmetric padding, windows larger than the image, one image,
and repeated values.
"""

import os

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from train.native import convolution
from train.native.convolution import conv_kernel_gradient

from tests.helpers.conv import CASES
from tests.helpers.conv import DIMENSIONS
from tests.helpers.conv import kernel_gradient_reference as reference
from tests.helpers.conv import pads_of


def _output_shape(shape, kernel_shape, strides, pads):
  return jax.eval_shape(
      lambda x, k: lax.conv_general_dilated(
          x, k, strides, pads, dimension_numbers=DIMENSIONS
      ),
      jax.ShapeDtypeStruct(shape, jnp.float32),
      jax.ShapeDtypeStruct(kernel_shape, jnp.float32),
  ).shape


def _case(
    shape, kernel_size, strides, padding, features, kind="normal", seed=0
):
  strides = (strides,) * 2 if isinstance(strides, int) else strides
  pads = pads_of(shape, kernel_size, strides, padding)
  out = _output_shape(shape, (*kernel_size, shape[-1], features), strides, pads)
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  g = rng.standard_normal(out)
  if kind == "repeated":  # a few values, many exact ties
    x = np.round(x * 2) / 2
    g = np.round(g)
  return x.astype(np.float32), g.astype(np.float32), strides, pads


@pytest.mark.parametrize("kind", ["normal", "repeated"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_equals_the_definition(case, kind):
  shape, kernel_size, strides, padding, features = case
  x, g, strides, pads = _case(
      shape, kernel_size, strides, padding, features, kind
  )
  want = reference(x, g, kernel_size, strides, pads)
  fn = jax.jit(
      lambda x, g: conv_kernel_gradient(x, g, kernel_size, strides, padding)
  )
  got = np.asarray(fn(x, g))
  assert got.shape == want.shape and got.dtype == np.float32
  scale = np.sqrt(np.einsum("nhwc->c", np.asarray(x, np.float64) ** 2).max())
  scale *= np.sqrt((np.asarray(g, np.float64) ** 2).sum(axis=(0, 1, 2)).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(scale, 1.0))
  if kind == "repeated":  # small integers and halves: every sum is exact
    np.testing.assert_array_equal(got, want)


def _compiled(fn, *args):
  """``jax.jit(fn)``'s compiled program for ``args`` and its HLO text."""
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, compiled.as_text()


def test_compiled_kernel_and_xla_agree_and_repeat_bit_for_bit(monkeypatch):
  if not convolution.native_available():
    pytest.skip("the compiled kernel is not built")
  x, g, strides, pads = _case((8, 16, 16, 16), (3, 3), 1, "SAME", 16, seed=3)
  # Two distinct functions: jit caches traces by function, so re-jitting one
  # after the patch below would serve its native trace again.
  native_fn = lambda x, g: conv_kernel_gradient(x, g, (3, 3), 1, "SAME")
  xla_fn = lambda x, g: conv_kernel_gradient(x, g, (3, 3), 1, "SAME")
  native, native_text = _compiled(native_fn, x, g)
  monkeypatch.setattr(convolution, "native_available", lambda: False)
  xla, xla_text = _compiled(xla_fn, x, g)
  assert "gbn_conv_kernel_grad_f32" in native_text
  assert " convolution(" not in native_text
  assert " convolution(" in xla_text
  assert "gbn_conv_kernel_grad_f32" not in xla_text
  first = np.asarray(native(x, g))
  again = np.asarray(native(x, g))
  np.testing.assert_array_equal(first.view(np.int32), again.view(np.int32))
  from_xla = np.asarray(xla(x, g))
  want = reference(x, g, (3, 3), strides, pads)
  scale = np.sqrt(np.einsum("nhwc->c", np.asarray(x, np.float64) ** 2).max())
  scale *= np.sqrt((np.asarray(g, np.float64) ** 2).sum(axis=(0, 1, 2)).max())
  np.testing.assert_allclose(from_xla, want, rtol=0, atol=1e-6 * scale)
  # The compiled kernel sums tiles from zero: no less accurate than XLA.
  assert np.abs(first - want).max() <= 2 * np.abs(from_xla - want).max() + 1e-6


def test_the_compiled_kernel_is_what_runs_on_a_cpu():
  if os.environ.get("GBN_EXPECT_NATIVE") == "1":
    assert convolution.native_available()
  if not convolution.native_available():
    pytest.skip("the compiled kernel is not built")
  x, g, *_ = _case((2, 4, 4, 8), (3, 3), 1, "SAME", 8)
  text = (
      jax.jit(lambda x, g: conv_kernel_gradient(x, g, (3, 3)))
      .lower(x, g)
      .compile()
      .as_text()
  )
  assert "gbn_conv_kernel_grad_f32" in text
  assert " convolution(" not in text


def test_a_cpu_export_needs_the_kernels_checks_and_computes_the_gradient():
  if not convolution.native_available():
    pytest.skip("the compiled kernel is not built")
  checks = convolution.export_disabled_checks()
  targets = ["kernel_grad", "forward", "input_grad"]
  assert checks == [
      jax.export.DisabledSafetyCheck.custom_call(f"gbn_conv_{t}_f32")
      for t in targets
  ]
  x, g, strides, pads = _case((2, 5, 5, 4), (3, 3), 1, "SAME", 8)
  fn = jax.jit(lambda x, g: conv_kernel_gradient(x, g, (3, 3)))
  specs = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, g)]
  with pytest.raises(ValueError, match="gbn_conv_kernel_grad_f32"):
    jax.export.export(fn, platforms=["cpu"])(*specs)
  exported = jax.export.export(fn, platforms=["cpu"], disabled_checks=checks)
  exported = exported(*specs)
  assert "gbn_conv_kernel_grad_f32" in exported.mlir_module()
  want = reference(x, g, (3, 3), strides, pads)
  np.testing.assert_allclose(exported.call(x, g), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_is_xla_s_and_keeps_the_dtype(dtype):
  x, g, strides, pads = _case((2, 5, 5, 4), (3, 3), 1, "SAME", 8)
  got = conv_kernel_gradient(x.astype(dtype), g.astype(dtype), (3, 3))
  assert got.dtype == dtype
  want = reference(x.astype(dtype), g.astype(dtype), (3, 3), strides, pads)
  np.testing.assert_allclose(
      np.asarray(got, np.float64), want, rtol=0.05, atol=0.5
  )


def test_non_finite_values_spread_as_in_the_zero_padded_sum():
  x, g, strides, pads = _case((2, 4, 4, 8), (3, 3), 1, "SAME", 8)
  x[0, 1, 2, 3] = np.nan
  g[1, 0, 0, 5] = np.inf  # meets padded zeros: 0 * inf is NaN
  got = np.asarray(
      jax.jit(lambda x, g: conv_kernel_gradient(x, g, (3, 3)))(x, g)
  )
  with np.errstate(invalid="ignore"):
    want = reference(x, g, (3, 3), strides, pads)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], atol=1e-4)


def test_bad_shapes_are_errors():
  x = jnp.zeros((2, 4, 4, 3))
  with pytest.raises(ValueError, match="NHWC"):
    conv_kernel_gradient(x[0], jnp.zeros((4, 4, 8)), (3, 3))
  with pytest.raises(ValueError, match="output is"):
    conv_kernel_gradient(x, jnp.zeros((2, 3, 3, 8)), (3, 3), 1, "SAME")
  with pytest.raises(ValueError, match="output is"):
    conv_kernel_gradient(x, jnp.zeros((3, 4, 4, 8)), (3, 3))


def test_gradient_of_a_convolution_matches_finite_differences():
  # conv_kernel_gradient is the derivative of <conv(x, k), g> in k.
  x, g, strides, pads = _case((2, 5, 5, 3), (3, 3), 2, "SAME", 8, seed=5)
  x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
  got = np.asarray(conv_kernel_gradient(x, g, (3, 3), 2, "SAME"))
  rng = np.random.default_rng(6)
  k = rng.standard_normal((3, 3, 3, 8))
  direction = rng.standard_normal(k.shape)

  def objective(kernel):
    y = lax.conv_general_dilated(
        jnp.asarray(x64, jnp.float32),
        jnp.asarray(kernel, jnp.float32),
        strides,
        pads,
        dimension_numbers=DIMENSIONS,
    )
    return float(np.sum(np.asarray(y, np.float64) * g64))

  eps = 1e-2  # the objective is linear in k: differences are exact but for rounding
  numeric = (
      objective(k + eps * direction) - objective(k - eps * direction)
  ) / (2 * eps)
  np.testing.assert_allclose(np.sum(got * direction), numeric, rtol=1e-3)


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0), (0, None)], ids=str)
def test_vmap_gives_each_pair_s_gradient(in_axes):
  rng = np.random.default_rng(7)
  x = rng.standard_normal((3, 2, 5, 5, 4)).astype(np.float32)
  g = rng.standard_normal((3, 2, 3, 3, 8)).astype(np.float32)
  args = [a if axis == 0 else a[0] for a, axis in zip((x, g), in_axes)]
  fn = lambda x, g: conv_kernel_gradient(x, g, (3, 3), 2, "SAME")
  got = np.asarray(jax.jit(jax.vmap(fn, in_axes=in_axes))(*args))
  pads = pads_of(x.shape[1:], (3, 3), (2, 2), "SAME")
  for i in range(3):
    pair = [a[i] if axis == 0 else a for a, axis in zip(args, in_axes)]
    want = reference(*pair, (3, 3), (2, 2), pads)
    np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
