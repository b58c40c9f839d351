"""Runs tests/multidevice in a subprocess on 4 forced host devices."""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow
def test_multidevice_suite():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "pytest",
          "-q",
          "-p",
          "no:cacheprovider",
          str(HERE / "multidevice"),
      ],
      env=env,
      cwd=HERE.parent,
      capture_output=True,
      text=True,
      timeout=1500,
  )
  print(proc.stdout[-20000:])
  print(proc.stderr[-5000:])
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout
