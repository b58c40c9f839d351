"""Tests of gbn_jax._selection.pallas (radix select as a Pallas kernel) against numpy.

On this CPU the kernel runs in Pallas's interpret mode: the exactness suite
shared with the radix and bracket selects (tests/helpers/selection.py: data
kinds, ranks, numpy oracle) runs on it, values bit for bit, tie and "above"
counts exactly; the sums of its last pass against numpy written from the
definitions; ``method="pallas_experimental"`` through ``kth_smallest`` and a GBatchNorm
sqd layer against the default method; and the CUDA lowering (Triton) of the
same functions, which needs no GPU to export.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax
from gbn_jax import _quantiles
from gbn_jax import selection
from gbn_jax._selection import common
from gbn_jax._selection import dispatch
from gbn_jax._selection import pallas

from tests.helpers.process import run_python
from tests.helpers.selection import TRITON_TARGET
from tests.helpers.selection import ExactnessSuite
from tests.helpers.selection import assert_bitwise
from tests.helpers.selection import assert_dispatch_with_ties
from tests.helpers.selection import assert_local_ties
from tests.helpers.selection import columns
from tests.helpers.selection import count_calls
from tests.helpers.selection import cuda_text
from tests.helpers.selection import data
from tests.helpers.selection import numpy_kth


@functools.partial(
    jax.jit, static_argnames=("axis", "digit_bits", "block_rows", "block_cols")
)
def select(
    x, k, axis, where=None, digit_bits=4, block_rows=None, block_cols=None
):
  return pallas.kth_smallest_with_sums_pallas(
      x,
      k,
      axis,
      where=where,
      digit_bits=digit_bits,
      block_rows=block_rows,
      block_cols=block_cols,
  )


@functools.partial(jax.jit, static_argnames=("axis",))
def select_local_ties(x, k, axis, where=None):
  return pallas.kth_smallest_pallas(x, k, axis, where=where, return_ties=True)


def check(x, k, axis, where=None, **kw):
  """Value, ties, above and the sums against numpy; ``k`` per kept position."""
  cols, mask, kept_shape = columns(x, axis, where)
  k = np.broadcast_to(np.asarray(k, np.int32), kept_shape)
  value, ties, mean, excess, above = select(
      x, jnp.asarray(k), axis, where, **kw
  )
  want_value, want_ties, want_above = numpy_kth(x, k, axis, where)
  assert_bitwise(value, want_value)
  valid = ~np.isnan(want_value)
  np.testing.assert_array_equal(np.asarray(ties)[valid], want_ties[valid])
  np.testing.assert_array_equal(np.asarray(above)[valid], want_above[valid])
  # The sums in float64 from the definitions, where they are finite.
  q = want_value.reshape(-1)
  with np.errstate(invalid="ignore", over="ignore"):
    x64 = np.where(mask, cols, 0.0).astype(np.float64)
    n = mask.sum(axis=0)
    want_mean = x64.sum(axis=0) / n
    gap = np.where(mask & (cols > q[None]), x64 - q[None], 0.0)
    want_excess = gap.sum(axis=0) / n
    scale = np.where(mask, np.abs(x64), 0.0).sum(axis=0) / n
  finite = valid.reshape(-1) & np.isfinite(want_excess) & np.isfinite(scale)
  # float32 sums of |x| beyond its range overflow (as radix_sums' do).
  finite &= np.isfinite(want_mean) & (scale * n < np.finfo(np.float32).max)
  for got, want in ((mean, want_mean), (excess, want_excess)):
    got = np.asarray(got, np.float64).reshape(-1)
    err = np.abs(got[finite] - want[finite])
    assert np.all(err <= 1e-5 * scale[finite] + 1e-30), (got, want)


class TestExactness(ExactnessSuite):
  check = staticmethod(check)
  value = staticmethod(
      lambda x, k, axis, where=None: select(x, k, axis, where)[0]
  )


@pytest.mark.parametrize(
    "digit_bits,block_rows,block_cols", [(2, 8, 4), (8, 64, 2), (4, 4, 1)]
)
def test_digit_widths_and_blocks_with_padding(
    digit_bits, block_rows, block_cols
):
  # 150 rows and 7 columns: neither a multiple of the blocks, so padded rows
  # and columns must never be counted or summed.
  rng = np.random.default_rng(7)
  x = np.concatenate(
      [data("relu", (150, 3), 7), data("denormal", (150, 3), 8)], axis=1
  )
  x = np.concatenate([x, data("inf", (150, 1), 9)], axis=1)
  where = rng.random(x.shape) < 0.8
  n = where.sum(axis=0)
  kw = dict(digit_bits=digit_bits, block_rows=block_rows, block_cols=block_cols)
  for alpha in (1e-6, 0.3, 0.5, 0.999999):
    k = np.maximum(np.ceil(alpha * n), 1).astype(np.int32)
    check(x, k, (0,), **kw)
    check(x, k, (0,), where, **kw)


@pytest.mark.parametrize("n", [1, 2, 33])
def test_k_one_and_k_n_on_tiny_batches(n):
  x = data("halves", (n, 5), seed=n)
  for k in (1, n):
    check(x, np.full(5, k), (0,))


def test_local_ties_are_this_devices_key_counts():
  x = data("signed_zero", (400, 6), seed=2)
  assert_local_ties(select_local_ties, x, (1, 130, 200, 400))


def test_vmap_axis_name_pools_histograms_and_sums():
  x = data("relu", (4, 700, 3), seed=6)
  where = np.random.default_rng(6).random(x.shape) < 0.7
  k = jnp.asarray([1, 900, 1900], jnp.int32)
  out = jax.jit(
      jax.vmap(
          lambda v, m: pallas.kth_smallest_with_sums_pallas(
              v, k, (0,), where=m, axis_name="b", return_count=True
          ),
          axis_name="b",
      )
  )(x, where)
  flat_x, flat_w = x.reshape(-1, 3), where.reshape(-1, 3)
  want_value, want_ties, want_above = numpy_kth(flat_x, k, (0,), flat_w)
  for d in range(4):
    assert_bitwise(out[0][d], want_value)
    np.testing.assert_array_equal(out[1][d], want_ties)
    np.testing.assert_array_equal(out[4][d], want_above)
    np.testing.assert_array_equal(out[5][d], flat_w.sum(axis=0))
  want_mean = np.where(flat_w, flat_x, 0).sum(0, dtype=np.float64) / flat_w.sum(
      0
  )
  np.testing.assert_allclose(out[2][0], want_mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gpu_compares", [False, True])
def test_dispatch_through_kth_smallest(monkeypatch, gpu_compares):
  assert "pallas_experimental" in dispatch.METHODS
  assert_dispatch_with_ties("pallas_experimental", monkeypatch, gpu_compares)


def test_never_a_default():
  for rows in (10, 100_000, 10_000_000):
    with common.platform_scope(common.GPU):
      assert dispatch.default_method(rows) != "pallas_experimental"
    with common.platform_scope(common.CPU):
      assert dispatch.default_method(rows) != "pallas_experimental"


def test_gbatchnorm_sqd2_equals_the_default_method(monkeypatch):
  calls = count_calls(monkeypatch, pallas, "kth_smallest_with_sums_pallas")
  rng = np.random.default_rng(3)
  x = rng.standard_normal((64, 6)).astype(np.float32)
  x[:, 2] = np.maximum(x[:, 2], 0)  # ReLU zeros: ties at the quantile
  x = jnp.asarray(x)
  norm = gbn_jax.GBatchNorm(use_running_average=False, measure="sqd2")
  variables = norm.init(jax.random.key(0), x)

  def loss(x):
    y, _ = norm.apply(variables, x, mutable=["batch_stats"])
    return jnp.sum(jnp.sin(y) * jnp.arange(1, 7)), y

  step = lambda: jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
  (_, y0), g0 = step()
  assert not calls
  with selection.selection_config(method="pallas_experimental"):
    (_, y), g = step()
  assert calls  # the kernel's fused sums, not the unfused path
  np.testing.assert_allclose(
      np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
      np.asarray(g), np.asarray(g0), rtol=1e-4, atol=1e-5
  )


def test_superquantile_through_quantiles_module():
  x = data("normal", (500, 4), seed=4)
  with selection.selection_config(method="pallas_experimental"):
    got = jax.jit(lambda v: _quantiles.superquantile(v, 0.9, axis=0))(x)
  q = np.sort(x, axis=0)[449]
  want = q + np.maximum(x - q, 0).mean(axis=0, dtype=np.float64) / 0.1
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_argument():
  x = jnp.ones((8, 3))
  with pytest.raises(ValueError, match="digit_bits"):
    pallas.kth_smallest_pallas(x, 1, (0,), digit_bits=16)
  with pytest.raises(ValueError, match="block_rows"):
    pallas.kth_smallest_pallas(x, 1, (0,), block_rows=12)
  with pytest.raises(ValueError, match="block_cols"):
    pallas.kth_smallest_pallas(x, 1, (0,), block_cols=0)
  with pytest.raises(ValueError, match="axis"):
    pallas.kth_smallest_pallas(x, 1, (1, 0))
  with pytest.raises(TypeError, match="floating"):
    pallas.kth_smallest_pallas(jnp.ones((4, 3), jnp.int32), 1, (0,))


def test_cuda_lowering_compiles_the_kernel_cpu_lowering_interprets_it():
  spec = jax.ShapeDtypeStruct((1000, 40), jnp.float32)
  mask = jax.ShapeDtypeStruct((1000, 40), jnp.bool_)
  fn = lambda x, m: pallas.kth_smallest_with_sums_pallas(x, 100, (0,), where=m)
  # The first pass, the loop's pass and the summing last pass: three Triton
  # kernels (two without sums) whatever the passes, no interpreted copy.
  assert cuda_text(fn, spec, mask).count(f"@{TRITON_TARGET}") == 3
  chosen = lambda x: dispatch.kth_smallest(
      x, 500, (0,), method="pallas_experimental"
  )
  assert cuda_text(chosen, spec).count(f"@{TRITON_TARGET}") == 2
  cpu = jax.export.export(jax.jit(chosen), platforms=["cpu"])(spec)
  assert TRITON_TARGET not in cpu.mlir_module()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["normal", "relu", "denormal"])
def test_hundred_thousand_rows(kind):
  x = data(kind, (100_000, 3), seed=10)
  for k in (1, 50_000, 99_999, 100_000):
    check(x, np.full(3, k), (0,))


_SHARD_MAP_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from gbn_jax._selection import pallas, sort
mesh = Mesh(np.array(jax.devices()[:4]), ("b",))
rng = np.random.default_rng(0)
x = rng.standard_normal((4 * 600, 5)).astype(np.float32)
x[:, 1] = np.maximum(x[:, 1], 0)  # ReLU zeros
where = rng.random(x.shape) < 0.8
k = np.asarray([1, 900, 1500, 1800, 7], np.int32)

def local(xs, ws):
  value, ties, mean, excess, above = pallas.kth_smallest_with_sums_pallas(
      xs, jnp.asarray(k), (0,), where=ws, axis_name="b")
  _, local_ties = pallas.kth_smallest_pallas(
      xs, jnp.asarray(k), (0,), where=ws, axis_name="b", return_ties=True)
  return value, ties, mean, excess, above, local_ties[None]

fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("b"), P("b")),
                           out_specs=(P(), P(), P(), P(), P(), P("b"))))
value, ties, mean, excess, above, local_ties = fn(x, where)
want = np.asarray(sort.kth_smallest_reference(x, k, (0,), where=where))
assert np.array_equal(np.asarray(value).view(np.int32), want.view(np.int32))
assert np.array_equal(ties, ((x == want) & where).sum(0))
assert np.array_equal(above, (~(x <= want) & where).sum(0))
for d, (xd, wd) in enumerate(zip(np.split(x, 4), np.split(where, 4))):
  assert np.array_equal(local_ties[d], ((xd == want) & wd).sum(0)), d
n = where.sum(0)
np.testing.assert_allclose(mean, np.where(where, x, 0).sum(0) / n, rtol=1e-5)
gap = np.where(where & (x > want), x.astype(np.float64) - want, 0).sum(0) / n
np.testing.assert_allclose(excess, gap, rtol=1e-5, atol=1e-7)
g = jax.pmap(lambda xs: pallas.kth_smallest_pallas(
    xs, 600, (0,), axis_name="b", axis_index_groups=[[0, 1], [2, 3]]),
    axis_name="b")(x.reshape(4, 600, 5))
for d, rows in ((0, x[:1200]), (3, x[1200:])):
  assert np.array_equal(g[d], sort.kth_smallest_reference(rows, 600, (0,)))
# Compiled for CUDA, the kernel's outputs are typed device-varying (check_vma).
checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
# Four of a named card: Triton needs its compute capability.
gpus = jax.sharding.AbstractMesh((4,), ("b",), (jax.sharding.AxisType.Auto,),
                                 abstract_device=(
    jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                platform="gpu")))
on_gpus = jax.jit(jax.shard_map(local, mesh=gpus, in_specs=(P("b"), P("b")),
                                out_specs=(P(), P(), P(), P(), P(), P("b"))))
with jax.sharding.use_abstract_mesh(gpus):
  cuda = jax.export.export(on_gpus, platforms=["cuda"], disabled_checks=checks)(
      jax.ShapeDtypeStruct(x.shape, jnp.float32),
      jax.ShapeDtypeStruct(x.shape, jnp.bool_))
assert cuda.mlir_module().count("@__gpu$xla.gpu.triton") == 5  # 3 with sums + 2
print("OK")
"""


@pytest.mark.slow
def test_shard_map_and_pmap_groups_on_four_host_devices():
  flags = os.environ.get("XLA_FLAGS", "")
  env = {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4"}
  assert "OK" in run_python(_SHARD_MAP_SCRIPT, env)
