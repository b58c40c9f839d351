"""Layer errors beyond flax's, and masks with nothing masked in (linen, nnx).

What a new user tripped over: an ``axis`` the input lacks was an
``IndexError`` from deep inside, a wrong ``num_features`` or ``momentum`` and
a float mask passed silently, a batch with every element masked out made
the running statistics NaN for good, and a mask of one flag per example,
shape ``(batch,)``, was a bare broadcasting error.
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


# --- a mask that does not broadcast to x ---------------------------------------

X_SHAPE = (8, 4, 4, 3)

# Each mask shape that does not broadcast to X_SHAPE, with what the message
# must name besides both shapes: the fix, or the shapes a mask can have.
BAD_MASKS = {
    "per_example": ((8,), ["mask[:, None, None, None]", "(8, 1, 1, 1)"]),
    "per_example_and_row": ((8, 4), ["mask[:, :, None, None]", "(8, 4, 1, 1)"]),
    "wrong_length": ((7,), ["(8, 1, 1, 1)", "one flag per example"]),
    "wrong_batch": ((7, 1, 1, 1), ["(8, 1, 1, 1)", "one flag per example"]),
    "more_axes": ((1, 8, 4, 4, 3), ["mask.reshape((8, 4, 4, 3))"]),
    "more_axes_wide": ((8, 4, 4, 1, 1), ["at most 4 axes (it has 5)"]),
}


def _mask(shape, seed=3):
  mask = jax.random.bernoulli(jax.random.key(seed), 0.7, shape)
  # Every feature keeps a masked-in element: flax's running statistics of
  # one without go NaN, where GBN keeps them (tested above).
  return mask.at[(0,) * (len(shape) - 1)].set(True) if len(shape) > 1 else mask


def _linen_call(mask, *, jit=False, **fields):
  x = _x(X_SHAPE)
  norm = gbn_jax.GBatchNorm(use_running_average=False, **fields)
  variables = norm.init(jax.random.key(0), x)
  apply = lambda v, x, m: norm.apply(v, x, mask=m, mutable=["batch_stats"])
  return (jax.jit(apply) if jit else apply)(variables, x, mask)


def _nnx_call(mask, **fields):
  norm = gbn_jax.nnx.GBatchNorm(X_SHAPE[-1], rngs=nnx.Rngs(0), **fields)
  return norm(_x(X_SHAPE), mask=mask)


def _flax_call(mask):
  """flax's BatchNorm, the reference: ``(y, running mean, running var)``."""
  x = _x(X_SHAPE)
  norm = nn.BatchNorm(use_running_average=False)
  variables = norm.init(jax.random.key(0), x)
  y, updates = norm.apply(variables, x, mask=mask, mutable=["batch_stats"])
  return y, updates["batch_stats"]["mean"], updates["batch_stats"]["var"]


def _assert_equals_flax(y, mean, var, mask):
  want_y, want_mean, want_var = _flax_call(mask)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var, want_var, rtol=1e-5, atol=1e-6)


def _mask_error(mask_shape, needs):
  """pytest.raises for the layer's error: ``mask``, both shapes, ``needs``."""
  pattern = "".join(
      f"(?=.*{re.escape(s)})"
      for s in [f"mask of shape {mask_shape}", f"x's shape {X_SHAPE}", *needs]
  )
  return pytest.raises(ValueError, match=pattern)


@pytest.mark.parametrize("name", list(BAD_MASKS))
def test_linen_mask_that_does_not_broadcast_names_shapes_and_fix(name):
  shape, needs = BAD_MASKS[name]
  for jit in (False, True):
    with _mask_error(shape, needs) as info:
      _linen_call(_mask(shape), jit=jit)
    # The layer's message, not jax's from a broadcast deep inside.
    assert "Incompatible" not in str(info.value)


@pytest.mark.parametrize("name", list(BAD_MASKS))
def test_nnx_mask_that_does_not_broadcast_names_shapes_and_fix(name):
  shape, needs = BAD_MASKS[name]
  with _mask_error(shape, needs):
    _nnx_call(_mask(shape))
  with _mask_error(shape, needs):
    nnx.jit(lambda m: _nnx_call(m))(_mask(shape))


def _suggested(message, mask):
  """The mask the message tells the user to pass, computed as written."""
  fix = re.search(
      r"pass (mask\[[^\]]*\])|(mask\.reshape\(\([^)]*\)\))", message
  )
  assert fix, message
  return eval(fix.group(1) or fix.group(2), {"mask": mask})  # pylint: disable=eval-used


@pytest.mark.parametrize(
    "name", ["per_example", "per_example_and_row", "more_axes"]
)
def test_following_the_suggested_fix_equals_flax(name):
  shape, _ = BAD_MASKS[name]
  mask = _mask(shape)
  with pytest.raises(ValueError) as info:
    _linen_call(mask)
  fixed = _suggested(str(info.value), mask)
  y, updates = _linen_call(fixed)
  stats = updates["batch_stats"]
  _assert_equals_flax(y, stats["mean"], stats["var"], fixed)

  with pytest.raises(ValueError) as info:
    _nnx_call(mask)
  fixed = _suggested(str(info.value), mask)
  norm = gbn_jax.nnx.GBatchNorm(X_SHAPE[-1], rngs=nnx.Rngs(0))
  y = norm(_x(X_SHAPE), mask=fixed)
  _assert_equals_flax(y, norm.mean[...], norm.var[...], fixed)


@pytest.mark.parametrize(
    "shape", [(8, 1, 1, 1), (1, 4, 4, 3), (4, 4, 3), (1, 1, 1, 3), X_SHAPE]
)
def test_broadcastable_masks_still_equal_flax(shape):
  mask = _mask(shape)
  y, updates = _linen_call(mask, jit=True)
  stats = updates["batch_stats"]
  _assert_equals_flax(y, stats["mean"], stats["var"], mask)
  norm = gbn_jax.nnx.GBatchNorm(X_SHAPE[-1], rngs=nnx.Rngs(0))
  y = norm(_x(X_SHAPE), mask=mask)
  _assert_equals_flax(y, norm.mean[...], norm.var[...], mask)


def test_renorm_and_converted_layers_check_the_mask_shape():
  shape, needs = BAD_MASKS["per_example"]
  mask = _mask(shape)
  with _mask_error(shape, needs):
    _linen_call(mask, renorm=True)
  with _mask_error(shape, needs):
    _nnx_call(mask, renorm=True)
  # flax's own layers, computing GBN through the conversions.
  x = _x(X_SHAPE)
  flax_norm = nn.BatchNorm(use_running_average=False)
  variables = flax_norm.init(jax.random.key(0), x)
  with gbn_jax.linen.batchnorm_as_gbn("mad"), _mask_error(shape, needs):
    flax_norm.apply(variables, x, mask=mask, mutable=["batch_stats"])
  converted = gbn_jax.nnx.convert_batchnorm(
      nnx.BatchNorm(X_SHAPE[-1], rngs=nnx.Rngs(0)), "mad"
  )
  with _mask_error(shape, needs):
    converted(x, mask=mask)


def _masked_mean_sd(x, axis, *, where=None):
  s = jnp.mean(x, axis, where=where)
  centered = x - jnp.expand_dims(s, axis)
  return s, jnp.sqrt(jnp.mean(jnp.square(centered), axis, where=where))


def test_symbolic_batch_mask_is_checked_by_broadcasting():
  # A measure of plain jnp reductions: the layer alone under a symbolic
  # batch, whatever the built-in measures support.
  measure = gbn_jax.Measure(
      "masked_mean_sd", _masked_mean_sd, supports_mask=True
  )
  norm = gbn_jax.GBatchNorm(use_running_average=False, measure=measure)
  variables = norm.init(jax.random.key(0), _x(X_SHAPE))
  (b,) = jax.export.symbolic_shape("b")
  abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)

  def export(mask_shape):
    return jax.export.export(
        jax.jit(
            lambda v, x, m: norm.apply(v, x, mask=m, mutable=["batch_stats"])
        )
    )(
        jax.tree.map(lambda a: abstract(a.shape, a.dtype), variables),
        abstract((b, *X_SHAPE[1:]), jnp.float32),
        abstract(mask_shape, jnp.bool_),
    )

  x = _x(X_SHAPE)
  for mask_shape in [(b, 1, 1, 1), (1, 4, 4, 3), (4, 4, 3), (b, 4, 4, 3)]:
    concrete = tuple(X_SHAPE[0] if d is b else d for d in mask_shape)
    mask = _mask(concrete)
    y, updates = export(mask_shape).call(variables, x, mask)
    stats = updates["batch_stats"]
    _assert_equals_flax(y, stats["mean"], stats["var"], mask)
  with pytest.raises(
      ValueError,
      match=re.escape("mask of shape (b,)")
      + ".*"
      + re.escape("mask[:, None, None, None] (shape (b, 1, 1, 1))"),
  ):
    export((b,))
  # A fixed batch size is no mask for every batch size.
  with pytest.raises(ValueError, match=re.escape("mask of shape (8, 1, 1, 1)")):
    export((8, 1, 1, 1))
