"""Runs tests/multidevice in a subprocess on 4 forced host devices."""

import pathlib

import pytest

from process_helpers import forced_host_devices
from process_helpers import run_pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow
def test_multidevice_suite():
  proc = run_pytest(
      str(HERE / "multidevice"), env=forced_host_devices(4), timeout=1500
  )
  print(proc.stdout[-20000:])
  print(proc.stderr[-5000:])
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout
