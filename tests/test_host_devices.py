"""train.host_devices: one XLA host device per core, set before JAX starts."""

import os
import subprocess
import sys

import pytest

from train import host_devices


def test_choose():
  assert host_devices.choose(cores=6, setting="auto") == 6
  assert host_devices.choose(cores=6, setting="1") == 1
  assert host_devices.choose(cores=2, setting=" 3 ") == 3
  for bad in ("0", "-2", "two"):
    with pytest.raises(SystemExit, match="GBN_HOST_DEVICES"):
      host_devices.choose(cores=2, setting=bad)


def _devices_seen(env_extra, batch):
  code = (
      "import sys; from train import host_devices; host_devices.configure();"
      "import jax; from train import train;"
      f"print(jax.device_count(), len(train.data_parallel_devices({batch})))"
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(env_extra, JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, "-c", code],
      env=env,
      capture_output=True,
      text=True,
      check=True,
      cwd=os.path.dirname(os.path.dirname(__file__)),
  )
  return tuple(int(v) for v in out.stdout.split())


def test_configure_splits_the_cpu_and_the_loop_uses_a_divisor():
  assert _devices_seen({"GBN_HOST_DEVICES": "3"}, batch=12) == (3, 3)
  assert _devices_seen({"GBN_HOST_DEVICES": "3"}, batch=10) == (3, 2)
  assert _devices_seen({"GBN_HOST_DEVICES": "1"}, batch=10) == (1, 1)
  # an explicit XLA_FLAGS setting wins
  assert _devices_seen(
      {
          "GBN_HOST_DEVICES": "3",
          "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
      },
      batch=8,
  ) == (2, 2)
