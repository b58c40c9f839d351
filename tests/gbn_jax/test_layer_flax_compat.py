"""GBatchNorm where flax's BatchNorm accepts unusual input.

* No axis left to reduce: an unbatched call (each feature has one element:
  ``S = x``, ``D = 0`` for every measure, so the output is ``bias``), and the
  per-example ``vmap`` with ``axis_name`` (the statistics pool the vmapped
  axis). The multi-device form is in
  tests/gbn_jax/test_layer_flax_compat_multidevice.py.
* Complex input: ``sd`` is flax's BatchNorm (complex mean, real ``E|x -
  mean|^2``), ``mad`` is ``E|x - mean|``; the order-based measures raise.
* Auto-names: ``GBatchNorm_0``; ``name=`` or ``gbn_jax.linen.BatchNorm`` keep
  flax's.

References: flax.linen.BatchNorm / flax.nnx.BatchNorm for ``sd``, numpy
from the definitions (tests/helpers/reference.py) for the rest.
"""

import functools

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax import GBatchNorm
import gbn_jax.linen
import gbn_jax.nnx

from tests.helpers import reference as ref
from tests.helpers.flax_compat import MOMENTUM
from tests.helpers.flax_compat import assert_close
from tests.helpers.flax_compat import assert_nnx_step_matches_references
from tests.helpers.flax_compat import per_example
from tests.helpers.flax_compat import reference_step
from tests.helpers.flax_compat import scale_and_bias
from tests.helpers.measures import COMPLETE_MEASURES

# The built-ins defined for complex input (through the modulus), and those
# that order values, for which complex input is an error: written here, not
# read from the library, and together every built-in (checked below).
COMPLEX_DEFINED = ["sd", "mad"]
ORDERED = ["rsd", "sqd1", "sqd2", "sqd3", "rbd", "wcd", "bpoe"]
EPS = 1e-5


def _ref_stats(measure, x, axes, mask=None):
  return ref.per_feature(lambda v: ref.measure_1d(measure, v), x, axes, mask)


# ------------------------------------------------- one element per feature


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_linen_unbatched_is_bias(measure):
  x = jnp.array([0.5, -2.0, 3.0])
  module = GBatchNorm(
      use_running_average=False, measure=measure, momentum=MOMENTUM
  )
  params = scale_and_bias(3)
  variables = {
      "params": params,
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }
  y, upd = module.apply(variables, x, mutable=["batch_stats"])
  # The definitions on a one-element batch: S = x, D = 0.
  s, d = _ref_stats(measure, np.asarray(x)[None], (0,))
  np.testing.assert_array_equal(s, x)
  np.testing.assert_array_equal(d, 0)
  assert_close(
      y, ref.normalize(x[None], s, d, (0,), params["scale"], params["bias"])[0]
  )
  assert_close(y, params["bias"])
  assert_close(upd["batch_stats"]["mean"], (1 - MOMENTUM) * s)
  assert_close(upd["batch_stats"]["var"], MOMENTUM + (1 - MOMENTUM) * d**2)
  # y = bias whatever x is, so no gradient reaches x.
  gx = jax.grad(
      lambda v: module.apply(variables, v, mutable=["batch_stats"])[0].sum()
  )(x)
  np.testing.assert_array_equal(gx, 0)
  # init_with_output: the failing call.
  y0, _ = module.init_with_output(jax.random.key(0), x)
  np.testing.assert_array_equal(y0, 0)


def test_linen_unbatched_sd_equals_flax():
  x = jnp.array([0.5, -2.0, 3.0])
  for fast in (True, False):
    kw = dict(
        use_running_average=False, momentum=MOMENTUM, use_fast_variance=fast
    )
    y, v = GBatchNorm(**kw).init_with_output(jax.random.key(0), x)
    yf, vf = nn.BatchNorm(**kw).init_with_output(jax.random.key(0), x)
    np.testing.assert_array_equal(y, yf)
    variables = {**vf, "params": scale_and_bias(3)}
    out = GBatchNorm(**kw).apply(variables, x, mutable=["batch_stats"])
    outf = nn.BatchNorm(**kw).apply(variables, x, mutable=["batch_stats"])
    jax.tree.map(np.testing.assert_array_equal, out, outf)


@pytest.mark.parametrize("measure", ["rbd", "wcd", "mad"])
def test_unbatched_calibrated(measure):
  # n = 1: rbd's and wcd's constants are 0 and D = 0 is left as is.
  x = jnp.array([0.5, -2.0, 3.0])
  module = GBatchNorm(
      use_running_average=False, measure=measure, calibration="normal"
  )
  variables = {
      "params": scale_and_bias(3),
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }
  y, upd = module.apply(variables, x, mutable=["batch_stats"])
  assert_close(y, variables["params"]["bias"])
  np.testing.assert_array_equal(upd["batch_stats"]["var"], np.float32(0.99))


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_nnx_unbatched_is_bias(measure):
  x = jnp.array([0.5, -2.0, 3.0])
  layer = gbn_jax.nnx.GBatchNorm(
      3, measure=measure, momentum=MOMENTUM, rngs=nnx.Rngs(0)
  )
  params = scale_and_bias(3)
  layer.scale[...], layer.bias[...] = params["scale"], params["bias"]
  y = layer(x)
  assert_close(y, params["bias"])
  assert_close(layer.mean[...], (1 - MOMENTUM) * x)
  assert_close(layer.var[...], MOMENTUM * jnp.ones(3))
  if measure == "sd":
    flax_layer = nnx.BatchNorm(3, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    flax_layer.scale[...], flax_layer.bias[...] = (
        params["scale"],
        params["bias"],
    )
    np.testing.assert_array_equal(y, flax_layer(x))
    np.testing.assert_array_equal(layer.var[...], flax_layer.var[...])


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_unbatched_masked(measure):
  # A masked-out element: no statistic (NaN or the measure's empty case),
  # exactly as in the batched call with one row.
  x = jnp.array([0.5, -2.0, 3.0])
  mask = jnp.array([True, False, True])
  module = GBatchNorm(use_running_average=False, measure=measure)
  variables = {
      "params": scale_and_bias(3),
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }
  y, upd = module.apply(variables, x, mask=mask, mutable=["batch_stats"])
  y1, upd1 = module.apply(
      variables, x[None], mask=mask[None], mutable=["batch_stats"]
  )
  np.testing.assert_array_equal(y, y1[0])
  jax.tree.map(np.testing.assert_array_equal, upd, upd1)
  assert_close(y[mask], variables["params"]["bias"][mask])


# ------------------------------------------- per-example vmap, axis_name


def _batch(n=12, f=3, seed=0):
  return jnp.asarray(ref.relu_like(np.random.default_rng(seed), (n, f)) - 0.25)


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_linen_vmap_axis_name(measure):
  x = _batch()
  params = scale_and_bias(3)
  variables = {
      "params": params,
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }

  y, upd = per_example(GBatchNorm, measure=measure, momentum=MOMENTUM).apply(
      variables, x, mutable=["batch_stats"]
  )
  jax.tree.map(
      assert_close,
      (y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]),
      reference_step(measure, x, params),
  )
  # The same as one batched call.
  yb, updb = GBatchNorm(
      use_running_average=False, measure=measure, momentum=MOMENTUM
  ).apply(variables, x, mutable=["batch_stats"])
  assert_close(y, yb)
  jax.tree.map(assert_close, upd, updb)
  if measure == "sd":
    yf, updf = per_example(nn.BatchNorm, momentum=MOMENTUM).apply(
        variables, x, mutable=["batch_stats"]
    )
    assert_close(y, yf)
    jax.tree.map(assert_close, upd, updf)


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_nnx_vmap_axis_name(measure):
  x = _batch()
  params = scale_and_bias(3)

  def run(layer):
    layer.scale[...], layer.bias[...] = params["scale"], params["bias"]

    @nnx.vmap(in_axes=(None, 0), out_axes=0, axis_name="batch")
    def f(m, v):
      return m(v)

    return f(layer, x), layer.mean[...], layer.var[...]

  assert_nnx_step_matches_references(run, measure, x, params)


@pytest.mark.parametrize("measure", ["sd", "sqd1", "rbd"])
def test_vmap_axis_name_gradient(measure):
  # Per-example vmap and the batched call are the same function of x.
  x = _batch(8)
  w = jax.random.normal(jax.random.key(5), x.shape)
  variables = {
      "params": scale_and_bias(3),
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }
  vm = per_example(GBatchNorm, measure=measure)
  batched = GBatchNorm(use_running_average=False, measure=measure)

  def grad(m):
    def loss(p, v):
      y = m.apply({**variables, "params": p}, v, mutable=["batch_stats"])[0]
      return jnp.sum(jnp.sin(y) * w)

    # Under jit: the subject is the gradient, and eager dispatch is slow.
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], x)

  # float32 sums in another order; some gradients cancel to 1e-3 of the
  # largest, hence an absolute tolerance relative to the largest.
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(
          a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max())
      ),
      grad(vm),
      grad(batched),
  )


# ----------------------------------------------------------------- complex


def _complex(shape=(4, 3, 2), seed=0):
  return jax.random.normal(jax.random.key(seed), shape, dtype=jnp.complex64)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_linen_complex_sd_equals_flax(fast, masked):
  x = _complex()
  mask = (
      jax.random.bernoulli(jax.random.key(1), 0.7, (4, 3, 1))
      if masked
      else None
  )
  kw = dict(
      use_running_average=False,
      momentum=MOMENTUM,
      dtype=jnp.complex64,
      use_fast_variance=fast,
  )
  y, v = GBatchNorm(**kw).init_with_output(jax.random.key(0), x, mask=mask)
  yf, vf = nn.BatchNorm(**kw).init_with_output(jax.random.key(0), x, mask=mask)
  assert y.dtype == jnp.complex64
  assert_close(y, yf)
  variables = {**vf, "params": scale_and_bias(2)}
  y, upd = GBatchNorm(**kw).apply(
      variables, x, mask=mask, mutable=["batch_stats"]
  )
  yf, updf = nn.BatchNorm(**kw).apply(
      variables, x, mask=mask, mutable=["batch_stats"]
  )
  assert_close(y, yf)
  assert upd["batch_stats"]["mean"].dtype == updf["batch_stats"]["mean"].dtype
  assert upd["batch_stats"]["var"].dtype == jnp.float32
  jax.tree.map(assert_close, upd, updf)
  # Inference from the running statistics (complex mean, real var).
  run = {**variables, **upd}
  infer = {**kw, "use_running_average": True}
  assert_close(
      GBatchNorm(**infer).apply(run, x), nn.BatchNorm(**infer).apply(run, x)
  )

  # Gradients of a real loss, for the parameters and the input.
  def grads(cls):
    def loss(p, v):
      out = cls(**kw).apply(
          {**variables, "params": p}, v, mask=mask, mutable=["batch_stats"]
      )[0]
      return jnp.sum(jnp.abs(out) ** 2 * jnp.arange(1.0, 3.0))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], x)

  jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5),
      grads(GBatchNorm),
      grads(nn.BatchNorm),
  )


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")
@pytest.mark.filterwarnings("ignore:Casting complex values to real")
def test_nnx_complex_sd_equals_flax():
  x = _complex()
  layers = [
      cls(2, dtype=jnp.complex64, momentum=MOMENTUM, rngs=nnx.Rngs(0))
      for cls in (gbn_jax.nnx.GBatchNorm, nnx.BatchNorm)
  ]
  y, yf = (layer(x) for layer in layers)
  assert y.dtype == jnp.complex64
  assert_close(y, yf)
  assert_close(layers[0].var[...], layers[1].var[...])
  assert layers[0].var[...].dtype == layers[1].var[...].dtype == jnp.float32
  # nnx.BatchNorm assigns the complex running mean into its float32 zeros,
  # dropping the imaginary part (with a ComplexWarning); GBatchNorm keeps it
  # complex, as linen's BatchNorm does.
  mean = (1 - MOMENTUM) * np.asarray(x, np.complex128).mean((0, 1))
  assert layers[0].mean[...].dtype == jnp.complex64
  assert_close(layers[0].mean[...], mean)
  assert_close(layers[1].mean[...], mean.real)
  layers[0].eval()
  assert_close(
      layers[0](x),
      nn.BatchNorm(use_running_average=True, dtype=jnp.complex64).apply(
          {
              "params": {"scale": jnp.ones(2), "bias": jnp.zeros(2)},
              "batch_stats": {
                  "mean": layers[0].mean[...],
                  "var": layers[0].var[...],
              },
          },
          x,
      ),
  )


def test_complex_mad_from_definition():
  x = _complex((16, 3))
  params = scale_and_bias(3)
  module = GBatchNorm(
      use_running_average=False,
      measure="mad",
      dtype=jnp.complex64,
      momentum=MOMENTUM,
  )
  variables = {
      "params": params,
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }
  y, upd = module.apply(variables, x, mutable=["batch_stats"])
  xn = np.asarray(x, np.complex128)
  s = xn.mean(0)
  d = np.abs(xn - s).mean(0)  # E|x - E x|, the modulus
  expected = (xn - s) / np.sqrt(d**2 + EPS) * params["scale"] + params["bias"]
  assert_close(y, expected)
  assert_close(upd["batch_stats"]["mean"], (1 - MOMENTUM) * s)
  assert upd["batch_stats"]["var"].dtype == jnp.float32
  assert_close(upd["batch_stats"]["var"], MOMENTUM + (1 - MOMENTUM) * d**2)
  layer = gbn_jax.nnx.GBatchNorm(
      3, measure="mad", dtype=jnp.complex64, momentum=MOMENTUM, rngs=nnx.Rngs(0)
  )
  layer.scale[...], layer.bias[...] = params["scale"], params["bias"]
  assert_close(layer(x), expected)
  assert_close(layer.mean[...], (1 - MOMENTUM) * s)
  assert_close(layer.var[...], MOMENTUM + (1 - MOMENTUM) * d**2)


def test_every_measure_is_tested_on_complex_input():
  # A new built-in must join one of the lists, so its complex case is tested.
  assert sorted(COMPLEX_DEFINED + ORDERED) == sorted(COMPLETE_MEASURES)


@pytest.mark.parametrize("measure", ORDERED)
def test_complex_ordered_measures_raise(measure):
  x = _complex((8, 2))
  with pytest.raises(
      TypeError,
      match=f"measure '{measure}' is not defined" " for complex input",
  ):
    GBatchNorm(use_running_average=False, measure=measure).init_with_output(
        jax.random.key(0), x
    )
  layer = gbn_jax.nnx.GBatchNorm(2, measure=measure, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=f"measure '{measure}' is not defined"):
    layer(x)
  # Running statistics are real: inference is defined, but nothing was
  # computed from x, so it is refused with the same error in training only.
  with pytest.raises(TypeError, match="complex"):
    gbn_jax.get_measure(measure)(x, axis=0)


def test_complex_calibrated_mad_and_renorm_raise():
  x = _complex((8, 2))
  with pytest.raises(ValueError, match="calibration='normal' of measure 'mad'"):
    GBatchNorm(
        use_running_average=False, measure="mad", calibration="normal"
    ).init_with_output(jax.random.key(0), x)
  # sd's constant is 1: calibration changes nothing, complex or not.
  y, _ = GBatchNorm(
      use_running_average=False, calibration="normal", dtype=jnp.complex64
  ).init_with_output(jax.random.key(0), x)
  yf, _ = nn.BatchNorm(
      use_running_average=False, dtype=jnp.complex64
  ).init_with_output(jax.random.key(0), x)
  assert_close(y, yf)
  with pytest.raises(TypeError, match="renorm=True is not defined for complex"):
    GBatchNorm(use_running_average=False, renorm=True).init_with_output(
        jax.random.key(0), x
    )


def test_complex_custom_measure_must_return_real_deviation():
  x = _complex((8, 2))
  bad = lambda v, axis: (v.mean(axis), v.std(axis) * (1 + 1j))
  with pytest.raises(TypeError, match="complex deviation"):
    GBatchNorm(use_running_average=False, measure=bad).init_with_output(
        jax.random.key(0), x
    )
  good = lambda v, axis: (v.mean(axis), jnp.abs(v - v.mean(axis)).max(axis))
  y, _ = GBatchNorm(
      use_running_average=False, measure=good, dtype=jnp.complex64
  ).init_with_output(jax.random.key(0), x)
  xn = np.asarray(x, np.complex128)
  s = xn.mean(0)
  d = np.abs(xn - s).max(0)
  assert_close(y, (xn - s) / np.sqrt(d**2 + EPS))


# --------------------------------------------------------------- auto-names


def _net(layer):
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return layer()(nn.Dense(3)(x))

  return Net()


def test_auto_names():
  x = jnp.ones((2, 3))
  flax_vars = _net(lambda: nn.BatchNorm(use_running_average=True)).init(
      jax.random.key(0), x
  )
  assert set(flax_vars["params"]) == {"Dense_0", "BatchNorm_0"}
  # GBatchNorm is named after its own class, like any flax subclass.
  gbn_vars = _net(lambda: GBatchNorm(use_running_average=True)).init(
      jax.random.key(0), x
  )
  assert set(gbn_vars["params"]) == {"Dense_0", "GBatchNorm_0"}
  # Both ways to keep flax's names load flax's variables unchanged.
  for layer in (
      lambda: GBatchNorm(use_running_average=True, name="BatchNorm_0"),
      lambda: gbn_jax.linen.BatchNorm(use_running_average=True),
  ):
    net = _net(layer)
    own = net.init(jax.random.key(0), x)
    assert jax.tree.structure(own) == jax.tree.structure(flax_vars)
    np.testing.assert_array_equal(
        net.apply(flax_vars, x),
        _net(lambda: nn.BatchNorm(use_running_average=True)).apply(
            flax_vars, x
        ),
    )
  assert issubclass(gbn_jax.linen.BatchNorm, GBatchNorm)
  assert gbn_jax.linen.BatchNorm.__name__ == "BatchNorm"
