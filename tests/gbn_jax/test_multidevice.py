"""Runs the library's test_*_multidevice.py in a subprocess on 4 host devices."""

import pathlib

import pytest

from tests.helpers.process import forced_host_devices
from tests.helpers.process import run_pytest
from tests.helpers.process import unoptimized_codegen

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow
def test_multidevice_suite():
  files = sorted(str(path) for path in HERE.rglob("test_?*_multidevice.py"))
  assert files, HERE
  proc = run_pytest(
      *files, env=unoptimized_codegen(forced_host_devices(4)), timeout=1500
  )
  print(proc.stdout[-20000:])
  print(proc.stderr[-5000:])
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout
