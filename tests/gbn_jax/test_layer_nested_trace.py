"""A GBN layer under a staging trace is traced once per shape.

ResNet20 has 19 norm layers but 3 distinct input shapes, and a quantile
measure traces over a thousand equations per layer (a branch per kind of
platform). Under ``jit``/``make_jaxpr`` a layer is a nested ``jax.jit``,
traced once per (measure, reduction, shapes, dtypes, trace context); eagerly
it runs op by op. The tests count how often the measure function runs (a
counter in it) and check the values against numpy from the definitions
(tests/helpers/reference.py). That an eager ``vmap`` stays op by op, bit for bit
flax's BatchNorm, is tests/gbn_jax/test_convert.py::test_linen_sd_is_flax_bit_for_bit.

Batch renormalization layers nest too, their limits static (or traced, given
as JAX arrays): their outputs, running statistics and derivatives in both
modes are the inline program's (the nesting switched off), bit for bit on the
CPU, and numpy's from Ioffe's definition.
"""

from collections.abc import Callable, Sequence
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import GBatchNorm
from gbn_jax import _normalization
from gbn_jax import _renorm
from gbn_jax._selection import common

from tests.helpers import reference as ref
from tests.helpers.measures import PROGRAM_MEASURES

EPS = 1e-5
#: GBatchNorm's (flax's) default momentum: the first update is (1 - it) S.
MOMENTUM = 0.99


def _counting_measure() -> tuple[Callable[..., Any], list[Any]]:
  """A fresh sd measure (a new cache key) and the list of its calls."""
  calls = []

  def counted_sd(x, axis):
    calls.append(common.lowering_platform())
    mean = jnp.mean(x, axis)
    centered = x - jnp.expand_dims(mean, axis)
    return mean, jnp.sqrt(jnp.mean(jnp.square(centered), axis))

  return counted_sd, calls


class _Stack(nn.Module):
  """Dense then GBN, once per width: one input shape per distinct width.

  With ``renorm``, batch renormalization clipped to ``renorm_clipping``.
  """

  measure: Any
  widths: Sequence[int]
  renorm: bool = False
  renorm_clipping: Any = None

  @nn.compact
  def __call__(self, x):
    for width in self.widths:
      x = nn.Dense(width)(x)
      x = GBatchNorm(
          use_running_average=False,
          measure=self.measure,
          renorm=self.renorm,
          renorm_clipping=self.renorm_clipping,
      )(x)
    return x


#: Limits that clip some features of the tests' batches and leave others.
CLIPPING = {"rmax": 1.5, "dmax": 0.5}
RENORM = {"renorm": True, "renorm_clipping": CLIPPING}


def _calls_of(
    widths: Sequence[int],
    transform: Callable[[Any], Any],
    x: jax.Array,
    **fields: Any,
) -> tuple[int, Any]:
  """Runs of a fresh measure while ``transform(loss)`` runs once."""
  measure, calls = _counting_measure()
  model = _Stack(measure, tuple(widths), **fields)
  variables = model.init(jax.random.key(1), x)

  def loss(params):
    y, _ = model.apply(
        {**variables, "params": params}, x, mutable=["batch_stats"]
    )
    return jnp.sum(jnp.sin(y))

  calls.clear()
  out = transform(loss)(variables["params"])
  return len(calls), out


def _batch(shape=(16, 3)) -> jax.Array:
  return jax.random.normal(jax.random.key(0), shape)


@pytest.mark.parametrize("fields", [{}, RENORM], ids=["gbn", "renorm"])
def test_jit_traces_a_stack_of_layers_once_per_input_shape(fields):
  x = _batch()
  # Six layers of one input shape, one of another: two traces, as for two
  # single layers (without nesting, seven).
  widths = (4, 4, 4, 4, 4, 4, 6)
  for transform in (jax.jit, lambda f: jax.jit(jax.grad(f))):
    one_layer, _ = _calls_of((4,), transform, x, **fields)
    stack, _ = _calls_of(widths, transform, x, **fields)
    assert one_layer >= 1
    assert stack == 2 * one_layer, (stack, one_layer)


@pytest.mark.parametrize("fields", [{}, RENORM], ids=["gbn", "renorm"])
def test_eager_calls_run_the_measure_every_time(fields):
  x = _batch()
  # Op by op: every layer runs its measure, every call again (a nested jit
  # would have run it once, then cached it).
  measure, calls = _counting_measure()
  model = _Stack(measure, (4, 4, 4), **fields)
  variables = model.init(jax.random.key(1), x)
  calls.clear()
  for _ in range(2):
    model.apply(variables, x, mutable=["batch_stats"])
  assert len(calls) == 6
  per_example = jax.vmap(
      lambda v: model.apply(variables, v, mutable=["batch_stats"])[0],
  )
  calls.clear()
  per_example(x[:, None])
  assert len(calls) == 3


def test_jitted_stack_equals_numpy_layer_by_layer():
  x = _batch()
  measure, _ = _counting_measure()
  model = _Stack(measure, (4, 4, 5))
  variables = model.init(jax.random.key(1), x)
  y, updates = jax.jit(functools.partial(model.apply, mutable=["batch_stats"]))(
      variables, x
  )
  # Dense and GBN (scale 1, bias 0 at init) in float64 numpy.
  h = np.asarray(x, np.float64)
  for i in range(3):
    dense = variables["params"][f"Dense_{i}"]
    h = h @ np.asarray(dense["kernel"], np.float64) + np.asarray(
        dense["bias"], np.float64
    )
    s, d = ref.per_feature(lambda v: ref.measure_1d("sd", v), h, (0,))
    np.testing.assert_allclose(
        updates["batch_stats"][f"GBatchNorm_{i}"]["mean"],
        (1 - MOMENTUM) * s,
        rtol=1e-5,
        atol=1e-7,
    )
    h = ref.normalize(h, s, d, (0,), eps=EPS)
  np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)


def test_trace_context_is_part_of_the_cache_key():
  x = _batch()
  measure, calls = _counting_measure()
  model = _Stack(measure, (4,))
  variables = model.init(jax.random.key(1), x)

  def trace():
    jax.make_jaxpr(lambda v, x: model.apply(v, x, mutable=["batch_stats"])[0])(
        variables, x
    )

  calls.clear()
  trace()
  trace()  # the same context: served from the cache
  assert len(calls) == 1
  # The platform kind that per_platform traces its branches under: a layer
  # traced for GPUs alone sees GPU, not the CPU trace cached above.
  with common.platform_scope(common.GPU):
    trace()
  assert calls[1:] == [common.GPU]
  with gbn_jax.selection.selection_config(method="sort"):
    trace()
  with jax.enable_x64(True):
    trace()
  assert len(calls) == 4


def test_named_axis_inside_jit_pools_the_vmapped_batch():
  # One example per vmapped member: the layer's reduction pools the whole
  # batch over axis_name, a psum inside the nested call.
  x = _batch((12, 5))
  layer = GBatchNorm(use_running_average=False, axis_name="batch")
  variables = layer.init(jax.random.key(1), x[0])

  def per_example(v):
    return layer.apply(variables, v, mutable=["batch_stats"])

  jaxpr = jax.make_jaxpr(jax.vmap(per_example, axis_name="batch"))(x)
  assert any(e.primitive.name in ("jit", "pjit") for e in jaxpr.eqns)
  y, updates = jax.jit(jax.vmap(per_example, axis_name="batch"))(x)
  s, d = ref.per_feature(lambda v: ref.measure_1d("sd", v), np.asarray(x), (0,))
  np.testing.assert_allclose(y, ref.normalize(x, s, d, (0,), eps=EPS), 1e-5)
  np.testing.assert_allclose(
      updates["batch_stats"]["mean"],
      np.broadcast_to((1 - MOMENTUM) * s, x.shape),
      rtol=1e-5,
      atol=1e-7,
  )


def test_a_measure_that_does_not_hash_is_traced_inline():
  # A parameter that is an array makes the measure unhashable: no cache
  # key, so every layer traces it, and the values are still right.
  x = _batch()
  calls = []

  def scaled_sd(v, axis, *, factor):
    calls.append(v.shape)
    return jnp.mean(v, axis), jnp.std(v, axis) * factor[0]

  measure = gbn_jax.Measure("scaled_sd", scaled_sd, (("factor", np.ones(1)),))
  model = _Stack(measure, (4, 4))
  variables = model.init(jax.random.key(1), x)
  calls.clear()
  y, _ = jax.jit(functools.partial(model.apply, mutable=["batch_stats"]))(
      variables, x
  )
  assert len(calls) == 2
  assert np.all(np.isfinite(y))


# --- batch renormalization: nested as plain GBN is, bit for bit the inline --


def _layer_calls(fn: Callable[..., Any], *args: Any) -> list[Any]:
  """The nested layer calls at the top of ``fn``'s jaxpr."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [
      e
      for e in jaxpr.eqns
      if e.primitive.name in ("jit", "pjit")
      and e.params["name"] == "_normalize_inline"
  ]


def _same_bits(got: Any, want: Any) -> None:
  got_leaves, got_tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert got_tree == want_tree
  for g, w in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    assert (g.dtype, g.shape) == (w.dtype, w.shape)
    np.testing.assert_array_equal(
        g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}")
    )


def _renorm_case(measure: str) -> tuple[nn.Module, Any, jax.Array]:
  """A 3-layer renorm stack, its variables away from their initial values
  (so that r, d, scale and bias vary per feature) and a batch."""
  x = _batch()
  model = _Stack(measure, (4, 4, 5), **RENORM)
  # Initialized with sd: the values do not depend on the measure (the norm
  # layers' are all drawn below), and an eager init would run each of a
  # quantile measure's many small operations on its own.
  variables = _Stack("sd", (4, 4, 5), **RENORM).init(jax.random.key(1), x)
  rng = np.random.default_rng(2)
  draw = lambda f, v: jnp.asarray(f(np.shape(v)), jnp.float32)
  params = dict(variables["params"])
  stats = {}
  for name, layer_stats in variables["batch_stats"].items():
    stats[name] = {
        "mean": draw(lambda n: rng.normal(0, 0.5, n), layer_stats["mean"]),
        "var": draw(lambda n: rng.uniform(0.2, 3, n), layer_stats["var"]),
    }
    params[name] = {
        "scale": draw(
            lambda n: rng.uniform(0.5, 1.5, n), params[name]["scale"]
        ),
        "bias": draw(lambda n: rng.normal(0, 0.3, n), params[name]["bias"]),
    }
  return model, {"params": params, "batch_stats": stats}, x


def _renorm_programs(model: nn.Module, variables: Any, x: jax.Array) -> Any:
  """Output and running statistics, reverse-mode gradients and a JVP, each
  under a fresh jit (a new function: no trace cached from another test)."""
  stats = variables["batch_stats"]

  def forward(params, v):
    return model.apply(
        {"params": params, "batch_stats": stats}, v, mutable=["batch_stats"]
    )

  def loss(params, v):
    y, _ = forward(params, v)
    return jnp.sum(jnp.sin(y) * jnp.arange(1, y.size + 1).reshape(y.shape))

  primals = (variables["params"], x)
  tangents = jax.tree.map(
      lambda v: jnp.cos(jnp.arange(v.size, dtype=v.dtype)).reshape(v.shape),
      primals,
  )
  jvp = lambda *p: jax.jvp(lambda *q: forward(*q)[0], p, tangents)
  return (
      len(_layer_calls(forward, *primals)),
      jax.jit(forward)(*primals),
      jax.jit(jax.grad(loss, argnums=(0, 1)))(*primals),
      jax.jit(jvp)(*primals),
  )


def _numpy_renorm_stack(measure: str, variables: Any, x: jax.Array) -> Any:
  """The stack's output and running statistics in float64, from Ioffe's
  definition: ``((x - S) / D_B * r + d) * scale + bias``."""
  params, stats = variables["params"], variables["batch_stats"]
  rmax, dmax = CLIPPING["rmax"], CLIPPING["dmax"]
  f64 = lambda v: np.asarray(v, np.float64)
  h, new_stats, clipped = f64(x), {}, []
  for i in range(3):
    dense, name = params[f"Dense_{i}"], f"GBatchNorm_{i}"
    h = h @ f64(dense["kernel"]) + f64(dense["bias"])
    s, dev = ref.per_feature(lambda v: ref.measure_1d(measure, v), h, (0,))
    run_mean, run_var = f64(stats[name]["mean"]), f64(stats[name]["var"])
    run_dev = np.sqrt(run_var + EPS)
    r = np.sqrt(dev**2 + EPS) / run_dev
    d = (s - run_mean) / run_dev
    clipped += [(r < 1 / rmax) | (r > rmax), np.abs(d) > dmax]
    r, d = np.clip(r, 1 / rmax, rmax), np.clip(d, -dmax, dmax)
    h = ((h - s) / np.sqrt(dev**2 + EPS) * r + d) * f64(
        params[name]["scale"]
    ) + f64(params[name]["bias"])
    new_stats[name] = {
        "mean": MOMENTUM * run_mean + (1 - MOMENTUM) * s,
        "var": MOMENTUM * run_var + (1 - MOMENTUM) * dev**2,
    }
  clipped = np.concatenate(clipped)
  # The case is meant to clip some features and leave others free.
  assert clipped.any() and not clipped.all()
  return h, new_stats


@pytest.mark.parametrize("measure", PROGRAM_MEASURES)
def test_nested_renorm_stack_is_the_inline_program_bit_for_bit(
    measure, monkeypatch
):
  model, variables, x = _renorm_case(measure)
  nested = _renorm_programs(model, variables, x)
  with monkeypatch.context() as patch:
    patch.setattr(_normalization, "_under_staging_trace", lambda x: False)
    inline = _renorm_programs(model, variables, x)
  assert (nested[0], inline[0]) == (3, 0)
  if jax.default_backend() == "cpu":
    _same_bits(nested[1:], inline[1:])
  else:
    # XLA:GPU fuses the two programs differently and may contract different
    # multiply-adds: each program is held to the definition instead, and the
    # derivatives to each other at the bound that holds the outputs. A
    # derivative that is zero by shift invariance (a bias before a
    # normalization) is the rounding of sums of terms at the largest
    # derivative's scale.
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(nested[2:]))
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(
            g, w, rtol=1e-4, atol=max(1e-5, 1e-6 * scale)
        ),
        nested[2:],
        inline[2:],
    )
  want_y, want_stats = _numpy_renorm_stack(measure, variables, x)
  for (y, updates), _, _ in (nested[1:], inline[1:]):
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        np.concatenate(jax.tree.leaves(updates["batch_stats"])),
        np.concatenate(jax.tree.leaves(want_stats)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_renorm_limits_as_arrays_nest_and_numpy_arrays_trace_inline():
  measure = _normalization.bind_measure("mad", None, True)
  reduction = _normalization.Reduction((0,), (1,), None, EPS)
  x = _batch((16, 4))
  rng = np.random.default_rng(3)
  affine_and_running = [
      jnp.asarray(rng.uniform(0.2, 2, 4), jnp.float32) for _ in range(4)
  ]

  def two_layers(limits, x, scale, bias, running_statistic, running_dev_sq):
    for _ in range(2):
      x, _, _ = _renorm.renormalize_batch(
          measure,
          x * 2,
          scale,
          bias,
          running_statistic,
          running_dev_sq,
          None,
          reduction,
          _renorm.RenormLimits(*limits),
      )
    return x

  floats = (1 / 1.5, 1.5, 0.5)
  numpy_arrays = tuple(np.asarray(v, np.float32) for v in floats)
  # Floats and numpy arrays are closed over (constants to the trace), the
  # JAX arrays are the program's first argument (tracers).
  cases = {
      "floats": (functools.partial(two_layers, floats), ()),
      "arrays": (two_layers, (tuple(jnp.float32(v) for v in floats),)),
      "numpy": (functools.partial(two_layers, numpy_arrays), ()),
  }
  results = {}
  for kind, (program, leading) in cases.items():
    args = (*leading, x, *affine_and_running)
    calls = _layer_calls(program, *args)
    # Both layers bind the one jaxpr traced for their shape, or none nests.
    assert len(calls) == (0 if kind == "numpy" else 2), kind
    assert len({id(e.params["jaxpr"]) for e in calls}) == len(calls[:1])
    loss = lambda *a, program=program: jnp.sum(jnp.sin(program(*a)))
    x_scale_bias = tuple(range(len(leading), len(leading) + 3))
    results[kind] = (
        jax.jit(program)(*args),
        jax.jit(jax.grad(loss, argnums=x_scale_bias))(*args),
    )
  _same_bits(results["arrays"], results["floats"])
  _same_bits(results["numpy"], results["floats"])
