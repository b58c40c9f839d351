"""Tests of gbn_jax._selection.bracket (sampled bracket + compaction) against numpy.

The exactness suite shared with the radix select (tests/helpers/selection.py:
data kinds, ranks, numpy oracle) runs on the bracket select; tests/gbn_jax/selection/test_dispatch.py
also runs ``kth_smallest(..., method="bracket")`` (a member of ``METHODS``).
Plus: the radix fallback runs exactly when the bracket misses or its buffer
overflows, and pooling over 4 host devices (shard_map, pmap groups) in a
subprocess. Values must match bit for bit, tie counts exactly (integer keys,
``-0.0 == +0.0``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gbn_jax._selection import bracket
from gbn_jax._selection import common
from gbn_jax._selection import radix
from gbn_jax._selection import sort

from tests.helpers.process import forced_host_devices
from tests.helpers.process import run_python_result
from tests.helpers.selection import ExactnessSuite
from tests.helpers.selection import assert_bitwise
from tests.helpers.selection import assert_dispatch_with_ties
from tests.helpers.selection import assert_half_precision_and_zero_gradient
from tests.helpers.selection import assert_static_loops
from tests.helpers.selection import assert_vmap_and_axis_name_pooling
from tests.helpers.selection import columns
from tests.helpers.selection import count_calls
from tests.helpers.selection import data
from tests.helpers.selection import numpy_kth


@functools.partial(jax.jit, static_argnames=("axis",))
def select(x, k, axis, where=None):
  return bracket.kth_smallest_bracket(x, k, axis, where=where, return_ties=True)


@jax.jit
def selection(rows, k, mask=None):
  """The raw :class:`BracketSelection` (with its ``missed`` flag)."""
  return bracket.bracket_kth_smallest(rows, mask, k, common.Comm(None, None))


def check(x, k, axis, where=None):
  """Value and tie count against numpy; ``k`` per kept position (traced)."""
  _, _, kept_shape = columns(x, axis)
  k = np.broadcast_to(np.asarray(k, np.int32), kept_shape)
  value, ties = select(x, jnp.asarray(k), axis, where)
  want_value, want_ties, _ = numpy_kth(x, k, axis, where)
  assert_bitwise(value, want_value)
  valid = ~np.isnan(want_value)
  assert ties.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(ties)[valid], want_ties[valid])


class TestExactness(ExactnessSuite):
  check = staticmethod(check)
  value = staticmethod(
      lambda x, k, axis, where=None: select(x, k, axis, where)[0]
  )


@pytest.mark.parametrize("kind", ["relu", "halves", "inf", "denormal", "wide"])
def test_large_batch_kinds_through_the_bracket(kind):
  # Enough rows that the sample is a strict subset (sample_size < N): the
  # bracket, the interior buffer and the endpoint ties all matter.
  n = 6000
  assert bracket.sample_size(n) < n
  x = data(kind, (n, 6), seed=11)
  x[:, 5] = -x[:, 5]  # ReLU zeros at the top end too
  for k in (1, 2, n // 5, n // 2, n // 2 + 1, (9 * n) // 10, n - 1, n):
    check(x, np.full(6, k), (0,))


def test_nan_inputs_sort_by_key_as_in_the_reference():
  # Outside the contract (no NaN), but the keys order NaNs as the sort does.
  x = data("normal", (6000, 6), seed=12)  # the shape above: no new compile
  x[::7, 0] = np.nan
  x[::5, 1] = -np.float32(np.nan)
  x[::3, 2] = np.nan
  x[::2, 3:] = np.nan
  for k in (1, 3000, 5900, 6000):
    want = sort.kth_smallest_reference(x, k, (0,))
    assert_bitwise(select(x, jnp.full((6,), k, jnp.int32), (0,))[0], want)


def test_plain_gaussian_never_falls_back():
  x = data("normal", (20000, 8), seed=2)
  for k in (1, 2, 100, 5000, 10000, 10001, 19999, 20000):
    sel = selection(jnp.asarray(x), jnp.full((8,), k, jnp.int32))
    assert not bool(sel.missed), k
    want, want_ties, _ = numpy_kth(x, k, (0,))
    assert_bitwise(common.key_to_output(sel.keys), want)
    np.testing.assert_array_equal(sel.local_ties, want_ties)


def test_heavy_zeros_on_an_endpoint_fit_without_fallback():
  # Half the rows are ReLU zeros: counted as an endpoint's ties, never buffered.
  x = data("relu", (20000, 4), seed=4)
  for k in (5000, 10000, 10500, 15000):
    sel = selection(jnp.asarray(x), jnp.full((4,), k, jnp.int32))
    assert not bool(sel.missed), k
    assert_bitwise(common.key_to_output(sel.keys), numpy_kth(x, k, (0,))[0])


def _adversarial(kind, n=20000, n_cols=3, seed=0):
  """Data on which the static sample misleads the bracket."""
  rng = np.random.default_rng(seed)
  idx = bracket.sample_rows(n)
  x = rng.standard_normal((n, n_cols)).astype(np.float32)
  if kind == "miss":
    # Sampled rows far above the rest: the bracket lies above the target.
    x[idx] += 1000
  else:  # "overflow": unsampled rows crowd between two sampled values
    x[idx] = np.linspace(-1, 1, idx.size, dtype=np.float32)[:, None]
    rest = np.setdiff1d(np.arange(n), idx)
    x[rest] = rng.uniform(-1e-3, 1e-3, (rest.size, n_cols)).astype(np.float32)
  return x


@pytest.mark.parametrize("kind", ["miss", "overflow"])
def test_fallback_runs_on_a_miss_or_an_overflow(kind, monkeypatch):
  n = 20000
  x = _adversarial(kind, n)
  k = jnp.asarray([1, n // 2, n], jnp.int32)
  # Counted at trace time: the fallback branch is in the program.
  calls = count_calls(monkeypatch, radix, "radix_kth_smallest")
  sel = jax.jit(
      lambda r, k: bracket.bracket_kth_smallest(
          r, None, k, common.Comm(None, None)
      )
  )(jnp.asarray(x), k)
  assert calls and bool(sel.missed)
  want, want_ties, _ = numpy_kth(x, np.asarray(k), (0,))
  assert_bitwise(common.key_to_output(sel.keys), want)
  np.testing.assert_array_equal(sel.local_ties, want_ties)
  if kind == "overflow":
    # The interior really exceeds the buffer (not merely a missed bracket).
    assert n - bracket.sample_size(n) > bracket.buffer_size(n)
  check(x, np.asarray(k), (0,))


@pytest.mark.parametrize("unique", [True, False])
def test_compaction_keeps_row_order_and_counts_overflow(unique):
  rng = np.random.default_rng(5)
  keys = rng.integers(-50, 50, (200, 3)).astype(np.int32)
  interior = rng.random((200, 3)) < np.asarray(
      [0.05, 0.2, 0.5]
  )  # 2nd, 3rd overflow
  buf, count = jax.jit(lambda k, i: bracket._compact(k, i, 16, unique))(
      keys, interior
  )
  np.testing.assert_array_equal(count, interior.sum(0))
  for f in range(3):
    kept = keys[interior[:, f], f][:16]
    np.testing.assert_array_equal(buf[: kept.size, f], kept)
    assert np.all(np.asarray(buf[kept.size :, f]) == np.iinfo(np.int32).max)


def test_one_cond_no_data_dependent_loop():
  x = jnp.asarray(data("normal", (2000, 7), seed=0))
  where = jnp.asarray(np.random.default_rng(0).random(x.shape) < 0.5)
  k = jnp.full((7,), 300, jnp.int32)
  fn = lambda v, m: bracket.kth_smallest_bracket(
      v, k, (0,), where=m, return_ties=True
  )
  # The cond picks the radix select on a miss, whose passes after the first
  # are one loop of static length (32 / digit_bits - 1, the platform's digits).
  _, bits = radix.default_histogram()
  assert_static_loops(
      fn, (x, where), [("cond", None), ("scan", 32 // bits - 1)]
  )


def test_vmap_and_vmap_axis_name_pooling():
  assert_vmap_and_axis_name_pooling(
      bracket.kth_smallest_bracket, rows=3000, k=1500, pooled_k=[1, 4000, 8400]
  )


def test_half_precision_float64_and_gradient():
  assert_half_precision_and_zero_gradient(bracket.kth_smallest_bracket)


def test_bad_arguments():
  with pytest.raises(ValueError, match="axis"):
    bracket.kth_smallest_bracket(jnp.ones((4, 3)), 1, (1, 0))
  with pytest.raises(TypeError, match="floating"):
    bracket.kth_smallest_bracket(jnp.ones((4, 3), jnp.int32), 1, (0,))


def test_static_sample_and_buffer_sizes():
  for n in (1, 3, 255, 256, 257, 1000, 6000, 1 << 20):
    idx = bracket.sample_rows(n)
    assert idx.size == bracket.sample_size(n) <= n
    assert np.all(np.diff(idx) > 0) and idx[0] >= 0 and idx[-1] < n
    assert bracket.buffer_size(n) <= n
  # A million rows (the conv shapes): two sorts of a few percent of the rows.
  assert bracket.sample_size(1 << 20) < 25000
  assert bracket.buffer_size(1 << 20) < 50000
  assert bracket.buffer_size(1 << 20, 4) < bracket.buffer_size(1 << 20)


@pytest.mark.parametrize("gpu_compares", [False, True])
def test_dispatch_through_kth_smallest(monkeypatch, gpu_compares):
  assert_dispatch_with_ties("bracket", monkeypatch, gpu_compares)


_SHARD_MAP_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from gbn_jax._selection import bracket, sort
mesh = Mesh(np.array(jax.devices()[:4]), ("b",))
rng = np.random.default_rng(0)
x = rng.standard_normal((4 * 2500, 6, 3)).astype(np.float32)
x[:, :, 1] = np.maximum(x[:, :, 1], 0)  # ReLU zeros
x[:, :, 2] = np.round(x[:, :, 2] * 2) / 2  # few distinct values
where = rng.random(x.shape) < 0.8
k = np.asarray([[1, 900, 7800], [2, 4000, 3000], [7500, 7000, 4], [1, 2, 3],
                [6000, 17, 8], [5, 6, 9000]], np.int32)  # n is about 8000

def local(xs, ws):
  a = bracket.kth_smallest_bracket(xs, 5000, (0,), axis_name="b")
  b, ties = bracket.kth_smallest_bracket(
      xs, jnp.asarray(k), (0,), where=ws, axis_name="b", return_ties=True)
  c = bracket.kth_smallest_bracket(xs, 1000, (0,))  # no axis_name: this device
  return a, b, ties[None], c[None]

fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("b"), P("b")),
                           out_specs=(P(), P(), P("b"), P("b"))))
a, b, ties, c = fn(x, where)
def same(u, v):
  return np.array_equal(np.asarray(u, np.float32).view(np.int32),
                        np.asarray(v, np.float32).view(np.int32))
assert same(a, sort.kth_smallest_reference(x, 5000, (0,)))
for d, xd in enumerate(np.split(x, 4)):
  assert same(c[d], sort.kth_smallest_reference(xd, 1000, (0,))), d
want = np.asarray(sort.kth_smallest_reference(x, k, (0,), where=where))
want = np.where(k > where.sum(0), np.nan, want)  # the reference gives the +inf fill
assert same(b, want)
for d, (xd, wd) in enumerate(zip(np.split(x, 4), np.split(where, 4))):
  valid = ~np.isnan(want)
  assert np.array_equal(ties[d][valid], ((xd == want[None]) & wd).sum(0)[valid]), d
g = jax.pmap(lambda xs: bracket.kth_smallest_bracket(
    xs, 2500, (0,), axis_name="b", axis_index_groups=[[0, 1], [2, 3]]),
    axis_name="b")(x.reshape(4, 2500, 6, 3))
assert same(g[0], sort.kth_smallest_reference(x[:5000], 2500, (0,))) and same(g[1], g[0])
assert same(g[2], sort.kth_smallest_reference(x[5000:], 2500, (0,))) and same(g[3], g[2])
print("OK")
"""


def test_shard_map_and_pmap_groups_on_four_host_devices():
  proc = run_python_result(
      _SHARD_MAP_SCRIPT, env=forced_host_devices(4), timeout=300
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
