"""gbn_jax.nnx.GBatchNorm vs flax.nnx.BatchNorm, numpy definitions and linen."""

import inspect

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax import GBatchNorm
import gbn_jax.nnx as gnnx

from tests.helpers import reference as ref
from tests.helpers.measures import COMPLETE_MEASURES


def _x(shape=(12, 4, 4, 3), seed=0):
  return jax.random.normal(jax.random.key(seed), shape) * 1.5 - 0.2


def _perturb(layer, seed=1):
  keys = iter(jax.random.split(jax.random.key(seed), 4))
  for p in (layer.scale, layer.bias):
    p[...] = p[...] + 0.3 * jax.random.normal(next(keys), p[...].shape)


@pytest.mark.parametrize(
    "kwargs", [{}, {"use_fast_variance": False}, {"axis": 1}], ids=str
)
def test_sd_is_nnx_batchnorm(kwargs):
  x = _x()
  features = x.shape[kwargs.get("axis", -1)]
  bn = nnx.BatchNorm(features, momentum=0.9, rngs=nnx.Rngs(0), **kwargs)
  gbn = gnnx.GBatchNorm(features, momentum=0.9, rngs=nnx.Rngs(0), **kwargs)
  _perturb(bn)
  _perturb(gbn)
  assert jax.tree.structure(nnx.state(bn)) == jax.tree.structure(nnx.state(gbn))
  for step in range(3):
    xs = _x(seed=5 + step)
    np.testing.assert_allclose(gbn(xs), bn(xs), rtol=1e-5, atol=1e-5)
  for name in ("mean", "var"):
    np.testing.assert_allclose(
        getattr(gbn, name)[...], getattr(bn, name)[...], rtol=1e-6
    )
  bn.eval()
  gbn.eval()
  assert gbn.use_running_average is True
  np.testing.assert_allclose(gbn(x), bn(x), rtol=1e-5, atol=1e-5)
  bn.train()
  gbn.train()
  assert gbn.use_running_average is False

  def loss(model, inp):
    return jnp.sum(jnp.sin(model(inp)))

  g_bn = nnx.grad(loss, argnums=(0, 1))(bn, x)
  g_g = nnx.grad(loss, argnums=(0, 1))(gbn, x)
  np.testing.assert_allclose(g_g[1], g_bn[1], rtol=1e-4, atol=1e-5)
  for name in ("scale", "bias"):
    np.testing.assert_allclose(
        g_g[0][name][...], g_bn[0][name][...], rtol=1e-4, atol=1e-5
    )


# sd is flax's nnx.BatchNorm, tested against it above.
@pytest.mark.parametrize("name", [m for m in COMPLETE_MEASURES if m != "sd"])
def test_measures_in_nnx(name):
  x = np.asarray(ref.relu_like(np.random.default_rng(0), (10, 3, 3, 2)))
  gbn = gnnx.GBatchNorm(2, measure=name, momentum=0.5, rngs=nnx.Rngs(0))
  _perturb(gbn)
  s, d = ref.per_feature(lambda r: ref.measure_1d(name, r), x, (0, 1, 2))
  y = gbn(jnp.asarray(x))
  want = ref.normalize(
      x, s, d, (0, 1, 2), np.asarray(gbn.scale[...]), np.asarray(gbn.bias[...])
  )
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(gbn.mean[...], 0.5 * s, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      gbn.var[...], 0.5 + 0.5 * d**2, rtol=1e-5, atol=1e-6
  )


def test_sqd_alpha_and_errors():
  x = _x((40, 5))
  gbn = gnnx.GBatchNorm(
      5, measure="sqd", alpha=0.3, use_bias=False, rngs=nnx.Rngs(0)
  )
  np.testing.assert_allclose(np.mean(np.asarray(gbn(x)) <= 0, 0), 0.3)
  with pytest.raises(ValueError, match="alpha"):
    gnnx.GBatchNorm(5, measure="sqd", alpha=2.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="valid names"):
    gnnx.GBatchNorm(5, measure="std", rngs=nnx.Rngs(0))


def test_measure_errors_speak_the_module_and_the_contract():
  with pytest.raises(TypeError) as e:
    gnnx.GBatchNorm(5, measure="sqd2", alpha=0.3, rngs=nnx.Rngs(0))
  assert "GBatchNorm(measure='sqd', alpha=...)" in str(e.value)
  with pytest.raises(TypeError, match=r"measure\(x, axis\) -> \(S, D\)"):
    gnnx.GBatchNorm(
        5, measure=lambda x: (x.mean(0), x.std(0)), rngs=nnx.Rngs(0)
    )


def test_nnx_jit_train_step_updates_batch_stats():
  class Net(nnx.Module):

    def __init__(self, rngs):
      self.lin = nnx.Linear(3, 4, rngs=rngs)
      self.norm = gnnx.GBatchNorm(4, measure="sqd2", rngs=rngs)

    def __call__(self, x):
      return nnx.relu(self.norm(self.lin(x))).sum()

  model = Net(nnx.Rngs(0))

  @nnx.jit
  def step(model, x):
    return nnx.grad(lambda m: m(x))(model)

  before = np.asarray(model.norm.mean[...]).copy()
  grads = step(model, _x((16, 3)))
  assert not np.allclose(before, model.norm.mean[...])
  assert np.isfinite(np.asarray(grads["lin"]["kernel"][...])).all()


# --- the constructor: explicit, flax's arguments and defaults ---------------------


def test_constructor_lists_every_nnx_batchnorm_argument():
  ours = inspect.signature(gnnx.GBatchNorm.__init__).parameters
  flax_params = inspect.signature(nnx.BatchNorm.__init__).parameters
  assert not any(p.kind is p.VAR_KEYWORD for p in ours.values())
  for name, p in flax_params.items():
    assert name in ours, name
    assert ours[name].kind == p.kind, name
    default = ours[name].default
    if p.default is p.empty or name == "promote_dtype":
      assert default is p.default or name == "promote_dtype", name
      continue  # promote_dtype: None is nnx's default, checked below
    if name.endswith("_init"):  # initializers: fresh closures, same values
      got = default(jax.random.key(0), (3,), jnp.float32)
      want = p.default(jax.random.key(0), (3,), jnp.float32)
      np.testing.assert_array_equal(got, want)
    else:
      assert default == p.default, name
  gbn = gnnx.GBatchNorm(3, rngs=nnx.Rngs(0))
  assert gbn.promote_dtype is nnx.BatchNorm(3, rngs=nnx.Rngs(0)).promote_dtype
  for name in ("measure", "alpha", "calibration", "renorm", "renorm_clipping"):
    assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY
    # inspect.getdoc: Python 3.13 strips a docstring's indentation itself.
    assert f"\n  {name}:" in inspect.getdoc(gnnx.GBatchNorm.__init__), name


def test_constructor_arguments_reach_the_layer():
  metadata = {"note": "kept"}
  gbn = gnnx.GBatchNorm(
      4,
      use_running_average=True,
      momentum=0.5,
      epsilon=1e-3,
      param_dtype=jnp.float16,
      use_bias=False,
      scale_init=nnx.initializers.constant(2.0),
      axis_index_groups=None,
      use_fast_variance=False,
      scale_metadata=metadata,
      rngs=nnx.Rngs(0),
  )
  assert (gbn.use_running_average, gbn.momentum, gbn.epsilon) == (
      True,
      0.5,
      1e-3,
  )
  assert gbn.bias is None and gbn.scale[...].dtype == jnp.float16
  np.testing.assert_array_equal(gbn.scale[...], 2.0)
  assert gbn.scale.get_metadata()["note"] == "kept"
  assert gbn.use_fast_variance is False
  calls = []

  def promote(args, dtype=None):
    calls.append(dtype)
    return args

  gnnx.GBatchNorm(2, promote_dtype=promote, rngs=nnx.Rngs(0))(_x((4, 2)))
  assert calls == [None]


def test_use_running_average_must_be_given():
  gbn = gnnx.GBatchNorm(3, use_running_average=None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="use_running_average"):
    gbn(_x((4, 3)))
  assert gbn(_x((4, 3)), use_running_average=True).shape == (4, 3)


# --- mask and dtypes ---------------------------------------------------------------


@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_mask_matches_nnx_batchnorm_for_sd(use_fast_variance):
  x = _x((10, 6))
  mask = jax.random.bernoulli(jax.random.key(4), 0.6, x.shape)
  kw = dict(momentum=0.8, use_fast_variance=use_fast_variance)
  bn = nnx.BatchNorm(6, rngs=nnx.Rngs(0), **kw)
  gbn = gnnx.GBatchNorm(6, rngs=nnx.Rngs(0), **kw)
  _perturb(bn)
  _perturb(gbn)
  np.testing.assert_allclose(
      gbn(x, mask=mask), bn(x, mask=mask), rtol=1e-5, atol=1e-5
  )
  for name in ("mean", "var"):
    np.testing.assert_allclose(
        getattr(gbn, name)[...], getattr(bn, name)[...], rtol=1e-6
    )


@pytest.mark.parametrize("name", ["mad", "sqd2", "rbd", "bpoe"])
def test_mask_restricts_statistics_per_definition(name):
  rng = np.random.default_rng(7)
  x = np.asarray(ref.relu_like(rng, (12, 3, 2)) - 0.2)
  mask = rng.random(x.shape) < 0.6
  gbn = gnnx.GBatchNorm(2, measure=name, momentum=0.5, rngs=nnx.Rngs(0))
  _perturb(gbn)
  s, d = ref.per_feature(lambda r: ref.measure_1d(name, r), x, (0, 1), mask)
  y = gbn(jnp.asarray(x), mask=jnp.asarray(mask))
  want = ref.normalize(
      x, s, d, (0, 1), np.asarray(gbn.scale[...]), np.asarray(gbn.bias[...])
  )
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(gbn.mean[...], 0.5 * s, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      gbn.var[...], 0.5 + 0.5 * d**2, rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": jnp.bfloat16},
        {"param_dtype": jnp.float16},
        {"dtype": jnp.float16, "param_dtype": jnp.bfloat16},
    ],
    ids=str,
)
@pytest.mark.parametrize("input_dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_match_nnx_batchnorm_for_sd(kwargs, input_dtype):
  bn = nnx.BatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0), **kwargs)
  gbn = gnnx.GBatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0), **kwargs)
  for step in range(2):
    xs = _x(seed=5 + step).astype(input_dtype)
    y_bn, y_g = bn(xs), gbn(xs)
    assert y_g.dtype == y_bn.dtype
    np.testing.assert_allclose(
        np.float32(y_g), np.float32(y_bn), rtol=1e-2, atol=1e-2
    )
  for name in ("mean", "var"):
    got, want = getattr(gbn, name)[...], getattr(bn, name)[...]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  bn.eval()
  gbn.eval()
  x = _x().astype(input_dtype)
  assert gbn(x).dtype == bn(x).dtype
  np.testing.assert_allclose(
      np.float32(gbn(x)), np.float32(bn(x)), rtol=1e-2, atol=1e-2
  )


@pytest.mark.parametrize("name", ["sqd2", "mad"])
def test_half_precision_input_statistics_in_float32(name):
  x = _x().astype(jnp.bfloat16)
  gbn = gnnx.GBatchNorm(3, measure=name, momentum=0.0, rngs=nnx.Rngs(0))
  y = gbn(x)
  assert y.dtype == nnx.BatchNorm(3, rngs=nnx.Rngs(0))(x).dtype
  assert gbn.mean[...].dtype == jnp.float32
  x32 = np.asarray(x, np.float32)
  s, d = ref.per_feature(lambda r: ref.measure_1d(name, r), x32, (0, 1, 2))
  np.testing.assert_allclose(gbn.mean[...], s, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gbn.var[...], d**2, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      np.float32(y), ref.normalize(x32, s, d, (0, 1, 2)), rtol=2e-2, atol=2e-2
  )


# --- one layer, two frameworks ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"measure": "sd"},
        {"measure": "sqd", "alpha": 0.3},
        {"measure": "rsd", "calibration": "normal"},
        {"measure": "mad", "renorm": True},
        {
            "measure": "rbd",
            "renorm": True,
            "renorm_clipping": {"rmax": 1.5, "dmax": 0.5},
        },
    ],
    ids=str,
)
def test_nnx_and_linen_agree_bit_for_bit(kwargs):
  x = _x((12, 4, 3))
  mask = jax.random.bernoulli(jax.random.key(9), 0.8, x.shape)
  gbn = gnnx.GBatchNorm(3, momentum=0.7, rngs=nnx.Rngs(0), **kwargs)
  _perturb(gbn)
  gbn.mean[...] = gbn.mean[...] + 0.2
  gbn.var[...] = gbn.var[...] * 1.3
  linen = GBatchNorm(momentum=0.7, **kwargs)
  variables = {
      "params": {"scale": gbn.scale[...], "bias": gbn.bias[...]},
      "batch_stats": {"mean": gbn.mean[...], "var": gbn.var[...]},
  }
  y_l, upd = linen.apply(
      variables, x, False, mask=mask, mutable=["batch_stats"]
  )
  y_n = gbn(x, mask=mask)
  np.testing.assert_array_equal(y_n, y_l)
  np.testing.assert_array_equal(gbn.mean[...], upd["batch_stats"]["mean"])
  np.testing.assert_array_equal(gbn.var[...], upd["batch_stats"]["var"])
  variables = {**variables, **upd}
  np.testing.assert_array_equal(
      gbn(x, use_running_average=True), linen.apply(variables, x, True)
  )


def test_public_names():
  assert sorted(gnnx.__all__) == [
      "GBatchNorm",
      "GGroupNorm",
      "GInstanceNorm",
      "GLayerNorm",
      "convert_batchnorm",
      "precise_batch_stats",
  ]
  assert all(callable(getattr(gnnx, name)) for name in gnnx.__all__)
