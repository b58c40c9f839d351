"""calibration='normal': D divided by its value for a standard normal feature."""

import functools
import math

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate
from scipy import stats

import gbn_jax
from gbn_jax import GBatchNorm
from gbn_jax import calibration
from gbn_jax import get_measure
from gbn_jax import measures
import gbn_jax.nnx as gnnx

from tests.helpers.measures import COMPLETE_MEASURES
from tests.helpers.process import run_python

ALPHAS = [0.05, 0.25, 0.5, 0.75, 0.97]


# Tests here register measures: the registry is restored after each.
pytestmark = pytest.mark.usefixtures("restore_registry")


def _measure(name, calibration=None):
  base, params = gbn_jax.parse_measure_name(name)
  return get_measure(base, calibration=calibration, **params)


# --- the constants against independent references --------------------------------


def _scipy_max(n):
  """E[max of n standard normals] by scipy's quad around the mode."""
  f = (
      lambda z: z
      * n
      * np.exp(stats.norm.logpdf(z) + (n - 1) * stats.norm.logcdf(z))
  )
  mode = math.sqrt(2 * math.log(n)) if n > 1 else 0.0
  return integrate.quad(
      f,
      -15,
      15,
      points=[mode - 1, mode, mode + 1],
      epsabs=1e-14,
      epsrel=1e-13,
      limit=500,
  )[0]


def test_population_constants_equal_scipy():
  norm = stats.norm()
  want = {
      "sd": norm.std(),
      "mad": norm.expect(abs),
      "rsd": norm.expect(lambda z: max(z, 0.0)),
      "bpoe": norm.expect(lambda z: z, lb=0, conditional=True),
  }
  for alpha in ALPHAS:  # CVaR_alpha minus the mean
    want[f"sqd:{alpha}"] = norm.expect(lambda z: z, lb=norm.ppf(alpha)) / (
        1 - alpha
    )
  want.update(
      {
          "sqd1": want["sqd:0.25"],
          "sqd2": want["sqd:0.5"],
          "sqd3": want["sqd:0.75"],
      }
  )
  for name, value in want.items():
    for n in (2, 1000):  # no dependence on n
      np.testing.assert_allclose(
          _measure(name).normal_constant(n), value, rtol=1e-9, err_msg=name
      )
  assert get_measure("sd").normal_constant(7) == 1.0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 10, 100, 1000, 10**5, 10**8, 2**40])
def test_expected_max_equals_scipy_quad(n):
  got = calibration.expected_normal_max(n)
  np.testing.assert_allclose(got, _scipy_max(n), rtol=1e-12)
  np.testing.assert_allclose(get_measure("wcd").normal_constant(n), got, rtol=0)
  np.testing.assert_allclose(
      get_measure("rbd").normal_constant(n), 2 * got, rtol=0
  )


def test_expected_max_closed_forms_and_degenerate_n():
  np.testing.assert_allclose(
      calibration.expected_normal_max(2), 1 / math.sqrt(math.pi), rtol=1e-14
  )
  np.testing.assert_allclose(
      calibration.expected_normal_max(3), 1.5 / math.sqrt(math.pi), rtol=1e-14
  )
  assert (
      calibration.expected_normal_max(1)
      == calibration.expected_normal_max(0)
      == 0.0
  )
  np.testing.assert_array_equal(
      calibration.expected_normal_max(jnp.array([0, 1])), 0
  )


@pytest.mark.parametrize("n", [7, 60])
def test_range_and_max_constants_equal_monte_carlo(n):
  z = np.random.default_rng(n).standard_normal((200_000, n))
  for name, d in (("rbd", z.max(1) - z.min(1)), ("wcd", z.max(1) - z.mean(1))):
    se = d.std() / math.sqrt(d.size)
    assert abs(d.mean() - get_measure(name).normal_constant(n)) < 4 * se, name


def test_traced_table_error_is_below_2e7():
  """The masked path's table against the exact integration, up to 2**31."""
  ns = np.concatenate(
      [
          np.arange(0, 5000),
          np.unique(
              np.round(np.geomspace(5000, 2**31 - 1, 4000)).astype(np.int64)
          ),
      ]
  )
  exact = np.array([calibration.expected_normal_max(int(n)) for n in ns])
  table = np.asarray(
      jax.jit(calibration.expected_normal_max)(jnp.asarray(ns, jnp.int32))
  )
  error = np.abs(table - exact) / np.maximum(exact, 1e-300)
  assert error.max() < 2e-7, (ns[error.argmax()], error.max())


def test_constants_do_not_import_scipy():
  code = (
      "import sys, gbn_jax; gbn_jax.calibration.expected_normal_max(10**6);"
      "gbn_jax.get_measure('sqd', alpha=0.3, calibration='normal')"
      ".normal_constant(5); assert 'scipy' not in sys.modules"
  )
  run_python(code)  # ProcessFailed unless the assert held


# --- D is sigma for Gaussian data -----------------------------------------------


@pytest.mark.parametrize("name", [*COMPLETE_MEASURES, "sqd:0.05", "sqd:0.97"])
def test_calibrated_deviation_is_sigma_on_normal_data(name):
  sigma = 2.5
  x = jax.random.normal(jax.random.key(0), (20_000, 64)) * sigma - 1.0
  # The extremes vary by 5-9% a feature (the mean of 64 by about 1%), the
  # others by well under 1%: tolerances of about 3 standard errors.
  extreme = name in ("rbd", "wcd")
  _, d = _measure(name, "normal")(x, axis=0)
  assert abs(float(jnp.mean(d)) / sigma - 1) < (0.03 if extreme else 0.005)
  if not extreme:
    np.testing.assert_allclose(d / sigma, 1, rtol=0.03)
  # Under a mask (traced n, per feature) too.
  mask = jax.random.bernoulli(jax.random.key(1), 0.3, x.shape)
  _, d = _measure(name, "normal")(x, axis=0, where=mask)
  assert abs(float(jnp.mean(d)) / sigma - 1) < (0.035 if extreme else 0.01)


def test_rbd_and_wcd_use_the_batch_size_they_see():
  # Small batches, many features: E[D] = sigma at every n (not only n -> inf).
  for n in (2, 4, 16):
    x = jax.random.normal(jax.random.key(n), (n, 50_000)) * 3
    for name in ("rbd", "wcd"):
      _, d = get_measure(name, calibration="normal")(x, axis=0)
      assert abs(float(jnp.mean(d)) / 3 - 1) < 0.02, (name, n)


@pytest.mark.parametrize("name", ["mad", "sqd1", "rbd", "wcd", "bpoe"])
def test_masked_constant_is_that_of_each_features_count(name):
  x = jax.random.normal(jax.random.key(2), (40, 6))
  keep = np.array([40, 33, 17, 5, 2, 1])  # per feature: the first k elements
  mask = jnp.arange(40)[:, None] < keep
  _, got = get_measure(name, calibration="normal")(x, axis=0, where=mask)
  for f, k in enumerate(keep):
    _, want = get_measure(name, calibration="normal")(x[:k, f : f + 1], axis=0)
    np.testing.assert_allclose(got[f], want[0], rtol=1e-6, atol=0)


def test_single_element_stays_zero():
  for name in COMPLETE_MEASURES:
    _, d = get_measure(name, calibration="normal")(jnp.ones((1, 3)), axis=0)
    np.testing.assert_array_equal(d, 0)
    _, d = get_measure(name, calibration="normal")(
        jnp.ones((4, 3)), axis=0, where=jnp.arange(4)[:, None] < 1
    )
    np.testing.assert_array_equal(d, 0)


# --- gradients, modules, running statistics -----------------------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", COMPLETE_MEASURES)
def test_gradient_is_the_raw_one_over_the_constant(name, masked):
  x = jax.random.normal(jax.random.key(3), (24, 5)) * 2
  w = jax.random.normal(jax.random.key(4), (5,))
  where = (
      jax.random.bernoulli(jax.random.key(5), 0.7, x.shape) if masked else None
  )
  n = jnp.sum(where, 0) if masked else x.shape[0]
  c = get_measure(name).normal_constant(n)
  cal, raw = get_measure(name, calibration="normal"), get_measure(name)
  loss = lambda m, v: jnp.sum(m(v, 0, where=where)[1] * w)
  # Under jit: the subject is the gradient, and eager dispatch is slow.
  g_cal = jax.jit(jax.grad(functools.partial(loss, cal)))(x)
  g_raw = jax.jit(
      jax.grad(lambda v: jnp.sum(raw(v, 0, where=where)[1] * w / c))
  )(x)
  np.testing.assert_allclose(g_cal, g_raw, rtol=1e-6, atol=1e-7)


def _module_reference(name, variables, x, mask, epsilon=1e-5):
  """Calibrated GBN written out from the raw measure, differentiated by autodiff."""
  raw = get_measure(name)
  n = jnp.sum(mask, 0) if mask is not None else x.shape[0]
  c = raw.normal_constant(n)
  p = variables["params"]

  def forward(params, v):
    s, d = raw(v, 0, where=mask)
    d2 = jnp.square(d / jnp.where(c > 0, c, 1))
    return (v - s) * jax.lax.rsqrt(d2 + epsilon) * params["scale"] + params[
        "bias"
    ], d2

  return forward, p


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", ["mad", "rsd", "sqd1", "rbd", "wcd", "bpoe"])
def test_module_equals_its_definition(name, masked):
  x = jax.random.normal(jax.random.key(6), (16, 4)) * 2 + 1
  wout = jax.random.normal(jax.random.key(7), x.shape)
  mask = (
      jax.random.bernoulli(jax.random.key(8), 0.8, x.shape) if masked else None
  )
  module = GBatchNorm(measure=name, calibration="normal", momentum=0.0)
  variables = module.init(jax.random.key(0), x, False)
  variables = {
      **variables,
      "params": jax.tree.map(lambda a: a + 0.3, variables["params"]),
  }
  forward, params = _module_reference(name, variables, x, mask)

  def loss(p, v):
    y, upd = module.apply(
        {**variables, "params": p}, v, False, mask=mask, mutable=["batch_stats"]
    )
    return jnp.sum(jnp.tanh(y) * wout), (y, upd["batch_stats"]["var"])

  def loss_ref(p, v):
    y, d2 = forward(p, v)
    return jnp.sum(jnp.tanh(y) * wout), (y, d2)

  value_and_grad = lambda f: jax.jit(
      jax.value_and_grad(f, (0, 1), has_aux=True)
  )
  (_, (y, var)), g = value_and_grad(loss)(params, x)
  (_, (y_ref, d2)), g_ref = value_and_grad(loss_ref)(params, x)
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  close(y, y_ref)
  close(var, d2)  # the running var holds the calibrated D^2
  jax.tree.map(close, g, g_ref)
  # Inference normalizes by the (calibrated) running statistics.
  stats_ = module.apply(
      variables, x, False, mask=mask, mutable=["batch_stats"]
  )[1]
  y_inf = module.apply({**variables, **stats_}, x, True)
  close(y_inf, y_ref)


def test_nnx_matches_linen():
  x = jax.random.normal(jax.random.key(9), (12, 3)) * 3
  for name in ("rsd", "rbd"):
    lin = GBatchNorm(measure=name, calibration="normal", momentum=0.5)
    variables = lin.init(jax.random.key(0), x, False)
    y, upd = lin.apply(variables, x, False, mutable=["batch_stats"])
    mod = gnnx.GBatchNorm(
        3, measure=name, calibration="normal", momentum=0.5, rngs=nnx.Rngs(0)
    )
    np.testing.assert_array_equal(mod(x), y)
    np.testing.assert_array_equal(mod.var[...], upd["batch_stats"]["var"])
    assert mod.calibration == "normal"


def test_renorm_with_calibration_at_rmax_1_is_plain_calibrated_gbn():
  x = jax.random.normal(jax.random.key(10), (16, 3))
  for name in ("mad", "sqd1", "rbd", "wcd"):
    plain = GBatchNorm(measure=name, calibration="normal")
    variables = plain.init(jax.random.key(0), x, False)
    y, stats_ = plain.apply(variables, x, False, mutable=["batch_stats"])
    renorm = plain.clone(renorm=True, renorm_clipping={"rmax": 1, "dmax": 0})
    y_r, stats_r = renorm.apply(variables, x, False, mutable=["batch_stats"])
    jax.tree.map(np.testing.assert_array_equal, stats_r, stats_)
    # (XLA fuses the two forwards differently: an ulp or two, calibrated or not.)
    np.testing.assert_allclose(y_r, y, rtol=1e-6, atol=1e-6)


# --- off, and sd: bit for bit -----------------------------------------------------


def _train_step(module, variables, x, w, mask=None):
  def loss(params, v):
    y, upd = module.apply(
        {**variables, "params": params},
        v,
        False,
        mask=mask,
        mutable=["batch_stats"],
    )
    return jnp.sum(jnp.sin(y) * w), (y, upd)

  (_, (y, upd)), grads = jax.jit(
      jax.value_and_grad(loss, (0, 1), has_aux=True)
  )(variables["params"], x)
  return y, upd, grads


@pytest.mark.parametrize("name", COMPLETE_MEASURES)
def test_off_is_bit_identical_to_the_module_without_the_option(name):
  x = jax.random.normal(jax.random.key(11), (8, 3, 3, 4)) * 2
  w = jax.random.normal(jax.random.key(12), x.shape)
  mask = jax.random.bernoulli(jax.random.key(13), 0.7, x.shape)
  variables = GBatchNorm(measure=name).init(jax.random.key(0), x, False)
  for m in (None, mask):
    a = _train_step(GBatchNorm(measure=name), variables, x, w, m)
    b = _train_step(
        GBatchNorm(measure=name, calibration=None), variables, x, w, m
    )
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_calibrated_sd_is_uncalibrated_sd_and_flax_batchnorm():
  x = jax.random.normal(jax.random.key(14), (8, 3, 3, 4)) * 2 + 0.5
  w = jax.random.normal(jax.random.key(15), x.shape)
  variables = nn.BatchNorm().init(jax.random.key(0), x, False)
  cal = _train_step(GBatchNorm(calibration="normal"), variables, x, w)
  jax.tree.map(
      np.testing.assert_array_equal,
      cal,
      _train_step(GBatchNorm(), variables, x, w),
  )
  bn = _train_step(nn.BatchNorm(), variables, x, w)
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  jax.tree.map(close, cal[:2], bn[:2])
  jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5),
      cal[2],
      bn[2],
  )
  s, d = get_measure("sd", calibration="normal")(x, (0, 1, 2))
  s0, d0 = get_measure("sd")(x, (0, 1, 2))
  np.testing.assert_array_equal(d, d0)


# --- registration and errors -----------------------------------------------------


def test_user_measure_needs_its_constant():
  def spread(x, axis):
    return jnp.mean(x, axis), jnp.std(x, axis)

  gbn_jax.register_measure("test_spread_nc", spread, overwrite=True)
  with pytest.raises(ValueError, match="no normal-consistency constant"):
    get_measure("test_spread_nc", calibration="normal")
  with pytest.raises(ValueError, match="no normal-consistency constant"):
    GBatchNorm(measure="test_spread_nc", calibration="normal")
  with pytest.raises(ValueError, match="no normal-consistency constant"):
    gnnx.GBatchNorm(
        3, measure="test_spread_nc", calibration="normal", rngs=nnx.Rngs(0)
    )
  with pytest.raises(ValueError, match="register it with"):
    GBatchNorm(measure=spread, calibration="normal")
  GBatchNorm(measure="test_spread_nc")  # fine uncalibrated
  GBatchNorm(measure=spread)


def test_user_constant_float_and_callable():
  def spread(x, axis, *, where=None, k=1.0):
    s = jnp.mean(x, axis, where=where)
    return s, k * jnp.sqrt(
        jnp.mean(jnp.square(x - jnp.expand_dims(s, axis)), axis, where=where)
    )

  x = jax.random.normal(jax.random.key(16), (10, 3))
  gbn_jax.register_measure(
      "test_spread_f", spread, normal_scale=2.0, k=2.0, overwrite=True
  )
  _, d = get_measure("test_spread_f", calibration="normal")(x, 0)
  np.testing.assert_allclose(d, jnp.std(x, 0), rtol=1e-6)
  seen = []

  def scale(n, *, k):
    seen.append((n, k))
    return k * jnp.sqrt(jnp.asarray(n - 1, jnp.float32) / n)  # E-ish

  gbn_jax.register_measure(
      "test_spread_c",
      spread,
      normal_scale=scale,
      supports_mask=True,
      overwrite=True,
  )
  get_measure("test_spread_c", calibration="normal", k=3.0)(x, 0)
  assert seen[-1] == (10, 3.0)
  mask = x > -5
  get_measure("test_spread_c", calibration="normal", k=3.0)(x, 0, where=mask)
  n, _ = seen[-1]
  np.testing.assert_array_equal(n, [10, 10, 10])
  assert n.dtype == jnp.int32
  # A built-in function registered anew keeps its constant.
  gbn_jax.register_measure(
      "test_sqd_p90", measures.sqd, alpha=0.9, overwrite=True
  )
  np.testing.assert_allclose(
      get_measure("test_sqd_p90", calibration="normal").normal_constant(3),
      get_measure("sqd", alpha=0.9).normal_constant(3),
  )


@pytest.mark.parametrize(
    "bad", [0.0, -1.0, float("nan"), float("inf"), "1", True]
)
def test_bad_normal_scale(bad):
  with pytest.raises(ValueError, match="normal_scale"):
    gbn_jax.register_measure(
        "test_bad_scale", measures.mad, normal_scale=bad, overwrite=True
    )


def test_bad_calibration_fails_at_construction():
  for make in (
      lambda: GBatchNorm(measure="mad", calibration="gaussian"),
      lambda: gnnx.GBatchNorm(3, calibration="Normal", rngs=nnx.Rngs(0)),
      lambda: get_measure("mad", calibration=True),
  ):
    with pytest.raises(
        ValueError, match="calibration must be None or 'normal'"
    ):
      make()


def test_measure_objects_and_repr():
  m = get_measure("sqd", alpha=0.3, calibration="normal")
  assert repr(m) == "Measure('sqd', alpha=0.3, calibration='normal')"
  assert m != get_measure("sqd", alpha=0.3) and hash(m) == hash(
      get_measure("sqd", alpha=0.3, calibration="normal")
  )
  # A Measure object as the module's measure is calibrated by the module, or
  # calibrates itself.
  x = jax.random.normal(jax.random.key(17), (8, 3))
  variables = GBatchNorm(measure="mad").init(jax.random.key(0), x, False)
  want = GBatchNorm(measure="mad", calibration="normal").apply(
      variables, x, False, mutable=["batch_stats"]
  )
  for module in (
      GBatchNorm(measure=get_measure("mad"), calibration="normal"),
      GBatchNorm(measure=get_measure("mad", calibration="normal")),
  ):
    jax.tree.map(
        np.testing.assert_array_equal,
        module.apply(variables, x, False, mutable=["batch_stats"]),
        want,
    )
