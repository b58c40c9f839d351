"""A run directory's ``metrics.jsonl``, read without JAX.

`train.loop.checkpointing` writes run directories (and re-exports these names);
the report, the plots, the sweep and the device checks read them, and the
report and the plots run where JAX is not installed, so the reader lives
here, importing nothing but the standard library.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
#: What ``python -m train.curvature`` adds beside it, one line per checkpoint.
CURVATURE_FILE = "curvature.jsonl"


def read_metrics(
    run_dir: str | os.PathLike[str], *, missing_ok: bool = True
) -> list[dict[str, Any]]:
  """Reads the rows of ``run_dir``'s ``metrics.jsonl``, one per epoch.

  Blank lines are skipped. Any other line that is not JSON (a line cut
  short, in a copy taken while the file was replaced, or a corrupt file) is
  an error rather than skipped: the rows after it, or the epoch it was
  meant to record, would be silently lost.

  Args:
    run_dir: The run directory.
    missing_ok: Whether a run directory without the file has no rows
      (rather than an error).

  Returns:
    The rows, in the file's order.

  Raises:
    FileNotFoundError: There is no ``metrics.jsonl`` and not
      ``missing_ok``.
    OSError: The file cannot be read.
    ValueError: A line is not JSON; the message names the file and line.
  """
  path = Path(run_dir) / METRICS_FILE
  try:
    text = path.read_text()
  except FileNotFoundError:
    if missing_ok:
      return []
    raise
  rows = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except ValueError as e:
      raise ValueError(f"{path} line {number}: {e}") from e
  return rows
