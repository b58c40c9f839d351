"""gbn_jax.precise_batch_stats (PreciseBN).

The reference is independent of the layers' updates: every norm layer's
input is captured (``flax.linen.intercept_methods``) and its per-batch ``S``
and ``D^2`` computed in numpy from the definitions (tests/helpers/reference.py),
then averaged over the batches.
"""

from __future__ import annotations

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm
from gbn_jax import precise_batch_stats
import gbn_jax.nnx as gnnx

from tests.helpers import reference as ref
from tests.helpers.measures import COMPLETE_MEASURES


class Net(nn.Module):
  """Two GBN layers and a flax BatchNorm, all in training mode."""

  momentum: float = 0.9
  measure: str = "sqd1"

  @nn.compact
  def __call__(self, x):
    norm = lambda cls, **kw: cls(
        use_running_average=False, momentum=self.momentum, **kw
    )
    x = nn.Conv(3, (2, 2), name="conv1")(x)
    x = nn.relu(norm(GBatchNorm, measure=self.measure, name="gbn1")(x))
    x = nn.Conv(4, (2, 2), name="conv2")(x)
    x = norm(nn.BatchNorm, name="bn")(x)
    x = norm(GBatchNorm, measure="rbd", name="gbn2")(x)
    return x.mean((1, 2))


def _batches(count=3, shape=(6, 4, 4, 2), seed=0):
  x = jax.random.normal(jax.random.key(seed), (count, *shape)) * 1.5 + 0.3
  return jnp.round(x * 64) / 64 + 1e-3 * jax.random.uniform(
      jax.random.key(1), x.shape
  )


def _variables(model, batch):
  variables = model.init(jax.random.key(2), batch)
  # Running statistics far from any batch's: they must not leak in.
  return {
      **variables,
      "batch_stats": jax.tree.map(
          lambda a: a * 3 + 7, variables["batch_stats"]
      ),
  }


def _norm_inputs(model, variables, batch):
  """Each norm layer's input, by module name, in a training-mode pass."""
  captured = {}

  def capture(next_fun, args, kwargs, context):
    if (
        isinstance(context.module, nn.BatchNorm)
        and context.method_name == "__call__"
    ):
      captured[context.module.name] = np.asarray(args[0], np.float64)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(capture):
    model.apply(variables, batch, mutable=["batch_stats"])
  return captured


def _reference(model, variables, batches, measures):
  """numpy: per-layer average over batches of the batch S and D^2."""
  sums = {}
  for batch in batches:
    for name, x in _norm_inputs(model, variables, batch).items():
      axes = tuple(range(x.ndim - 1))
      s, d = ref.per_feature(
          lambda v: ref.measure_1d(measures[name], v), x, axes
      )
      total = sums.setdefault(name, {"mean": 0.0, "var": 0.0})
      total["mean"] = total["mean"] + s
      total["var"] = total["var"] + d**2
  return {
      name: {k: v / len(batches) for k, v in total.items()}
      for name, total in sums.items()
  }


def _apply(model):
  return jax.jit(lambda v, b: model.apply(v, b, mutable=["batch_stats"]))


def _close(got, want, rtol=1e-4, atol=1e-6):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(
      lambda g, w: np.testing.assert_allclose(g, w, rtol=rtol, atol=atol),
      got,
      want,
  )


# --- against numpy ---------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.9, 0.0, 0.99])
def test_equals_numpy_average_of_batch_statistics(momentum):
  model = Net(momentum)
  batches = _batches()
  variables = _variables(model, batches[0])
  before = jax.tree.map(np.array, variables)
  got = precise_batch_stats(_apply(model), variables, list(batches))
  want = _reference(
      model, variables, batches, {"gbn1": "sqd1", "bn": "sd", "gbn2": "rbd"}
  )
  _close(got, want)
  # Nothing given is changed, and the parameters were frozen.
  jax.tree.map(np.testing.assert_array_equal, variables, before)
  # Stacked batches (one lax.scan) and a jitted call agree.
  stacked = jax.jit(lambda v, b: precise_batch_stats(_apply(model), v, b))(
      variables, batches
  )
  _within(stacked, got, _linen_bounds(model, variables, batches, got))


@pytest.mark.parametrize("measure", COMPLETE_MEASURES)
def test_every_measure(measure):
  model = Net(0.9, measure)
  batches = _batches(count=2, seed=3)
  variables = _variables(model, batches[0])
  got = precise_batch_stats(_apply(model), variables, iter(batches))
  want = _reference(
      model, variables, batches, {"gbn1": measure, "bn": "sd", "gbn2": "rbd"}
  )
  _close(got, want)


# --- exactness of backing out the statistic --------------------------------------


EPS = float(np.finfo(np.float32).eps)
# The statistics' arithmetic is not fixed by the code: each layer's batch S
# and D^2 sum the n values of a feature in an order that the compiled
# program picks (vector width, fusion), which differs between programs and
# between CPUs. A bound in ulps is then a bound on one machine. Summation in
# any order errs by at most (n - 1) eps sum|t_i| to first order (Higham,
# Accuracy and Stability of Numerical Algorithms, 4.2), so a mean of n
# values by n eps mean|t_i|; two computations differ by twice that.
# S (mean, MAD's centre) sums x: C_MEAN = 2 (two computations) + 2 (the
# backing out, two roundings of S, |S| <= mean|x|). D^2 sums products or
# |x - S| and squares: for MAD, |dD| <= n eps (mean|x - S| + mean|x|) +
# |dS| <= 4 n eps mean|x| with D <= 2 mean|x|, so |d(D^2)| = 2 D |dD| <=
# 16 n eps mean|x|^2 <= 16 n eps mean(x^2) (the fast variance E[x^2] -
# E[x]^2 of sd: 3 n eps mean(x^2)); twice for two computations, plus the
# backing out: C_VAR = 34.
C_MEAN, C_VAR = 4, 34


def _order_bounds(inputs):
  """Per layer, bounds on the difference of two float32 computations of
  its batch S and D^2 whose summation orders may differ (see C_MEAN)."""
  bounds = {}
  for name, x in inputs.items():
    x = np.asarray(x, np.float64)
    x = x.reshape(-1, x.shape[-1])
    n = x.shape[0]
    bounds[name] = {
        "mean": C_MEAN * n * EPS * np.abs(x).mean(0),
        "var": C_VAR * n * EPS * (x**2).mean(0),
    }
  return bounds


def _within(got, want, bounds):
  jax.tree.map(
      lambda g, w, b: np.testing.assert_array_less(
          np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)),
          b + np.finfo(np.float32).tiny,
      ),
      got,
      want,
      bounds,
  )


def _linen_bounds(model, variables, batches, stats):
  """The bound on two computations of ``stats``, the average over
  ``batches`` of the statistics of ``model``'s layers."""
  bounds = [_order_bounds(_norm_inputs(model, variables, b)) for b in batches]
  return _average_bounds(bounds, [stats] * len(bounds))


def _average_bounds(per_batch_bounds, per_batch):
  """The bound on two float32 averages of k statistics, each within its
  batch's bound: the mean of the bounds, plus the k additions and the
  division of values known to those bounds (2 k eps mean|s_i|)."""
  k = len(per_batch)
  return jax.tree.map(
      lambda *a: np.mean(a[:k], 0)
      + 2 * k * EPS * np.mean(np.abs(np.asarray(a[k:], np.float64)), 0),
      *per_batch_bounds,
      *per_batch,
  )


@pytest.mark.parametrize("momentum", [0.5, 0.9, 0.99, 0.999, 0.9997])
def test_backed_out_statistic_is_the_layers_own_to_float32_rounding(momentum):
  # With momentum 0 the update *is* the batch statistic, bit for bit.
  batches = _batches(count=4, seed=5)
  model, exact_model = Net(momentum, "mad"), Net(0.0, "mad")
  variables = _variables(model, batches[0])
  apply, exact = _apply(model), _apply(exact_model)
  per_batch, bounds = [], []
  for batch in batches:
    got = precise_batch_stats(apply, variables, [batch])
    want = exact(variables, batch)[1]["batch_stats"]
    bounds.append(_order_bounds(_norm_inputs(model, variables, batch)))
    _within(got, want, bounds[-1])
    per_batch.append(want)
  # The average too, against the same float32 sum of the exact statistics.
  got = precise_batch_stats(apply, variables, list(batches))
  want = jax.tree.map(lambda *s: sum(s[1:], s[0]) / len(s), *per_batch)
  _within(got, want, _average_bounds(bounds, per_batch))


def test_momentum_that_is_no_short_decimal():
  momentum = 1 - 1 / 300  # 1 - m is then known to 2^-25 / (1 - m) only
  batches = _batches(count=2, seed=6)
  model = Net(momentum, "mad")
  variables = _variables(model, batches[0])
  for batch in batches:
    got = precise_batch_stats(_apply(model), variables, [batch])
    want = _apply(Net(0.0, "mad"))(variables, batch)[1]["batch_stats"]
    bounds = jax.tree.map(
        lambda b, w: b + 2**-25 * 300 * np.abs(w),
        _order_bounds(_norm_inputs(model, variables, batch)),
        want,
    )
    _within(got, want, bounds)


# --- the pytree contract ----------------------------------------------------------


class _Counting(nn.Module):
  """A BatchNorm next to a batch_stats leaf that is no statistic."""

  @nn.compact
  def __call__(self, x):
    count = self.variable(
        "batch_stats", "count", lambda: jnp.zeros((), jnp.int32)
    )
    if not self.is_initializing():
      count.value += 1
    return nn.BatchNorm(use_running_average=False, momentum=0.9)(x)


def test_other_leaves_and_structure_are_kept():
  x = _batches(count=2, shape=(8, 3))
  variables = _Counting().init(jax.random.key(0), x[0])
  variables["batch_stats"]["count"] = jnp.asarray(5, jnp.int32)
  got = precise_batch_stats(_apply(_Counting()), variables, x)
  assert jax.tree.structure(got) == jax.tree.structure(variables["batch_stats"])
  assert int(got["count"]) == 5
  np.testing.assert_allclose(
      got["BatchNorm_0"]["mean"], x.mean(1).mean(0), rtol=1e-5
  )
  np.testing.assert_allclose(
      got["BatchNorm_0"]["var"], x.var(1).mean(0), rtol=1e-5
  )


def test_errors():
  model = Net()
  batches = _batches(count=1)
  variables = _variables(model, batches[0])
  with pytest.raises(ValueError, match="at least one batch"):
    precise_batch_stats(_apply(model), variables, [])
  with pytest.raises(ValueError, match="no 'mean'/'var' leaves"):
    precise_batch_stats(
        _apply(model), {**variables, "batch_stats": {}}, batches
    )
  forgetful = lambda v, b: (_apply(model)(v, b)[0], {"batch_stats": {}})
  with pytest.raises(ValueError, match="did not update(.|\n)*training mode"):
    precise_batch_stats(forgetful, variables, batches)


def _assert_refused(model, match, **call):
  """The same clear error eagerly and while tracing (jit; jit of a scan)."""
  x = _batches(count=2, shape=(8, 3))
  variables = model.init(jax.random.key(0), x[0], **call)
  apply = lambda v, b: model.apply(v, b, mutable=["batch_stats"], **call)
  with pytest.raises(ValueError, match=match):
    precise_batch_stats(apply, variables, list(x))
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda v: precise_batch_stats(apply, v, list(x)))(variables)
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda v, b: precise_batch_stats(apply, v, b, stacked=True))(
        variables, x
    )


@pytest.mark.parametrize("cls", [GBatchNorm, nn.BatchNorm])
def test_statistics_that_do_not_move_are_refused(cls):
  # Momentum 1: the update keeps the running value, no batch value in it.
  model = cls(use_running_average=False, momentum=1.0)
  _assert_refused(model, "mean, var were not updated")


def test_statistics_of_a_layer_in_inference_mode_are_refused():
  # use_running_average=True: the statistics come back as they went in.
  model = nn.BatchNorm(momentum=0.9)
  _assert_refused(model, "mean, var were not updated", use_running_average=True)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9997])
def test_traced_calls_accept_every_momentum_below_one(momentum):
  # Under jit the momentum is read off the program (its update's derivative
  # in the old value); the result equals the eager call's, no NaN.
  model = Net(momentum)
  batches = _batches(count=2)
  variables = _variables(model, batches[0])
  eager = precise_batch_stats(_apply(model), variables, list(batches))
  apply = lambda v, b: model.apply(v, b, mutable=["batch_stats"])
  traced = jax.jit(lambda v: precise_batch_stats(apply, v, list(batches)))(
      variables
  )
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(traced))
  _within(traced, eager, _linen_bounds(model, variables, batches, eager))


class ParamMomentum(nn.Module):
  """A norm of its own, no BatchNorm, whose momentum is a parameter."""

  @nn.compact
  def __call__(self, x):
    mean = self.variable("batch_stats", "mean", jnp.zeros, x.shape[-1:])
    var = self.variable("batch_stats", "var", jnp.ones, x.shape[-1:])
    logit = self.param("momentum_logit", nn.initializers.zeros, ())
    s, d2 = x.mean(0), x.var(0)
    if not self.is_initializing():
      m = jax.nn.sigmoid(logit)  # 0.5
      mean.value = m * mean.value + (1 - m) * s
      var.value = m * var.value + (1 - m) * d2
    return (x - s) / jnp.sqrt(d2 + 1e-5)


def test_a_norm_of_unknown_momentum_is_refused_under_jit():
  # Eagerly its momentum is probed; traced, only flax's and gbn_jax's
  # BatchNorm layers tell theirs.
  x = _batches(count=2, shape=(8, 3))
  model = ParamMomentum()
  variables = model.init(jax.random.key(0), x[0])
  apply = lambda v, b: model.apply(v, b, mutable=["batch_stats"])
  eager = precise_batch_stats(apply, variables, list(x))
  want = [np.asarray(b, np.float64) for b in x]
  np.testing.assert_allclose(
      eager["mean"], np.mean([b.mean(0) for b in want], 0), rtol=1e-4
  )
  np.testing.assert_allclose(
      eager["var"], np.mean([b.var(0) for b in want], 0), rtol=1e-4
  )
  with pytest.raises(ValueError, match="mean, var belong to no layer whose"):
    jax.jit(lambda v: precise_batch_stats(apply, v, list(x)))(variables)


def test_renorm_models_are_refused():
  # Their training-mode output reads the running statistics.
  model = GBatchNorm(
      use_running_average=False,
      renorm=True,
      renorm_clipping={"rmax": 3, "dmax": 5},
  )
  _assert_refused(model, "depends on its running statistics")


# --- nnx: gbn_jax.nnx.precise_batch_stats ---------------------------------------


class NnxNet(nnx.Module):
  """Net's twin in nnx: two GBN layers and an nnx.BatchNorm."""

  def __init__(self, momentum=0.9, measure="sqd1", *, rngs):
    norm = lambda cls, n, **kw: cls(n, momentum=momentum, rngs=rngs, **kw)
    self.conv1 = nnx.Conv(2, 3, (2, 2), rngs=rngs)
    self.gbn1 = norm(gnnx.GBatchNorm, 3, measure=measure)
    self.conv2 = nnx.Conv(3, 4, (2, 2), rngs=rngs)
    self.bn = norm(nnx.BatchNorm, 4)
    self.gbn2 = norm(gnnx.GBatchNorm, 4, measure="rbd")

  def __call__(self, x):
    h = self.conv2(nnx.relu(self.gbn1(self.conv1(x))))
    return self.gbn2(self.bn(h)).mean((1, 2))

  def norm_inputs(self, x):
    """Each norm layer's input in a training-mode pass (the layers' own)."""
    inputs = {"gbn1": self.conv1(x)}
    inputs["bn"] = self.conv2(
        nnx.relu(self.gbn1(inputs["gbn1"], use_running_average=False))
    )
    inputs["gbn2"] = self.bn(inputs["bn"], use_running_average=False)
    return inputs


def _nnx_model(momentum=0.9, measure="sqd1"):
  model = NnxNet(momentum, measure, rngs=nnx.Rngs(2))
  for layer in (model.gbn1, model.bn, model.gbn2):
    # Running statistics far from any batch's: they must not leak in.
    layer.mean[...] = layer.mean[...] * 3 + 7
    layer.var[...] = layer.var[...] * 3 + 7
  model.eval()
  return model


def _nnx_reference(model, batches, measures):
  """numpy: per-layer average over batches of the batch S and D^2."""
  sums = {}
  for batch in batches:
    inputs = nnx.clone(model).norm_inputs(batch)
    for name, x in inputs.items():
      x = np.asarray(x, np.float64)
      s, d = ref.per_feature(
          lambda v: ref.measure_1d(measures[name], v), x, (0, 1, 2)
      )
      total = sums.setdefault(name, {"mean": 0.0, "var": 0.0})
      total["mean"] = total["mean"] + s / len(batches)
      total["var"] = total["var"] + d**2 / len(batches)
  return sums


def _nnx_stats(model):
  return {
      name: {"mean": layer.mean[...], "var": layer.var[...]}
      for name, layer in (
          ("gbn1", model.gbn1),
          ("bn", model.bn),
          ("gbn2", model.gbn2),
      )
  }


@pytest.mark.parametrize("momentum", [0.9, 0.0, 0.99])
def test_nnx_equals_numpy_average_of_batch_statistics(momentum):
  batches = _batches()
  model = _nnx_model(momentum)
  want = _nnx_reference(
      model, batches, {"gbn1": "sqd1", "bn": "sd", "gbn2": "rbd"}
  )
  params = jax.tree.map(np.array, nnx.state(model, nnx.Param))
  gnnx.precise_batch_stats(model, list(batches))
  _close(_nnx_stats(model), want)
  # The parameters and the layers' mode are left as they were.
  jax.tree.map(
      np.testing.assert_array_equal, nnx.state(model, nnx.Param), params
  )
  assert model.gbn1.use_running_average and model.bn.use_running_average
  # Stacked batches (one lax.scan) under nnx.jit, and a forward function.
  again = _nnx_model(momentum)
  nnx.jit(
      lambda m, b: gnnx.precise_batch_stats(m, b, forward=lambda mm, bb: mm(bb))
  )(again, batches)
  bounds = [_order_bounds(_nnx_model(momentum).norm_inputs(b)) for b in batches]
  stats = _nnx_stats(model)
  _within(
      _nnx_stats(again),
      stats,
      _average_bounds(bounds, [stats] * len(bounds)),
  )


@pytest.mark.parametrize("measure", ["sd", "mad", "sqd3", "wcd", "bpoe"])
def test_nnx_measures(measure):
  batches = _batches(count=2, seed=3)
  model = _nnx_model(0.9, measure)
  want = _nnx_reference(
      model, batches, {"gbn1": measure, "bn": "sd", "gbn2": "rbd"}
  )
  gnnx.precise_batch_stats(model, iter(batches))
  _close(_nnx_stats(model), want)


def test_nnx_backed_out_statistic_is_the_layers_own():
  # A layer with momentum 0 stores its batch statistic, bit for bit.
  batches = _batches(count=3, seed=5)
  per_batch, bounds = [], []
  for batch in batches:
    model = _nnx_model(0.99, "mad")
    bounds.append(_order_bounds(nnx.clone(model).norm_inputs(batch)))
    exact = nnx.clone(model)
    for layer in (exact.gbn1, exact.bn, exact.gbn2):
      layer.momentum = 0.0
    exact.train()
    exact(batch)
    gnnx.precise_batch_stats(model, [batch])
    got, want = _nnx_stats(model), _nnx_stats(exact)
    _within(got, want, bounds[-1])
    per_batch.append(want)
  model = _nnx_model(0.99, "mad")
  gnnx.precise_batch_stats(model, batches)  # one array: stacked
  want = jax.tree.map(lambda *s: sum(s[1:], s[0]) / len(s), *per_batch)
  _within(_nnx_stats(model), want, _average_bounds(bounds, per_batch))


def test_nnx_matches_linen():
  # The same layers and weights in both frameworks give the same statistics.
  batch = _batches(count=1, shape=(16, 3))
  layer = gnnx.GBatchNorm(3, measure="sqd2", momentum=0.9, rngs=nnx.Rngs(0))
  linen = GBatchNorm(use_running_average=False, measure="sqd2", momentum=0.9)
  variables = {
      "params": {"scale": layer.scale[...], "bias": layer.bias[...]},
      "batch_stats": {"mean": layer.mean[...], "var": layer.var[...]},
  }
  want = precise_batch_stats(_apply(linen), variables, batch)
  gnnx.precise_batch_stats(layer, batch)
  np.testing.assert_array_equal(layer.mean[...], want["mean"])
  np.testing.assert_array_equal(layer.var[...], want["var"])


def test_nnx_errors():
  batches = _batches(count=1)
  model = _nnx_model()
  with pytest.raises(ValueError, match="at least one batch"):
    gnnx.precise_batch_stats(model, [])
  with pytest.raises(ValueError, match="no nnx.BatchNorm layers"):
    gnnx.precise_batch_stats(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), batches)
  frozen = lambda m, b: m.gbn2(m.bn(m.conv2(m.conv1(b))), True)
  with pytest.raises(ValueError, match="gbn2/mean, gbn2/var were not updated"):
    gnnx.precise_batch_stats(model, batches, forward=frozen)
  before = _nnx_stats(model)
  renorm = gnnx.GBatchNorm(
      3, renorm=True, renorm_clipping={"rmax": 3, "dmax": 5}, rngs=nnx.Rngs(0)
  )
  x = _batches(count=2, shape=(8, 3))
  with pytest.raises(ValueError, match="depends on its running statistics"):
    gnnx.precise_batch_stats(renorm, x)
  renorm_stats = (np.array(renorm.mean[...]), np.array(renorm.var[...]))
  with pytest.raises(ValueError, match="depends on its running statistics"):
    nnx.jit(gnnx.precise_batch_stats)(renorm, x)
  np.testing.assert_array_equal(renorm.mean[...], renorm_stats[0])
  np.testing.assert_array_equal(renorm.var[...], renorm_stats[1])
  with pytest.raises(ValueError, match="gbn2/mean, gbn2/var were not updated"):
    nnx.jit(lambda m, b: gnnx.precise_batch_stats(m, b, forward=frozen))(
        model, batches
    )
  jax.tree.map(np.testing.assert_array_equal, _nnx_stats(model), before)


def test_api_exported():
  assert gbn_jax.precise_batch_stats is precise_batch_stats
