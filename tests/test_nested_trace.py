"""A GBN layer under a staging trace is traced once per shape (issue 36).

ResNet20 has 19 norm layers but 3 distinct input shapes, and a quantile
measure traces over a thousand equations per layer (a branch per kind of
platform). Under ``jit``/``make_jaxpr`` a layer is a nested ``jax.jit``,
traced once per (measure, reduction, shapes, dtypes, trace context); eagerly
it runs op by op. The tests count how often the measure function runs (a
counter in it) and check the values against numpy from the definitions
(tests/reference.py). That an eager ``vmap`` stays op by op, bit for bit
flax's BatchNorm, is tests/test_convert.py::test_linen_sd_is_flax_bit_for_bit.
"""

from collections.abc import Callable, Sequence
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gbn_jax
from gbn_jax import GBatchNorm
from gbn_jax._selection import common

import reference as ref

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
  """Dense then GBN, once per width: one input shape per distinct width."""

  measure: Any
  widths: Sequence[int]

  @nn.compact
  def __call__(self, x):
    for width in self.widths:
      x = nn.Dense(width)(x)
      x = GBatchNorm(use_running_average=False, measure=self.measure)(x)
    return x


def _calls_of(
    widths: Sequence[int], transform: Callable[[Any], Any], x: jax.Array
) -> tuple[int, Any]:
  """Runs of a fresh measure while ``transform(loss)`` runs once."""
  measure, calls = _counting_measure()
  model = _Stack(measure, tuple(widths))
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


def test_jit_traces_a_stack_of_layers_once_per_input_shape():
  x = _batch()
  # Six layers of one input shape, one of another: two traces, as for two
  # single layers (without nesting, seven).
  widths = (4, 4, 4, 4, 4, 4, 6)
  for transform in (jax.jit, lambda f: jax.jit(jax.grad(f))):
    one_layer, _ = _calls_of((4,), transform, x)
    stack, _ = _calls_of(widths, transform, x)
    assert one_layer >= 1
    assert stack == 2 * one_layer, (stack, one_layer)


def test_eager_calls_run_the_measure_every_time():
  x = _batch()
  # Op by op: every layer runs its measure, every call again (a nested jit
  # would have run it once, then cached it).
  measure, calls = _counting_measure()
  model = _Stack(measure, (4, 4, 4))
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
