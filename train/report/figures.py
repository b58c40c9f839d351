"""The report's figures: learning curves and recorded activations (PNG)."""

from __future__ import annotations

from collections.abc import Sequence
import json
from pathlib import Path
import re
from typing import Any

import numpy as np

from train.report import plot
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
