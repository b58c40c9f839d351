"""Layer errors beyond flax's, and masks with nothing masked in (linen, nnx).

What a new user tripped over: an ``axis`` the input lacks was an
``IndexError`` from deep inside, a wrong ``num_features`` or ``momentum`` and
a float mask passed silently, and a batch with every element masked out made
the running statistics NaN for good.
"""

from __future__ import annotations

import re

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
import gbn_jax.nnx

MEASURES = ("sd", "mad", "sqd2")


def _x(shape=(6, 3), seed=0):
  return jax.random.normal(jax.random.key(seed), shape) * 2 + 1


# --- bad arguments -------------------------------------------------------------


@pytest.mark.parametrize("axis", [5, -3, (0, 2)])
def test_linen_axis_out_of_range_names_axis_and_rank(axis):
  norm = gbn_jax.GBatchNorm(use_running_average=False, axis=axis)
  with pytest.raises(
      ValueError, match=re.escape(f"axis={axis!r}") + ".*rank 2"
  ) as info:
    norm.init(jax.random.key(0), _x())
  assert "IndexError" not in repr(info.value)


def test_nnx_axis_out_of_range_names_axis_and_rank():
  norm = gbn_jax.nnx.GBatchNorm(3, axis=5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"axis=5 .*rank 2"):
    norm(_x())


def test_nnx_wrong_num_features_names_both_sizes():
  norm = gbn_jax.nnx.GBatchNorm(8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_features=8 .* 4 features"):
    norm(_x((5, 4)))
  # Along the axis the layer normalizes, not the last one.
  channels_first = gbn_jax.nnx.GBatchNorm(4, axis=1, rngs=nnx.Rngs(0))
  assert channels_first(_x((5, 4, 3))).shape == (5, 4, 3)
  with pytest.raises(ValueError, match=r"num_features=4 .* 3 features"):
    gbn_jax.nnx.GBatchNorm(4, rngs=nnx.Rngs(0))(_x((5, 4, 3)))


@pytest.mark.parametrize("momentum", [1.5, -0.1, float("nan"), "0.9", True])
def test_momentum_outside_unit_interval_fails_at_construction(momentum):
  with pytest.raises(ValueError, match="momentum"):
    gbn_jax.GBatchNorm(momentum=momentum)
  with pytest.raises(ValueError, match="momentum"):
    gbn_jax.nnx.GBatchNorm(3, momentum=momentum, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("momentum", [0, 0.0, 0.9, 1.0])
def test_momentum_in_unit_interval_is_accepted(momentum):
  x = _x()
  norm = gbn_jax.GBatchNorm(use_running_average=False, momentum=momentum)
  variables = norm.init(jax.random.key(0), x)
  _, updates = norm.apply(variables, x, mutable=["batch_stats"])
  want = momentum * 0.0 + (1 - momentum) * np.asarray(x).mean(0)
  np.testing.assert_allclose(updates["batch_stats"]["mean"], want, rtol=1e-6)
  gbn_jax.nnx.GBatchNorm(3, momentum=momentum, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_non_boolean_mask_is_a_type_error(dtype):
  x = _x()
  mask = jnp.ones(x.shape, dtype)
  norm = gbn_jax.GBatchNorm(use_running_average=False)
  variables = norm.init(jax.random.key(0), x)
  with pytest.raises(
      TypeError, match=r"mask.*boolean.*" + jnp.dtype(dtype).name
  ):
    norm.apply(variables, x, mask=mask, mutable=["batch_stats"])
  with pytest.raises(TypeError, match="mask"):
    gbn_jax.nnx.GBatchNorm(3, rngs=nnx.Rngs(0))(x, mask=mask)
  # Also under jit, where the mask is a tracer.
  with pytest.raises(TypeError, match="mask"):
    jax.jit(lambda v, x, m: norm.apply(v, x, mask=m, mutable=["batch_stats"]))(
        variables, x, mask
    )


def test_boolean_masks_still_work_as_numpy_and_lists():
  x = _x((4, 2))
  norm = gbn_jax.GBatchNorm(use_running_average=False, momentum=0.0)
  variables = norm.init(jax.random.key(0), x)
  mask = np.array([True, True, False, True])[:, None]
  for m in (mask, mask.tolist(), jnp.asarray(mask)):
    _, updates = norm.apply(variables, x, mask=m, mutable=["batch_stats"])
    np.testing.assert_allclose(
        updates["batch_stats"]["mean"],
        np.asarray(x)[mask[:, 0]].mean(0),
        rtol=1e-6,
    )


# --- a batch with nothing masked in ----------------------------------------------


def _masked_reference(x, mask, old_mean, old_var, momentum):
  """numpy, from the definitions: per feature, the masked-in mean and
  (biased) variance; a feature without masked-in elements keeps its old
  running statistics."""
  x, mask = np.asarray(x, np.float64), np.broadcast_to(mask, x.shape)
  mean, var = np.array(old_mean, np.float64), np.array(old_var, np.float64)
  for f in range(x.shape[-1]):
    values = x[mask[:, f], f]
    if values.size:
      mean[f] = momentum * mean[f] + (1 - momentum) * values.mean()
      var[f] = momentum * var[f] + (1 - momentum) * values.var()
  return mean, var


MASKS = {
    "nothing": np.zeros((6, 3), bool),
    # Feature 1 has nothing masked in; features 0 and 2 have some.
    "one_feature": np.array(
        [[1, 0, 1], [0, 0, 1], [1, 0, 0], [1, 0, 1], [0, 0, 0], [0, 0, 1]],
        bool,
    ),
    "broadcast_rows": np.zeros((6, 1), bool),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_linen_empty_mask_keeps_running_statistics_under_jit(mask_name):
  x, mask = _x(), MASKS[mask_name]
  momentum = 0.8
  norm = gbn_jax.GBatchNorm(use_running_average=False, momentum=momentum)
  variables = norm.init(jax.random.key(0), x)
  # Running statistics that are not the initial ones: from one full batch.
  _, stats = norm.apply(variables, _x(seed=1), mutable=["batch_stats"])
  variables = {**variables, **stats}
  step = jax.jit(
      lambda v, x, m: norm.apply(v, x, mask=m, mutable=["batch_stats"])
  )
  y, updates = step(variables, x, jnp.asarray(mask))
  want_mean, want_var = _masked_reference(
      x,
      mask,
      stats["batch_stats"]["mean"],
      stats["batch_stats"]["var"],
      momentum,
  )
  got = updates["batch_stats"]
  assert np.isfinite(got["mean"]).all() and np.isfinite(got["var"]).all()
  np.testing.assert_allclose(got["mean"], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["var"], want_var, rtol=1e-5, atol=1e-6)
  empty = ~np.broadcast_to(mask, x.shape).any(0)
  # Kept bit for bit where nothing was masked in.
  np.testing.assert_array_equal(
      np.asarray(got["mean"])[empty],
      np.asarray(stats["batch_stats"]["mean"])[empty],
  )
  # The output of such a feature has no statistics to normalize with.
  assert np.isnan(np.asarray(y)[:, empty]).all()
  # Flax's BatchNorm, for comparison: its running statistics go NaN there.
  flax_norm = nn.BatchNorm(use_running_average=False, momentum=momentum)
  _, flax_updates = flax_norm.apply(
      variables, x, mask=jnp.asarray(mask), mutable=["batch_stats"]
  )
  assert np.isnan(np.asarray(flax_updates["batch_stats"]["mean"])[empty]).all()
  # Inference afterwards is finite.
  inference = norm.clone(use_running_average=True).apply(
      {**variables, **updates}, x
  )
  assert np.isfinite(inference).all()


@pytest.mark.parametrize("measure", MEASURES)
@pytest.mark.parametrize("mask_name", ["nothing", "one_feature"])
def test_nnx_empty_mask_keeps_running_statistics_under_jit(measure, mask_name):
  x, mask = _x(), MASKS[mask_name]
  norm = gbn_jax.nnx.GBatchNorm(
      3, measure=measure, momentum=0.5, rngs=nnx.Rngs(0)
  )
  norm(_x(seed=1))  # running statistics that are not the initial ones
  before_mean, before_var = np.asarray(norm.mean[...]), np.asarray(
      norm.var[...]
  )

  @nnx.jit
  def step(norm, x, mask):
    return norm(x, mask=mask)

  step(norm, x, jnp.asarray(mask))
  after_mean, after_var = np.asarray(norm.mean[...]), np.asarray(norm.var[...])
  empty = ~mask.any(0)
  np.testing.assert_array_equal(after_mean[empty], before_mean[empty])
  np.testing.assert_array_equal(after_var[empty], before_var[empty])
  assert np.isfinite(after_mean).all() and np.isfinite(after_var).all()
  if (~empty).any():
    # The others are updated, with the masked-in elements' statistics.
    assert not np.array_equal(after_mean[~empty], before_mean[~empty])
    if measure == "sd":
      want_mean, want_var = _masked_reference(
          x, mask, before_mean, before_var, 0.5
      )
      np.testing.assert_allclose(after_mean, want_mean, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(after_var, want_var, rtol=1e-5, atol=1e-6)


def test_empty_mask_on_one_device_of_several_still_updates():
  # The statistics pool the devices along axis_name: a device with nothing
  # masked in must not hold back the update the others' elements make.
  x = _x((4, 6, 3))  # 4 "devices" of 6 examples
  mask = np.ones((4, 6, 1), bool)
  mask[0] = False
  norm = gbn_jax.GBatchNorm(
      use_running_average=False, momentum=0.0, axis_name="batch"
  )
  variables = norm.init(jax.random.key(0), x[0])
  _, updates = jax.vmap(
      lambda x, m: norm.apply(variables, x, mask=m, mutable=["batch_stats"]),
      axis_name="batch",
  )(x, jnp.asarray(mask))
  want = np.asarray(x)[1:].reshape(-1, 3).mean(0)
  for device in range(4):
    np.testing.assert_allclose(
        updates["batch_stats"]["mean"][device], want, rtol=1e-5
    )
  # Nothing masked in on any device: kept everywhere.
  _, kept = jax.vmap(
      lambda x, m: norm.apply(variables, x, mask=m, mutable=["batch_stats"]),
      axis_name="batch",
  )(x, jnp.zeros_like(mask))
  np.testing.assert_array_equal(
      kept["batch_stats"]["mean"],
      np.broadcast_to(variables["batch_stats"]["mean"], (4, 3)),
  )
