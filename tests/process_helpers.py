"""A fresh Python process for settings fixed when a process or JAX starts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(
    code: str,
    env: Mapping[str, str] | None = None,
    *,
    drop: Sequence[str] = (),
    args: Sequence[str] = (),
) -> str:
  """``python -c code args`` in the repository on the CPU; its stdout.

  The environment is this process's without ``drop``, with ``env`` over it.
  """
  full = {k: v for k, v in os.environ.items() if k not in drop}
  full.update(env or {}, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-c", code, *args],
      env=full,
      capture_output=True,
      text=True,
      check=True,
      cwd=REPO,
  ).stdout
