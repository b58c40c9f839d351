"""``python -m train.plot RUN_DIR... [--out DIR]``: curves of several runs.

Reads ``config.json`` and ``metrics.jsonl`` of each run directory (a
RUN_DIR without ``config.json`` stands for the runs under it, as in
:mod:`train.report`, and is skipped with a note if it holds none) and writes
four PNGs to ``--out`` (default: ``plots/`` beside the runs, in the folder
that holds them all), each overlaying all runs:

* ``train_loss_vs_epoch.png``, ``test_error_vs_epoch.png``;
* ``train_loss_vs_seconds.png``, ``test_error_vs_seconds.png`` (cumulative
  training wall-clock time, ``elapsed_seconds``).

Runs are labelled by their norm plus every config field that differs between
the plotted runs, and drawn in one colour per norm (its runs, e.g. seeds,
in different line styles); the titles name the dataset and model where all
runs share them. A run with no finished epoch is skipped with a warning.
The helpers that style an axis are shared with :mod:`train.report`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import os
from pathlib import Path
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")
# pylint: disable=g-import-not-at-top,wrong-import-position
from matplotlib import ticker
import matplotlib.pyplot as plt

from train import run_files

#: (metric, y label, x key, x label) of the four curves.
CURVES = (
    ("train_loss", "training loss", "epoch", "epoch"),
    ("test_error", "test error (%)", "epoch", "epoch"),
    ("train_loss", "training loss", "elapsed_seconds", "wall-clock seconds"),
    ("test_error", "test error (%)", "elapsed_seconds", "wall-clock seconds"),
)
#: How a config field is named in labels (the CLI flag, without dashes).
FIELD_LABELS = {
    "learning_rate": "lr",
    "batch_size": "batch",
    "weight_decay": "wd",
    "norm_momentum": "norm-momentum",
    "norm_epsilon": "norm-eps",
    "eval_every": "eval-every",
}


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
    rows = run_files.read_metrics(run_dir, missing_ok=False)
  except (OSError, ValueError) as e:
    raise PlotError(f"{run_dir} is not a readable run directory: {e}") from e
  if not rows:
    raise PlotError(
        f"{run_dir}/{run_files.METRICS_FILE} has no finished epoch yet"
    )
  return config, rows


def varying_fields(
    configs: Sequence[dict[str, Any]], exclude: Sequence[str] = ("norm",)
) -> list[str]:
  """Config fields whose values differ between ``configs``, in field order."""
  fields: list[str] = []
  for config in configs:
    fields += [k for k in config if k not in fields]
  return [
      k
      for k in fields
      if k not in exclude and len({json.dumps(c.get(k)) for c in configs}) > 1
  ]


def describe(config: dict[str, Any], fields: Sequence[str]) -> str:
  """``lr=0.1, seed=2``-style text of ``fields`` of ``config``."""
  return ", ".join(f"{FIELD_LABELS.get(k, k)}={config.get(k)}" for k in fields)


def run_labels(configs: Sequence[dict[str, Any]]) -> list[str]:
  """Labels runs by norm, adding every field that tells them apart.

  >>> run_labels([{"norm": "bn", "seed": 0, "epochs": 3},
  ...             {"norm": "bn", "seed": 0, "epochs": 5}])
  ['bn (epochs=3)', 'bn (epochs=5)']
  """
  fields = varying_fields(configs)
  labels = []
  for config in configs:
    extra = describe(config, fields)
    labels.append(config.get("norm", "?") + (f" ({extra})" if extra else ""))
  return labels


#: Line styles of the runs of one norm (seeds, other settings), in turn.
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))
#: Fields named in a figure's title where every plotted run shares them.
TITLE_FIELDS = ("dataset", "model")


def run_styles(configs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Matplotlib line styles: one colour per norm, the norm's runs told apart
  by line style (and fading a little), so that seeds of a norm read as one
  family.

  >>> [(s["color"], s["linestyle"]) for s in run_styles(
  ...     [{"norm": "bn"}, {"norm": "rsd"}, {"norm": "bn"}])]
  [('C0', '-'), ('C1', '-'), ('C0', '--')]
  """
  colours: dict[str, str] = {}
  seen: dict[str, int] = {}
  styles = []
  for config in configs:
    norm = config.get("norm", "?")
    colour = colours.setdefault(norm, f"C{len(colours) % 10}")
    index = seen[norm] = seen.get(norm, -1) + 1
    styles.append(
        {
            "color": colour,
            "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
            "alpha": max(0.55, 1.0 - 0.15 * index),
        }
    )
  return styles


def shared_context(configs: Sequence[dict[str, Any]]) -> str:
  """``fashion_mnist, lenet``: the :data:`TITLE_FIELDS` all runs share.

  >>> shared_context([{"dataset": "cifar10", "model": "lenet"},
  ...                 {"dataset": "cifar10", "model": "resnet20"}])
  'cifar10'
  """
  shared = []
  for field in TITLE_FIELDS:
    values = {json.dumps(c.get(field)) for c in configs}
    if len(values) == 1 and configs[0].get(field) is not None:
      shared.append(str(configs[0][field]))
  return ", ".join(shared)


def style_axes(
    ax: plt.Axes, metric: str, xkey: str, xlabel: str, ylabel: str
) -> None:
  """Axis labels, integer epoch ticks, readable loss ticks, a grid."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if xkey == "epoch":
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  if metric == "train_loss":
    low, high = ax.get_ylim()
    if low > 0 and high / low > 3:  # a log axis only where it helps
      ax.set_yscale("log")
      ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.yaxis.set_major_formatter(
          ticker.FuncFormatter(lambda value, _: f"{value:g}")
      )
      ax.yaxis.set_minor_formatter(ticker.NullFormatter())
  ax.grid(True, alpha=0.3)


def outside_legend(ax: plt.Axes) -> None:
  """A legend to the right of the axes, where it can't cover data."""
  ax.legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      borderaxespad=0.0,
      fontsize="small",
  )


def default_out(run_dirs: Sequence[str | Path]) -> Path:
  """``plots/`` in the folder that holds all of ``run_dirs``."""
  paths = [Path(d).absolute() for d in run_dirs]
  common = Path(os.path.commonpath(paths))
  if len(paths) == 1 or common in paths:
    common = common.parent
  return common / "plots"


def _stderr(message: str) -> None:
  print(message, file=sys.stderr)


def expand_run_dirs(
    paths: Sequence[str | Path], warn=_stderr
) -> list[tuple[Path, bool]]:
  """The run directories that ``paths`` name or hold, as ``(dir, named)``.

  A path with a ``config.json`` is a run directory (``named``: True); any
  other folder stands for the run directories under it, as in
  :mod:`train.report` (a sweep folder, whose ``report/`` is no run). A
  folder with no run in or under it is skipped with a ``warn`` note, so that
  ``sweeps/x/*/`` works.

  Raises:
    PlotError: If a path does not exist or is not a folder (a typo is no
      reason to plot the other runs only).
  """
  found: list[tuple[Path, bool]] = []
  for path in map(Path, paths):
    if not path.is_dir():
      state = "it does not exist" if not path.exists() else "not a folder"
      raise PlotError(f"{path} is not a readable run directory: {state}")
    if (path / "config.json").is_file():
      found.append((path, True))
      continue
    below = sorted(
        c.parent
        for c in path.rglob("config.json")
        if "checkpoints" not in c.relative_to(path).parts
    )
    if not below:
      warn(
          f"note: skipped {path}: not a run directory (no config.json in or "
          "under it)"
      )
    found += [(run_dir, False) for run_dir in below]
  return found


def plot_runs(
    run_dirs: Sequence[str | Path], out_dir: str | Path, warn=_stderr
) -> list[Path]:
  """Writes the four PNGs for ``run_dirs`` into ``out_dir``.

  ``run_dirs`` may also name folders above the runs (see
  :func:`expand_run_dirs`). Runs without a finished epoch, folders that are
  not run directories, and unreadable runs found under a folder are skipped,
  each with a ``warn`` message.

  Returns:
    The paths written.

  Raises:
    PlotError: If no run directories are given, a path does not exist, a
      run directory named itself is unreadable, or no run with a finished
      epoch is left.
  """
  if not run_dirs:
    raise PlotError("no run directories given")
  runs = []
  expanded = expand_run_dirs(run_dirs, warn)
  if not expanded:
    raise PlotError("none of the given folders holds a run directory")
  for run_dir, named in expanded:
    try:
      runs.append(load_run(run_dir))
    except PlotError as e:
      if "no finished epoch" in str(e):
        warn(f"warning: skipped {run_dir}: no finished epoch yet")
      elif named:
        raise
      else:
        warn(f"warning: skipped {e}")
  if not runs:
    raise PlotError("none of the runs has a finished epoch")
  configs = [config for config, _ in runs]
  labels = run_labels(configs)
  styles = run_styles(configs)
  context = shared_context(configs)
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for metric, ylabel, xkey, xlabel in CURVES:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for (_, rows), label, style in zip(runs, labels, styles):
      points = [(r[xkey], r[metric]) for r in rows if r.get(metric) is not None]
      if not points:
        continue
      xs, ys = zip(*points)
      if metric == "test_error":
        ys = [100 * y for y in ys]
      ax.plot(
          xs, ys, marker="." if len(xs) < 30 else None, label=label, **style
      )
    style_axes(ax, metric, xkey, xlabel, ylabel)
    outside_legend(ax)
    ax.set_title(f"{ylabel} vs {xlabel}" + (f" ({context})" if context else ""))
    fig.tight_layout()
    suffix = "epoch" if xkey == "epoch" else "seconds"
    path = out_dir / f"{metric}_vs_{suffix}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m train.plot",
      description="Plot training loss and test error of runs against epoch "
      "and wall-clock seconds, one line per run, labelled by norm and by "
      "whatever else differs between the runs. For means over seeds and "
      "tables, see `python -m train.report`.",
  )
  parser.add_argument(
      "run_dirs",
      nargs="+",
      metavar="RUN_DIR",
      help="--workdir of a train.cifar / train.mnist run, or "
      "a folder above runs (e.g. a sweep's); folders without "
      "a run are skipped with a note",
  )
  parser.add_argument(
      "--out",
      default=None,
      help="folder for the PNGs (default: plots/ in the "
      "folder that holds the runs)",
  )
  args = parser.parse_args(argv)
  try:
    # Expanded here too (quietly: plot_runs gives the notes), so that the
    # default --out of a sweep folder lands inside it, beside its runs.
    run_dirs = [d for d, _ in expand_run_dirs(args.run_dirs, lambda _: None)]
    out = Path(args.out) if args.out else default_out(run_dirs or args.run_dirs)
    paths = plot_runs(args.run_dirs, out)
  except PlotError as e:
    print(f"python -m train.plot: error: {e}", file=sys.stderr)
    return 1
  for path in paths:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
