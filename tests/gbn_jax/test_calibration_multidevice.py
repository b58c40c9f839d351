"""calibration='normal' across 4 host devices: n counts every device's values.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (test_calibration.py
runs this file in a subprocess, and test_multidevice.py every multidevice file).
"""

import functools

import jax
import numpy as np
import pytest

from gbn_jax import GBatchNorm
from gbn_jax import get_measure

from tests.helpers import multidevice as md

pytestmark = pytest.mark.multidevice

md.require_devices()


def _x(shape=(16, 3, 3, 5), seed=0):
  return jax.random.normal(jax.random.key(seed), shape) * 2 + 0.5


_close = functools.partial(md.assert_trees_close, atol=1e-4)
_step = md.training_step
_sharded_step = md.sharded_training_step


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("measure", ["mad", "sqd1", "rbd", "wcd"])
def test_shard_map_calibrated_equals_single_device(measure, masked):
  x = _x()
  w = jax.random.normal(jax.random.key(1), x.shape)
  mask = (
      jax.random.bernoulli(jax.random.key(2), 0.7, x.shape) if masked else None
  )
  variables = GBatchNorm(measure=measure).init(jax.random.key(0), x, False)
  one = GBatchNorm(measure=measure, calibration="normal", momentum=0.0)
  want = _step(one, variables, x, w, mask)
  got = _sharded_step(one.clone(axis_name="batch"), variables, x, w, mask)
  _close(got, want)
  # The sharded layer divides by the constant of the global n (16 x 3 x 3
  # values per feature), not of one device's 4 x 3 x 3.
  raw = _step(GBatchNorm(measure=measure, momentum=0.0), variables, x, w, mask)
  ratio = raw[1]["batch_stats"]["var"] / got[1]["batch_stats"]["var"]
  if not masked:
    np.testing.assert_allclose(
        ratio, get_measure(measure).normal_constant(x.size // 5) ** 2, rtol=1e-5
    )


def test_shard_map_without_calibration_is_bit_identical():
  x = _x(seed=3)
  w = jax.random.normal(jax.random.key(4), x.shape)
  mask = jax.random.bernoulli(jax.random.key(5), 0.7, x.shape)
  for measure in ("sd", "rbd"):
    variables = GBatchNorm(measure=measure).init(jax.random.key(0), x, False)
    a = _sharded_step(
        GBatchNorm(measure=measure, axis_name="batch"), variables, x, w, mask
    )
    b = _sharded_step(
        GBatchNorm(measure=measure, axis_name="batch", calibration=None),
        variables,
        x,
        w,
        mask,
    )
    jax.tree.map(np.testing.assert_array_equal, a, b)
  # sd's constant is 1: calibrated sd is uncalibrated sd, bit for bit.
  variables = GBatchNorm().init(jax.random.key(0), x, False)
  a = _sharded_step(GBatchNorm(axis_name="batch"), variables, x, w, mask)
  b = _sharded_step(
      GBatchNorm(axis_name="batch", calibration="normal"), variables, x, w, mask
  )
  jax.tree.map(np.testing.assert_array_equal, a, b)
