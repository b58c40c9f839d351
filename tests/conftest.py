"""Test configuration.

tests/multidevice needs XLA_FLAGS=--xla_force_host_platform_device_count=4 set
before jax is imported, so the main run does not collect it directly:
tests/test_multidevice.py runs it in a subprocess with that flag.
"""

import os

collect_ignore = []
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  collect_ignore.append("multidevice")
