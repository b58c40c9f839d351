"""``python -m train.plot RUN_DIR... [--out DIR]``: curves of several runs.

Reads ``config.json`` and ``metrics.jsonl`` of each run directory (a
RUN_DIR without ``config.json`` stands for the runs under it, as in
:mod:`train.report`, and is skipped with a note if it holds none) and writes
four PNGs to ``--out`` (default: ``plots/`` beside the runs, in the folder
that holds them all), each overlaying all runs:

* ``train_loss_vs_epoch.png``, ``test_error_vs_epoch.png``;
* ``train_loss_vs_seconds.png``, ``test_error_vs_seconds.png`` (cumulative
  training wall-clock time, ``elapsed_seconds``).

Runs are labelled by their norm plus the settings that differ between the
plotted runs, spelled as in the run folders' names (``sqd2 b128 lr0.1
seed1``), and drawn in one colour per norm (its runs, e.g. seeds, in
different line styles); the titles name the dataset and model where all runs
share them. The legend goes under the axes, in as many columns as fit, and
the figure grows with its rows, so the plot keeps its size however many runs
there are. A run with no finished epoch is skipped with a warning. The
helpers that style an axis are shared with :mod:`train.report`.

Each PNG records the run folders it shows. A figure already in ``--out``
that shows only runs plotted now is replaced, and named on stdout
(``replaced PATH``); one that shows any other run, or does not say which, is
kept and nothing is written, unless ``--force``.
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
from PIL import Image  # matplotlib's own, which writes its PNGs

from train import run_files

# Re-exported: the labels, as the plot's callers and tests name them.
from train.report.labels import ADDED_FIELD_DEFAULTS as ADDED_FIELD_DEFAULTS
from train.report.labels import FIELD_LABELS as FIELD_LABELS
from train.report.labels import RUN_NAME_PREFIXES as RUN_NAME_PREFIXES
from train.report.labels import as_setting as as_setting
from train.report.labels import describe as describe
from train.report.labels import run_dir_names as run_dir_names
from train.report.labels import run_labels as run_labels
from train.report.labels import setting_text as setting_text
from train.report.labels import varying_fields as varying_fields

#: (metric, y label, x key, x label) of the four curves.
CURVES = (
    ("train_loss", "training loss", "epoch", "epoch"),
    ("test_error", "test error (%)", "epoch", "epoch"),
    ("train_loss", "training loss", "elapsed_seconds", "wall-clock seconds"),
    ("test_error", "test error (%)", "elapsed_seconds", "wall-clock seconds"),
)
#: The PNG text entry that lists the run folders a figure shows (resolved
#: paths, one a line): what tells a figure of the same runs from one of
#: other runs.
RUNS_KEY = "gbn_jax runs"


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


#: Inches of the figure without its legend: the plot's size.
FIGURE_SIZE = (9.0, 4.5)


def legend_below(fig: plt.Figure, ax: plt.Axes) -> None:
  """The legend under the axes, in as many columns as fit the figure's
  width; the figure grows by its height, so that the axes keep their size
  however many runs there are. Needs the figure's constrained layout."""
  handles, labels = ax.get_legend_handles_labels()
  if not handles:
    return
  style = {"fontsize": "small", "frameon": False}
  renderer = fig.canvas.get_renderer()
  # One column's width, from the widest entry, decides how many fit.
  probe = fig.legend(handles, labels, ncols=1, **style)
  column = probe.get_window_extent(renderer).width
  probe.remove()
  columns = max(1, min(len(handles), int(0.95 * fig.bbox.width // column)))
  legend = fig.legend(
      handles, labels, loc="outside lower center", ncols=columns, **style
  )
  height = legend.get_window_extent(renderer).height / fig.dpi
  fig.set_figheight(fig.get_figheight() + height)


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


def figure_runs(path: str | Path) -> list[str] | None:
  """The run folders that a figure of this module records, or None (not a
  PNG, or written by something else or before figures recorded them)."""
  try:
    with Image.open(path) as image:
      text = getattr(image, "text", {}).get(RUNS_KEY)
  except (OSError, ValueError):
    return None
  return None if text is None else text.splitlines()


def figure_paths(out_dir: str | Path) -> list[Path]:
  """The PNGs that :func:`plot_runs` writes into ``out_dir``, in order."""
  return [
      Path(out_dir)
      / f"{metric}_vs_{'epoch' if xkey == 'epoch' else 'seconds'}.png"
      for metric, _, xkey, _ in CURVES
  ]


def check_replaceable(
    out_dir: str | Path, run_dirs: Sequence[str | Path]
) -> None:
  """Refuses to replace a figure that shows runs not among ``run_dirs``.

  A figure that shows only runs among ``run_dirs`` loses nothing when it is
  drawn again; one that shows another run, or does not record its runs,
  would be lost.

  Raises:
    PlotError: If such a figure is in ``out_dir``; the message names it,
      the runs it shows and the ways on.
  """
  plotted = {str(Path(d).resolve()) for d in run_dirs}
  kept: list[Path] = []
  others: list[str] = []
  for path in figure_paths(out_dir):
    if not path.exists():
      continue
    shown = figure_runs(path)
    if shown is None or not set(shown) <= plotted:
      kept.append(path)
      others += [r for r in shown or () if r not in plotted and r not in others]
  if not kept:
    return
  if others:
    names = run_dir_names(others)
    listed = ", ".join(names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    runs = f"{len(names)} run" + ("s" if len(names) > 1 else "")
    what = f"of {runs} not plotted now ({listed})"
  else:
    what = "that do not record which runs they show"
  raise PlotError(
      f"{Path(out_dir)} already holds figures {what}: "
      + ", ".join(p.name for p in kept)
      + ". Nothing was written: pass --out DIR to write these runs' figures"
      " elsewhere, or --force to replace them."
  )


def plot_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    warn=_stderr,
    *,
    force: bool = False,
) -> list[tuple[Path, bool]]:
  """Writes the four PNGs for ``run_dirs`` into ``out_dir``.

  ``run_dirs`` may also name folders above the runs (see
  :func:`expand_run_dirs`). Runs without a finished epoch, folders that are
  not run directories, and unreadable runs found under a folder are skipped,
  each with a ``warn`` message. Each PNG records the runs it shows
  (:data:`RUNS_KEY`), so that a later call tells its own figures from
  others (:func:`check_replaceable`).

  Args:
    run_dirs: Run directories, or folders above them.
    out_dir: The folder for the PNGs (created if need be).
    warn: Takes each note and warning.
    force: Replace figures in ``out_dir`` even where they show other runs.

  Returns:
    Each path written, and whether a file of that name was replaced.

  Raises:
    PlotError: If no run directories are given, a path does not exist, a
      run directory named itself is unreadable, no run with a finished
      epoch is left, or (without ``force``) ``out_dir`` holds figures of
      other runs; nothing is written then.
  """
  if not run_dirs:
    raise PlotError("no run directories given")
  runs = []
  kept_dirs = []
  expanded = expand_run_dirs(run_dirs, warn)
  if not expanded:
    raise PlotError("none of the given folders holds a run directory")
  for run_dir, named in expanded:
    try:
      runs.append(load_run(run_dir))
      kept_dirs.append(run_dir)
    except PlotError as e:
      if "no finished epoch" in str(e):
        warn(f"warning: skipped {run_dir}: no finished epoch yet")
      elif named:
        raise
      else:
        warn(f"warning: skipped {e}")
  if not runs:
    raise PlotError("none of the runs has a finished epoch")
  out_dir = Path(out_dir)
  if not force:
    check_replaceable(out_dir, kept_dirs)
  configs = [config for config, _ in runs]
  labels = run_labels(configs, kept_dirs)
  styles = run_styles(configs)
  context = shared_context(configs)
  record = {RUNS_KEY: "\n".join(str(d.resolve()) for d in kept_dirs)}
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for (metric, ylabel, xkey, xlabel), path in zip(
      CURVES, figure_paths(out_dir)
  ):
    fig, ax = plt.subplots(figsize=FIGURE_SIZE, layout="constrained")
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
    ax.set_title(f"{ylabel} vs {xlabel}" + (f" ({context})" if context else ""))
    legend_below(fig, ax)
    replaced = path.exists()
    fig.savefig(path, dpi=120, metadata=record)
    plt.close(fig)
    written.append((path, replaced))
  return written


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m train.plot",
      description="Plot training loss and test error of runs against epoch "
      "and wall-clock seconds, one line per run, labelled by norm and by "
      "whatever else differs between the runs. Prints each file it writes "
      "('wrote PATH') or replaces ('replaced PATH'). For means over seeds "
      "and tables, see `python -m train.report`.",
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
  parser.add_argument(
      "--force",
      action="store_true",
      help="replace figures in the --out folder that show runs not "
      "plotted now; without it such figures are kept and nothing is "
      "written (figures of only the runs plotted now are always replaced, "
      "and each replaced file is printed)",
  )
  args = parser.parse_args(argv)
  try:
    # Expanded here too (quietly: plot_runs gives the notes), so that the
    # default --out of a sweep folder lands inside it, beside its runs.
    run_dirs = [d for d, _ in expand_run_dirs(args.run_dirs, lambda _: None)]
    out = Path(args.out) if args.out else default_out(run_dirs or args.run_dirs)
    written = plot_runs(args.run_dirs, out, force=args.force)
  except PlotError as e:
    print(f"python -m train.plot: error: {e}", file=sys.stderr)
    return 1
  for path, replaced in written:
    print(f"{'replaced' if replaced else 'wrote'} {path}")
  return 0
