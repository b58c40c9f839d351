"""Tests of gbn_jax._selection.radix (radix select, fixed pass count) against numpy.

The numpy oracle, the data kinds and the exactness suite shared with the
bracket select are in tests/helpers/selection.py; values must match bit for
bit, tie and "above" counts exactly.
Multi-device runs are in tests/gbn_jax/selection/test_radix_multidevice.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import radix

from tests.helpers.selection import ExactnessSuite
from tests.helpers.selection import assert_backend_ties
from tests.helpers.selection import assert_bitwise
from tests.helpers.selection import assert_half_precision_and_zero_gradient
from tests.helpers.selection import assert_local_ties
from tests.helpers.selection import assert_static_loops
from tests.helpers.selection import assert_vmap_and_axis_name_pooling
from tests.helpers.selection import columns
from tests.helpers.selection import data
from tests.helpers.selection import numpy_kth


@functools.partial(jax.jit, static_argnames=("axis", "digit_bits", "histogram"))
def select(x, k, axis, where=None, digit_bits=8, histogram="scatter"):
  return radix.kth_smallest_with_sums_accelerator(
      x, k, axis, where=where, digit_bits=digit_bits, histogram=histogram
  )


@functools.partial(jax.jit, static_argnames=("axis",))
def select_local_ties(x, k, axis, where=None):
  return radix.kth_smallest_accelerator(
      x, k, axis, where=where, return_ties=True
  )


def check(x, k, axis, where=None, **kw):
  """Value, ties and above against numpy; ``k`` per kept position (traced)."""
  _, _, kept_shape = columns(x, axis)
  k = np.broadcast_to(np.asarray(k, np.int32), kept_shape)
  value, ties, _, _, above = select(x, jnp.asarray(k), axis, where, **kw)
  want_value, want_ties, want_above = numpy_kth(x, k, axis, where)
  assert_bitwise(value, want_value)
  valid = ~np.isnan(want_value)
  np.testing.assert_array_equal(np.asarray(ties)[valid], want_ties[valid])
  np.testing.assert_array_equal(np.asarray(above)[valid], want_above[valid])


class TestExactness(ExactnessSuite):
  check = staticmethod(check)
  value = staticmethod(
      lambda x, k, axis, where=None: select(x, k, axis, where)[0]
  )


@pytest.mark.parametrize(
    "histogram,digit_bits",
    [
        ("scatter", 4),
        ("scatter", 16),
        ("scatter", 2),
        ("compare", 8),
        ("compare", 4),
    ],
)
def test_histogram_kernels_and_digit_widths(histogram, digit_bits):
  rng = np.random.default_rng(7)
  x = np.concatenate(
      [data("relu", (150, 3), 7), data("denormal", (150, 3), 8)], axis=1
  )
  x[:, 1] = data("inf", (150,), 9)
  where = rng.random(x.shape) < 0.8
  n = where.sum(axis=0)
  for alpha in (0.0, 0.3, 0.5, 1.0):
    k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
    check(x, k, (0,), where, digit_bits=digit_bits, histogram=histogram)


def test_local_ties_without_axis_name_are_the_ties():
  x = data("tiny_set", (500, 6), seed=2)
  assert_local_ties(select_local_ties, x, (1, 125, 250, 500))


@pytest.mark.parametrize("kind", ["normal", "offset", "inf", "relu"])
def test_sums_for_the_superquantile(kind):
  if kind == "offset":  # cancellation: E[(x - q)^+] is small next to x
    x = 1000 + data("normal", (3000, 5), seed=4)
  else:
    x = data(kind, (3000, 5), seed=4)
  where = np.random.default_rng(4).random(x.shape) < 0.9
  n = where.sum(axis=0)
  finite = np.abs(x[np.isfinite(x)])
  scale = float(finite.mean())
  for alpha in (0.0, 0.5, 0.95, 1.0):
    k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
    value, _, mean, excess, _ = select(x, jnp.asarray(k), (0,), where)
    x64 = np.where(where, x, 0).astype(np.float64)
    q = np.asarray(value, np.float64)[None]
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as wanted
      want_mean = x64.sum(axis=0) / n
      want_excess = np.where(where & (x > q), x64 - q, 0.0).sum(axis=0) / n
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(
        excess, want_excess, rtol=1e-5, atol=1e-6 * scale
    )


def test_fixed_pass_count_in_one_loop_body():
  # No data-dependent loop, and one traced pass body: 32 / digit_bits passes
  # over the keys, all but the first in the loop. The default digits are the
  # platform's (radix.default_histogram).
  kind, bits = radix.default_histogram()
  loop = 32 // bits - 1
  x = jnp.asarray(data("normal", (2000, 7), seed=0))
  where = jnp.asarray(np.random.default_rng(0).random(x.shape) < 0.5)
  k = jnp.full((7,), 300, jnp.int32)
  fns = [
      lambda v, m: radix.kth_smallest_accelerator(
          v, k, (0,), where=m, return_ties=True
      ),
      lambda v, m: radix.kth_smallest_with_sums_accelerator(
          v, k, (0,), where=m
      ),
  ]
  for fn in fns:
    assert_static_loops(fn, (x, where), [("scan", loop)])
  # A scatter histogram is one scatter-add in the first pass and one in the
  # loop body; compare histograms scatter nothing.
  jaxpr = str(jax.make_jaxpr(fns[0])(x, where))
  assert jaxpr.count("scatter-add") == (2 if kind == "scatter" else 0)
  # 4-bit digits: 8 passes, 7 of them in the loop.
  compare = lambda v, m: radix.kth_smallest_with_sums_accelerator(
      v, k, (0,), where=m, digit_bits=4, histogram="compare"
  )
  assert_static_loops(compare, (x, where), [("scan", 7)])
  # Pooled over a named (vmapped) axis: one psum per pass, still one loop.
  pooled = jax.vmap(
      lambda v: radix.kth_smallest_accelerator(v, 100, (0,), axis_name="b"),
      axis_name="b",
  )
  assert_static_loops(pooled, (x.reshape(4, 500, 7),), [("scan", loop)])


def test_vmap_and_vmap_axis_name_pooling():
  assert_vmap_and_axis_name_pooling(
      radix.kth_smallest_accelerator, rows=600, k=300, pooled_k=[1, 800, 1680]
  )


def test_half_precision_and_gradient():
  assert_half_precision_and_zero_gradient(radix.kth_smallest_accelerator)


def test_bad_arguments():
  x = jnp.ones((4, 3))
  with pytest.raises(ValueError, match="digit_bits"):
    radix.kth_smallest_accelerator(x, 1, (0,), digit_bits=3)
  with pytest.raises(ValueError, match="histogram"):
    radix.kth_smallest_accelerator(x, 1, (0,), histogram="sort")
  with pytest.raises(ValueError, match="axis"):
    radix.kth_smallest_accelerator(x, 1, (1, 0))
  with pytest.raises(TypeError, match="floating"):
    radix.kth_smallest_accelerator(jnp.ones((4, 3), jnp.int32), 1, (0,))


@pytest.mark.parametrize("gpu_compares", [False, True])
def test_dispatch_through_kth_smallest_and_the_quantile_layers(
    monkeypatch, gpu_compares
):
  """method="accelerator" reaches the radix select; the measures' values and
  gradients equal those of the sort reference."""
  import gbn_jax  # pylint: disable=g-import-not-at-top

  # Both answers on any backend: the GPU's compares keep denormals.
  monkeypatch.setattr(common, "compares_keep_denormals", lambda: gpu_compares)
  rng = np.random.default_rng(7)
  x = rng.standard_normal((300, 5)).astype(np.float32)
  x[::3, 1] = 0.0  # ties at the target
  got = dispatch.kth_smallest(jnp.asarray(x), 90, (0,), method="accelerator")
  np.testing.assert_array_equal(np.asarray(got), np.sort(x, axis=0)[89])
  value, ties = dispatch.kth_smallest(
      jnp.asarray(x), 90, (0,), method="accelerator", return_ties=True
  )
  assert_backend_ties(ties, x, value, gpu_compares)

  def measures(x):
    s, d = gbn_jax.get_measure("sqd1")(x, axis=0)
    return jnp.sum(s * jnp.arange(5.0)) + jnp.sum(d), (s, d)

  results = {}
  for method in ("sort", "accelerator"):
    # A fresh jit per method: the configuration applies where it is traced.
    with gbn_jax.selection.selection_config(method=method):
      (_, stats), grad = jax.jit(jax.value_and_grad(measures, has_aux=True))(
          jnp.asarray(x)
      )
    results[method] = (stats, grad)
  # atol: "accelerator" takes the fused sums (one pass, counts from the
  # radix), "sort" separate means; at q the gradient is O(1) terms that
  # cancel, so the two round apart by ulps of the largest term. A GPU sums
  # in another order than a CPU (this failed there with atol=1e-6, commit
  # b329b70), so the bound scales with the largest entry.
  for a, b in zip(
      jax.tree.leaves(results["sort"]), jax.tree.leaves(results["accelerator"])
  ):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())
