"""The report's batch-size study: best test error per condition and batch
size (markdown lines).

A batch-size study trains the same conditions (norms and their options) at
several batch sizes, each with its own learning rate; the settings of the
other tables then scatter it over one row per batch size.
"""

from __future__ import annotations

from collections.abc import Sequence

from train.report.labels import condition_text
from train.report.labels import varying_fields
from train.report.runs import Cell
from train.report.runs import Run
from train.report.runs import mean_std
from train.report.runs import norm_order
from train.report.runs import pm

#: Fields a batch-size study varies along its axis, not between conditions.
BATCH_AXIS_FIELDS = ("batch_size", "learning_rate", "seed")


def batch_sizes(runs: Sequence[Run]) -> list[int]:
  """The runs' batch sizes, ascending."""
  return sorted({r.config["batch_size"] for r in runs})


def batch_conditions(runs: Sequence[Run]) -> dict[str, dict[int, list[Run]]]:
  """``{condition label: {batch size: runs}}`` of a batch-size study.

  A condition is a config less :data:`BATCH_AXIS_FIELDS`; its label names
  the norm and the fields that differ between conditions. Conditions are
  in the norms' column order, then by label.
  """
  fields = varying_fields(
      [r.config for r in runs], exclude=("norm", *BATCH_AXIS_FIELDS)
  )
  by_label: dict[str, dict[int, list[Run]]] = {}
  norms: dict[str, str] = {}
  for run in runs:
    label = condition_text(run.config, fields)
    norms[label] = run.config["norm"]
    by_label.setdefault(label, {}).setdefault(
        run.config["batch_size"], []
    ).append(run)
  rank = {n: i for i, n in enumerate(norm_order(norms.values()))}
  return {
      label: by_label[label]
      for label in sorted(by_label, key=lambda k: (rank[norms[k]], k))
  }


def batch_study(runs: Sequence[Run]) -> list[Run]:
  """The runs of the conditions run at two or more batch sizes.

  Runs of several settings (datasets, say) that differ in batch size too
  are no batch-size study: each of their conditions has one batch size.
  """
  return [
      run
      for by_size in batch_conditions(runs).values()
      if len(by_size) > 1
      for size_runs in by_size.values()
      for run in size_runs
  ]


def batch_size_table(runs: Sequence[Run]) -> list[str]:
  """Markdown lines: best test error per condition (rows) and batch size.

  A cell is the best test error of its finished runs, mean ± std over
  seeds (n), as in :func:`train.report.tables.error_table`; the lowest mean
  of a column is in bold. ``runs`` are those of :func:`batch_study`; empty
  without any.
  """
  sizes = batch_sizes(runs)
  if len(sizes) < 2:
    return []
  conditions = batch_conditions(runs)
  cells = {
      (label, size): Cell.of(by_size.get(size, []))
      for label, by_size in conditions.items()
      for size in sizes
  }
  best = {}
  for size in sizes:
    means = [
        mean_std(cells[label, size].best_errors())[0]
        for label in conditions
        if cells[label, size].best_errors()
    ]
    best[size] = min(means) if means else None
  lines = [
      "| condition | " + " | ".join(f"batch {b}" for b in sizes) + " |",
      "|---|" + "---|" * len(sizes),
  ]
  for label in conditions:
    texts = []
    for size in sizes:
      cell = cells[label, size]
      text = ""
      if cell.best_errors():
        mean, std = mean_std(cell.best_errors())
        text = pm(mean, std)
        if mean == best[size]:
          text = f"**{text}**"
        text += f" (n={len(cell.best_errors())})"
      if cell.others:
        text = (text + "; " if text else "") + cell.others_text()
      texts.append(text or "–")
    lines.append(f"| {label} | " + " | ".join(texts) + " |")
  return lines


def batch_size_note(runs: Sequence[Run]) -> str:
  """The learning rate of each batch size and the steps, as in the runs."""
  rates = []
  for size in batch_sizes(runs):
    found = sorted(
        {
            r.config["learning_rate"]
            for r in runs
            if r.config["batch_size"] == size
        }
    )
    rates.append(f"{size}: {', '.join(map(str, found))}")
  steps = {r.config.get("steps") for r in runs}
  if len(steps) == 1 and None not in steps:
    length = f"{steps.pop()} optimizer steps at every batch size"
  else:
    length = "Training lengths: " + ", ".join(
        sorted(
            {
                f"{r.config['steps']} optimizer steps"
                if r.config.get("steps") is not None
                else f"{r.config['epochs']} epochs"
                for r in runs
            }
        )
    )
  return f"Learning rate by batch size: {'; '.join(rates)}. {length}."
