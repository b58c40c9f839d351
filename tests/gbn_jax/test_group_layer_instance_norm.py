"""GLayerNorm, GGroupNorm and GInstanceNorm (linen and nnx).

References: numpy written from the definitions (each example's, or
group's, statistic and deviation, docs/measures.md), flax's own layers for
``measure='sd'`` (eagerly bit for bit on the CPU, to rounding under jit), and central
differences for the derivatives.
"""

from __future__ import annotations

from fractions import Fraction
import functools
import math
import statistics

import chex
from flax import nnx
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import gbn_jax
import gbn_jax.linen
import gbn_jax.nnx

from tests.helpers.backend import assert_flax_bits

# name -> (the registered name, alpha): every built-in measure, and sqd
# at a level chosen by the layer.
MEASURES = {
    "sd": ("sd", None),
    "mad": ("mad", None),
    "rsd": ("rsd", None),
    "sqd1": ("sqd1", None),
    "sqd2": ("sqd2", None),
    "sqd3": ("sqd3", None),
    "sqd_0.9": ("sqd", 0.9),
    "rbd": ("rbd", None),
    "wcd": ("wcd", None),
    "bpoe": ("bpoe", None),
}
LEVELS = {"sqd1": 0.25, "sqd2": 0.5, "sqd3": 0.75}


def _some_quick(values, quick):
  """``values`` as parameters, those not in ``quick`` marked slow (the
  quick suite's time is small; CI runs the slow ones too)."""
  return [
      v if v in quick else pytest.param(v, marks=pytest.mark.slow)
      for v in values
  ]


LINEN = {
    "layer": (gbn_jax.linen.GLayerNorm, nn.LayerNorm),
    "group": (gbn_jax.linen.GGroupNorm, nn.GroupNorm),
    "instance": (gbn_jax.linen.GInstanceNorm, nn.InstanceNorm),
}


# --------------------------------------------------------------- references


@functools.cache
def _normal_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A fine grid and the standard normal's cdf and pdf on it (math.erf
  element by element is the slow part: done once)."""
  z = np.linspace(-12.0, 12.0, 240_001)
  cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
  pdf = np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
  return z, cdf, pdf


@functools.cache
def _normal_max(n: int) -> float:
  """E[max of n standard normals], by the trapezoid rule on a fine grid."""
  z, cdf, pdf = _normal_grid()
  f = z * n * pdf * cdf ** (n - 1)
  return float(np.sum((f[1:] + f[:-1]) / 2) * (z[1] - z[0]))


def _normal_constant(measure: str, alpha: float | None, n: int) -> float:
  """D of a standard normal sample of n values (docs/measures.md)."""
  if measure == "sd":
    return 1.0
  if measure in ("mad", "bpoe"):
    return math.sqrt(2 / math.pi)
  if measure == "rsd":
    return 1 / math.sqrt(2 * math.pi)
  if measure == "sqd":
    dist = statistics.NormalDist()
    return dist.pdf(dist.inv_cdf(alpha)) / (1 - alpha)
  if measure == "rbd":
    return 2 * _normal_max(n)
  return _normal_max(n)  # wcd


def _pair(v: np.ndarray, measure: str, alpha: float | None):
  """(S, D) of the values v, from the definitions, in float64."""
  v = np.asarray(v, np.float64)
  mean = v.mean()
  if measure == "sd":
    return mean, np.sqrt(np.mean((v - mean) ** 2))
  if measure == "mad":
    return mean, np.mean(np.abs(v - mean))
  if measure == "rsd":
    return mean, np.mean(np.maximum(v - mean, 0))
  if measure == "sqd":
    rank = max(math.ceil(Fraction(str(alpha)) * v.size), 1)
    q = np.sort(v)[rank - 1]
    return q, q + np.mean(np.maximum(v - q, 0)) / (1 - alpha) - mean
  if measure == "rbd":
    return (v.max() + v.min()) / 2, v.max() - v.min()
  if measure == "wcd":
    return v.max(), v.max() - mean
  above = v[v > mean]  # bpoe
  return mean, (above - mean).mean() if above.size else 0.0


def _canon(axes, ndim):
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return sorted({a % ndim for a in axes})


def reference(
    x,
    kind,
    measure,
    alpha=None,
    *,
    reduction_axes=None,
    feature_axes=-1,
    num_groups=None,
    group_size=None,
    mask=None,
    scale=None,
    bias=None,
    epsilon=1e-6,
    calibration=None,
):
  """The layer's output in float64 numpy: each statistic from the values
  it sees (an example's, or a group's), then ``(x - S) / sqrt(D^2 + eps)
  * scale + bias``."""
  name, alpha = _resolve(measure, alpha)
  x = np.asarray(x, np.float64)
  shape, ndim = x.shape, x.ndim
  view = x
  if kind == "layer":
    reduced = _canon(-1 if reduction_axes is None else reduction_axes, ndim)
    param_axes = _canon(feature_axes, ndim)
  elif kind == "instance":
    param_axes = _canon(feature_axes, ndim)
    reduced = [i for i in range(1, ndim) if i not in param_axes]
  else:
    if reduction_axes is None:
      reduction_axes = list(range(1, ndim - 1)) + [-1]
    size = group_size or shape[-1] // num_groups
    view = x.reshape(shape[:-1] + (shape[-1] // size, size))
    reduced = _canon(reduction_axes, ndim)[:-1] + [ndim]
    param_axes = [ndim - 1]
  where = np.ones(view.shape, bool)
  if mask is not None:
    where = np.broadcast_to(mask, shape).reshape(view.shape)
  kept = [i for i in range(view.ndim) if i not in reduced]
  count = math.prod(view.shape[i] for i in reduced)
  rows = view.transpose(kept + reduced).reshape(-1, count)
  flags = where.transpose(kept + reduced).reshape(-1, count)
  stats = []
  for row, flag in zip(rows, flags):
    s, d = _pair(row[flag], name, alpha)
    if calibration == "normal":
      d = d / _normal_constant(name, alpha, int(flag.sum()))
    stats.append((s, d))
  stats = np.array(stats).reshape([view.shape[i] for i in kept] + [2])
  s = np.expand_dims(stats[..., 0], reduced)
  d = np.expand_dims(stats[..., 1], reduced)
  y = ((view - s) / np.sqrt(d * d + epsilon)).reshape(shape)
  param_shape = [shape[i] if i in param_axes else 1 for i in range(ndim)]
  if scale is not None:
    y = y * np.asarray(scale, np.float64).reshape(param_shape)
  if bias is not None:
    y = y + np.asarray(bias, np.float64).reshape(param_shape)
  return y


def _resolve(measure, alpha):
  if measure in MEASURES:
    name, level = MEASURES[measure]
    alpha = level if alpha is None else alpha
  else:
    name = measure
  if name in LEVELS:
    name, alpha = "sqd", LEVELS[name]
  return name, alpha


def _fields(measure):
  name, alpha = MEASURES[measure]
  return {"measure": name, "alpha": alpha}


def _params(variables, seed=1):
  """Scale and bias away from their initializers, so that both show."""
  params = variables["params"]
  keys = jax.random.split(jax.random.key(seed), 2)
  out = {}
  for key, (name, value) in zip(keys, sorted(params.items())):
    out[name] = value + 0.5 * jax.random.normal(key, value.shape, value.dtype)
  return {"params": out}


def _close(got, want, rtol=2e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.nanmax(np.abs(want))))
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def _linen(kind, x, measure="sd", seed=1, **fields):
  # init jitted: only the parameters are kept, so the compiled program
  # drops the normalization that an eager init would run op by op.
  layer = LINEN[kind][0](**{**_fields(measure), **fields})
  variables = _params(jax.jit(layer.init)(jax.random.key(0), x), seed)
  return layer, variables


def _jit_apply(layer, variables, x, mask=None):
  """``layer.apply`` as one compiled program: far cheaper than compiling
  each op of a measure on its own. The eager calls are
  test_every_measure_is_its_definition's and the flax comparisons'."""
  return jax.jit(lambda v, a, m: layer.apply(v, a, mask=m))(variables, x, mask)


def _expected(kind, x, measure, variables, **fields):
  p = variables["params"]
  return reference(
      x, kind, measure, scale=p.get("scale"), bias=p.get("bias"), **fields
  )


# The shapes the selection sees as many short rows: a token of 768 values
# (layer), a group of 2,048 (group: 16 x 16 pixels x 8 channels).
SHAPES = {
    "layer": ((4, 768), {}),
    "group": ((2, 16, 16, 32), {"num_groups": 4}),
    "instance": ((2, 6, 5, 3), {}),
}


# ---------------------------------------------------- every measure, numpy


@pytest.mark.parametrize(
    "kind,measure",
    [
        (kind, measure)
        if kind != "instance" or measure in ("sd", "sqd2", "bpoe")
        else pytest.param(kind, measure, marks=pytest.mark.slow)
        for kind in sorted(LINEN)
        for measure in sorted(MEASURES)
    ],
)
def test_every_measure_is_its_definition(kind, measure):
  shape, fields = SHAPES[kind]
  x = jax.random.normal(jax.random.key(2), shape) * 3 + 1
  layer, variables = _linen(kind, x, measure, **fields)
  _close(
      layer.apply(variables, x),
      _expected(kind, x, measure, variables, **fields),
  )


@pytest.mark.parametrize(
    "measure", _some_quick(["mad", "sqd_0.9", "rbd", "wcd"], {"rbd"})
)
def test_calibration_counts_the_values_each_statistic_sees(measure):
  # rbd's and wcd's constants depend on n: a group sees 4 x 3 x 2 values,
  # a token 7, an instance 4 x 3; under a mask, each its own count.
  cases = [
      ("group", (2, 4, 3, 8), {"num_groups": 4}),
      ("layer", (3, 7), {}),
      ("instance", (2, 4, 3, 2), {}),
  ]
  rng = np.random.default_rng(3)
  for kind, shape, fields in cases:
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    mask = rng.random(shape) < 0.7
    mask[(0,) * (len(shape) - 1)] = True
    layer, variables = _linen(kind, x, measure, calibration="normal", **fields)
    for m in (None, jnp.asarray(mask)):
      _close(
          _jit_apply(layer, variables, x, m),
          _expected(
              kind,
              x,
              measure,
              variables,
              calibration="normal",
              mask=None if m is None else mask,
              **fields,
          ),
          rtol=1e-4,
      )


@pytest.mark.parametrize(
    "measure", _some_quick(sorted(MEASURES), {"sd", "sqd2", "rbd"})
)
def test_masks_count_only_the_masked_in_values(measure):
  # As flax's own mask tests: the masked-out values are NaN, and no
  # statistic may see them.
  rng = np.random.default_rng(4)
  x = rng.standard_normal((3, 4, 12))
  mask = rng.random(x.shape) < 0.6
  mask[..., :3] = True
  x_nan = jnp.asarray(np.where(mask, x, np.nan), jnp.float32)
  cases = [
      ("layer", {}),
      ("group", {"num_groups": 3}),
      ("instance", {"feature_axes": 1}),
  ]
  for kind, fields in cases:
    layer, variables = _linen(kind, x_nan, measure, **fields)
    y = np.asarray(_jit_apply(layer, variables, x_nan, jnp.asarray(mask)))
    want = _expected(kind, x, measure, variables, mask=mask, **fields)
    _close(y[mask], want[mask])
    assert np.isnan(y[~mask]).all()


def test_a_mask_broadcasts_and_must_be_boolean():
  x = jax.random.normal(jax.random.key(0), (4, 6))
  per_feature = np.array([True, False, True, True, False, True])
  layer, variables = _linen("group", x, "sqd2", num_groups=2)
  _close(
      _jit_apply(layer, variables, x, jnp.asarray(per_feature)),
      _expected("group", x, "sqd2", variables, num_groups=2, mask=per_feature),
  )
  with pytest.raises(TypeError, match="mask must be a boolean"):
    layer.apply(variables, x, mask=jnp.ones(x.shape))
  with pytest.raises(ValueError, match="does not broadcast"):
    layer.apply(variables, x, mask=jnp.ones((4,), bool))


@pytest.mark.parametrize(
    "measure", _some_quick(sorted(MEASURES), {"sd", "sqd1", "wcd", "bpoe"})
)
def test_ties_and_repeated_values(measure):
  # Few distinct values: every order statistic is tied.
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.integers(-2, 3, (3, 2, 16)), jnp.float32)
  for kind, fields in [("layer", {}), ("group", {"num_groups": 2})]:
    layer, variables = _linen(kind, x, measure, **fields)
    _close(
        _jit_apply(layer, variables, x),
        _expected(kind, x, measure, variables, **fields),
    )


@pytest.mark.parametrize(
    "measure", _some_quick(sorted(MEASURES), {"sd", "sqd3", "rbd"})
)
def test_tiny_groups(measure):
  # Groups of two values, and of one (S = x, D = 0: the output is bias).
  x = jax.random.normal(jax.random.key(6), (5, 6))
  layer, variables = _linen("group", x, measure, num_groups=None, group_size=2)
  _close(
      _jit_apply(layer, variables, x),
      _expected("group", x, measure, variables, group_size=2),
  )
  for kind, fields in [
      ("group", {"num_groups": None, "group_size": 1}),
      ("instance", {}),  # (batch, features): nothing left to reduce
  ]:
    layer, variables = _linen(kind, x, measure, **fields)
    y = _jit_apply(layer, variables, x)
    np.testing.assert_array_equal(
        y, jnp.broadcast_to(variables["params"]["bias"], x.shape)
    )
    g = jax.jit(
        jax.grad(lambda a: jnp.sum(jnp.sin(layer.apply(variables, a))))
    )(x)
    assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("alpha", [1e-3, 0.999])
def test_extreme_alpha(alpha):
  for kind in ("layer", "group"):
    shape, fields = SHAPES[kind]
    x = jax.random.normal(jax.random.key(7), shape)
    layer, variables = _linen(kind, x, "sqd_0.9", alpha=alpha, **fields)
    _close(
        _jit_apply(layer, variables, x),
        _expected(kind, x, "sqd", variables, alpha=alpha, **fields),
        rtol=1e-4,
    )


def test_user_measures():
  def mean_and_range(x, axis, *, where=None):
    # A user's own pair, not a built-in: the mean and the full range.
    hi = jnp.max(x, axis, where=where, initial=-jnp.inf)
    lo = jnp.min(x, axis, where=where, initial=jnp.inf)
    return jnp.mean(x, axis, where=where), hi - lo

  def numpy_pair(v):
    return v.mean(), v.max() - v.min()

  rng = np.random.default_rng(8)
  x = rng.standard_normal((3, 5, 8))
  mask = rng.random(x.shape) < 0.7
  mask[..., 0] = True
  xj = jnp.asarray(x, jnp.float32)
  measure = gbn_jax.Measure("mean_range", mean_and_range, supports_mask=True)
  for kind, fields in [("layer", {}), ("group", {"num_groups": 4})]:
    cls = LINEN[kind][0]
    for fn, m in [(mean_and_range, None), (measure, mask)]:
      layer = cls(measure=fn, use_bias=False, use_scale=False, **fields)
      y = layer.apply({}, xj, mask=None if m is None else jnp.asarray(m))
      view = x.reshape(3, 5, -1, 8 // fields.get("num_groups", 1))
      flags = np.ones(view.shape, bool) if m is None else m.reshape(view.shape)
      axes = (2, 3) if kind == "layer" else (1, 3)
      want = np.empty_like(view)
      for idx in np.ndindex(
          *[view.shape[i] for i in range(4) if i not in axes]
      ):
        sel = [slice(None)] * 4
        for a, i in zip([i for i in range(4) if i not in axes], idx):
          sel[a] = i
        s, d = numpy_pair(view[tuple(sel)][flags[tuple(sel)]])
        want[tuple(sel)] = (view[tuple(sel)] - s) / np.sqrt(d * d + 1e-6)
      _close(y, want.reshape(x.shape))
  # Undeclared, a mask is refused, naming the measure.
  layer = LINEN["layer"][0](measure=mean_and_range)
  with pytest.raises(TypeError, match="mean_and_range"):
    layer.init(jax.random.key(0), xj, mask=jnp.asarray(mask))


def test_a_registered_measure_calibrates(restore_registry):
  gbn_jax.register_measure(
      "half_range",
      lambda x, axis, *, where=None: (
          jnp.mean(x, axis, where=where),
          (jnp.max(x, axis) - jnp.min(x, axis)) / 2,
      ),
      supports_mask=True,
      normal_scale=2.0,
  )
  x = jax.random.normal(jax.random.key(9), (4, 10))
  layer = gbn_jax.linen.GLayerNorm(
      measure="half_range", calibration="normal", use_scale=False
  )
  y = layer.apply({"params": {"bias": jnp.zeros(10)}}, x)
  xs = np.asarray(x, np.float64)
  d = (xs.max(-1, keepdims=True) - xs.min(-1, keepdims=True)) / 2 / 2.0
  _close(y, (xs - xs.mean(-1, keepdims=True)) / np.sqrt(d * d + 1e-6))


def test_bfloat16_reduces_in_float32():
  # Statistics of the bfloat16 values, in float32; the output's dtype is
  # flax's (here float32, from the float32 parameters).
  for kind, shape, fields in [
      ("layer", (4, 768), {}),
      ("group", (2, 8, 8, 16), {"num_groups": 4}),
      ("instance", (2, 8, 8, 3), {}),
  ]:
    x = (jax.random.normal(jax.random.key(10), shape) * 2 + 50).astype(
        jnp.bfloat16
    )
    for measure in ("sqd2", "rbd"):
      layer, variables = _linen(kind, x, measure, **fields)
      y = _jit_apply(layer, variables, x)
      flax_layer = LINEN[kind][1](**fields)
      assert y.dtype == jax.eval_shape(flax_layer.apply, variables, x).dtype
      _close(
          y,
          _expected(
              kind, np.asarray(x, np.float32), measure, variables, **fields
          ),
          rtol=1e-3,
      )
      both = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
      layer = LINEN[kind][0](**_fields(measure), **both, **fields)
      y = _jit_apply(layer, jax.jit(layer.init)(jax.random.key(0), x), x)
      assert (
          y.dtype == jnp.bfloat16
          and np.isfinite(np.asarray(y, np.float32)).all()
      )


# ------------------------------------------------------------ sd is flax's


SD_CASES = [
    ("layer", {}),
    ("layer", {"reduction_axes": (1, 2), "feature_axes": -1}),
    ("layer", {"reduction_axes": -2, "feature_axes": (1, 3)}),
    ("layer", {"reduction_axes": (0, 1, 2, 3)}),
    ("layer", {"use_fast_variance": False, "epsilon": 1e-3}),
    ("group", {"num_groups": 2}),
    ("group", {"num_groups": None, "group_size": 1}),
    ("group", {"num_groups": 3, "reduction_axes": (0, 1, 3)}),
    ("group", {"num_groups": 6, "use_scale": False}),
    ("instance", {}),
    ("instance", {"feature_axes": (1, 2), "use_bias": False}),
    ("instance", {"use_fast_variance": False}),
]


def _inputs(shape=(2, 3, 4, 6)):
  x = jax.random.normal(jax.random.key(11), shape) * 2 + 3
  mask = jax.random.uniform(jax.random.key(12), shape) < 0.7
  # At least two masked-in values in every reduction set these tests use
  # (the last axis, or axis -2): with one, the variance is rounding noise
  # beside epsilon and the derivative's size is set by that noise alone.
  return x, mask.at[..., :2].set(True).at[..., :2, :].set(True)


@pytest.mark.parametrize(
    "kind,fields",
    [
        case if i in (0, 5, 10) else pytest.param(*case, marks=pytest.mark.slow)
        for i, case in enumerate(SD_CASES)
    ],
)
def test_sd_is_flax_linen(kind, fields):
  x, mask = _inputs()
  ours, theirs = LINEN[kind][0](**fields), LINEN[kind][1](**fields)
  variables = _params(theirs.init(jax.random.key(0), x))
  chex.assert_trees_all_equal(
      jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)),
      jax.tree.map(jnp.shape, theirs.init(jax.random.key(0), x)),
  )
  for m in (None, mask):
    # Eagerly, as flax's operations one by one.
    assert_flax_bits(
        ours.apply(variables, x, mask=m), theirs.apply(variables, x, mask=m)
    )

    # Under jit, output and gradients in one program per layer: each
    # compilation has its overhead.
    def compiled(layer):
      loss = lambda v, a: jnp.sum(jnp.sin(layer.apply(v, a, mask=m)) * a)
      return jax.jit(
          lambda v, a: (layer.apply(v, a, mask=m), jax.grad(loss, (0, 1))(v, a))
      )(variables, x)

    (got_y, got), (want_y, want) = compiled(ours), compiled(theirs)
    _close(got_y, want_y, rtol=1e-6)
    jax.tree.map(lambda g, w: _close(g, w, rtol=1e-5), got, want)


@pytest.mark.parametrize("fields", [{}, {"use_fast_variance": False}])
def test_instance_sd_derivatives_are_flax_bit_for_bit_under_jit(fields):
  # Per example and channel, sd is differentiated through flax's own
  # operations (the faster program there): one compiled program, the same
  # values and gradients as flax's. (A loss that used x again beside the
  # layer could add the two cotangents of x in another order.)
  x, mask = _inputs((4, 5, 5, 6))
  w = jax.random.normal(jax.random.key(13), x.shape)
  ours = LINEN["instance"][0](**fields)
  theirs = LINEN["instance"][1](**fields)
  variables = _params(theirs.init(jax.random.key(0), x))
  for m in (None, mask):

    def compiled(layer):
      loss = lambda v, a: jnp.sum(jnp.sin(layer.apply(v, a, mask=m)) * w)
      return jax.jit(jax.value_and_grad(loss, (0, 1)))(variables, x)

    chex.assert_trees_all_equal(compiled(ours), compiled(theirs))


@pytest.mark.parametrize("kind", sorted(LINEN))
def test_sd_is_flax_in_half_precision(kind):
  x, _ = _inputs()
  fields = {"num_groups": 3} if kind == "group" else {}
  for dtype, force in [
      (jnp.bfloat16, True),
      (jnp.bfloat16, False),
      (jnp.float16, True),
  ]:
    cfg = dict(dtype=dtype, param_dtype=dtype, force_float32_reductions=force)
    ours = LINEN[kind][0](**cfg, **fields)
    theirs = LINEN[kind][1](**cfg, **fields)
    xh = x.astype(dtype)
    variables = _params(theirs.init(jax.random.key(0), xh))
    got, want = ours.apply(variables, xh), theirs.apply(variables, xh)
    assert got.dtype == want.dtype
    if force:
      np.testing.assert_array_equal(got, want)
    else:
      # Reduced in bfloat16, flax's mean and ours round differently (as
      # GBatchNorm's do): equal to a few bfloat16 ulps.
      _close(got, want, rtol=3e-2)


NNX = {
    "layer": (gbn_jax.nnx.GLayerNorm, nnx.LayerNorm, (6,), {}),
    "group": (gbn_jax.nnx.GGroupNorm, nnx.GroupNorm, (6, 3), {}),
    "instance": (gbn_jax.nnx.GInstanceNorm, nnx.InstanceNorm, (6,), {}),
}


@pytest.mark.parametrize("kind", sorted(NNX))
def test_sd_is_flax_nnx(kind):
  ours_cls, theirs_cls, args, _ = NNX[kind]
  x, mask = _inputs()
  for cfg in [{}, {"use_fast_variance": False}, {"param_dtype": jnp.bfloat16}]:
    ours = ours_cls(*args, **cfg, rngs=nnx.Rngs(0))
    theirs = theirs_cls(*args, **cfg, rngs=nnx.Rngs(0))
    chex.assert_trees_all_equal(nnx.state(ours), nnx.state(theirs))
    for m in (None, mask):
      assert_flax_bits(ours(x, mask=m), theirs(x, mask=m))
      _close(
          nnx.jit(lambda l, a: l(a, mask=m))(ours, x),
          nnx.jit(lambda l, a: l(a, mask=m))(theirs, x),
          rtol=1e-6,
      )


@pytest.mark.parametrize(
    "measure", _some_quick(["sqd1", "bpoe", "wcd"], {"sqd1"})
)
@pytest.mark.parametrize("kind", sorted(NNX))
def test_nnx_measures_are_their_definitions(kind, measure):
  cls, _, args, _ = NNX[kind]
  x, mask = _inputs()
  layer = cls(*args, **_fields(measure), rngs=nnx.Rngs(0))
  layer.scale[...] = jnp.linspace(0.5, 2.0, 6)
  layer.bias[...] = jnp.linspace(-1.0, 1.0, 6)
  fields = {"num_groups": 3} if kind == "group" else {}
  for m in (None, mask):
    _close(
        nnx.jit(lambda l, a, m: l(a, mask=m))(layer, x, m),
        reference(
            x,
            kind,
            measure,
            mask=None if m is None else np.asarray(m),
            scale=layer.scale[...],
            bias=layer.bias[...],
            **fields,
        ),
    )


# ------------------------------------------------ derivatives and transforms


def _central_differences(f, x, direction, eps=1e-6):
  return (f(x + eps * direction) - f(x - eps * direction)) / (2 * eps)


@pytest.mark.parametrize(
    "kind,measure",
    [
        (kind, measure)
        if (kind, measure) == ("group", "mad")
        else pytest.param(kind, measure, marks=pytest.mark.slow)
        for kind in ("group", "layer")
        for measure in sorted(MEASURES)
    ],
)
def test_derivatives_are_central_differences(kind, measure):
  # float64, at distinct values (every order statistic untied): grad, jvp,
  # jacfwd and a Hessian-vector product against central differences.
  rng = np.random.default_rng(13)
  fields = {"num_groups": 2} if kind == "group" else {}
  with jax.enable_x64(True):
    # Normal values: no two equal, none at a mean (mad's, rsd's and
    # bpoe's kinks).
    x = jnp.asarray(rng.standard_normal((2, 3, 8)))
    w = jnp.asarray(rng.standard_normal(x.shape))
    layer, variables = _linen(kind, x, measure, **fields)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), variables)
    # Jitted: a few small programs, not every op of the layer compiled one
    # by one in float64; the derivatives in one program, since each
    # compilation has its overhead.
    y = jax.jit(lambda a, v=variables: layer.apply(v, a))
    loss = jax.jit(lambda a, v=variables: jnp.sum(jnp.sin(y(a, v)) * w))
    d = jnp.asarray(rng.standard_normal(x.shape))
    grad = jax.jit(jax.grad(loss))
    derivatives = jax.jit(
        lambda a: {
            "grad": jax.grad(loss)(a),
            "jvp": jax.jvp(loss, (a,), (d,))[1],
            "jacfwd": jax.jacfwd(y)(a),
            "hvp": jax.jvp(jax.grad(loss), (a,), (d,))[1],
            "params": jax.grad(loss, argnums=1)(a, variables),
        }
    )(x)
    fd = _central_differences(loss, x, d)
    _close(jnp.sum(derivatives["grad"] * d), fd, rtol=1e-6)
    _close(derivatives["jvp"], fd, rtol=1e-6)
    _close(
        jnp.tensordot(derivatives["jacfwd"], d, d.ndim),
        _central_differences(y, x, d),
        rtol=1e-6,
    )
    _close(derivatives["hvp"], _central_differences(grad, x, d), rtol=1e-5)
    # The parameters too.
    grads = derivatives["params"]
    for name in ("scale", "bias"):
      p = variables["params"][name]
      e = jnp.asarray(rng.standard_normal(p.shape))
      shifted = lambda t: loss(
          x, {"params": {**variables["params"], name: p + t * e}}
      )
      _close(
          jnp.sum(grads["params"][name] * e),
          _central_differences(shifted, 0.0, 1.0),
          rtol=1e-6,
      )


@pytest.mark.parametrize(
    "measure", _some_quick(["sqd2", "wcd", "rbd"], {"sqd2"})
)
def test_gradients_at_ties_split_equally(measure):
  # Tied values of the selected order statistic share its cotangent:
  # along a direction that keeps the ties, the derivative is the
  # one-sided limit both ways (docs/measures.md, conventions).
  rng = np.random.default_rng(14)
  with jax.enable_x64(True):
    x = jnp.asarray(rng.integers(-3, 4, (2, 16)), jnp.float64)
    layer = gbn_jax.linen.GLayerNorm(**_fields(measure), use_bias=False)
    variables = {"params": {"scale": jnp.linspace(0.5, 1.5, 16)}}
    w = jnp.asarray(rng.standard_normal(x.shape))
    loss = jax.jit(lambda a: jnp.sum(layer.apply(variables, a) * w))
    values = np.asarray(x)
    levels = rng.standard_normal(7)
    d = jnp.asarray(levels[(values + 3).astype(int)])  # equal within a tie
    _close(
        jnp.sum(jax.jit(jax.grad(loss))(x) * d),
        _central_differences(loss, x, d),
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "measure", _some_quick(["sd", "sqd1", "bpoe"], {"sqd1"})
)
def test_vmap_scan_remat(measure):
  x = jax.random.normal(jax.random.key(15), (3, 4, 2, 8))
  layer, variables = _linen("group", x[0], measure, num_groups=4)
  apply = lambda a: layer.apply(variables, a)
  want = np.stack(
      [_expected("group", xi, measure, variables, num_groups=4) for xi in x]
  )
  _close(jax.vmap(apply)(x), want)
  _close(jax.jit(jax.vmap(apply))(x), want)
  _, ys = lax.scan(lambda c, a: (c, apply(a)), 0.0, x)
  _close(ys, want)
  loss = lambda a: jnp.sum(jnp.sin(apply(a)))
  d = jax.random.normal(jax.random.key(16), x[0].shape)
  _close(
      jnp.sum(jax.jit(jax.grad(jax.checkpoint(loss)))(x[0]) * d),
      # The differences under jit: the eager calls above are the subject.
      _central_differences(jax.jit(loss), x[0], d, eps=1e-3),
      rtol=5e-3,
  )


@pytest.mark.parametrize(
    "measure", _some_quick(["sqd_0.9", "mad"], {"sqd_0.9"})
)
def test_shard_map_with_axis_name(measure):
  # The reduced axis split across the devices: the statistics pool them.
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("d",))
  n = len(devices)
  x = jax.random.normal(jax.random.key(17), (3, 16 * n))
  layer = gbn_jax.linen.GLayerNorm(
      **_fields(measure), axis_name="d", use_scale=False, use_bias=False
  )
  f = jax.jit(
      jax.shard_map(
          lambda a: layer.apply({}, a),
          mesh=mesh,
          in_specs=P(None, "d"),
          out_specs=P(None, "d"),
      )
  )
  _close(f(x), reference(x, "layer", measure))


@pytest.mark.parametrize("measure", _some_quick(["sqd1", "rbd"], {"sqd1"}))
def test_export_lowers_for_cpu_and_cuda(measure):
  x = jax.random.normal(jax.random.key(18), (2, 8, 8, 16))
  layer, variables = _linen("group", x, measure, num_groups=2)
  f = jax.jit(lambda a: layer.apply(variables, a))
  spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
  cuda = jax.export.export(f, platforms=["cuda"])(spec)
  assert cuda.platforms == ("cuda",) and cuda.mlir_module()
  cpu = jax.export.export(
      f, platforms=["cpu"], disabled_checks=gbn_jax.export_disabled_checks()
  )(spec)
  _close(
      cpu.call(x),
      _expected("group", x, measure, variables, num_groups=2),
  )


# -------------------------------------------------------------------- errors


def test_flax_errors_are_kept():
  x = jnp.ones((2, 4, 6))
  bad = [
      gbn_jax.linen.GGroupNorm(num_groups=4),  # does not divide 6
      gbn_jax.linen.GGroupNorm(num_groups=2, group_size=3),
      gbn_jax.linen.GGroupNorm(num_groups=None),
      gbn_jax.linen.GGroupNorm(num_groups=None, group_size=4),
      gbn_jax.linen.GGroupNorm(num_groups=2, reduction_axes=(1,)),
  ]
  for layer in bad:
    with pytest.raises(ValueError):
      layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="cannot include the leading"):
    gbn_jax.linen.GInstanceNorm(feature_axes=(0, 2)).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="reduction_axes"):
    gbn_jax.linen.GLayerNorm(reduction_axes=3).init(jax.random.key(0), x)
  with pytest.raises(ValueError):
    gbn_jax.nnx.GGroupNorm(6, num_groups=4, rngs=nnx.Rngs(0))


def test_bad_measures_fail_at_construction_naming_the_layer():
  with pytest.raises(ValueError, match="unknown measure"):
    gbn_jax.linen.GLayerNorm(measure="nope")
  with pytest.raises(TypeError, match=r"GGroupNorm\(measure='sqd'"):
    gbn_jax.linen.GGroupNorm(measure="sqd2", alpha=0.3)
  with pytest.raises(TypeError, match=r"GInstanceNorm\(measure='sqd'"):
    gbn_jax.nnx.GInstanceNorm(3, measure="sqd1", alpha=0.3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError):
    gbn_jax.nnx.GLayerNorm(
        3,
        measure=lambda x, axis: (x, x),
        calibration="normal",
        rngs=nnx.Rngs(0),
    )
