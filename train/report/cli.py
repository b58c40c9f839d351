"""``python -m train.report DIR... --out OUT``: tables and curves of many runs.

Each DIR is a run directory or any folder above run directories (a sweep
dir, ``results/``); run directories (folders with ``config.json``) are
found recursively. ``OUT/report.md`` then holds:

* **Test error**, in the layout of the paper's Tables 2/3: one row per
  setting (dataset, model, learning rate, batch, augmentation, and any other
  field that differs between settings), one column per norm. A cell is the
  best test error of a run (its lowest over the evaluated epochs), mean ±
  sample standard deviation over seeds, with n; the row's lowest mean is in
  bold.
* **Convergence**: per norm, the epochs and seconds (cumulative training
  wall-clock, ``elapsed_seconds``) a run takes to first reach the target
  error, BatchNorm's mean final test error in the same setting.
* **Best learning rate**: per norm, its lowest mean over the learning-rate
  grid of a setting, and at which rate.
* **Gain**, where a run has ``gain.json`` (``python -m train.gain``) or
  with ``--gain``: per setting and norm, the gain ``sigma/D`` a Gaussian
  feature meets (from ``gbn_jax``'s normal-consistency constants, as
  training recorded them in ``norm_layers.json``, see
  :mod:`train.loop.capture`), the gain measured on real activations, the best
  error; and Spearman's rank correlation of gain with best error across
  the norms of each setting.
* **Calibrated against raw measures and BatchNorm**, where runs with
  ``calibration='normal'`` exist: per measure, raw, calibrated, BatchNorm
  with its Gaussian gain (``bn_gain:<measure>``), and the differences
  calibrated − BatchNorm, raw − calibrated, ``bn_gain`` − BatchNorm with
  their standard errors over independent seeds.
* **Batch size**, where a condition (the norm and the fields that differ,
  less batch size, learning rate and seed) has runs at two or more batch
  sizes: one row per such condition, one column per batch size, best test
  error as above; and ``batch_size.png``, the same against batch size.
* **Curvature**, where a run has ``curvature.jsonl``: per condition and
  measured epoch, the top Hessian eigenvalue and trace (less weight decay's
  shift), noise scale, training and test error and their gap, mean ± std
  over seeds (n); and ``curvature.png``, the same against epoch.
* **Precise statistics**, for runs trained with ``--precise-stats``: per
  norm, the final test error with the running averages (EMA) and with the
  statistics recomputed over training batches (PreciseBN), and their paired
  difference.
* **Curves** (``curves_*.png``): training loss and test error against epoch
  and seconds, the mean over seeds with a ±std band, one line per norm.
* **Activations** (``activations_*.png``), for runs trained with
  ``--record-activations``: percentile bands of one feature before and
  after one norm layer over training iterations.

Only finished runs (every epoch of their config) enter the means; an
unfinished or failed run is listed as such in its cell and in the run list,
never dropped silently.

This module is the command line; the work is done, with numpy and
matplotlib only, by :mod:`train.report.runs` (finding and reading runs),
:mod:`train.report.tables`, :mod:`train.report.batch`,
:mod:`train.report.gain`, :mod:`train.report.curvature` and
:mod:`train.report.figures`, whose public names are also this module's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
import sys

# The public names of the report modules are this module's too (the
# notebooks and scripts use ``report.find_runs`` etc.).
from train.report.batch import batch_conditions
from train.report.batch import batch_size_note
from train.report.batch import batch_size_table
from train.report.batch import batch_study
from train.report.curvature import CURVATURE_FILE
from train.report.curvature import curvature_section
from train.report.curvature import curvature_study
from train.report.curvature import curvature_table
from train.report.figures import activations_figure
from train.report.figures import batch_size_figure
from train.report.figures import curvature_figure
from train.report.figures import curves_figure
from train.report.figures import read_activations
from train.report.figures import slug
from train.report.gain import GAIN_FILE
from train.report.gain import GAIN_STAGES
from train.report.gain import NORM_LAYERS_FILE
from train.report.gain import gain_tables
from train.report.gain import gaussian_layer_gains
from train.report.gain import measured_gains
from train.report.gain import rank_correlation
from train.report.gain import read_gain
from train.report.runs import ACTIVATIONS_FILE
from train.report.runs import ADDED_FIELD_DEFAULTS
from train.report.runs import NORM_ORDER
from train.report.runs import PROG
from train.report.runs import ROW_FIELDS
from train.report.runs import Cell
from train.report.runs import Run
from train.report.runs import distinct_runs
from train.report.runs import find_runs
from train.report.runs import first_config
from train.report.runs import group_runs
from train.report.runs import mean_std
from train.report.runs import norm_order
from train.report.runs import row_extra
from train.report.runs import run_list
from train.report.runs import run_names
from train.report.runs import setting_label
from train.report.tables import PAPER_TABLE2_CIFAR10_LENET
from train.report.tables import Reach
from train.report.tables import best_lr_table
from train.report.tables import calibration_table
from train.report.tables import convergence_table
from train.report.tables import epoch_seconds
from train.report.tables import error_table
from train.report.tables import precise_table

__all__ = [
    "ACTIVATIONS_FILE",
    "ADDED_FIELD_DEFAULTS",
    "CURVATURE_FILE",
    "Cell",
    "GAIN_FILE",
    "GAIN_STAGES",
    "NORM_LAYERS_FILE",
    "NORM_ORDER",
    "PAPER_TABLE2_CIFAR10_LENET",
    "ROW_FIELDS",
    "Reach",
    "Run",
    "activations_figure",
    "batch_conditions",
    "batch_size_figure",
    "batch_size_table",
    "batch_study",
    "best_lr_table",
    "calibration_table",
    "convergence_table",
    "curvature_figure",
    "curvature_study",
    "curvature_table",
    "curves_figure",
    "distinct_runs",
    "epoch_seconds",
    "error_table",
    "find_runs",
    "gain_tables",
    "gaussian_layer_gains",
    "group_runs",
    "main",
    "mean_std",
    "measured_gains",
    "norm_order",
    "precise_table",
    "rank_correlation",
    "read_activations",
    "read_gain",
    "run_list",
    "run_names",
    "write_report",
]

Groups = dict[str, dict[str, list[Run]]]


def _head_lines(
    runs: Sequence[Run], all_runs: Sequence[Run], command: str | None
) -> list[str]:
  """The title, the command and the count of runs by state."""
  lines = ["# Report", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  finished = sum(r.finished for r in runs)
  return lines + [
      f"{len(runs)} runs: {finished} finished, "
      f"{sum(r.state == 'unfinished' for r in runs)} unfinished, "
      f"{sum(r.state == 'failed' for r in runs)} failed"
      + (
          f" (and {len(all_runs) - len(runs)} repeated configs, counted once)"
          if len(all_runs) > len(runs)
          else ""
      )
      + ". Means and standard "
      "deviations (sample, ddof=1) are over the finished runs (seeds) of a "
      "cell; errors in %.",
      "",
  ]


def _error_section(groups: Groups) -> list[str]:
  return [
      "## Best test error (the paper's table layout)",
      "",
      "Each cell: the lowest test error a run reached over its evaluated "
      "epochs, mean ± std over seeds (n); the lowest mean of a row in bold.",
      "",
      *error_table(groups),
      "",
  ]


def _convergence_section(
    groups: Groups, timing: Sequence[str | Path]
) -> list[str]:
  """Epochs and seconds to target; quiet speeds from ``timing`` runs."""
  return [
      "## Convergence",
      "",
      "Epochs and seconds (cumulative training wall-clock, compilation "
      "excluded) until a run's test error first falls to the target; mean ± "
      "std over the runs that reached it. BatchNorm's own row has its own "
      "mean as target, so its runs that end above their mean never reach "
      "it."
      + (
          " Quiet seconds per epoch: the median epoch of the timing runs "
          f"({', '.join(map(str, timing))}), run one at a time on an idle "
          "machine; seconds to target at quiet speed = epochs to target x "
          "that; both empty for a setting or norm with no timing run."
          if timing
          else ""
      ),
      "",
      *convergence_table(
          groups, epoch_seconds(find_runs(timing)) if timing else None
      ),
  ]


def _gain_section(groups: Groups) -> list[str]:
  return [
      "## Gain",
      "",
      "The gain σ/D: what a norm layer multiplies a feature by, "
      "relative to BatchNorm (σ: the feature's standard deviation "
      "over the batch, D: the layer's deviation measure). Gaussian "
      "gain: for a Gaussian feature, 1 / `Measure.normal_constant(n)`"
      " of `gbn_jax` (the divisor of `calibration='normal'`: 1 for "
      "`bn`, `sd` and every calibrated measure; for `bn_gain:<m>`, "
      "`m`'s), with n = batch × spatial positions of each norm layer "
      "from the model's shapes (it matters for `rbd` and `wcd` only); "
      "the range over the layers is shown, their median enters the "
      "correlation. Measured gain: `overall` of the runs' `gain.json` "
      "(`python -m train.gain`: the median over layers of each "
      "layer's median over features of σ/D, on real "
      "pre-normalization activations), mean ± std over the runs that "
      "have one (n); '–' where none has.",
      "",
      *gain_tables(groups),
  ]


def _table_section(title: str, about: str, table: list[str]) -> list[str]:
  """Section ``title``: ``about`` then ``table``; none without a table."""
  if not table:
    return []
  return [f"## {title}", "", about, "", *table]


def _calibration_section(runs: Sequence[Run]) -> list[str]:
  """Raw against calibrated measures; empty without calibrated runs."""
  return _table_section(
      "Calibrated against raw measures and BatchNorm",
      "Best test error (%), mean ± std over seeds (n). Calibrated: "
      "`calibration='normal'`, each D divided by its value for a "
      "standard normal feature, so that every measure has "
      "BatchNorm's gain 1 on Gaussian data; raw: without. The "
      "differences are of means over seeds, in points; seeds are "
      "independent runs (not paired), so ± is the standard error of "
      "the difference, sqrt(s_a²/n_a + s_b²/n_b) with the sample "
      "variances (ddof=1) of the two cells, shown where both have at "
      "least 2 runs.",
      calibration_table(runs),
  )


def _learning_rate_section(runs: Sequence[Run]) -> list[str]:
  return _table_section(
      "Best learning rate",
      "Per norm, the learning rate with the lowest mean best test error.",
      best_lr_table(runs),
  )


#: The batch-size study's figure.
BATCH_SIZE_FIGURE = "batch_size.png"


def _batch_size_section(
    runs: Sequence[Run], out: Path, written: set[str]
) -> list[str]:
  """Best error per condition and batch size, with its figure; none where
  no condition has runs at two batch sizes. Adds the figure's name to
  ``written``."""
  runs = batch_study(runs)
  table = batch_size_table(runs)
  if not table:
    return []
  batch_size_figure(batch_conditions(runs), out / BATCH_SIZE_FIGURE)
  written.add(BATCH_SIZE_FIGURE)
  return [
      "## Batch size",
      "",
      "Each cell: the lowest test error a run reached, mean ± std over "
      "seeds (n), of one condition (the norm and the fields that differ "
      "between conditions) at one batch size; the lowest mean of a column "
      "in bold.",
      "",
      *table,
      "",
      batch_size_note(runs),
      "",
      f"![best test error against batch size]({BATCH_SIZE_FIGURE})",
      "",
  ]


#: The curvature study's figure.
CURVATURE_FIGURE = "curvature.png"


def _curvature_section(
    runs: Sequence[Run], out: Path, written: set[str]
) -> list[str]:
  """The curvature section and figure (its name added to ``written``);
  none where no run has ``curvature.jsonl``."""
  study = curvature_study(runs)
  if study is None:
    return []
  if not any(study.conditions.values()):
    return curvature_section(study, None)
  curvature_figure(study, out / CURVATURE_FIGURE)
  written.add(CURVATURE_FIGURE)
  return curvature_section(study, CURVATURE_FIGURE)


def _precise_section(groups: Groups) -> list[str]:
  return _table_section(
      "Precise statistics",
      "Runs trained with `--precise-stats N`: before each evaluation "
      "the norms' statistics were also recomputed as equal-weight "
      "averages over N training batches (PreciseBN) and the test set "
      "evaluated with them; the model trained the same either way.",
      precise_table(groups),
  )


def _curves_section(
    groups: Groups, extra: Sequence[str], out: Path, written: set[str]
) -> list[str]:
  """Draws one curves figure per setting; adds their names to ``written``."""
  lines = ["## Curves", ""]
  for index, by_norm in enumerate(groups.values()):
    label = setting_label(first_config(by_norm), extra)
    name = f"curves_{index + 1:02d}_{slug(label)[:80]}.png"
    curves_figure(by_norm, label, out / name)
    written.add(name)
    lines += [f"![{label}]({name})", ""]
  return lines


def _activations_section(
    all_runs: Sequence[Run], extra: Sequence[str], out: Path, written: set[str]
) -> list[str]:
  """One figure per setting of the runs that recorded activations (its
  first run of each norm); adds their names to ``written``."""
  activation_runs = [
      r for r in all_runs if (r.path / ACTIVATIONS_FILE).exists()
  ]
  if not activation_runs:
    return []
  lines = ["## Activations", ""]
  for index, by_norm in enumerate(group_runs(activation_runs).values()):
    chosen = [runs[0] for runs in by_norm.values()]
    name = f"activations_{index + 1:02d}.png"
    if activations_figure(chosen, out / name):
      written.add(name)
      label = setting_label(first_config(by_norm), extra)
      lines += [
          f"{label}: "
          + ", ".join(
              f"{r.config['norm']} seed {r.config['seed']}" for r in chosen
          ),
          "",
          f"![activations]({name})",
          "",
      ]
  return lines


def write_report(
    dirs: Sequence[str | Path],
    out: str | Path,
    command: str | None = None,
    timing: Sequence[str | Path] = (),
    gain: bool = False,
) -> Path:
  """Writes ``out/report.md`` and its PNGs; returns the report's path.

  ``timing`` folders hold runs timed on an idle machine (see
  :func:`epoch_seconds`); they are not part of the tables otherwise. The
  gain section is written where a run has ``gain.json``, or always with
  ``gain``.

  Raises:
    FileNotFoundError: If a DIR is missing.
    ValueError: If no run directory is found.
  """
  all_runs = find_runs(dirs)
  if not all_runs:
    raise ValueError(
        "no run directories (folders with config.json) found "
        f"in {', '.join(map(str, dirs))}"
    )
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  runs = distinct_runs(all_runs)
  groups = group_runs(runs)
  extra = row_extra(groups)
  lines = [
      *_head_lines(runs, all_runs, command),
      *_error_section(groups),
      *_convergence_section(groups, timing),
  ]
  if gain or any((r.path / GAIN_FILE).exists() for r in runs):
    lines += _gain_section(groups)
  written: set[str] = set()
  lines += [
      *_calibration_section(runs),
      *_learning_rate_section(runs),
      *_batch_size_section(runs, out, written),
      *_precise_section(groups),
      *_curvature_section(runs, out, written),
  ]
  lines += _curves_section(groups, extra, out, written)
  lines += _activations_section(all_runs, extra, out, written)
  lines += ["## Runs", "", *run_list(all_runs, out), ""]
  path = out / "report.md"
  path.write_text("\n".join(lines))
  _remove_stale_figures(out, written)
  return path


def _remove_stale_figures(out: Path, written: set[str]) -> None:
  """Deletes figures of an earlier report in ``out`` that this one lacks.

  Only the report's own names (``curves_*.png``, ``activations_*.png``,
  :data:`BATCH_SIZE_FIGURE`, :data:`CURVATURE_FIGURE`), so
  that a rerun into the same folder leaves no figure of settings or labels
  that are gone.
  """
  named = [BATCH_SIZE_FIGURE, CURVATURE_FIGURE]
  for pattern in ["curves_*.png", "activations_*.png", *named]:
    for figure in out.glob(pattern):
      if figure.name not in written:
        figure.unlink()


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m train.report``; returns the exit status."""
  parser = argparse.ArgumentParser(
      prog=PROG,
      description=__doc__.split("\n\n")[0].split(": ", 1)[1]
      + " Writes OUT/report.md plus PNGs; see train/report/cli.py.",
  )
  parser.add_argument(
      "dirs",
      nargs="+",
      metavar="DIR",
      help="run directories or folders above them",
  )
  parser.add_argument(
      "--timing",
      nargs="+",
      default=(),
      metavar="DIR",
      help="runs timed on an idle machine: their seconds per "
      "epoch give each norm's speed in the convergence table",
  )
  parser.add_argument(
      "--gain",
      action="store_true",
      help="write the gain section even where no run has a "
      "gain.json (python -m train.gain); it is written "
      "anyway where one has",
  )
  parser.add_argument(
      "--out", required=True, help="folder for report.md and the PNGs"
  )
  args = parser.parse_args(argv)
  command = " ".join([PROG, *(argv if argv is not None else sys.argv[1:])])
  try:
    path = write_report(
        args.dirs, args.out, command=command, timing=args.timing, gain=args.gain
    )
  except (FileNotFoundError, ValueError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1
  print(path)
  return 0
