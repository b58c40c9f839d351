"""benchmarks/step/bench_lenet_step.py's pieces: its model variants are exact.

Every variant the benchmark times must give the real LeNet's loss (the train
step's), gradients and batch statistics up to float32 summation order
(relative 1e-5; a 1e-4 error in one op fails), for BatchNorm and a quantile
norm; the benchmark's child must time the train step itself, and the profile
must attribute the step's ops to layers.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.step import bench_lenet_step
from benchmarks.step import lenet_children
from benchmarks.step import lenet_profile
from benchmarks.step import lenet_setup
from benchmarks.step import lenet_variants
from benchmarks.step import step_profile

pytestmark = pytest.mark.slow  # about 15-40 s in all (compilations)

TOL = 1e-5
VARIANTS = [v for v in lenet_variants.VARIANTS if v != "base"]


@pytest.mark.parametrize("norm", ["bn", "sqd2"])
def test_variants_match_the_real_model(norm):
  rows = lenet_setup.check_variants(norm, VARIANTS, batch=8, seed=1)
  assert set(rows) == set(VARIANTS)
  for variant, diffs in rows.items():
    assert all(d <= TOL for d in diffs.values()), (variant, diffs)


def test_pools_agree_after_relu_even_on_ties():
  # Zeros after the ReLU tie in most windows; positive values tie too here.
  x = jnp.asarray(
      np.random.default_rng(0).integers(-3, 3, (2, 6, 8, 3)), jnp.float32
  )
  g = jax.random.normal(jax.random.key(0), (2, 3, 4, 3))
  pools = {
      "window": lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)),
      "reshape": lenet_variants.max_pool_2x2,
      "mask": lenet_variants.max_pool_2x2_mask,
  }
  outs, grads = {}, {}
  for name, pool in pools.items():
    y, vjp = jax.vjp(lambda x: pool(nn.relu(x)), x)
    outs[name], grads[name] = y, vjp(g)[0]
  for name in ("reshape", "mask"):
    np.testing.assert_array_equal(outs[name], outs["window"])
    np.testing.assert_allclose(grads[name], grads["reshape"], rtol=1e-6)
  # Without the ReLU, positive ties split the gradient (reduce_window gives
  # it all to one): the same total per window.
  _, vjp = jax.vjp(lenet_variants.max_pool_2x2_mask, x)
  _, vjp_w = jax.vjp(pools["window"], x)
  total = lambda d: d.reshape(2, 3, 2, 4, 2, 3).sum(axis=(2, 4))
  np.testing.assert_allclose(total(vjp(g)[0]), total(vjp_w(g)[0]), rtol=1e-6)


def test_conv_formulations_and_col2im():
  x = jax.random.normal(jax.random.key(1), (3, 12, 12, 4))
  k = jax.random.normal(jax.random.key(2), (5, 5, 4, 6))
  g = jax.random.normal(jax.random.key(3), (3, 8, 8, 6))
  dp = jax.random.normal(jax.random.key(4), (3, 8, 8, 100))

  @jax.jit
  def run():
    out = []
    for fn in (
        lenet_variants._conv_nhwc,
        lenet_variants.conv_im2col_wgrad,
        lenet_variants.conv_matmul_bwd,
    ):
      y, vjp = jax.vjp(fn, x, k)
      out.append((y, *vjp(g)))
    # col2im is im2col's transpose: <im2col(x), dp> = <x, col2im(dp)>
    dots = (
        jnp.vdot(lenet_variants.im2col(x, 5, 5), dp),
        jnp.vdot(x, lenet_variants.col2im(dp, 5, 5)),
    )
    return out, dots

  (ref, *others), (lhs, rhs) = run()
  for got in others:
    for a, b in zip(got, ref):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(lhs, rhs, rtol=1e-5)


def test_child_times_the_real_step_and_compares_variants():
  result = lenet_children.child_time(
      {
          "norms": ["bn"],
          "variants": ["base", "pool_mask"],
          "batch": 8,
          "runs": 1,
          "warmup": 1,
      }
  )
  row = result["norms"]["bn"]
  assert row["devices"] >= 1
  base, variant = row["variants"]["base"], row["variants"]["pool_mask"]
  assert base["median_ms"] > 0 and base["ratio_to_base"] == 1
  assert variant["loss_rel"] <= TOL and variant["update_rel"] <= 1e-4


def test_profile_attributes_ops_to_layers():
  setup = lenet_setup.Setup("bn", batch=8)
  compiled, state, _ = setup.compile("base")
  index = lenet_profile.hlo_index(compiled.as_text())
  parts = {info["part"] for info in index.values()}
  assert {"conv1", "conv2", "norm1", "fc1", "pool"} <= parts
  prof = step_profile.profile_compiled(index, setup.runner(compiled, state), 1)
  assert prof["op_wall_ms_per_step"] > 0
  assert abs(sum(v["share"] for v in prof["by_part"].values()) - 1) < 1e-6
  # the weight-gradient convolutions, which carry no op_name, are found
  assert any(p.startswith("conv2/backward") for p in prof["by_part"])


def test_command_line_defaults_and_quick():
  args = bench_lenet_step.parse_args([])
  assert args.sections == ["variants", "profile", "flags", "final"]
  assert (args.batch, args.runs, args.norms) == (1000, 7, ["bn", "sqd2"])
  assert args.flag_sets == list(lenet_children.DEFAULT_FLAG_SETS)
  quick = bench_lenet_step.parse_args(["--quick", "--devices", "1", "2"])
  assert (quick.batch, quick.runs, quick.warmup, quick.devices) == (
      64,
      2,
      1,
      [2],
  )
  assert quick.flag_sets == ["ynn_off"]
