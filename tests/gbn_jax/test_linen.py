"""gbn_jax.GBatchNorm (linen) vs flax.linen.BatchNorm and numpy definitions."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm

from tests.helpers import reference as ref
from tests.helpers.gradients import assert_bfloat16_input_gradient_is_finite
from tests.helpers.gradients import assert_matches_central_differences
from tests.helpers.measures import COMPLETE_MEASURES


def _x(shape=(16, 5, 5, 3), seed=0, dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(seed), shape) * 2 + 0.5).astype(
      dtype
  )


def _nonzero_params(variables, seed=1):
  # Non-trivial scale and bias so that they are really tested.
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  return jax.tree.map(
      lambda a: a + 0.3 * jax.random.normal(next(keys), a.shape, a.dtype),
      variables,
  )


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"use_fast_variance": False},
        {"axis": 1},
        {"axis": (1, 3)},
        {"momentum": 0.9, "epsilon": 1e-3},
        {"use_bias": False, "use_scale": False},
        {"dtype": jnp.bfloat16},
        {"param_dtype": jnp.float16, "force_float32_reductions": False},
    ],
    ids=str,
)
def test_sd_is_flax_batchnorm(kwargs):
  x = _x()
  bn = nn.BatchNorm(**kwargs)
  gbn = GBatchNorm(**kwargs)
  variables = bn.init(jax.random.key(0), x, use_running_average=False)
  assert jax.tree.structure(variables) == jax.tree.structure(
      gbn.init(jax.random.key(0), x, use_running_average=False)
  )
  variables = _nonzero_params(variables)
  state = {"bn": variables, "gbn": variables}
  for step in range(4):  # training updates, then inference with running stats
    xs = _x(seed=10 + step)
    y_bn, up_bn = bn.apply(state["bn"], xs, False, mutable=["batch_stats"])
    y_g, up_g = gbn.apply(state["gbn"], xs, False, mutable=["batch_stats"])
    assert y_bn.dtype == y_g.dtype
    np.testing.assert_allclose(
        np.float32(y_g), np.float32(y_bn), rtol=1e-5, atol=1e-5
    )
    state = {k: {**state[k], **u} for k, u in (("bn", up_bn), ("gbn", up_g))}
  chex_close = functools.partial(
      np.testing.assert_allclose, rtol=1e-6, atol=1e-6
  )
  jax.tree.map(
      chex_close, state["gbn"]["batch_stats"], state["bn"]["batch_stats"]
  )
  y_bn = bn.apply(state["bn"], x, use_running_average=True)
  y_g = gbn.apply(state["gbn"], x, use_running_average=True)
  np.testing.assert_allclose(
      np.float32(y_g), np.float32(y_bn), rtol=1e-5, atol=1e-5
  )


def test_sd_gradients_match_flax():
  x = _x((8, 4, 4, 3))
  w = jax.random.normal(jax.random.key(3), x.shape)
  bn, gbn = nn.BatchNorm(use_running_average=False), GBatchNorm(
      use_running_average=False
  )
  variables = _nonzero_params(bn.init(jax.random.key(0), x))

  def loss(module, params, inp):
    y, _ = module.apply(
        {**variables, "params": params}, inp, mutable=["batch_stats"]
    )
    return jnp.sum(jnp.tanh(y) * w)

  for argnum in (1, 2):
    g_bn = jax.grad(loss, argnums=argnum)(bn, variables["params"], x)
    g_g = jax.grad(loss, argnums=argnum)(gbn, variables["params"], x)
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5),
        g_g,
        g_bn,
    )


def test_mask_matches_flax_for_sd():
  x = _x((10, 6))
  mask = jax.random.bernoulli(jax.random.key(4), 0.6, x.shape)
  bn, gbn = nn.BatchNorm(use_running_average=False), GBatchNorm(
      use_running_average=False
  )
  variables = bn.init(jax.random.key(0), x)
  y_bn, s_bn = bn.apply(variables, x, mask=mask, mutable=["batch_stats"])
  y_g, s_g = gbn.apply(variables, x, mask=mask, mutable=["batch_stats"])
  np.testing.assert_allclose(y_g, y_bn, rtol=1e-5, atol=1e-5)
  jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-6), s_g, s_bn
  )


@pytest.mark.parametrize("name", [*COMPLETE_MEASURES, "sqd:0.05", "sqd:0.97"])
def test_every_measure_normalizes_per_definition(name):
  measure, params = gbn_jax.parse_measure_name(name)
  alpha = params.get("alpha")
  x = np.asarray(ref.relu_like(np.random.default_rng(2), (12, 3, 3, 4)) - 0.3)
  gbn = GBatchNorm(measure=measure, alpha=alpha, momentum=0.8)
  variables = _nonzero_params(gbn.init(jax.random.key(0), x, False))
  scale, bias = (np.asarray(variables["params"][k]) for k in ("scale", "bias"))
  s, d = ref.per_feature(
      lambda r: ref.measure_1d(measure, r, alpha), x, (0, 1, 2)
  )
  y, updates = gbn.apply(variables, x, False, mutable=["batch_stats"])
  want = ref.normalize(x, s, d, (0, 1, 2), scale, bias)
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
  stats = updates["batch_stats"]
  old = {k: np.asarray(v) for k, v in variables["batch_stats"].items()}
  np.testing.assert_allclose(
      stats["mean"], 0.8 * old["mean"] + 0.2 * s, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
      stats["var"], 0.8 * old["var"] + 0.2 * d**2, rtol=1e-5, atol=1e-6
  )
  # inference uses the running S and D^2
  y_eval = gbn.apply({**variables, **updates}, x, use_running_average=True)
  want_eval = ref.normalize(
      x,
      np.asarray(stats["mean"]),
      np.sqrt(np.asarray(stats["var"])),
      (0, 1, 2),
      scale,
      bias,
  )
  np.testing.assert_allclose(y_eval, want_eval, rtol=1e-4, atol=1e-4)


def test_quantile_centering_zeroes_alpha_of_relu():
  x = _x((64, 25))
  for alpha in (0.1, 0.25, 0.5, 0.9):
    y, _ = GBatchNorm(
        use_running_average=False, measure="sqd", alpha=alpha, use_bias=False
    ).init_with_output(jax.random.key(0), x)
    # exactly ceil(alpha N) of N values sit at or below q_alpha (no ties here)
    np.testing.assert_allclose(
        np.mean(np.asarray(jax.nn.relu(y)) == 0, 0), np.ceil(alpha * 64) / 64
    )


def test_init_does_not_update_running_stats():
  x = _x()
  variables = GBatchNorm(use_running_average=False, measure="sqd2").init(
      jax.random.key(0), x
  )
  np.testing.assert_array_equal(variables["batch_stats"]["mean"], 0)
  np.testing.assert_array_equal(variables["batch_stats"]["var"], 1)


def test_one_line_swap_in_a_model():
  class Net(nn.Module):
    norm: type = nn.BatchNorm

    @nn.compact
    def __call__(self, x, train):
      x = nn.Conv(4, (3, 3))(x)
      x = self.norm(use_running_average=not train)(x)
      return nn.Dense(2)(nn.relu(x).mean((1, 2)))

  x = _x((4, 6, 6, 3))
  for norm in (
      nn.BatchNorm,
      GBatchNorm,
      functools.partial(GBatchNorm, measure="rsd"),
  ):
    variables = Net(norm).init(jax.random.key(0), x, train=False)
    logits, updates = Net(norm).apply(
        variables, x, train=True, mutable=["batch_stats"]
    )
    assert logits.shape == (4, 2) and set(updates) == {"batch_stats"}


def test_custom_callable_measure():
  def trimmed(x, axis):  # the bare contract: no where / axis_name
    return gbn_jax.quantile(x, 0.5, axis), gbn_jax.quantile(
        x, 0.9, axis
    ) - gbn_jax.quantile(x, 0.1, axis)

  x = _x((20, 3))
  y, _ = GBatchNorm(
      use_running_average=False, measure=trimmed
  ).init_with_output(jax.random.key(0), x)
  xs = np.asarray(x)
  med = np.array([ref.quantile_1d(xs[:, j], 0.5) for j in range(3)])
  spread = np.array(
      [
          ref.quantile_1d(xs[:, j], 0.9) - ref.quantile_1d(xs[:, j], 0.1)
          for j in range(3)
      ]
  )
  np.testing.assert_allclose(
      y, ref.normalize(xs, med, spread, (0,)), rtol=1e-5, atol=1e-5
  )
  with pytest.raises(TypeError, match="does not accept `where`"):
    GBatchNorm(use_running_average=False, measure=trimmed).init(
        jax.random.key(0), x, mask=x > 0
    )
  with pytest.raises(TypeError, match="only apply to named measures"):
    GBatchNorm(measure=trimmed, alpha=0.3)


def test_measure_errors_speak_the_module_and_the_contract():
  # A fixed alpha: the fix is written as the module call, not get_measure.
  with pytest.raises(TypeError) as e:
    GBatchNorm(measure="sqd2", alpha=0.3)
  assert "GBatchNorm(measure='sqd', alpha=...)" in str(e.value)
  assert "get_measure" not in str(e.value)
  # A callable that can't take (x, axis) fails at construction, naming the
  # contract, before any array reaches it.
  for bad in (
      lambda x: (x.mean(0), x.std(0)),
      lambda x, axis, scale: (x.mean(axis), x.std(axis)),
  ):
    with pytest.raises(TypeError, match=r"measure\(x, axis\) -> \(S, D\)"):
      GBatchNorm(use_running_average=False, measure=bad)
  # Keyword-only extras and *args are fine.
  GBatchNorm(measure=lambda *args, **kwargs: None)
  # A callable that returns one array, not (S, D): the contract, at the call.
  with pytest.raises(TypeError, match=r"not a pair \(S, D\)"):
    GBatchNorm(
        use_running_average=False, measure=lambda x, axis: x.std(axis)
    ).init(jax.random.key(0), _x((8, 3)))


def test_bad_configuration_fails_at_construction():
  with pytest.raises(ValueError, match="valid names"):
    GBatchNorm(measure="batchnorm")
  with pytest.raises(ValueError, match="alpha"):
    GBatchNorm(measure="sqd", alpha=0.0)
  with pytest.raises(TypeError, match="needs parameter"):
    GBatchNorm(measure="sqd")
  with pytest.raises(TypeError, match="unexpected parameter"):
    GBatchNorm(measure="mad", alpha=0.5)


@pytest.mark.parametrize("name", COMPLETE_MEASURES)
def test_constant_single_and_nan_inputs(name):
  gbn = GBatchNorm(use_running_average=False, measure=name)
  variables = _nonzero_params(gbn.init(jax.random.key(0), jnp.zeros((4, 2))))
  bias = np.asarray(variables["params"]["bias"])
  for x in (jnp.full((6, 2), 4.0), jnp.array([[1.0, -2.0]])):  # D = 0
    y, _ = gbn.apply(variables, x, mutable=["batch_stats"])
    np.testing.assert_allclose(y, np.broadcast_to(bias, y.shape), atol=1e-6)
    g = jax.grad(
        lambda v: gbn.apply(variables, v, mutable=["batch_stats"])[0].sum()
    )(x)
    assert np.isfinite(np.asarray(g)).all()
  x = jnp.array([[1.0, 2.0], [jnp.nan, 3.0], [0.5, 1.0]])
  y, _ = gbn.apply(variables, x, mutable=["batch_stats"])
  assert (
      np.isnan(np.asarray(y[:, 0])).all()
      and np.isfinite(np.asarray(y[:, 1])).all()
  )


def test_half_precision_inputs():
  x = _x(dtype=jnp.bfloat16)
  for name in ("sqd2", "mad"):
    gbn = GBatchNorm(use_running_average=False, measure=name)
    variables = gbn.init(jax.random.key(0), x)
    y, _ = gbn.apply(variables, x, mutable=["batch_stats"])
    assert (
        y.dtype
        == nn.BatchNorm(use_running_average=False)
        .apply(variables, x, mutable=["batch_stats"])[0]
        .dtype
    )
    x32 = np.asarray(x, np.float32)
    s, d = ref.per_feature(lambda r: ref.measure_1d(name, r), x32, (0, 1, 2))
    np.testing.assert_allclose(
        np.float32(y), ref.normalize(x32, s, d, (0, 1, 2)), rtol=1e-4, atol=1e-4
    )


def _autodiff_reference(name, alpha, x, scale, bias, mask=None, eps=1e-5):
  """The layer written as plain JAX, differentiated by autodiff (no fused VJP)."""
  measure = gbn_jax.get_measure(name, **({"alpha": alpha} if alpha else {}))
  kw = {} if mask is None else {"where": mask}
  s, d = measure(x.astype(jnp.float32), (0, 1, 2), **kw)
  y = (x - s) * jax.lax.rsqrt(jnp.square(d) + eps)
  return y * scale + bias


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("name", [*COMPLETE_MEASURES, "sqd:0.05"])
def test_fused_backward_equals_autodiff(name, masked):
  measure, params = gbn_jax.parse_measure_name(name)
  alpha = params.get("alpha")
  rng = np.random.default_rng(11)
  x = jnp.asarray(ref.relu_like(rng, (10, 3, 3, 4)) - 0.2)
  mask = jnp.asarray(rng.random(x.shape) < 0.7) if masked else None
  w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  gbn = GBatchNorm(measure=measure, alpha=alpha)
  variables = _nonzero_params(gbn.init(jax.random.key(0), x, False))

  # Alike tests/helpers/multidevice.py::training_step: a masked loss of the same
  # shape, here set against reference_loss's unfused layer.
  def layer_loss(params, inp):
    y, _ = gbn.apply(
        {**variables, "params": params},
        inp,
        False,
        mask=mask,
        mutable=["batch_stats"],
    )
    return jnp.sum(jnp.sin(y) * w)

  def reference_loss(params, inp):
    y = _autodiff_reference(
        measure, alpha, inp, params["scale"], params["bias"], mask
    )
    return jnp.sum(jnp.sin(y) * w)

  got = jax.grad(layer_loss, argnums=(0, 1))(variables["params"], x)
  want = jax.grad(reference_loss, argnums=(0, 1))(variables["params"], x)
  # float32 rounding relative to the largest entry (small D makes them large)
  close = lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()) + 1e-6
  )
  jax.tree.map(close, got, want)


def test_layer_gradient_matches_finite_differences():
  # Generic point (no ties): the fused VJP against central differences.
  rng = np.random.default_rng(12)
  x = (
      rng.permutation(96).reshape(8, 12) * 0.05 + rng.random((8, 12)) * 0.01
  ).astype(np.float32)
  w = rng.standard_normal(x.shape)
  for name in ("mad", "sqd3", "bpoe", "rbd"):
    gbn = GBatchNorm(measure=name, use_bias=False, use_scale=False)
    variables = gbn.init(jax.random.key(0), x, False)
    # One program per function, evaluated at every point of the differences.
    f = jax.jit(
        lambda v: jnp.vdot(
            gbn.apply(variables, v, False, mutable=["batch_stats"])[0], w
        )
    )
    g = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(x)), np.float64)
    assert_matches_central_differences(f, g, x, rng, directions=2)


def test_fused_backward_half_precision_and_no_params():
  x = _x((8, 3, 3, 4), dtype=jnp.bfloat16)
  for kwargs in ({"use_scale": False, "use_bias": False}, {}):
    gbn = GBatchNorm(measure="rsd", **kwargs)
    variables = gbn.init(jax.random.key(0), x, False)
    assert_bfloat16_input_gradient_is_finite(gbn, variables, x)


def test_public_names():
  import gbn_jax.linen  # pylint: disable=g-import-not-at-top

  assert sorted(gbn_jax.linen.__all__) == [
      "BatchNorm",
      "GGroupNorm",
      "GInstanceNorm",
      "GLayerNorm",
      "batchnorm_as_gbn",
  ]
  assert gbn_jax.linen.GBatchNorm is GBatchNorm
