"""train/model/models.py: architectures, parameter counts, the norm factory."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
from jax.ad_checkpoint import print_saved_residuals
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
import scipy.stats

import gbn_jax
from train.model import models
from train.model import norms

from tests.helpers.measures import COMPLETE_MEASURES
from tests.helpers.training import FORMULATION_MODELS
from tests.helpers.training import RESNET8

GBN_NORMS = (*COMPLETE_MEASURES, "sqd:0.9")
ALL_NORMS = ("bn",) + GBN_NORMS


def _init(model: nn.Module, shape, seed=0):
  return model.init(jax.random.key(seed), jnp.zeros(shape), train=False)


def _abstract_init(model: nn.Module, shape):
  """Shapes of the variables, without computing them."""
  return jax.eval_shape(lambda: _init(model, shape))


def _count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _shapes(tree):
  return jax.tree.map(lambda x: x.shape, tree)


# --- parameter counts from the architecture formulas -------------------------


def _conv(k, c_in, c_out):  # no bias: a norm follows every conv
  return k * k * c_in * c_out


def _norm(c):  # scale + bias
  return 2 * c


def _dense(n_in, n_out):
  return n_in * n_out + n_out


def resnet_cifar_params(
    n: int, channels, in_channels: int, num_classes: int
) -> int:
  """He et al.'s CIFAR ResNet (6n+2 layers) with parameter-free shortcuts."""
  total = _conv(3, in_channels, channels[0]) + _norm(channels[0])
  c_in = channels[0]
  for c in channels:
    for _ in range(n):
      total += _conv(3, c_in, c) + _norm(c) + _conv(3, c, c) + _norm(c)
      c_in = c
  return total + _dense(channels[-1], num_classes)


def lenet_params(
    height: int, width: int, channels: int, num_classes: int
) -> int:
  """Caffe LeNet: VALID 5x5 convs, 2x2 pools, dense 500."""
  h, w = height, width
  for _ in range(2):
    h, w = (h - 4) // 2, (w - 4) // 2
  return (
      _conv(5, channels, 20)
      + _norm(20)
      + _conv(5, 20, 50)
      + _norm(50)
      + _dense(h * w * 50, 500)
      + _dense(500, num_classes)
  )


def test_resnet20_parameter_count_matches_he_et_al():
  model = models.ResNet20(num_classes=10, norm=models.make_norm("bn"))
  params = _abstract_init(model, (1, 32, 32, 3))["params"]
  expected = resnet_cifar_params(3, (16, 32, 64), 3, 10)
  assert _count(params) == expected
  # He et al. (2016), Table 6: ResNet20 has 0.27M parameters.
  assert round(expected / 1e6, 2) == 0.27


@pytest.mark.parametrize("classes", [10, 100])
def test_resnet20_parameter_count_other_heads(classes):
  model = models.create_model(
      "resnet20", num_classes=classes, norm=models.make_norm("mad")
  )
  params = _abstract_init(model, (1, 32, 32, 3))["params"]
  assert _count(params) == resnet_cifar_params(3, (16, 32, 64), 3, classes)


@pytest.mark.parametrize("shape", [(28, 28, 1), (32, 32, 3)])
def test_lenet_parameter_count(shape):
  model = models.create_model(
      "lenet", num_classes=10, norm=models.make_norm("bn")
  )
  params = _abstract_init(model, (1, *shape))["params"]
  assert _count(params) == lenet_params(*shape, 10)
  # Caffe's MNIST LeNet: 4x4x50 = 800 inputs to the 500-unit layer.
  if shape == (28, 28, 1):
    assert params["fc1"]["kernel"].shape == (800, 500)


@pytest.mark.parametrize(
    "name,shape,classes",
    [
        ("lenet", (28, 28, 1), 10),
        ("lenet", (32, 32, 3), 100),
        ("resnet20", (32, 32, 3), 10),
        ("resnet20", (28, 28, 1), 10),
    ],
)
def test_output_shapes(name, shape, classes):
  model = models.create_model(
      name, num_classes=classes, norm=models.make_norm("rbd")
  )
  variables = _abstract_init(model, (3, *shape))
  x = jax.ShapeDtypeStruct((5, *shape), jnp.float32)
  logits, _ = jax.eval_shape(
      lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]),
      variables,
      x,
  )
  assert logits.shape == (5, classes)
  logits = jax.eval_shape(
      lambda v, x: model.apply(v, x, train=False), variables, x
  )
  assert logits.shape == (5, classes)


def test_resnet_feature_map_sizes():
  """Stages of 16/32/64 channels at 32/16/8 pixels, as in He et al."""
  model = models.ResNet20(num_classes=10, norm=models.make_norm("bn"))
  variables = _abstract_init(model, (1, 32, 32, 3))
  _, state = jax.eval_shape(
      lambda v: model.apply(
          v,
          jnp.ones((2, 32, 32, 3)),
          train=False,
          capture_intermediates=True,
          mutable=["intermediates"],
      ),
      variables,
  )
  inter = state["intermediates"]
  for stage, (hw, c) in enumerate([(32, 16), (16, 32), (8, 64)], start=1):
    for block in (1, 2, 3):
      out = inter[f"stage{stage}_block{block}"]["__call__"][0]
      assert out.shape == (2, hw, hw, c)


def test_option_a_shortcut_matches_numpy():
  x = np.random.default_rng(0).normal(size=(2, 8, 8, 16)).astype(np.float32)
  got = np.asarray(models._option_a_shortcut(jnp.asarray(x), 32, 2))
  expected = np.zeros((2, 4, 4, 32), np.float32)
  expected[..., :16] = x[:, 0::2, 0::2, :]
  np.testing.assert_array_equal(got, expected)
  np.testing.assert_array_equal(
      np.asarray(models._option_a_shortcut(jnp.asarray(x), 16, 1)), x
  )


# --- the norm factory ----------------------------------------------------------


def _norm_layers(model, variables, x):
  """(path, class, measure, alpha) of every BatchNorm-like module called."""
  seen = []

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(module, nn.BatchNorm):
      seen.append(
          (
              module.path,
              type(module),
              getattr(module, "measure", None),
              getattr(module, "alpha", None),
          )
      )
    return next_fun(*args, **kwargs)

  def apply(variables, x):
    with nn.intercept_methods(interceptor):
      return model.apply(variables, x, train=True, mutable=["batch_stats"])

  jax.eval_shape(apply, variables, x)  # tracing is enough to see the calls
  return seen


@pytest.mark.parametrize("name", ["lenet", "resnet20"])
def test_norm_swap_changes_only_norm_layers(name):
  shape = (32, 32, 3)
  x = jax.ShapeDtypeStruct((4, *shape), jnp.float32)
  ref_model = models.create_model(
      name, num_classes=10, norm=models.make_norm("bn")
  )
  ref = _abstract_init(ref_model, (1, *shape))
  ref_layers = _norm_layers(ref_model, ref, x)
  assert ref_layers and all(cls is nn.BatchNorm for _, cls, _, _ in ref_layers)
  # A norm after every conv: as many norms as convolution kernels.
  kernels = [
      path
      for path, _ in jax.tree_util.tree_flatten_with_path(ref["params"])[0]
      if "conv" in jax.tree_util.keystr(path)
  ]
  assert len(ref_layers) == len(kernels)
  # Every norm is the same factory with another measure: LeNet goes through
  # all of them, ResNet20 (19 norms to trace each time) through a measure
  # with a level and one without.
  for norm in GBN_NORMS if name == "lenet" else ("sqd:0.9", "rbd"):
    model = models.create_model(
        name, num_classes=10, norm=models.make_norm(norm)
    )
    variables = _abstract_init(model, (1, *shape))
    # Same parameter and batch_stats trees.
    assert _shapes(variables) == _shapes(ref)
    layers = _norm_layers(model, variables, x)
    spec = models.parse_norm(norm)
    assert [p for p, *_ in layers] == [p for p, *_ in ref_layers]
    for _, cls, measure, alpha in layers:
      assert cls is gbn_jax.GBatchNorm
      assert (measure, alpha) == (spec.measure, spec.alpha)


def test_norm_swap_keeps_initial_values():
  """The norm doesn't change what the other layers draw from the key."""
  inits = [
      jax.jit(
          lambda key, norm=norm: _init(
              models.create_model(
                  "lenet", num_classes=10, norm=models.make_norm(norm)
              ),
              (1, 28, 28, 1),
          )
      )(jax.random.key(5))
      for norm in ("bn", "sqd:0.9")
  ]
  jax.tree.map(np.testing.assert_array_equal, *inits)


@pytest.mark.parametrize("name", ["lenet", "resnet8"])
def test_sd_norm_equals_flax_batchnorm(name):
  """GBN with the sd measure is BatchNorm: same outputs and statistics."""
  x = jax.random.normal(jax.random.key(3), (8, 32, 32, 3))

  def passes(norm, x):
    model = FORMULATION_MODELS[name](
        num_classes=10, norm=models.make_norm(norm, momentum=0.5)
    )
    variables = _init(model, (1, 32, 32, 3))
    logits, updates = model.apply(
        variables, x, train=True, mutable=["batch_stats"]
    )
    eval_logits = model.apply({**variables, **updates}, x, train=False)
    return logits, updates, eval_logits

  # One compiled program for both models, their initialization included:
  # A ResNet op by op takes far longer, and each compilation has its overhead.
  outs = jax.jit(lambda x: [passes(norm, x) for norm in ("bn", "sd")])(x)
  jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=2e-4, atol=2e-5),
      outs[0],
      outs[1],
  )


@pytest.mark.slow
def test_norms_differ_in_training_mode():
  """A non-sd measure really changes the computation."""
  x = jax.random.normal(jax.random.key(4), (8, 28, 28, 1))
  norms = ("bn", "rbd", "sqd1")

  def train_logits(norm, x):
    model = models.create_model(
        "lenet", num_classes=10, norm=models.make_norm(norm)
    )
    variables = _init(model, (1, 28, 28, 1))
    return model.apply(variables, x, train=True, mutable=["batch_stats"])[0]

  # One compiled program for the three models: each compilation has its
  # overhead.
  logits = dict(
      zip(norms, jax.jit(lambda x: [train_logits(n, x) for n in norms])(x))
  )
  assert not np.allclose(logits["bn"], logits["rbd"], atol=1e-3)
  assert not np.allclose(logits["bn"], logits["sqd1"], atol=1e-3)


def test_make_norm_passes_settings():
  bn = models.make_norm("bn", momentum=0.8, epsilon=1e-3, axis_name="data")
  assert bn.func is nn.BatchNorm
  assert bn.keywords == dict(momentum=0.8, epsilon=1e-3, axis_name="data")
  sqd = models.make_norm("sqd:0.3", momentum=0.7)
  assert sqd.func is gbn_jax.GBatchNorm
  assert sqd.keywords["measure"] == "sqd" and sqd.keywords["alpha"] == 0.3
  assert sqd.keywords["momentum"] == 0.7


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("bn", models.NormSpec(None)),
        ("mad", models.NormSpec("mad")),
        ("sqd2", models.NormSpec("sqd2")),
        ("sqd:0.9", models.NormSpec("sqd", 0.9)),
        ("sqd:1e-3", models.NormSpec("sqd", 0.001)),
        (" wcd ", models.NormSpec("wcd")),
    ],
)
def test_parse_norm(spec, expected):
  assert models.parse_norm(spec) == expected


# Alike tests/gbn_jax/test_measures_capabilities.py::test_parse_measure_name_errors: the
# training suite's parser, with its own spellings ('bn') and messages.
@pytest.mark.parametrize(
    "spec,message",
    [
        ("batchnorm", "unknown norm"),
        ("", "unknown norm"),
        ("sqd", "needs a quantile"),
        ("sqd:0", "strictly between 0 and 1"),
        ("sqd:1", "strictly between 0 and 1"),
        ("sqd:1.5", "strictly between"),
        ("sqd:-0.1", "strictly between"),
        ("sqd:nan", "strictly between"),
        ("sqd:x", "not a number"),
        ("mad:0.5", "takes no alpha"),
        ("bn:0.5", "unknown norm"),
    ],
)
def test_parse_norm_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    models.parse_norm(spec)


def test_norm_names_cover_every_measure():
  names = models.norm_names()
  assert names[0] == "bn"
  for measure in gbn_jax.MEASURES:
    assert measure in names or f"{measure}:<alpha>" in names


def test_create_model_unknown():
  with pytest.raises(ValueError, match="unknown model 'vgg'"):
    models.create_model("vgg", num_classes=10, norm=models.make_norm("bn"))


# --- LeNet's max-pool -----------------------------------------------------------


def _numpy_pool_and_grad(x: np.ndarray, g: np.ndarray):
  """2x2/2 max-pool from its definition; gradient split equally over ties."""
  n, h, w, c = x.shape
  y = np.zeros((n, h // 2, w // 2, c))
  dx = np.zeros_like(x)
  for b, i, j, f in np.ndindex(*y.shape):
    window = x[b, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, f]
    y[b, i, j, f] = window.max()
    hit = window == window.max()
    dx[b, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, f] += (
        hit * g[b, i, j, f] / hit.sum()
    )
  return y, dx


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (3, 7, 9, 2), (1, 2, 2, 1)])
def test_max_pool_2x2_matches_flax_and_numpy(shape):
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape).astype(np.float32)
  x[0, :2, :2, 0] = 1.5  # a window of four tied maxima
  g = rng.normal(size=(shape[0], shape[1] // 2, shape[2] // 2, shape[3]))
  g = g.astype(np.float32)
  y, vjp = jax.vjp(models.max_pool_2x2, jnp.asarray(x))
  np.testing.assert_array_equal(
      y, nn.max_pool(jnp.asarray(x), (2, 2), strides=(2, 2))
  )
  want_y, want_dx = _numpy_pool_and_grad(x, g)
  np.testing.assert_array_equal(y, want_y)
  np.testing.assert_allclose(vjp(jnp.asarray(g))[0], want_dx, rtol=1e-6)
  # Where every window's maximum is unique, flax's own gradient agrees.
  x[0, :2, :2, 0] = [[1.5, 0.1], [0.2, 0.3]]
  flax_vjp = jax.vjp(
      lambda v: nn.max_pool(v, (2, 2), strides=(2, 2)), jnp.asarray(x)
  )[1]
  np.testing.assert_array_equal(
      jax.vjp(models.max_pool_2x2, jnp.asarray(x))[1](jnp.asarray(g))[0],
      flax_vjp(jnp.asarray(g))[0],
  )


# --- LeNet's convolutions as matmuls -----------------------------------------------


@pytest.mark.parametrize(
    "shape,features",
    [((2, 12, 12, 1), 20), ((3, 9, 11, 7), 5), ((1, 5, 5, 2), 3)],
)
def test_patch_conv_equals_flax_conv(shape, features):
  x = jax.random.normal(jax.random.key(0), shape)
  conv = nn.Conv(features, (5, 5), padding="VALID", use_bias=False)
  patch = models.PatchConv(features, (5, 5))
  params = conv.init(jax.random.key(1), x)
  # Same parameter tree and, from the same key, the same initial values.
  jax.tree.map(
      np.testing.assert_array_equal, params, patch.init(jax.random.key(1), x)
  )
  out_shape = (shape[0], shape[1] - 4, shape[2] - 4, features)
  g = jax.random.normal(jax.random.key(2), out_shape)
  want, want_vjp = jax.vjp(conv.apply, params, x)
  got, got_vjp = jax.vjp(patch.apply, params, x)
  assert got.shape == out_shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(got_vjp(g)), jax.tree.leaves(want_vjp(g))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _assert_default_follows_backend(
    default: nn.Module,
    on_cpu: nn.Module,
    elsewhere: nn.Module,
    variables,
    x: jax.Array,
):
  """``default`` (built without the backend-dependent options) computes
  exactly as ``on_cpu`` on the CPU and as ``elsewhere`` on other backends."""
  want = on_cpu if jax.default_backend() == "cpu" else elsewhere
  np.testing.assert_array_equal(
      default.apply(variables, x, train=False),
      want.apply(variables, x, train=False),
  )


@pytest.mark.parametrize("norm", ["bn", "sqd2"])
def test_lenet_conv_as_matmul_is_the_same_model(norm):
  x = jax.random.normal(jax.random.key(0), (16, 28, 28, 1))
  kwargs = dict(num_classes=10, norm=models.make_norm(norm))
  flax_ops = models.LeNet(conv_as_matmul=False, **kwargs)
  matmul = models.LeNet(conv_as_matmul=True, **kwargs)
  variables = flax_ops.init(jax.random.key(1), x, train=False)
  jax.tree.map(
      np.testing.assert_array_equal,
      variables,
      matmul.init(jax.random.key(1), x, train=False),
  )
  for model in (flax_ops, matmul):
    logits, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    if model is flax_ops:
      want = logits
  np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
  # The default follows the backend: matmuls on the CPU.
  assert models.LeNet(**kwargs).conv_as_matmul is None
  _assert_default_follows_backend(
      models.LeNet(**kwargs), matmul, flax_ops, variables, x
  )


@pytest.mark.parametrize(
    "target,constant",
    [
        (
            "sqd1",
            lambda n: scipy.stats.norm.pdf(scipy.stats.norm.ppf(0.25)) / 0.75,
        ),
        ("rsd", lambda n: 1 / np.sqrt(2 * np.pi)),
        # E[range of n standard normals], by scipy's quadrature of n x phi Phi^(n-1).
        (
            "rbd",
            lambda n: 2
            * scipy.integrate.quad(
                lambda t: t
                * n
                * scipy.stats.norm.pdf(t)
                * scipy.stats.norm.cdf(t) ** (n - 1),
                -12,
                12,
                limit=200,
            )[0],
        ),
    ],
)
def test_bn_gain_is_batchnorm_with_another_measures_gaussian_d(
    target, constant
):
  x = np.random.default_rng(4).normal(2.0, 3.0, (8, 4, 4, 3)).astype(np.float32)
  norm = models.make_norm(f"bn_gain:{target}", momentum=0.0)
  layer = norm(use_running_average=False)
  variables = layer.init(jax.random.key(0), x)
  y, updates = layer.apply(variables, x, mutable=["batch_stats"])
  x64 = x.astype(np.float64)
  mean, sigma = x64.mean(axis=(0, 1, 2)), x64.std(axis=(0, 1, 2))
  d = sigma * constant(8 * 4 * 4)
  np.testing.assert_allclose(
      y, (x64 - mean) / np.sqrt(d**2 + 1e-5), rtol=2e-5, atol=2e-5
  )
  np.testing.assert_allclose(updates["batch_stats"]["var"], d**2, rtol=1e-5)
  with pytest.raises(TypeError, match="constant needs the static number"):
    layer.apply(variables, x, mask=x > 0, mutable=["batch_stats"])


# --- ResNet's convolutions on a CPU ------------------------------------------


@pytest.mark.parametrize("strides", [1, 2, 3])
@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (3, 9, 10, 5)])
def test_im2col_same_and_strided_is_the_convolution(shape, strides):
  x = jax.random.normal(jax.random.key(0), shape)
  kernel = jax.random.normal(jax.random.key(1), (3, 3, shape[-1], 4))
  got = models.im2col(x, 3, 3, strides=strides, padding="SAME") @ (
      kernel.reshape(-1, 4)
  )
  want = jax.lax.conv_general_dilated(
      x,
      kernel,
      (strides,) * 2,
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_computed_once_is_the_identity_and_stays_in_the_program():
  big = np.finfo(np.float32).max
  tiny = np.finfo(np.float32).smallest_normal
  x = jnp.asarray([0.0, -0.0, 1.5, -3.25, tiny, -tiny, big, -big], jnp.float32)
  got = models.computed_once(x)
  np.testing.assert_array_equal(
      np.asarray(got).view(np.uint32), np.asarray(x).view(np.uint32)
  )
  # Subnormals: as after any arithmetic, themselves or, where the backend
  # flushes them (XLA:CPU does), zeros of the same sign.
  sub = np.finfo(np.float32).smallest_subnormal * np.asarray([1, -1, 7])
  got = np.asarray(models.computed_once(jnp.asarray(sub, jnp.float32)))
  assert np.all((got == sub) | ((got == 0) & (np.signbit(got) == (sub < 0))))
  g = jnp.asarray([1.0, -2.0, 0.0, big, -big, tiny, -0.0, -0.5], jnp.float32)
  got_g = jax.vjp(models.computed_once, x)[1](g)[0]
  np.testing.assert_array_equal(
      np.asarray(got_g).view(np.uint32), np.asarray(g).view(np.uint32)
  )
  # Documented: an infinite element becomes NaN, NaN stays NaN.
  special = models.computed_once(jnp.asarray([np.inf, -np.inf, np.nan]))
  assert jnp.all(jnp.isnan(special))
  # The division XLA does not duplicate is still there after optimization.
  text = (
      jax.jit(lambda v: jax.nn.relu(models.computed_once(v + 1)))
      .lower(x)
      .compile()
      .as_text()
  )
  assert " divide(" in text


@pytest.mark.parametrize("strides", [1, 2, (2, 2)])
@pytest.mark.parametrize("shape", [(2, 8, 8, 16), (3, 9, 7, 5)])
def test_resnet_conv_equals_flax_conv(shape, strides):
  x = jax.random.normal(jax.random.key(0), shape)
  kwargs = dict(
      strides=strides,
      use_bias=False,
      kernel_init=nn.initializers.kaiming_normal(),
  )
  conv = nn.Conv(6, (3, 3), **kwargs)
  ours = models.ResNetConv(6, (3, 3), **kwargs)
  params = conv.init(jax.random.key(1), x)
  jax.tree.map(
      np.testing.assert_array_equal, params, ours.init(jax.random.key(1), x)
  )
  want, want_vjp = jax.vjp(conv.apply, params, x)
  got, got_vjp = jax.vjp(ours.apply, params, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  g = jax.random.normal(jax.random.key(2), want.shape)
  for a, b in zip(jax.tree.leaves(got_vjp(g)), jax.tree.leaves(want_vjp(g))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="no bias"):
    models.ResNetConv(6, (3, 3), use_bias=True).init(jax.random.key(1), x)


@pytest.mark.parametrize("norm", ["bn", "sqd2"])
@pytest.mark.slow
def test_resnet_cpu_convs_are_the_same_model(norm):
  x = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
  labels = jnp.arange(4) % 10
  kwargs = dict(num_classes=10, norm=models.make_norm(norm))
  flax_ops = RESNET8(conv=nn.Conv, recompute_norm=False, **kwargs)
  cpu_ops = RESNET8(conv=models.ResNetConv, recompute_norm=True, **kwargs)
  # One compiled program for both initializations: op by op, every
  # parameter shape's draw is a compilation of its own.
  variables, cpu_variables = jax.jit(
      lambda: [
          model.init(jax.random.key(1), x, train=False)
          for model in (flax_ops, cpu_ops)
      ]
  )()
  jax.tree.map(np.testing.assert_array_equal, variables, cpu_variables)

  def loss_and_grads(model):
    def loss(params):
      logits, updates = model.apply(
          {"params": params, "batch_stats": variables["batch_stats"]},
          x,
          train=True,
          mutable=["batch_stats"],
      )
      ce = -jnp.take_along_axis(
          jax.nn.log_softmax(logits), labels[:, None], axis=1
      )
      return jnp.mean(ce), (logits, updates["batch_stats"])

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])

  (want_loss, (want_logits, want_stats)), want_grads = loss_and_grads(flax_ops)
  (got_loss, (got_logits, got_stats)), got_grads = loss_and_grads(cpu_ops)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
  # The compiled forward pass rounds otherwise: a quantile's running
  # statistic may move to a neighbouring order statistic.
  jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
      got_stats,
      want_stats,
  )
  assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
  for path, got in jax.tree_util.tree_flatten_with_path(got_grads)[0]:
    want = functools.reduce(lambda t, k: t[k.key], path, want_grads)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(
        got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path)
    )
  # The default follows the backend: ResNetConv and recomputed norms on the
  # CPU.
  assert models.ResNet20(**kwargs).conv is None
  assert models.ResNet20(**kwargs).recompute_norm is None
  _assert_default_follows_backend(
      RESNET8(**kwargs), cpu_ops, flax_ops, variables, x
  )


@pytest.mark.parametrize(
    "norm",
    ["bn", "sd", "mad", "rbd", "sqd1", "sqd:0.99", "bpoe", "bn_gain:rbd"],
)
def test_recompute_elementwise_is_the_same_layer(norm):
  # Ties and a constant feature, as well as random values.
  x = jax.random.normal(jax.random.key(0), (6, 5, 5, 4))
  x = x.at[:, :, :, 1].set(jnp.round(x[:, :, :, 1]))
  x = x.at[:, :, :, 2].set(0.5)
  factory = models.make_norm(norm)
  plain = factory(use_running_average=False)
  recomputed = models.recompute_elementwise(factory)(use_running_average=False)
  variables = plain.init(jax.random.key(1), x)
  jax.tree.map(
      np.testing.assert_array_equal,
      variables,
      recomputed.init(jax.random.key(1), x),
  )
  g = jax.random.normal(jax.random.key(2), x.shape)

  def run(module):
    def loss(params, x):
      y, updates = module.apply(
          {"params": params, "batch_stats": variables["batch_stats"]},
          x,
          mutable=["batch_stats"],
      )
      return jnp.vdot(jax.nn.relu(y), g), (y, updates)

    fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    return jax.jit(fn)(variables["params"], x)

  want, got = run(plain), run(recomputed)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(jnp.max(jnp.abs(b))) or 1.0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


def _saved_residuals(factory, x, capsys) -> list[str]:
  """What autodiff keeps of a norm layer for its backward pass, one per line."""
  module = factory(use_running_average=False)
  variables = module.init(jax.random.key(1), x)

  def apply(params, x):
    y, _ = module.apply(
        {"params": params, "batch_stats": variables["batch_stats"]},
        x,
        mutable=["batch_stats"],
    )
    return y

  capsys.readouterr()
  print_saved_residuals(apply, variables["params"], x)
  return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("norm", ["bn", "mad", "rbd", "sqd2"])
def test_recompute_elementwise_keeps_the_input_and_the_statistics(norm, capsys):
  x = jax.random.normal(jax.random.key(0), (6, 5, 5, 4))
  activation = re.compile(r"^\w+\[6,5,5,4\]")
  factory = models.make_norm(norm)
  plain = _saved_residuals(factory, x, capsys)
  recomputed = _saved_residuals(
      models.recompute_elementwise(factory), x, capsys
  )
  # Stored, the layer keeps activation-sized arrays besides its input ...
  assert [r for r in plain if activation.match(r) and "argument x" not in r]
  # ... recomputed, its input alone, ...
  assert [r for r in recomputed if activation.match(r)] == [
      "f32[6,5,5,4] from the argument x"
  ]
  # ... and the statistics (reductions, a selection), not recomputed.
  kept = {
      m[1]
      for m in map(re.compile(r".* output of (\w+)").match, recomputed)
      if m
  }
  assert kept and not kept & norms._ELEMENTWISE_PRIMITIVES, recomputed


def test_recompute_elementwise_takes_module_factories_only():
  with pytest.raises(TypeError, match="Module class"):
    models.recompute_elementwise(lambda **kw: nn.BatchNorm(**kw))


def test_lenet_convolutions_follow_the_lowering():
  # The default LeNet: im2col matmuls lowered for the CPU, XLA's
  # convolution for an accelerator, from one trace and the same parameters.
  model = models.LeNet(num_classes=10, norm=models.make_norm("bn"))
  x = jnp.zeros((2, 28, 28, 1))
  variables = model.init(jax.random.key(0), x, train=False)
  f = jax.jit(lambda v, x: model.apply(v, x, train=False))
  for platform, convolutions in (("cpu", 0), ("cuda", 2)):
    text = jax.export.export(f, platforms=[platform])(variables, x)
    assert text.mlir_module().count("stablehlo.convolution") == convolutions
  matmul = models.LeNet(
      num_classes=10, norm=models.make_norm("bn"), conv_as_matmul=True
  )
  np.testing.assert_array_equal(
      f(variables, x + 0.5), matmul.apply(variables, x + 0.5, train=False)
  )
