"""Declared measure capabilities, the errors and fallbacks they drive, the
``'sqd:0.9'`` parser, the public reduction helpers and the public surface."""

import dataclasses
import importlib
import inspect
import typing

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm
from gbn_jax import measures
from gbn_jax._selection import reductions
import gbn_jax.nnx as gnnx

from tests.helpers import reference as ref
from tests.helpers.measures import BUILTIN_MEASURES

# Tests here register measures: the registry is restored after each.
pytestmark = pytest.mark.usefixtures("restore_registry")


def _spread(x, axis):
  """The bare contract: mean and population std, no keywords."""
  return jnp.mean(x, axis), jnp.std(x, axis)


def _masked_spread(x, axis, *, where=None):
  s = jnp.mean(x, axis, where=where)
  centered = x - jnp.expand_dims(s, axis)
  return s, jnp.sqrt(jnp.mean(jnp.square(centered), axis, where=where))


def _np_masked_spread(x, mask, axis=0):
  x = np.asarray(x, np.float64)
  m = np.broadcast_to(mask, x.shape)
  s = np.sum(np.where(m, x, 0), axis) / np.sum(m, axis)
  d2 = np.sum(np.where(m, (x - np.expand_dims(s, axis)) ** 2, 0), axis)
  return s, np.sqrt(d2 / np.sum(m, axis))


# --- what the registry declares ----------------------------------------------


def test_builtins_declare_mask_and_device_support():
  for name in BUILTIN_MEASURES:
    spec = gbn_jax.MEASURES[name]
    assert isinstance(spec, gbn_jax.MeasureSpec), name
    assert spec.supports_mask is True and spec.pools_devices is True, name
    m = gbn_jax.get_measure(name, **dict.fromkeys(spec.required, 0.3))
    assert m.supports_mask and m.pools_devices, name
  assert gbn_jax.MEASURES["sqd2"].params == (("alpha", 0.5),)
  assert gbn_jax.MEASURES["sqd"].params == ()
  assert gbn_jax.MEASURES["sqd"].required == ("alpha",)
  assert gbn_jax.MEASURES["sqd1"].required == ()
  assert gbn_jax.MEASURES["sqd1"].accepted == ()
  assert gbn_jax.MEASURES["mad"].required == ()


def test_a_bare_function_declares_nothing_by_default():
  gbn_jax.register_measure("test_bare", _spread)
  spec = gbn_jax.MEASURES["test_bare"]
  assert (spec.supports_mask, spec.pools_devices) == (False, False)
  assert spec.normal_scale is None and spec.fn is _spread
  gbn_jax.register_measure(
      "test_declared",
      _masked_spread,
      supports_mask=True,
      pools_devices=False,
  )
  m = gbn_jax.get_measure("test_declared")
  assert (m.supports_mask, m.pools_devices) == (True, False)
  # A built-in function under a new name keeps its declarations (and may
  # drop them explicitly).
  gbn_jax.register_measure("test_sqd_p9", measures.sqd, alpha=0.9)
  assert gbn_jax.MEASURES["test_sqd_p9"].supports_mask is True
  assert gbn_jax.MEASURES["test_sqd_p9"].pools_devices is True
  gbn_jax.register_measure(
      "test_sqd_local", measures.sqd, alpha=0.9, pools_devices=False
  )
  assert gbn_jax.MEASURES["test_sqd_local"].pools_devices is False


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_capabilities_must_be_bools(bad):
  kw = {"supports_mask": bad} if bad is not None else {"pools_devices": 0}
  with pytest.raises(TypeError, match="must be True or False"):
    gbn_jax.register_measure("test_bad_caps", _spread, **kw)
  with pytest.raises(TypeError, match="must be True or False"):
    gbn_jax.Measure("mine", _spread, **kw)


def test_names_cannot_hold_the_parser_separator():
  with pytest.raises(ValueError, match="without ':'"):
    gbn_jax.register_measure("test:odd", _spread)


def test_registry_view_is_read_only():
  with pytest.raises(TypeError):
    gbn_jax.MEASURES["x"] = gbn_jax.MEASURES["sd"]  # type: ignore[index]
  with pytest.raises(dataclasses.FrozenInstanceError):
    gbn_jax.MEASURES["sd"].supports_mask = False  # type: ignore[misc]


# --- a mask without supports_mask: a clear error, never a deep TypeError -----


def _x(shape=(12, 3), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _assert_names_the_capability(excinfo, name):
  text = str(excinfo.value)
  assert f"measure {name!r}" in text, text
  assert "does not accept `where`" in text and "supports_mask=True" in text
  assert "unexpected keyword" not in text


def test_mask_with_a_registered_bare_function_is_a_clear_error():
  calls = []

  def bare(x, axis):
    calls.append(axis)
    return _spread(x, axis)

  gbn_jax.register_measure("test_bare_mask", bare)
  x, mask = _x(), _x() > 0
  with pytest.raises(TypeError) as e:
    GBatchNorm(use_running_average=False, measure="test_bare_mask").init(
        jax.random.key(0), x, mask=mask
    )
  _assert_names_the_capability(e, "test_bare_mask")
  layer = gnnx.GBatchNorm(3, measure="test_bare_mask", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError) as e:
    layer(x, mask=mask)
  _assert_names_the_capability(e, "test_bare_mask")
  with pytest.raises(TypeError) as e:
    gbn_jax.get_measure("test_bare_mask")(x, 0, where=mask)
  _assert_names_the_capability(e, "test_bare_mask")
  assert not calls  # refused before the function ran
  # Without a mask it works, and is the plain definition.
  y, _ = GBatchNorm(
      use_running_average=False, measure="test_bare_mask"
  ).init_with_output(jax.random.key(0), x)
  xs = np.asarray(x, np.float64)
  want = ref.normalize(xs, xs.mean(0), xs.std(0), (0,))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_mask_with_a_plain_callable_names_it():
  x, mask = _x(), _x() > 0
  with pytest.raises(TypeError) as e:
    GBatchNorm(use_running_average=False, measure=_masked_spread).init(
        jax.random.key(0), x, mask=mask
    )
  # A where= keyword in the signature is not a declaration.
  _assert_names_the_capability(e, "_masked_spread")


def test_a_measure_that_cannot_take_a_mask_says_why():
  calls = []

  def static_count(x, axis):
    calls.append(axis)
    return _spread(x, axis)

  reason = "it needs the static number of values"
  measure = gbn_jax.Measure("counted", static_count, mask_refusal=reason)
  x, mask = _x(), _x() > 0
  for call in (
      lambda: measure(x, 0, where=mask),
      lambda: GBatchNorm(use_running_average=False, measure=measure).init(
          jax.random.key(0), x, mask=mask
      ),
  ):
    with pytest.raises(TypeError) as e:
      call()
    assert (
        str(e.value) == f"measure 'counted' does not accept a mask: {reason}."
    )
  assert not calls
  assert measure == gbn_jax.Measure("counted", static_count)  # not an identity
  for bad in (
      dict(supports_mask=True, mask_refusal=reason),
      dict(mask_refusal=3),
  ):
    with pytest.raises(ValueError, match="mask_refusal of measure 'counted'"):
      gbn_jax.Measure("counted", static_count, **bad)


def test_declared_mask_support_reaches_the_function():
  x = np.asarray(_x((20, 3), seed=1))
  mask = np.asarray(_x((20, 3), seed=2)) > -0.5
  gbn_jax.register_measure("test_masked", _masked_spread, supports_mask=True)
  want_s, want_d = _np_masked_spread(x, mask)
  s, d = gbn_jax.get_measure("test_masked")(x, 0, where=mask)
  np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(d, want_d, rtol=1e-5, atol=1e-6)
  # The same through a layer, by name and as an unregistered Measure.
  for measure in (
      "test_masked",
      gbn_jax.Measure("mine", _masked_spread, supports_mask=True),
  ):
    y, _ = GBatchNorm(use_running_average=False, measure=measure).apply(
        {
            "params": {"scale": jnp.ones(3), "bias": jnp.zeros(3)},
            "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
        },
        x,
        mask=mask,
        mutable=["batch_stats"],
    )
    np.testing.assert_allclose(
        y, ref.normalize(x, want_s, want_d, (0,)), rtol=1e-4, atol=1e-4
    )


# --- device pooling without pools_devices: the documented gather ------------


def _per_device(x, devices=4):
  return x.reshape(devices, x.shape[0] // devices, *x.shape[1:])


def test_a_function_without_device_pooling_sees_the_global_batch():
  # vmap with axis_name runs the collectives on one CPU device.
  seen = []

  def local_only(x, axis, *, where=None):
    seen.append(x.shape)
    return _masked_spread(x, axis, where=where)

  gbn_jax.register_measure("test_local", local_only, supports_mask=True)
  x = np.asarray(_x((16, 3), seed=3))
  mask = np.asarray(_x((16, 3), seed=4)) > -0.3
  measure = gbn_jax.get_measure("test_local")
  s, d = jax.vmap(
      lambda v, m: measure(v, 0, where=m, axis_name="dev"), axis_name="dev"
  )(_per_device(x), _per_device(mask))
  want_s, want_d = _np_masked_spread(x, mask)
  for dev in range(4):  # every device holds the global batch's statistics
    np.testing.assert_allclose(s[dev], want_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d[dev], want_d, rtol=1e-5, atol=1e-6)
  assert seen and all(shape == (16, 3) for shape in seen), seen


def test_the_gather_fallback_in_a_layer_matches_one_batched_call():
  gbn_jax.register_measure("test_bare_dev", _spread)
  x = np.asarray(_x((16, 3), seed=5))
  variables = {
      "params": {"scale": jnp.ones(3) * 1.5, "bias": jnp.ones(3) * 0.2},
      "batch_stats": {"mean": jnp.zeros(3), "var": jnp.ones(3)},
  }
  pooled = GBatchNorm(
      use_running_average=False, measure="test_bare_dev", axis_name="dev"
  )
  y = jax.vmap(
      lambda v: pooled.apply(variables, v, mutable=["batch_stats"])[0],
      axis_name="dev",
  )(_per_device(x))
  xs = x.astype(np.float64)
  want = ref.normalize(xs, xs.mean(0), xs.std(0), (0,), 1.5, 0.2)
  np.testing.assert_allclose(
      np.asarray(y).reshape(x.shape), want, rtol=1e-4, atol=1e-5
  )


def test_a_function_that_pools_devices_gets_the_axis_name():
  got = []

  def pooling(x, axis, *, axis_name=None, axis_index_groups=None):
    got.append((x.shape, axis_name, axis_index_groups))
    s = gbn_jax.reductions.mean(x, axis, axis_name=axis_name)
    return s, gbn_jax.reductions.extreme(
        x, axis, largest=True, axis_name=axis_name
    )

  gbn_jax.register_measure("test_pooling", pooling, pools_devices=True)
  x = np.asarray(_x((8, 2), seed=6))
  s, d = jax.vmap(
      lambda v: gbn_jax.get_measure("test_pooling")(v, 0, axis_name="dev"),
      axis_name="dev",
  )(_per_device(x, 2))
  assert got == [((4, 2), "dev", None)]  # local shards, the name passed on
  np.testing.assert_allclose(s[0], x.astype(np.float64).mean(0), atol=1e-6)
  np.testing.assert_array_equal(d[1], x.max(0))


# --- the one parser of 'sqd:0.9' ---------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("sqd:0.9", ("sqd", {"alpha": 0.9})),
        ("sqd:1e-3", ("sqd", {"alpha": 0.001})),
        (" sqd:0.25 ", ("sqd", {"alpha": 0.25})),
        ("mad", ("mad", {})),
        ("sqd2", ("sqd2", {})),
        ("sqd", ("sqd", {})),  # the alpha may come later, as get_measure's
    ],
)
def test_parse_measure_name(text, expected):
  assert gbn_jax.parse_measure_name(text) == expected


@pytest.mark.parametrize(
    "text,message",
    [
        ("sqd:0", "strictly between 0 and 1"),
        ("sqd:1", "strictly between 0 and 1"),
        ("sqd:-0.1", "strictly between 0 and 1"),
        ("sqd:nan", "strictly between 0 and 1"),
        ("sqd:inf", "strictly between 0 and 1"),
        ("sqd:x", "not a number"),
        ("sqd:", "not a number"),
        ("mad:0.5", "takes no alpha"),
        ("sqd2:0.3", r"fixes alpha=0.5; write 'sqd:<alpha>'"),
        ("batchnorm", "unknown measure 'batchnorm'"),
        ("bn:0.5", "unknown measure"),
        ("", "unknown measure"),
    ],
)
def test_parse_measure_name_errors(text, message):
  with pytest.raises(ValueError, match=message):
    gbn_jax.parse_measure_name(text)


def test_parsed_names_build_the_measure_they_name():
  x = np.asarray(_x((30, 2), seed=7))
  name, params = gbn_jax.parse_measure_name("sqd:0.3")
  s, d = gbn_jax.get_measure(name, **params)(x, 0)
  for j in range(2):
    want_s, want_d = ref.measure_1d("sqd", x[:, j], 0.3)
    np.testing.assert_allclose(s[j], want_s, rtol=1e-6)
    np.testing.assert_allclose(d[j], want_d, rtol=1e-5)


def test_get_measure_points_the_colon_spelling_at_the_parser():
  with pytest.raises(ValueError, match="parse_measure_name"):
    gbn_jax.get_measure("sqd:0.9")


# --- complex input to an order statistic: an error, not a silent cast --------


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: gbn_jax.quantile(x, 0.5, 0),
        lambda x: gbn_jax.superquantile(x, 0.5, 0),
        lambda x: gbn_jax.reductions.extreme(x, 0, largest=True),
    ],
    ids=["quantile", "superquantile", "extreme"],
)
def test_order_statistics_refuse_complex_input(fn):
  x = jnp.array([1 + 2j, 3 + 0j, -1 - 1j])
  with pytest.raises(TypeError, match="not defined for complex input"):
    fn(x)


def test_prepare_reduction_refuses_complex_unless_allowed():
  x = jnp.array([1 + 2j, 3 + 0j])
  with pytest.raises(TypeError, match="complex input"):
    reductions.prepare_reduction(x, 0, None)
  kept, axes, _ = reductions.prepare_reduction(x, 0, None, allow_complex=True)
  assert kept.dtype == x.dtype and axes == (0,)
  ints, _, _ = reductions.prepare_reduction(jnp.array([1, 2]), 0, None)
  assert ints.dtype == jnp.float32


def test_mean_is_defined_for_complex_input():
  x = np.array([[1 + 2j, 2], [3 - 1j, 5j]], np.complex64)
  np.testing.assert_allclose(
      gbn_jax.reductions.mean(x, 0), x.mean(0), rtol=1e-6
  )


# --- the public helpers a custom measure is built from ------------------------


def test_mean_and_extreme_against_numpy_with_a_mask():
  rng = np.random.default_rng(8)
  x = rng.standard_normal((6, 5, 3)).astype(np.float32)
  mask = rng.random(x.shape) < 0.6
  got = gbn_jax.reductions.mean(x, (0, 1), where=mask)
  want = np.array(
      [x[..., j][mask[..., j]].astype(np.float64).mean() for j in range(3)]
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for largest, pick in ((True, np.max), (False, np.min)):
    got = gbn_jax.reductions.extreme(x, (0, 1), largest=largest, where=mask)
    want = [pick(x[..., j][mask[..., j]]) for j in range(3)]
    np.testing.assert_array_equal(got, want)
  # axis=None reduces everything, as in quantile.
  np.testing.assert_array_equal(
      gbn_jax.reductions.extreme(x, largest=False), x.min()
  )


def test_extreme_gradient_splits_ties():
  x = jnp.array([1.0, 3.0, 3.0, 2.0])
  g = jax.grad(lambda v: gbn_jax.reductions.extreme(v, 0, largest=True))(x)
  np.testing.assert_array_equal(g, [0.0, 0.5, 0.5, 0.0])


def test_reductions_share_their_argument_names():
  want = ["x", "axis", "where", "axis_name", "axis_index_groups"]
  for fn in (gbn_jax.reductions.mean, gbn_jax.reductions.extreme):
    names = [n for n in inspect.signature(fn).parameters if n != "largest"]
    assert names == want, fn
  for fn in (gbn_jax.quantile, gbn_jax.superquantile):
    names = [n for n in inspect.signature(fn).parameters if n != "alpha"]
    assert names == want, fn


# --- the public surface ---------------------------------------------------------

PUBLIC_MODULES = [
    "gbn_jax",
    "gbn_jax.calibration",
    "gbn_jax.deviations",
    "gbn_jax.measures",
    "gbn_jax.reductions",
    "gbn_jax.selection",
]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_functions_are_typed_and_documented(module_name):
  module = importlib.import_module(module_name)
  assert hasattr(module, "__all__"), module_name
  missing = []
  for name in module.__all__:
    obj = getattr(module, name)  # every listed name exists
    if not inspect.isfunction(obj):
      continue
    hints = typing.get_type_hints(obj)
    params = [
        p
        for p in inspect.signature(obj).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    untyped = [p.name for p in params if p.name not in hints]
    doc = inspect.getdoc(obj) or ""
    if untyped or "return" not in hints:
      missing.append(f"{name}: hints for {untyped or 'the return'}")
    if params and "Args:" not in doc:
      missing.append(f"{name}: no Args")
    if hints.get("return") is not type(None) and not (
        "Returns:" in doc or "Yields:" in doc
    ):
      missing.append(f"{name}: no Returns")
  assert not missing, missing


def test_no_private_type_leaks_through_the_registry():
  for spec in gbn_jax.MEASURES.values():
    assert not type(spec).__name__.startswith("_")
    assert type(spec).__module__ == "gbn_jax.measures"
