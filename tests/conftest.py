"""Test configuration.

The test_*_multidevice.py files need
XLA_FLAGS=--xla_force_host_platform_device_count=4 set before jax is
imported, so a run without it does not collect them:
tests/gbn_jax/test_multidevice.py and tests/train/test_multidevice.py run
them in a subprocess with that flag.
"""

import atexit
import os
import shutil
import tempfile

import pytest

from tests.helpers import tiers

# One persistent compilation cache for the whole run, shared by the xdist
# workers and every subprocess they start (they inherit the environment set
# here, before any of them imports jax): the CLI and sweep tests compile the
# same LeNet/ResNet20 programs in many processes, and reading them back cut a
# third of those tests' time on 2 cores. A cache the user set is left alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="gbn_jax_test_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Relative to this folder; fnmatch's "*" spans folders. The runners
# (test_multidevice.py) do not match.
collect_ignore_glob = []
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
  collect_ignore_glob.append("*/test_?*_multidevice.py")


def pytest_collection_modifyitems(items):
  """Marks the tests the quick tier leaves to the full run
  (:mod:`tests.helpers.tiers`) slow, then puts the slow tests first, in
  their own order.

  A full run (``-n auto``, work stealing) then starts the longest tests
  while the quick ones fill the other workers, instead of ending on one
  worker still running a long test after the others have run dry.
  """
  for item in items:
    # Node ids are relative to the run's root folder (the checkout, or the
    # copy CI tests the wheel from): the tiers name paths from the root.
    if tiers.is_thorough(item.nodeid) and not item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def restore_registry():
  """Leaves the measure registry as it was (for tests that register)."""
  # pylint: disable=protected-access,g-import-not-at-top
  from gbn_jax import measures  # imported late: jax reads XLA_FLAGS once

  saved = dict(measures._REGISTRY)
  yield
  measures._REGISTRY.clear()
  measures._REGISTRY.update(saved)
