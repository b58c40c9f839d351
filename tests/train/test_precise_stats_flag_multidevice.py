"""The training loop's --precise-stats evaluation across 4 host devices.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4
(tests/train/test_multidevice.py does this in a subprocess).
"""

import jax
import numpy as np
import pytest

from train.loop import sharding
from train.loop import trainer as train

from tests.helpers import multidevice as md
from tests.helpers.multidevice import NDEV
from tests.helpers.precise_programs import compile_precise_run
from tests.helpers.precise_programs import precise_evaluation
from tests.helpers.training import TINY
from tests.helpers.training import small_dataset

pytestmark = pytest.mark.multidevice

md.require_devices()


def test_train_precise_evaluation_four_devices_equal_one():
  """The training loop's --precise-stats evaluation on a 4-device Auto mesh."""
  ds = small_dataset()
  config = train.resolve(TINY.replace(norm="sqd1"))
  results = []
  for count in (1, NDEV):
    run = compile_precise_run(
        config, ds, sharding.make_mesh(jax.devices()[:count])
    )
    run.step(0)
    results.append(precise_evaluation(run))
  one, four = results
  np.testing.assert_allclose(four["loss_sum"], one["loss_sum"], rtol=1e-4)
  assert abs(int(four["errors"]) - int(one["errors"])) <= 1
  assert int(four["count"]) == int(one["count"]) == 37
