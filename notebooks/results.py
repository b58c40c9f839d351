# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Results: does another deviation measure beat BatchNorm?
#
# The paper's question (Yuan et al., AAAI 2019): BatchNorm normalizes by the
# pair (mean, standard deviation); does another pair $(S, D)$ train to a lower
# test error, or reach BatchNorm's error sooner? The paper reports that on
# MNIST `sqd1` and `rsd` converge faster, and on CIFAR-10 (LeNet, its Table 2)
# `sqd2` and `sqd3` end lower and `sqd1` much higher.
#
# This notebook reads the runs committed under `results/` and shows, with
# `train.report` (the module behind `python -m train.report`):
#
# 1. the best test error per setting and norm, in the layout of the paper's
#    tables, and a summary of each norm against BatchNorm;
# 2. convergence: epochs and seconds to reach BatchNorm's final test error;
# 3. each norm's best learning rate, where a setting was run at several;
# 4. gain or shape: each norm's gain σ/D (Gaussian and measured), its rank
#    correlation with the best error, and calibrated against raw measures
#    and BatchNorm;
# 5. curvature: the training loss's Hessian along training and the
#    generalization gap, for runs measured with `python -m train.curvature`;
# 6. training loss and test error curves;
# 7. the distribution of one feature before and after a norm layer over
#    training (the paper's Figure 1), for runs in `results/activations/`;
# 8. every run and its state.
#
# `results/sweeps/` holds the sweeps (`python -m train.sweep --sweep-dir
# results/sweeps/NAME ...`; each run's `sweep.log` starts with its command),
# `results/activations/` runs trained with `--record-activations K`. Sweeps may
# be partial: unfinished and failed runs are listed as such and left out of
# the means, and a missing folder skips its section. After new runs,
# re-execute this notebook from the repository root with
# `python -m notebooks.execute results`. To read another results folder, set
# the environment variable `GBN_RESULTS_DIR` to it before starting Jupyter.

# %%
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from IPython.display import Image, Markdown, display


def find_root(start: Path) -> Path:
  """The repository: the first folder up from ``start`` with train/report/cli.py."""
  for folder in [start, *start.parents]:
    if (folder / "train" / "report" / "cli.py").is_file():
      return folder
  raise FileNotFoundError(
      f"no gbn-jax checkout (train/report/cli.py) at or above {start}; open this"
      " notebook from the repository's notebooks/ folder")


ROOT = find_root(Path.cwd().resolve())
if str(ROOT) not in sys.path:  # this checkout's train package, not another
  sys.path.insert(0, str(ROOT))

from train.report import cli as report  # noqa: E402  (needs ROOT on sys.path)
from train.report import curvature  # noqa: E402
from train.report import plot  # noqa: E402

RESULTS = Path(os.environ.get("GBN_RESULTS_DIR") or ROOT / "results").resolve()
SWEEPS = RESULTS / "sweeps"
ACTIVATIONS = RESULTS / "activations"
TIMING = RESULTS / "benchmarks" / "timing"  # runs timed on an idle machine


def rel(path: Path) -> str:
  """``path`` relative to the repository, if it is inside."""
  return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def load(folder: Path, what: str) -> list[report.Run]:
  """The run directories under ``folder``; a message if there are none."""
  where = rel(folder)
  if not folder.is_dir():
    print(f"{where}/ does not exist (no {what} yet).")
    return []
  runs = report.find_runs([folder])
  if not runs:
    print(f"{where}/ holds no run directory (config.json) yet.")
    return []
  states = [run.state for run in runs]
  print(f"{where}/: {len(runs)} runs, "
        + ", ".join(f"{states.count(s)} {s}"
                    for s in ("finished", "unfinished", "failed")))
  return runs


RUNS = load(SWEEPS, "sweeps")
GROUPS = report.group_runs(RUNS)
print(f"{len(GROUPS)} setting(s): runs that differ only in norm and seed")


def setting_label(by_norm: dict[str, list[report.Run]]) -> str:
  """A setting's label, as in the report's table rows."""
  configs = [next(iter(g.values()))[0].config for g in GROUPS.values()]
  fields = [*report.ROW_FIELDS, *(f for f in plot.varying_fields(
      configs, exclude=("norm", "seed")) if f not in report.ROW_FIELDS)]
  return plot.describe(next(iter(by_norm.values()))[0].config, fields)


def show(lines: list[str], otherwise: str) -> None:
  """Markdown lines rendered, or a message if there are none."""
  if lines:
    display(Markdown("\n".join(lines)))
  else:
    print(otherwise)


# %% [markdown]
# ## Best test error (the paper's table layout)
#
# Each cell: the lowest test error a run reached over its evaluated epochs,
# mean ± sample standard deviation over the finished runs (seeds), with n; the
# lowest mean of a row in bold. Unfinished and failed runs are counted in
# their cell, not averaged. For CIFAR-10 LeNet at batch 1024 and learning rate
# 0.1 the paper's Table 2 is shown underneath.

# %%
show(report.error_table(GROUPS) if GROUPS else [],
     f"No runs in {rel(SWEEPS)}/: nothing to tabulate.")

# %% [markdown]
# Each norm against BatchNorm (`bn`) in the same setting: the difference of
# the mean best test errors (negative: lower than BatchNorm) and that
# difference in standard errors, $\Delta / \sqrt{s_1^2/n_1 + s_2^2/n_2}$
# (about 2 or more in absolute value: unlikely to be seed noise; it needs at
# least two finished runs on both sides).

# %%
def against_bn(by_norm: dict[str, list[report.Run]]) -> list[str]:
  errors = {norm: report.Cell.of(runs).best_errors()
            for norm, runs in by_norm.items()}
  errors = {norm: e for norm, e in errors.items() if e}
  if "bn" not in errors:
    return [f"**{setting_label(by_norm)}**: no finished `bn` run yet.", ""]
  bn = np.asarray(errors["bn"])
  lines = [f"**{setting_label(by_norm)}**", "",
           "| norm | mean best test error (%) | n | vs bn (points) |"
           " in standard errors |", "|---|---|---|---|---|"]
  for norm in sorted(errors, key=lambda n: np.mean(errors[n])):
    e = np.asarray(errors[norm])
    delta = e.mean() - bn.mean()
    if norm == "bn":
      z = ""
    elif min(e.size, bn.size) < 2:
      z = "n < 2"
    else:
      se = np.sqrt(e.var(ddof=1) / e.size + bn.var(ddof=1) / bn.size)
      z = f"{delta / se:+.1f}" if se > 0 else "–"
    lines.append(f"| {norm} | {e.mean():.2f} | {e.size} | "
                 f"{'' if norm == 'bn' else f'{delta:+.2f}'} | {z} |")
  return [*lines, ""]


show([line for by_norm in GROUPS.values() for line in against_bn(by_norm)],
     f"No runs in {rel(SWEEPS)}/: nothing to compare.")

# %% [markdown]
# ## Convergence
#
# Per setting, the target is BatchNorm's mean final test error; each norm's
# epochs and seconds (cumulative training wall-clock, compilation excluded)
# until a run's test error first falls to it, mean ± std over the runs that
# reached it. Seconds compare only runs on the same machine and load; the
# sweeps shared the machine with other work, so where
# `results/benchmarks/timing/` has runs of the same setting timed on an idle
# machine, their seconds per epoch give each norm's "quiet" speed and the
# seconds to target at that speed.

# %%
QUIET = (report.epoch_seconds(report.find_runs([TIMING]))
         if TIMING.is_dir() else None)
show(report.convergence_table(GROUPS, QUIET) if GROUPS else [],
     f"No runs in {rel(SWEEPS)}/: no convergence to show.")

# %% [markdown]
# ## Best learning rate
#
# Where a setting was run at several learning rates: each norm's lowest mean
# best test error over the grid, and at which rate.

# %%
show(report.best_lr_table(RUNS),
     "No setting was run at more than one learning rate (yet).")

# %% [markdown]
# ## Precise statistics
#
# For runs trained with `--precise-stats N` (the small-batch study): the
# final test error with the running averages the layers keep, and with the
# statistics recomputed as equal-weight averages over N training batches
# (PreciseBN), per norm; the paired difference is negative where precise
# statistics help.

# %%
show(report.precise_table(GROUPS) if GROUPS else [],
     "No run was trained with --precise-stats (yet).")

# %% [markdown]
# ## Batch size
#
# Where conditions were run at several batch sizes for the same number of
# optimizer steps (`--steps`, the small-batch study): each condition's best
# test error by batch size, and the same as a figure.

# %%
BATCH_RUNS = report.batch_study(RUNS)
if not BATCH_RUNS:
  print("No condition was run at more than one batch size (yet).")
# One study per dataset: a column mixes no datasets.
for dataset in sorted({run.config["dataset"] for run in BATCH_RUNS}):
  study = [run for run in BATCH_RUNS if run.config["dataset"] == dataset]
  display(Markdown(f"**{dataset}**"))
  show(report.batch_size_table(study), "")
  display(Markdown(report.batch_size_note(study)))
  with tempfile.TemporaryDirectory() as tmp:
    path = report.batch_size_figure(report.batch_conditions(study),
                                    Path(tmp) / "batch_size.png")
    display(Image(filename=path, width=900))

# %% [markdown]
# ## Curvature
#
# Where runs have `curvature.jsonl` (`python -m train.curvature RUN_DIR`, the
# curvature study): per condition and measured epoch, the top eigenvalue and
# the trace of the training loss's Hessian (weight decay's constant shift
# taken off), the gradient noise scale, and the training and test error with
# their gap, mean ± std over seeds; then the same against epoch.

# %%
CURVATURE = report.curvature_study(RUNS)
if CURVATURE is None:
  print(f"No run has {curvature.CURVATURE_FILE} (yet).")
else:
  display(Markdown(curvature.settings_note(CURVATURE)))
  show(report.curvature_table(CURVATURE), "")
  for note in CURVATURE.notes:
    display(Markdown(note))
  if any(CURVATURE.conditions.values()):
    with tempfile.TemporaryDirectory() as tmp:
      path = report.curvature_figure(CURVATURE, Path(tmp) / "curvature.png")
      display(Image(filename=path, width=900))

# %% [markdown]
# ## Gain or shape?
#
# A norm layer multiplies each feature by the *gain* σ/D relative to
# BatchNorm. For a Gaussian feature the gain is a constant of the measure
# (`gbn_jax`'s `Measure.normal_constant`, what `calibration='normal'`
# divides D by: 2.5 for `rsd`, about 0.1 for `rbd`), and it acts like a
# larger learning rate. Per setting: each norm's Gaussian gain (per layer,
# from the model's shapes), the gain measured on real activations where a
# run has `gain.json` (`python -m train.gain RUN_DIR`), the best test error,
# and Spearman's rank correlation of gain with best error across the norms.

# %%
show(report.gain_tables(GROUPS) if GROUPS else [],
     f"No runs in {rel(SWEEPS)}/: no gains to show.")

# %% [markdown]
# Calibrated measures (`--calibration normal`: every measure has
# BatchNorm's Gaussian gain 1) against the raw ones and BatchNorm, and
# BatchNorm given a measure's Gaussian gain (`--norm bn_gain:<measure>`);
# differences of means over independent seeds ± their standard error
# $\sqrt{s_a^2/n_a + s_b^2/n_b}$.

# %%
show(report.calibration_table(RUNS),
     "No calibrated runs (--calibration normal) yet.")

# %% [markdown]
# ## Curves
#
# Per setting: training loss and test error against epochs and wall-clock
# seconds, the mean over seeds with a ±std band, one line per norm (the
# legend counts finished and unfinished runs). These are the figures of
# `python -m train.report`. The batch-size study's settings, a few epochs
# each, are drawn above by batch size instead.

# %%
if not GROUPS:
  print(f"No runs in {rel(SWEEPS)}/: no curves to draw.")
IN_BATCH_STUDY = {run.path for run in BATCH_RUNS}
with tempfile.TemporaryDirectory() as tmp:
  for index, by_norm in enumerate(GROUPS.values()):
    if all(run.path in IN_BATCH_STUDY
           for runs in by_norm.values() for run in runs):
      continue
    path = report.curves_figure(by_norm, setting_label(by_norm),
                                Path(tmp) / f"curves_{index}.png")
    display(Image(filename=path, width=900))

# %% [markdown]
# ## Activations (the paper's Figure 1)
#
# For runs trained with `--record-activations K` (e.g. `python -m train.mnist
# ... --record-activations 10 --workdir results/activations/NORM`), in
# `results/activations/` or in a sweep: percentile bands of one feature over
# the batch, before and after one norm layer, over training iterations; one
# column per norm (its first seed).

# %%
ACTIVATION_RUNS = [
    run for run in [*RUNS, *load(ACTIVATIONS, "activation recordings")]
    if (run.path / report.ACTIVATIONS_FILE).exists()]
if not ACTIVATION_RUNS:
  print(f"No run in {rel(SWEEPS)}/ or {rel(ACTIVATIONS)}/ has"
        f" {report.ACTIVATIONS_FILE}: no activations to draw.")
with tempfile.TemporaryDirectory() as tmp:
  for index, by_norm in enumerate(report.group_runs(ACTIVATION_RUNS).values()):
    chosen = [runs[0] for runs in by_norm.values()]
    path = report.activations_figure(chosen, Path(tmp) / f"act_{index}.png")
    if path:
      display(Image(filename=path, width=900))

# %% [markdown]
# ## Runs
#
# Every run directory found under `results/sweeps/`, with its state.

# %%
show(report.run_list(RUNS, SWEEPS / "report.md") if RUNS else [],
     f"No runs in {rel(SWEEPS)}/.")
