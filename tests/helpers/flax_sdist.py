"""flax's own sources, from the sdist of the installed flax version."""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import tarfile

import pytest

from tests.helpers.process import ProcessFailed

REPO = pathlib.Path(__file__).resolve().parents[2]


def load_module(name: str, path: pathlib.Path):
  """The Python file at ``path``, imported as module ``name``."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def unpacked_flax_sdist(tmp_dir: pathlib.Path) -> pathlib.Path:
  """flax's unpacked sdist (``GBN_FLAX_SRC``, ``GBN_FLAX_SDIST`` or pip).

  Skips the calling test where it cannot be had, e.g. offline.
  """
  tool = REPO / "tools" / "flax_batchnorm_suite.py"
  if not tool.exists():
    pytest.skip(f"{tool} (which fetches flax's sdist) is not here")
  suite = load_module("gbn_flax_batchnorm_suite", tool)
  args = argparse.Namespace(
      src=os.environ.get("GBN_FLAX_SRC"), sdist=os.environ.get("GBN_FLAX_SDIST")
  )
  try:
    with pytest.MonkeyPatch.context() as patch:
      # Offline, pip would retry for minutes before the skip.
      patch.setenv("PIP_DEFAULT_TIMEOUT", "20")
      patch.setenv("PIP_RETRIES", "1")
      return suite._unpack(args, tmp_dir)  # pylint: disable=protected-access
  except (ProcessFailed, StopIteration, OSError) as e:
    pytest.skip(
        f"flax's sdist could not be had ({type(e).__name__}: {e}); set"
        " GBN_FLAX_SDIST or GBN_FLAX_SRC to a copy to run these tests offline"
    )
  except tarfile.TarError as e:
    pytest.skip(f"flax's sdist could not be unpacked: {e}")
