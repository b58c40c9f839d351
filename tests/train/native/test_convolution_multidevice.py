"""conv and conv_kernel_gradient on a batch sharded over 4 host devices.

Each device sums its own images and the parts are added (an all-reduce, no
gather of the activations); the result equals the single-device one.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4
(tests/train/test_multidevice.py does this in a subprocess).
"""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from train.native import convolution

from tests.helpers import multidevice as md

pytestmark = pytest.mark.multidevice

md.require_devices()


def _normal(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


@pytest.mark.parametrize("spec", [P("b"), P(None, "b"), P()], ids=str)
def test_sharded_batch_gives_the_whole_batch_gradient(spec):
  mesh = md.mesh("b")
  x, g = _normal(0, (8, 8, 8, 16), (8, 4, 4, 32))
  fn = lambda x, g: convolution.conv_kernel_gradient(x, g, (3, 3), 2, "SAME")
  want = np.asarray(jax.jit(fn)(x, g))
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  gs = jax.device_put(g, NamedSharding(mesh, spec))
  compiled = jax.jit(fn).lower(xs, gs).compile()
  got = np.asarray(compiled(xs, gs))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  if convolution.native_available() and spec == P("b"):
    text = compiled.as_text()
    assert "all-reduce" in text and "all-gather" not in text


@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.parametrize("spec", [P("b"), P(None, "b"), P()], ids=str)
def test_sharded_batch_convolves_each_device_s_images(spec, strides):
  mesh = md.mesh("b")
  out_hw = 8 // strides
  x, k, g = _normal(1, (8, 8, 8, 16), (3, 3, 16, 16), (8, out_hw, out_hw, 16))

  def fn(x, k, g):
    y, vjp = jax.vjp(lambda x, k: convolution.conv(x, k, strides), x, k)
    return y, *vjp(g)

  want = jax.jit(fn)(x, k, g)
  xs, gs = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, g))
  compiled = jax.jit(fn).lower(xs, k, gs).compile()
  got = compiled(xs, k, gs)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
  if convolution.native_available() and spec == P("b"):
    # The forward pass and the input gradient (a forward convolution at
    # stride 1, its own kernel when strided) stay on each device's images;
    # only the kernel gradient is summed.
    text = compiled.as_text()
    assert "all-gather" not in text
    forwards = text.count('custom_call_target="gbn_conv_forward_f32"')
    input_grads = text.count('custom_call_target="gbn_conv_input_grad_f32"')
    assert (forwards, input_grads) == ((2, 0) if strides == 1 else (1, 1))
