"""Half precision: what ``force_float32_reductions`` does, as the README says.

bfloat16 features of mean 100 and standard deviation 1 (where a bf16 ulp is
0.5): the statistics are checked against float64 numpy computed from their
definitions on the same bf16 values, and ``sd`` against flax's BatchNorm.

* ``force_float32_reductions=True`` (the default): S and D to float32
  rounding; ``sd`` with ``use_fast_variance`` (E[x^2] - E[x]^2) is flax's
  BatchNorm bit for bit, cancellation included.
* ``False``: reductions in bf16, as flax's. ``sd`` with fast variance then
  collapses exactly as flax's BatchNorm does; ``sd`` without it, ``mad`` and
  ``sqd2`` stay within a few bf16 roundings.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gbn_jax

SHAPE = (4096, 4)


@pytest.fixture(scope="module")
def x():
  return jnp.asarray(
      100 + np.random.default_rng(0).standard_normal(SHAPE), jnp.bfloat16
  )


def _reference(x, measure: str) -> tuple[np.ndarray, np.ndarray]:
  """``(S, D)`` per feature in float64, from the definitions."""
  xr = np.asarray(x, np.float64)  # the bf16 values, exactly
  mean = xr.mean(0)
  if measure == "sd":
    return mean, xr.std(0)
  if measure == "mad":
    return mean, np.abs(xr - mean).mean(0)
  assert measure == "sqd2"  # alpha 0.5: q = the ceil(n/2)-th smallest
  q = np.sort(xr, 0)[int(np.ceil(0.5 * len(xr))) - 1]
  superquantile = q + np.maximum(xr - q, 0).mean(0) / 0.5
  return q, superquantile - mean


def _apply(module, x):
  variables = module.init(jax.random.key(0), x)
  y, state = module.apply(variables, x, mutable=["batch_stats"])
  stats = state["batch_stats"]  # momentum 0: this batch's S and D^2
  return (
      np.asarray(y.astype(jnp.float32), np.float64),
      y.dtype,
      np.asarray(stats["mean"], np.float64),
      np.sqrt(np.asarray(stats["var"], np.float64)),
  )


def _gbn(measure, f32, fast=False, **kw):
  return gbn_jax.GBatchNorm(
      measure=measure,
      use_running_average=False,
      momentum=0.0,
      force_float32_reductions=f32,
      use_fast_variance=fast,
      **kw,
  )


def _flax(f32, fast, **kw):
  return nn.BatchNorm(
      use_running_average=False,
      momentum=0.0,
      force_float32_reductions=f32,
      use_fast_variance=fast,
      **kw,
  )


@pytest.mark.parametrize("measure", ["sd", "mad", "sqd2"])
def test_float32_reductions_match_float64(x, measure):
  _, _, s, d = _apply(_gbn(measure, True), x)
  s_ref, d_ref = _reference(x, measure)
  np.testing.assert_allclose(s, s_ref, rtol=1e-6)
  np.testing.assert_allclose(d, d_ref, rtol=1e-5)


@pytest.mark.parametrize("f32", [True, False])
@pytest.mark.parametrize("fast", [True, False])
def test_sd_is_flax_batchnorm_in_every_mode(x, f32, fast):
  y, dtype, s, d = _apply(_gbn("sd", f32, fast), x)
  y_flax, dtype_flax, s_flax, d_flax = _apply(_flax(f32, fast), x)
  np.testing.assert_array_equal(y, y_flax)
  np.testing.assert_array_equal(s, s_flax)
  np.testing.assert_array_equal(d, d_flax)
  assert dtype == dtype_flax


def test_fast_variance_cancellation_is_flax_own(x):
  """E[x^2] - E[x]^2 at mean 100: a few digits lost in float32, everything
  in bf16 (flax's BatchNorm likewise; the test above has them equal)."""
  _, d_ref = _reference(x, "sd")
  y_ref = np.abs(np.asarray(x, np.float64) - _reference(x, "sd")[0]) / d_ref
  _, _, _, d32 = _apply(_gbn("sd", True, fast=True), x)
  assert np.abs(d32 / d_ref - 1).max() < 5e-3
  y16, _, _, _ = _apply(_flax(False, True), x)
  assert np.abs(y16).mean() > 10 * y_ref.mean()  # the collapse, flax's


@pytest.mark.parametrize(
    "measure, d_rtol", [("sd", 5e-3), ("mad", 1e-2), ("sqd2", 5e-2)]
)
def test_bf16_reductions_stay_close(x, measure, d_rtol):
  _, _, s, d = _apply(_gbn(measure, False), x)
  s_ref, d_ref = _reference(x, measure)
  np.testing.assert_allclose(d, d_ref, rtol=d_rtol)
  if measure == "sqd2":
    np.testing.assert_array_equal(s, s_ref)  # an element: selected exactly
  else:
    np.testing.assert_allclose(s, s_ref, atol=0.25)  # half a bf16 ulp at 100
  # Far from the fast variance's collapse: D is what it should be.
  assert np.abs(d / d_ref - 1).max() > 1e-6  # but not float32-exact


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, jnp.float32])
def test_output_dtype_is_flax_batchnorm_s(x, dtype):
  for measure in ("mad", "sqd2"):
    _, got, _, _ = _apply(_gbn(measure, True, dtype=dtype), x)
    _, want, _, _ = _apply(_flax(True, False, dtype=dtype), x)
    assert got == want, (measure, dtype)


def _figures() -> None:
  """Prints the README's figures:
  ``python -m tests.gbn_jax.test_layer_half_precision``."""
  x = jnp.asarray(
      100 + np.random.default_rng(0).standard_normal(SHAPE), jnp.bfloat16
  )
  y_ref = (
      np.abs(np.asarray(x, np.float64) - _reference(x, "sd")[0]).mean(0)
      / _reference(x, "sd")[1]
  )
  print(
      f"bf16, mean 100, std 1, {SHAPE}; float64 mean |y| of sd: "
      f"{y_ref.mean():.3f}"
  )
  for f32 in (True, False):
    print(f"force_float32_reductions={f32}:")
    for fast in (True, False):
      y, _, _, _ = _apply(_flax(f32, fast), x)
      print(
          f"  flax BatchNorm, use_fast_variance={fast}: mean |y| "
          f"{np.abs(y).mean():.3f}"
      )
    for measure, fast in (
        ("sd", True),
        ("sd", False),
        ("mad", False),
        ("sqd2", False),
        ("bpoe", False),
    ):
      y, _, _, d = _apply(_gbn(measure, f32, fast), x)
      text = (
          f"  {measure}"
          + (f", use_fast_variance={fast}" if measure == "sd" else "")
          + f": mean |y| {np.abs(y).mean():.3f}"
      )
      if measure != "bpoe":
        text += (
            f", max |D / D_float64 - 1| "
            f"{np.abs(d / _reference(x, measure)[1] - 1).max():.2g}"
        )
      print(text)


if __name__ == "__main__":
  _figures()
