"""Test configuration.

tests/multidevice needs XLA_FLAGS=--xla_force_host_platform_device_count=4 set
before jax is imported, so the main run does not collect it directly:
tests/test_multidevice.py runs it in a subprocess with that flag.
"""

import os

import pytest

collect_ignore = []
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  collect_ignore.append("multidevice")


@pytest.fixture
def restore_registry():
  """Leaves the measure registry as it was (for tests that register)."""
  # pylint: disable=protected-access,g-import-not-at-top
  from gbn_jax import measures  # imported late: jax reads XLA_FLAGS once

  saved = dict(measures._REGISTRY)
  yield
  measures._REGISTRY.clear()
  measures._REGISTRY.update(saved)
