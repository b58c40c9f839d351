"""``python -m train.plot RUN_DIR... [--out DIR]``: curves of several runs.

Reads ``config.json`` and ``metrics.jsonl`` of each run directory and writes
four PNGs to ``--out``, each overlaying all runs labelled by their norm:

* ``train_loss_vs_epoch.png``, ``test_error_vs_epoch.png``;
* ``train_loss_vs_seconds.png``, ``test_error_vs_seconds.png`` (cumulative
  training wall-clock time, ``elapsed_seconds``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

_CURVES = (  # (metric, y label, x key, x label)
    ("train_loss", "training loss", "epoch", "epoch"),
    ("test_error", "test error (%)", "epoch", "epoch"),
    ("train_loss", "training loss", "elapsed_seconds", "wall-clock seconds"),
    ("test_error", "test error (%)", "elapsed_seconds", "wall-clock seconds"),
)


class PlotError(ValueError):
  """A run directory can't be plotted."""


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict]]:
  """Reads ``(config, metrics rows)`` of a run directory.

  Raises:
    PlotError: If a file is missing or unreadable, or there are no rows.
  """
  run_dir = Path(run_dir)
  try:
    config = json.loads((run_dir / "config.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
  except (OSError, ValueError) as e:
    raise PlotError(f"{run_dir} is not a readable run directory: {e}") from e
  if not rows:
    raise PlotError(f"{run_dir}/metrics.jsonl has no epochs yet")
  return config, rows


def run_labels(configs: Sequence[dict[str, Any]]) -> list[str]:
  """Labels runs by norm, adding the other fields that tell them apart."""
  keys = ("dataset", "model", "seed", "batch_size", "learning_rate",
          "momentum")
  varying = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
  labels = []
  for config in configs:
    extra = ", ".join(f"{k}={config.get(k)}" for k in varying)
    labels.append(config.get("norm", "?") + (f" ({extra})" if extra else ""))
  return labels


def plot_runs(run_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
  """Writes the four PNGs for ``run_dirs`` into ``out_dir``.

  Returns:
    The paths written.
  """
  if not run_dirs:
    raise PlotError("no run directories given")
  runs = [load_run(d) for d in run_dirs]
  labels = run_labels([config for config, _ in runs])
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for metric, ylabel, xkey, xlabel in _CURVES:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (_, rows), label in zip(runs, labels):
      points = [(r[xkey], r[metric]) for r in rows if r.get(metric) is not None]
      if not points:
        continue
      xs, ys = zip(*points)
      if metric == "test_error":
        ys = [100 * y for y in ys]
      ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
    if metric == "train_loss":
      ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"{ylabel} vs {xlabel}")
    fig.tight_layout()
    suffix = "epoch" if xkey == "epoch" else "seconds"
    path = out_dir / f"{metric}_vs_{suffix}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m train.plot",
      description="Plot training loss and test error of runs against epoch "
      "and wall-clock seconds, one line per run, labelled by norm.")
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="--workdir of a train.cifar / train.mnist run")
  parser.add_argument("--out", default=".",
                      help="folder for the PNGs (default: current folder)")
  args = parser.parse_args(argv)
  try:
    paths = plot_runs(args.run_dirs, args.out)
  except PlotError as e:
    print(f"python -m train.plot: error: {e}", file=sys.stderr)
    return 1
  for path in paths:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
