"""precise_batch_stats over masked layers: a batch that holds no element of a
feature does not count for that feature's statistics (linen eager and under
jit, nnx), against numpy from BatchNorm's definition."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
import gbn_jax.nnx


def _masked_batches():
  rng = np.random.default_rng(7)
  xs = rng.standard_normal((3, 6, 2)).astype(np.float32)
  masks = rng.random((3, 6, 2)) < 0.6
  masks[:, 0, :] = True  # every feature has elements in every batch ...
  masks[1, :, 1] = False  # ... but feature 1 has none in batch 1
  return xs, masks


def _numpy_means(xs, masks):
  # Per feature, the mean over the batches that hold it of the batch's
  # masked-in mean and variance (BatchNorm's statistics, from the definition).
  means, variances = [], []
  for f in range(xs.shape[-1]):
    ms, vs = [], []
    for x, m in zip(xs[..., f], masks[..., f]):
      if m.any():
        v = x[m].astype(np.float64)
        ms.append(v.mean())
        vs.append(((v - v.mean()) ** 2).mean())
    means.append(np.mean(ms))
    variances.append(np.mean(vs))
  return np.array(means), np.array(variances)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_linen_masked_feature_counts_only_the_batches_that_hold_it(traced):
  xs, masks = _masked_batches()
  model = gbn_jax.GBatchNorm(use_running_average=False, momentum=0.9)
  variables = model.init(jax.random.key(0), jnp.asarray(xs[0]))
  apply = lambda v, b: model.apply(v, b[0], mask=b[1], mutable=["batch_stats"])
  batches = (jnp.asarray(xs), jnp.asarray(masks))
  run = functools.partial(gbn_jax.precise_batch_stats, apply, stacked=True)
  stats = (jax.jit(run) if traced else run)(variables, batches)
  want_mean, want_var = _numpy_means(xs, masks)
  np.testing.assert_allclose(stats["mean"], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], want_var, rtol=1e-5, atol=1e-6)


def test_nnx_masked_feature_counts_only_the_batches_that_hold_it():
  xs, masks = _masked_batches()
  norm = gbn_jax.nnx.GBatchNorm(2, momentum=0.9, rngs=nnx.Rngs(0))
  batches = [(jnp.asarray(x), jnp.asarray(m)) for x, m in zip(xs, masks)]
  gbn_jax.nnx.precise_batch_stats(
      norm, batches, forward=lambda m, b: m(b[0], mask=b[1])
  )
  want_mean, want_var = _numpy_means(xs, masks)
  np.testing.assert_allclose(norm.mean[...], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(norm.var[...], want_var, rtol=1e-5, atol=1e-6)
