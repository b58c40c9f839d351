"""The report's figures (PNG): learning curves, recorded activations, best
error against batch size, curvature along training."""

from __future__ import annotations

from collections.abc import Sequence
import json
from pathlib import Path
import re
from typing import Any

import numpy as np

from train.report import plot
from train.report.curvature import CurvatureStudy
from train.report.curvature import Point
from train.report.runs import ACTIVATIONS_FILE
from train.report.runs import NORM_ORDER
from train.report.runs import Run
from train.report.runs import norm_order


def slug(text: str) -> str:
  """``text`` as a file-name part (letters, digits, dots, ``_``)."""
  return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def curves_figure(
    by_norm: dict[str, list[Run]], title: str, path: Path
) -> Path:
  """Writes the 2x2 curves of one setting: mean over seeds, ±std band."""
  fig, axes = plot.plt.subplots(2, 2, figsize=(12, 7.5))
  for ax, (metric, ylabel, xkey, xlabel) in zip(axes.T.flat, plot.CURVES):
    for norm in norm_order(by_norm):
      runs = [r for r in by_norm[norm] if r.rows]
      epochs = sorted({row["epoch"] for r in runs for row in r.rows})
      xs, means, stds = [], [], []
      for epoch in epochs:
        at = [
            row
            for r in runs
            for row in r.rows
            if row["epoch"] == epoch and row.get(metric) is not None
        ]
        if not at:
          continue
        ys = [
            row[metric] * (100 if metric == "test_error" else 1) for row in at
        ]
        xs.append(float(np.mean([row[xkey] for row in at])))
        means.append(float(np.mean(ys)))
        stds.append(float(np.std(ys, ddof=1)) if len(ys) > 1 else 0.0)
      if not xs:
        continue
      done = sum(r.finished for r in runs)
      label = f"{norm} (n={done}" + (
          f", +{len(runs) - done} unfinished)" if done < len(runs) else ")"
      )
      (line,) = ax.plot(xs, means, marker="o", markersize=3, label=label)
      ax.fill_between(
          xs,
          np.subtract(means, stds),
          np.add(means, stds),
          color=line.get_color(),
          alpha=0.2,
          linewidth=0,
      )
    plot.style_axes(ax, metric, xkey, xlabel, ylabel)
    ax.set_title(f"{ylabel} vs {xlabel}")
  axes[0, 1].legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      fontsize="small",
      title="mean ± std over seeds",
  )
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plot.plt.close(fig)
  return path


def read_activations(run: Run) -> list[dict[str, Any]]:
  """The run's ``activations.jsonl`` rows (none without one)."""
  path = run.path / ACTIVATIONS_FILE
  if not path.exists():
    return []
  return [
      json.loads(line) for line in path.read_text().splitlines() if line.strip()
  ]


def activations_figure(runs: Sequence[Run], path: Path) -> Path | None:
  """Percentile bands of the recorded feature, before and after the norm.

  One column per run (BatchNorm first), rows: before / after the layer; the
  panels of a row share their y-scale, so that spreads compare.
  """
  recorded = [(r, read_activations(r)) for r in runs]
  recorded = [(r, rows) for r, rows in recorded if rows]
  if not recorded:
    return None
  recorded.sort(
      key=lambda item: norm_order([item[0].config["norm"], *NORM_ORDER]).index(
          item[0].config["norm"]
      )
  )
  # One y-scale per row: the spread of the feature under each norm is what
  # the panels of a row compare.
  fig, axes = plot.plt.subplots(
      2,
      len(recorded),
      squeeze=False,
      figsize=(4.5 * len(recorded), 6.5),
      sharex="col",
      sharey="row",
  )
  for column, (run, rows) in enumerate(recorded):
    percentiles = rows[0]["percentiles"]
    steps = np.array([row["step"] for row in rows])
    for row_index, key in enumerate(("before", "after")):
      ax = axes[row_index, column]
      values = np.array([row[key] for row in rows])  # (records, percentiles)
      middle = len(percentiles) // 2
      # Outer bands light, inner dark, opaque and drawn outside in, so that
      # each band has its own clearly different colour.
      shades = plot.plt.cm.Blues(np.linspace(0.3, 0.75, max(middle, 1)))
      for i in range(middle):
        ax.fill_between(
            steps,
            values[:, i],
            values[:, -1 - i],
            color=shades[i],
            linewidth=0,
            label=f"{percentiles[i]:g}-{percentiles[-1 - i]:g}th",
        )
      ax.plot(
          steps,
          values[:, middle],
          color="C3",
          label=f"{percentiles[middle]:g}th (median)",
      )
      ax.axhline(0, color="k", linewidth=0.6)
      ax.set_title(f"{run.config['norm']}: {key} {rows[0]['layer']}")
      ax.set_xlabel("training iteration")
      ax.set_ylabel(f"feature {rows[0]['feature']} value")
      ax.grid(True, alpha=0.3)
  axes[0, -1].legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      fontsize="small",
      title="percentiles over the batch",
  )
  fig.suptitle(
      "Distribution of one feature over training (cf. the paper's " "Figure 1)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plot.plt.close(fig)
  return path


#: Markers of the batch-size figure's conditions, in turn.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">")


def batch_size_figure(
    conditions: dict[str, dict[int, list[Run]]], path: Path
) -> Path:
  """Writes best test error against batch size, one line per condition.

  Means over the finished runs (seeds) with ±std bars; group norms
  (``gn``, ``gn:<measure>``) dashed, batch norms solid, so that the two
  families read apart whatever their colours.
  """
  sizes = sorted({b for by_size in conditions.values() for b in by_size})
  fig, ax = plot.plt.subplots(figsize=(7.5, 4.5))
  for index, (label, by_size) in enumerate(conditions.items()):
    xs, means, stds = [], [], []
    for size in sorted(by_size):
      errors = [
          100 * e
          for e in (r.best_error() for r in by_size[size] if r.finished)
          if e is not None
      ]
      if not errors:
        continue
      xs.append(size)
      means.append(float(np.mean(errors)))
      stds.append(float(np.std(errors, ddof=1)) if len(errors) > 1 else 0.0)
    if not xs:
      continue
    norm = next(iter(by_size.values()))[0].config["norm"]
    ax.errorbar(
        xs,
        means,
        yerr=stds,
        label=label,
        color=f"C{index % 10}",
        marker=_MARKERS[index % len(_MARKERS)],
        markersize=4,
        linestyle="--" if norm.split(":")[0] == "gn" else "-",
        capsize=3,
        linewidth=1.2,
    )
  ax.set_xscale("log", base=2)
  ax.set_xticks(sizes, [str(b) for b in sizes])
  ax.xaxis.set_minor_locator(plot.ticker.NullLocator())
  ax.set_xlabel("batch size")
  ax.set_ylabel("best test error (%)")
  ax.set_title("Best test error against batch size (mean ± std over seeds)")
  ax.grid(True, alpha=0.3)
  ax.legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      fontsize="small",
      title="solid: batch norms, dashed: group norms",
      title_fontsize="small",
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plot.plt.close(fig)
  return path


#: The curvature figure's panels: (title, point values, log scale).
_CURVATURE_PANELS = (
    ("top Hessian eigenvalue", (lambda p: p.top_eigenvalue,), True),
    ("Hessian trace", (lambda p: p.trace,), True),
    (
        "error (%): test solid, train dashed",
        (lambda p: p.test_error, lambda p: p.train_error),
        False,
    ),
    (
        "generalization gap (test − train error, points)",
        (Point.gap.fget,),
        False,
    ),
)


def _series(
    points: Sequence[Point], value, log: bool
) -> tuple[list[int], list[float]]:
  """Epochs and values of ``points`` that have one (positive on a log
  axis, where no other value can be drawn)."""
  pairs = [(p.epoch, value(p)) for p in points]
  pairs = [(e, v) for e, v in pairs if v is not None and (v > 0 or not log)]
  return [e for e, _ in pairs], [v for _, v in pairs]


def curvature_figure(study: CurvatureStudy, path: Path) -> Path:
  """Writes four panels against epoch, one colour per condition: the top
  eigenvalue and the trace (log scales), training and test error, and
  their gap; the mean over seeds bold, each seed thin."""
  # One epoch axis for all panels, so that the errors, which have no epoch
  # 0 (the initial parameters), line up with the curvature above them.
  fig, axes = plot.plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
  for ax, (title, values, log) in zip(axes.flat, _CURVATURE_PANELS):
    for index, (label, by_epoch) in enumerate(study.conditions.items()):
      color = f"C{index % 10}"
      points = [p for group in by_epoch.values() for p in group]
      for value, style in zip(values, ("-", "--")):
        for run in sorted({p.run for p in points}):
          xs, ys = _series([p for p in points if p.run == run], value, log)
          ax.plot(
              xs, ys, color=color, linestyle=style, linewidth=0.7, alpha=0.4
          )
        xs, means = [], []
        for epoch, group in by_epoch.items():
          _, ys = _series(group, value, log)
          if ys:
            xs.append(epoch)
            means.append(float(np.mean(ys)))
        ax.plot(
            xs,
            means,
            color=color,
            linestyle=style,
            marker="o",
            markersize=3,
            linewidth=1.6,
            label=label if style == "-" else None,
        )
    if log:
      ax.set_yscale("log")
      ax.yaxis.set_major_locator(plot.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.yaxis.set_major_formatter(
          plot.ticker.FuncFormatter(lambda value, _: f"{value:g}")
      )
      ax.yaxis.set_minor_formatter(plot.ticker.NullFormatter())
    ax.xaxis.set_major_locator(plot.ticker.MaxNLocator(integer=True))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
  for ax in axes[1]:
    ax.set_xlabel("epoch")
  axes[0, 1].legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      fontsize="small",
      title="mean over seeds (thin: each seed)",
      title_fontsize="small",
  )
  fig.suptitle(
      "Curvature of the training loss (weight decay's shift taken off)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plot.plt.close(fig)
  return path
