"""Generalized batch renormalization (renorm=True), linen and nnx.

The reference is numpy, written from the formula: with ``D = sqrt(D^2 +
eps)`` for batch and running statistics, ``r = clip(D_B / D_run, rmin,
rmax)`` and ``d = clip((S_B - S_run) / D_run, -dmax, dmax)`` held constant,
``y = ((x - S_B) / D_B * r + d) * scale + bias``. Gradients: ``dbias = sum
g``, ``dscale = sum g (xhat r + d)``, and ``dx`` by central differences of
the numpy forward with ``r`` and ``d`` frozen at the base point.
"""

import functools

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax import GBatchNorm
import gbn_jax.nnx as gnnx

from tests.helpers import reference as ref
from tests.helpers.gradients import assert_bfloat16_input_gradient_is_finite
from tests.helpers.measures import COMPLETE_MEASURES

GRAD_MEASURES = ["sd", "mad", "sqd1", "rbd", "bpoe"]
EPS = 1e-5
MOMENTUM = 0.8
CLIP = {"rmax": 1.5, "dmax": 0.5}  # rmin = 1/1.5


def _generic_x(shape=(8, 2, 3), seed=0):
  """No ties (every order statistic has a unique element): FD-friendly."""
  rng = np.random.default_rng(seed)
  n = int(np.prod(shape))
  x = rng.permutation(n).reshape(shape) * 0.07 - 1.1
  return (x + rng.random(shape) * 0.01).astype(np.float32)


def _state(features, seed=1):
  """Params and running statistics far enough from the batch to clip some
  features and not others."""
  rng = np.random.default_rng(seed)
  f32 = lambda a: np.asarray(a, np.float32)
  return {
      "params": {
          "scale": f32(1 + 0.3 * rng.standard_normal(features)),
          "bias": f32(0.3 * rng.standard_normal(features)),
      },
      "batch_stats": {
          "mean": f32(0.4 * rng.standard_normal(features)),
          "var": f32(rng.uniform(0.05, 3.0, features)),
      },
  }


def _state_for(x, measure, axes, seed=1):
  """Running statistics placed around the batch's so that, with CLIP, r
  clips above, is free, and clips below, and d is free or clips."""
  state = _state(x.shape[-1], seed)
  s, dev = ref.per_feature(lambda v: ref.measure_1d(measure, v), x, axes)
  var_ratio = np.resize([0.2, 1.1, 4.0], s.shape)  # r = 2.2, 0.95, 0.5
  shift = np.resize([0.1, -1.0, 0.3], s.shape)  # d = -0.2, 1.0, -0.15
  state["batch_stats"] = {
      "mean": np.float32(s + shift * dev),
      "var": np.float32(var_ratio * dev**2),
  }
  return state


def _limits(clipping):
  if clipping is None:
    return None, None, None
  rmax = clipping.get("rmax")
  rmin = clipping.get("rmin", None if rmax is None else 1 / rmax)
  return rmin, rmax, clipping.get("dmax")


def _reference(x, measure, state, clipping, axes):
  """(y, r, d, xhat, S, D) in float64 from the formula."""
  s, dev = ref.per_feature(lambda v: ref.measure_1d(measure, v), x, axes)
  run_s = np.float64(state["batch_stats"]["mean"])
  run_d = np.sqrt(np.float64(state["batch_stats"]["var"]) + EPS)
  batch_d = np.sqrt(dev**2 + EPS)
  rmin, rmax, dmax = _limits(clipping)
  r = np.clip(batch_d / run_d, rmin, rmax)
  d = (s - run_s) / run_d
  if dmax is not None:
    d = np.clip(d, -dmax, dmax)
  e = lambda v: np.expand_dims(v, axes)
  xhat = (np.float64(x) - e(s)) / e(batch_d)
  scale = np.float64(state["params"]["scale"])
  bias = np.float64(state["params"]["bias"])
  y = (xhat * e(r) + e(d)) * scale + bias
  return y, r, d, xhat, s, dev


def _reference_dx(x, measure, state, r, d, w, axes, h=1e-6):
  """Central differences of sum(w * y) with r, d frozen, in float64."""
  scale = np.float64(state["params"]["scale"])
  e = lambda v: np.expand_dims(v, axes)

  def f(v):
    s, dev = ref.per_feature(lambda u: ref.measure_1d(measure, u), v, axes)
    y = ((v - e(s)) / e(np.sqrt(dev**2 + EPS)) * e(r) + e(d)) * scale
    return np.sum(w * y)

  x = np.float64(x)
  grad = np.zeros_like(x)
  for i in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[i] = h
    grad[i] = (f(x + step) - f(x - step)) / (2 * h)
  return grad


# --- the two APIs, as functions of (state, x) -----------------------------------


def _linen_step(measure, clipping, state, x, w, renorm=True):
  """Output, updated running stats and gradients (params, x) of sum(w y)."""
  layer = GBatchNorm(
      measure=measure,
      momentum=MOMENTUM,
      epsilon=EPS,
      renorm=renorm,
      renorm_clipping=clipping if renorm else None,
  )

  def loss(params, inp):
    y, updates = layer.apply(
        {"params": params, "batch_stats": state["batch_stats"]},
        inp,
        False,
        mutable=["batch_stats"],
    )
    return jnp.sum(y * w), (y, updates["batch_stats"])

  (_, (y, stats)), grads = jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True
  )(state["params"], jnp.asarray(x))
  return y, stats, grads


# Alike notebooks/execute.py::execute: only the shape of a call with keywords.
def _nnx_layer(measure, clipping, state, features, renorm=True):
  layer = gnnx.GBatchNorm(
      features,
      measure=measure,
      momentum=MOMENTUM,
      epsilon=EPS,
      renorm=renorm,
      renorm_clipping=clipping if renorm else None,
      rngs=nnx.Rngs(0),
  )
  for name in ("scale", "bias"):
    getattr(layer, name)[...] = jnp.asarray(state["params"][name])
  for name in ("mean", "var"):
    getattr(layer, name)[...] = jnp.asarray(state["batch_stats"][name])
  return layer


def _nnx_step(measure, clipping, state, x, w, renorm=True):
  layer = _nnx_layer(measure, clipping, state, x.shape[-1], renorm)

  def loss(model, inp):
    y = model(inp)
    return jnp.sum(y * w), y

  (_, y), (g_model, g_x) = nnx.value_and_grad(
      loss, argnums=(0, 1), has_aux=True
  )(layer, jnp.asarray(x))
  stats = {name: getattr(layer, name)[...] for name in ("mean", "var")}
  grads = {name: g_model[name][...] for name in ("scale", "bias")}
  return y, stats, (grads, g_x)


STEPS = {"linen": _linen_step, "nnx": _nnx_step}


# --- values and gradients against numpy -----------------------------------------


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("measure", GRAD_MEASURES)
def test_values_and_gradients_match_numpy(measure, api):
  x = _generic_x()
  axes = (0, 1)
  state = _state_for(x, measure, axes)
  w = np.random.default_rng(5).standard_normal(x.shape)
  y, stats, (g_params, g_x) = STEPS[api](
      measure, CLIP, state, x, jnp.asarray(w, jnp.float32)
  )
  want, r, d, xhat, s, dev = _reference(x, measure, state, CLIP, axes)
  # The case is meant to clip some features and leave others free.
  rmin, rmax, dmax = _limits(CLIP)
  raw_r = np.sqrt(dev**2 + EPS) / np.sqrt(
      np.float64(state["batch_stats"]["var"]) + EPS
  )
  assert (raw_r > rmax).any() and (raw_r < rmin).any()
  assert ((raw_r > rmin) & (raw_r < rmax)).any()
  assert (np.abs(d) == dmax).any() and (np.abs(d) < dmax).any()
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  # Running statistics: updated exactly as without renorm.
  old = state["batch_stats"]
  np.testing.assert_allclose(
      stats["mean"],
      MOMENTUM * old["mean"] + (1 - MOMENTUM) * s,
      rtol=1e-5,
      atol=1e-6,
  )
  np.testing.assert_allclose(
      stats["var"],
      MOMENTUM * old["var"] + (1 - MOMENTUM) * dev**2,
      rtol=1e-5,
      atol=1e-6,
  )
  sum_axes = tuple(range(x.ndim - 1))
  np.testing.assert_allclose(
      g_params["bias"], w.sum(sum_axes), rtol=1e-5, atol=1e-5
  )
  e = lambda v: np.expand_dims(v, axes)
  np.testing.assert_allclose(
      g_params["scale"],
      np.sum(w * (xhat * e(r) + e(d)), sum_axes),
      rtol=1e-5,
      atol=1e-5,
  )
  want_dx = _reference_dx(x, measure, state, r, d, w, axes)
  np.testing.assert_allclose(
      g_x, want_dx, rtol=1e-3, atol=1e-4 * np.abs(want_dx).max()
  )


def test_dx_is_plain_gbn_with_scale_times_r():
  # With r, d constant, renorm's input gradient is GBN's with scale * r.
  x = _generic_x((10, 4), seed=3)
  state = _state(4, seed=4)
  w = jnp.asarray(
      np.random.default_rng(6).standard_normal(x.shape), jnp.float32
  )
  for measure in ("sqd2", "wcd"):
    _, _, (_, g_x) = _linen_step(measure, CLIP, state, x, w)
    _, r, _, _, _, _ = _reference(x, measure, state, CLIP, (0,))
    scaled = {
        **state,
        "params": {
            **state["params"],
            "scale": np.float32(state["params"]["scale"] * r),
        },
    }
    _, _, (_, g_plain) = _linen_step(measure, None, scaled, x, w, renorm=False)
    np.testing.assert_allclose(g_x, g_plain, rtol=1e-4, atol=1e-5)


# --- special cases ---------------------------------------------------------------


def _relu_x(shape=(12, 3, 3, 4), seed=0):
  return jnp.asarray(ref.relu_like(np.random.default_rng(seed), shape) - 0.3)


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_rmax_1_dmax_0_is_plain_gbn(measure, api):
  x = _relu_x()
  state = _state(x.shape[-1], seed=7)
  w = jax.random.normal(jax.random.key(8), x.shape)
  step = STEPS[api]
  y, stats, grads = step(measure, {"rmax": 1, "dmax": 0}, state, x, w)
  y0, stats0, grads0 = step(measure, None, state, x, w, renorm=False)
  np.testing.assert_array_equal(y, y0)  # the forward, bit for bit
  jax.tree.map(np.testing.assert_array_equal, stats, stats0)
  # Autodiff through the measure vs the fused backward: float32 rounding.
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(
          a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()) + 1e-6
      ),
      grads,
      grads0,
  )


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_no_clipping_equals_huge_limits(api):
  x = _relu_x(seed=2)
  state = _state(x.shape[-1], seed=9)
  w = jax.random.normal(jax.random.key(10), x.shape)
  huge = {"rmax": 1e30, "rmin": 1e-30, "dmax": 1e30}
  for measure in ("mad", "sqd3"):
    free = STEPS[api](measure, None, state, x, w)
    clipped = STEPS[api](measure, huge, state, x, w)
    jax.tree.map(np.testing.assert_array_equal, free, clipped)
    # and it is a different layer from the clipped one used elsewhere
    y_clip = STEPS[api](measure, CLIP, state, x, w)[0]
    assert not np.allclose(free[0], y_clip)


def test_no_clipping_makes_training_output_the_inference_output():
  # Unclipped, r and d undo the batch statistics: y is the running-average
  # output (Ioffe's motivation), up to rounding.
  x = _relu_x(seed=4)
  state = _state(x.shape[-1], seed=11)
  layer = GBatchNorm(measure="sqd1", epsilon=EPS, renorm=True)
  y_train, _ = layer.apply(state, x, False, mutable=["batch_stats"])
  y_eval = layer.apply(state, x, True)
  np.testing.assert_allclose(y_train, y_eval, rtol=1e-5, atol=1e-5)


def test_default_rmin_is_one_over_rmax():
  x = _generic_x((16, 3), seed=5)
  state = _state(3, seed=12)
  w = jnp.ones(x.shape)
  for clipping in (
      {"rmax": 2.0},
      {"rmax": 2.0, "rmin": 0.5},
      {"dmax": 0.1},
      {"rmin": 0.9},
  ):
    y = _linen_step("mad", clipping, state, x, w)[0]
    want = _reference(x, "mad", state, clipping, (0,))[0]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  y_default = _linen_step("mad", {"rmax": 2.0}, state, x, w)[0]
  y_explicit = _linen_step("mad", {"rmax": 2.0, "rmin": 0.5}, state, x, w)[0]
  np.testing.assert_array_equal(y_default, y_explicit)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_inference_and_running_stats_do_not_change(api):
  x = _relu_x(seed=6)
  state = _state(x.shape[-1], seed=13)
  w = jnp.ones(x.shape)
  for measure in ("sd", "rbd"):
    stats = STEPS[api](measure, CLIP, state, x, w)[1]
    stats0 = STEPS[api](measure, None, state, x, w, renorm=False)[1]
    jax.tree.map(np.testing.assert_array_equal, stats, stats0)
  if api == "linen":
    y = GBatchNorm(renorm=True, renorm_clipping=CLIP).apply(state, x, True)
    y0 = GBatchNorm().apply(state, x, True)
  else:
    layer = _nnx_layer("sd", CLIP, state, x.shape[-1])
    layer.eval()
    y = layer(x)
    plain = _nnx_layer("sd", None, state, x.shape[-1], renorm=False)
    plain.eval()
    y0 = plain(x)
  np.testing.assert_array_equal(y, y0)


def test_mask():
  x = _generic_x((12, 3), seed=8)
  mask = np.random.default_rng(14).random(x.shape) < 0.7
  state = _state(3, seed=15)
  layer = GBatchNorm(
      measure="sqd2", epsilon=EPS, renorm=True, renorm_clipping=CLIP
  )
  y, _ = layer.apply(state, x, False, mask=mask, mutable=["batch_stats"])
  s, dev = ref.per_feature(lambda v: ref.measure_1d("sqd2", v), x, (0,), mask)
  run_d = np.sqrt(np.float64(state["batch_stats"]["var"]) + EPS)
  r = np.clip(np.sqrt(dev**2 + EPS) / run_d, 1 / 1.5, 1.5)
  d = np.clip((s - state["batch_stats"]["mean"]) / run_d, -0.5, 0.5)
  want = (((x - s) / np.sqrt(dev**2 + EPS)) * r + d) * state["params"][
      "scale"
  ] + state["params"]["bias"]
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_renorm_false_keeps_the_fused_backward():
  x = _relu_x((6, 4))
  state = _state(4)

  def jaxpr(renorm):
    layer = GBatchNorm(measure="mad", renorm=renorm)
    f = lambda v: layer.apply(state, v, False, mutable=["batch_stats"])[0].sum()
    return str(jax.make_jaxpr(f)(x))

  assert "name=_fused_normalize" in jaxpr(False)
  assert "name=_fused_normalize" not in jaxpr(True)


def test_half_precision_and_no_params():
  x = _relu_x(seed=3).astype(jnp.bfloat16)
  for measure, kwargs in (
      ("sqd1", {"use_scale": False, "use_bias": False}),
      ("sqd1", {}),
      ("mad", {"param_dtype": jnp.float16, "force_float32_reductions": False}),
  ):
    layer = GBatchNorm(
        measure=measure, renorm=True, renorm_clipping=CLIP, **kwargs
    )
    variables = layer.init(jax.random.key(0), x, False)
    y, _ = layer.apply(variables, x, False, mutable=["batch_stats"])
    plain = GBatchNorm(measure=measure, **kwargs)
    y0, _ = plain.apply(variables, x, False, mutable=["batch_stats"])
    assert y.dtype == y0.dtype
    assert_bfloat16_input_gradient_is_finite(layer, variables, x)


# --- construction ----------------------------------------------------------------


@pytest.mark.parametrize(
    "clipping,error,match",
    [
        ({"rmax": 3, "dmax": 5, "r_max": 2}, ValueError, "unknown key"),
        ({"rmax": 0.5}, ValueError, r"'rmax'\] must be >= 1"),
        ({"rmax": float("nan")}, ValueError, "rmax"),
        ({"dmax": -1}, ValueError, r"'dmax'\] must be >= 0"),
        ({"rmin": 1.5}, ValueError, r"'rmin'\] must be in \(0, 1\]"),
        ({"rmin": 0}, ValueError, "rmin"),
        ({"rmin": -0.5, "rmax": 2}, ValueError, "rmin"),
        ({"rmax": "3"}, TypeError, "real number"),
        ({"dmax": True}, TypeError, "real number"),
        ([("rmax", 3)], TypeError, "must be a dict"),
    ],
)
def test_bad_clipping_fails_at_construction(clipping, error, match):
  with pytest.raises(error, match=match):
    GBatchNorm(renorm=True, renorm_clipping=clipping)
  with pytest.raises(error, match=match):
    gnnx.GBatchNorm(3, renorm=True, renorm_clipping=clipping, rngs=nnx.Rngs(0))


def test_clipping_without_renorm_is_an_error():
  with pytest.raises(ValueError, match="renorm=True"):
    GBatchNorm(renorm_clipping={"rmax": 3})
  with pytest.raises(ValueError, match="renorm=True"):
    gnnx.GBatchNorm(3, renorm_clipping={"rmax": 3}, rngs=nnx.Rngs(0))


def test_modules_stay_hashable_and_jittable():
  layer = GBatchNorm(renorm=True, renorm_clipping={"rmax": 3, "dmax": 5})
  assert hash(layer) == hash(layer.clone())
  assert dict(layer.renorm_clipping) == {"rmax": 3.0, "dmax": 5.0}
  x = _relu_x((8, 4))
  variables = layer.init(jax.random.key(0), x, False)
  apply = jax.jit(
      functools.partial(layer.apply, mutable=["batch_stats"]), static_argnums=2
  )
  y, _ = apply(variables, x, False)
  assert y.shape == x.shape

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)
      self.norm = gnnx.GBatchNorm(
          4,
          measure="sqd2",
          renorm=True,
          renorm_clipping={"rmax": 2, "dmax": 1},
          rngs=rngs,
      )

    def __call__(self, v):
      return nnx.relu(self.norm(self.lin(v))).sum()

  model = Net(nnx.Rngs(0))
  graphdef, _ = nnx.split(model)
  hash(graphdef)

  @nnx.jit
  def step(m, v):
    return nnx.grad(lambda mm: mm(v))(m)

  before = np.asarray(model.norm.mean[...]).copy()
  grads = step(model, x)
  assert not np.allclose(before, model.norm.mean[...])
  assert np.isfinite(np.asarray(grads["lin"]["kernel"][...])).all()


def test_flax_batchnorm_model_swap():
  # renorm layers drop into a model next to flax's BatchNorm.
  class Net(nn.Module):

    @nn.compact
    def __call__(self, v, train):
      v = GBatchNorm(
          use_running_average=not train,
          renorm=True,
          renorm_clipping={"rmax": 3, "dmax": 5},
      )(nn.Dense(4)(v))
      return nn.BatchNorm(use_running_average=not train)(v)

  x = _relu_x((8, 4))
  variables = Net().init(jax.random.key(0), x, train=False)
  y, updates = Net().apply(variables, x, train=True, mutable=["batch_stats"])
  assert y.shape == x.shape and set(updates["batch_stats"]) == {
      "GBatchNorm_0",
      "BatchNorm_0",
  }
