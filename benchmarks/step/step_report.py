"""The step benchmarks' report: its JSON file, and reading and printing times.

Shared by ``bench_lenet_step`` and ``bench_resnet_step``: a :class:`Report`
holds the sections' results and rewrites its JSON after each (a cut-off run
keeps what it measured); :func:`median_ms` reads a variant's step time out of
a child's result and :func:`format_ms` prints it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
import json
from pathlib import Path
import subprocess
from typing import Any

from benchmarks.step.step_children import REPO


def git_commit() -> str | None:
  """The checkout's commit, ``+dirty`` if tracked files differ from it."""
  git = lambda *args: subprocess.run(
      ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
  ).stdout.strip()
  try:
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+dirty" if dirty else "")


class Report:
  """Collects the sections, saving the JSON after each.

  ``data`` starts with the command line (``python -m module argv...``), the
  parsed arguments, the code's commit and ``complete: False``.
  """

  def __init__(
      self, args: argparse.Namespace, argv: Sequence[str], module: str
  ):
    self.path = args.out
    self.data: dict[str, Any] = {
        "command": " ".join([f"python -m {module}", *argv]),
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
        "code": git_commit(),
        "complete": False,
    }

  def put(self, key: str, value: Any) -> None:
    """Sets ``key`` and saves."""
    self.data[key] = value
    self.save()

  def save(self) -> None:
    """Writes ``data`` to the ``--out`` path, if there is one."""
    if self.path:
      Path(self.path).parent.mkdir(parents=True, exist_ok=True)
      with open(self.path, "w") as f:
        json.dump(self.data, f, indent=1)


def median_ms(result: Any, norm: str, variant: str) -> float | None:
  """A child's median step ms for ``norm`` and ``variant`` (None: not timed)."""
  try:
    return result["norms"][norm]["variants"][variant]["median_ms"]
  except (KeyError, TypeError):
    return None


def format_ms(ms: float | None) -> str:
  """``ms`` in a 11-character column, ``failed`` where there is none."""
  return "   failed" if ms is None else f"{ms:8.1f} ms"


def measured_runs(data: dict[str, Any]) -> Iterator[tuple[int, str, dict]]:
  """``(devices, flag set, result)`` of each timing process of a report.

  The ``variants`` section's (one device, default flags) first, then the
  ``final`` section's; those without times (a failed child) are left out.
  """
  if "norms" in data.get("variants", {}):
    yield 1, "default", data["variants"]
  for r in data.get("final", []):
    if "norms" in r:
      yield r["devices"], r["flag_set"], r


def print_ratio_line(
    label: str, ms: float | None, torch_ms: float | None, width: int = 44
) -> None:
  """A step's ms, and its ratio to PyTorch's BatchNorm step where both are."""
  extra = f"  = {ms / torch_ms:.2f}x PyTorch BN" if ms and torch_ms else ""
  print(f"  {label:<{width}} {format_ms(ms)}{extra}", flush=True)
