"""gbn_jax.nnx.GBatchNorm vs flax.nnx.BatchNorm and numpy definitions."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax.nnx as gnnx

import reference as ref


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


@pytest.mark.parametrize(
    "name", ["mad", "rsd", "sqd1", "sqd2", "sqd3", "rbd", "wcd", "bpoe"]
)
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
