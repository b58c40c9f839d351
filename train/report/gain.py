"""The report's gain section: Gaussian and measured gains against error.

The Gaussian gain of each norm layer is what training recorded in
``norm_layers.json`` (``train.loop.capture``); the measured one is ``gain.json``
(``python -m train.gain``). Both are read, never computed here, so that the
report needs no jax.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
from typing import Any

import numpy as np

from train.report.runs import Cell
from train.report.runs import Run
from train.report.runs import first_config
from train.report.runs import mean_std
from train.report.runs import norm_order
from train.report.runs import pm
from train.report.runs import row_extra
from train.report.runs import setting_label
from train.report.runs import warn

GAIN_FILE = "gain.json"
#: Stages of ``gain.json`` (``python -m train.gain``), in table order.
GAIN_STAGES = ("init", "final")


def read_gain(run: Run) -> dict[str, Any] | None:
  """The run's ``gain.json`` (``python -m train.gain``), or ``None``."""
  path = run.path / GAIN_FILE
  if not path.exists():
    return None
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    warn(f"skipped {path}: {e}")
    return None
  return data if isinstance(data, dict) else None


def measured_gains(runs: Sequence[Run], stage: str) -> list[float]:
  """``overall`` gain of ``stage`` of each run that has it in ``gain.json``."""
  gains = []
  for run in runs:
    entry = (read_gain(run) or {}).get(stage)
    if isinstance(entry, dict) and entry.get("overall") is not None:
      gains.append(float(entry["overall"]))
  return gains


#: What training records of its norm layers: each one's ``n`` and Gaussian
#: gain (``train.loop.capture.NORM_LAYERS_FILE``; a test keeps the two equal).
NORM_LAYERS_FILE = "norm_layers.json"
#: Fields of ``norm_layers.json`` that must match the run's config.
_RECORDED_FIELDS = ("dataset", "model", "batch_size", "norm", "calibration")


def gaussian_layer_gains(run: Run) -> dict[str, float] | None:
  """``{norm layer: Gaussian gain}`` as the run recorded it.

  The gain ``sigma/D`` a Gaussian feature of each layer's ``n`` values
  meets (``train.loop.capture.gaussian_gain``), from the run's
  ``norm_layers.json``. ``None`` (the table shows '–') where the run has no
  readable one, or one of another config: runs trained before training
  wrote it get it from ``python -m train.gain --norm-layers RUN...``.
  """
  path = run.path / NORM_LAYERS_FILE
  if not path.exists():
    return None
  try:
    record = json.loads(path.read_text())
    gains = {
        name: float(entry["gaussian"])
        for name, entry in record["layers"].items()
    }
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    warn(f"skipped {path}: {e!r}")
    return None
  differ = [
      field
      for field in _RECORDED_FIELDS
      if record.get(field) != run.config.get(field)
  ]
  if differ:
    warn(f"skipped {path}: its {', '.join(differ)} differ from config.json")
    return None
  return gains


def _gain_range(gains: dict[str, float] | None) -> str:
  if not gains:
    return "–"
  low, high = min(gains.values()), max(gains.values())
  return (
      f"{low:.3f}"
      if f"{low:.3f}" == f"{high:.3f}"
      else (f"{low:.3f}–{high:.3f}")
  )


def rank_correlation(
    gains: Sequence[float], errors: Sequence[float]
) -> tuple[float, float] | None:
  """Spearman's rho and its p-value; ``None`` below 3 points or for a
  constant input (rho is undefined there)."""
  if len(gains) < 3 or len(set(gains)) < 2 or len(set(errors)) < 2:
    return None
  from scipy import stats  # pylint: disable=g-import-not-at-top

  result = stats.spearmanr(gains, errors)
  return float(result.statistic), float(result.pvalue)


def _rho_text(pairs: Sequence[tuple[float, float]]) -> str:
  rho = rank_correlation([g for g, _ in pairs], [e for _, e in pairs])
  if rho is None:
    return f"– ({len(pairs)} norms" + (
        ", gain constant)" if len(pairs) >= 3 else ")"
    )
  return f"{rho[0]:+.2f} (p={rho[1]:.2g}, {len(pairs)} norms)"


def gain_tables(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Markdown lines: per setting, each norm's gain and best error, and the
  rank correlation of gain with best error across norms.

  The Gaussian gain of a norm is the median over its layers (each layer's
  as recorded in training, see :func:`gaussian_layer_gains`), as ``gain.json``'s
  ``overall`` is of the measured ones; a measured gain is the mean over the
  runs (seeds) that have a ``gain.json``.
  """
  extra = row_extra(groups)
  lines, rho_rows = [], []
  for by_norm in groups.values():
    config = first_config(by_norm)
    label = setting_label(config, extra)
    rows, pairs = [], {"gaussian": [], **{s: [] for s in GAIN_STAGES}}
    for norm in norm_order(by_norm):
      cell = Cell.of(by_norm[norm])
      errors = cell.best_errors()
      layer_gains = gaussian_layer_gains(
          cell.finished[0] if cell.finished else by_norm[norm][0]
      )
      texts = []
      if errors:
        error = mean_std(errors)[0]
        if layer_gains:
          pairs["gaussian"].append(
              (float(np.median(list(layer_gains.values()))), error)
          )
      for stage in GAIN_STAGES:
        measured = measured_gains(cell.finished, stage)
        if measured:
          texts.append(
              f"{pm(*mean_std(measured), digits=3)} " f"(n={len(measured)})"
          )
          if errors:
            pairs[stage].append((float(np.mean(measured)), error))
        else:
          texts.append("–")
      best = (
          f"{pm(*mean_std(errors))} (n={len(errors)})"
          if errors
          else cell.others_text() or "–"
      )
      rows.append(
          f"| {norm} | {_gain_range(layer_gains)} | "
          + " | ".join(texts)
          + f" | {best} |"
      )
    lines += [
        f"**{label}**",
        "",
        "| norm | Gaussian gain σ/D (per layer) | measured gain at "
        "init | measured gain after training | best test error (%) |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    rho_rows.append(
        f"| {label} | {_rho_text(pairs['gaussian'])} | "
        f"{_rho_text(pairs['init'])} | "
        f"{_rho_text(pairs['final'])} |"
    )
  return lines + [
      "Spearman's rank correlation of gain with mean best test error, "
      "across the norms of a setting (`scipy.stats.spearmanr`; p: its "
      "two-sided p-value, small n). Negative: the larger the gain, the "
      "lower the error. A measured gain enters for the norms where a "
      "finished run has one (its mean over those runs, as in the table "
      "above); '–' where fewer than 3 norms or a constant "
      "gain (calibrated norms all have Gaussian gain 1) leave it undefined.",
      "",
      "| setting | ρ, Gaussian gain | ρ, measured gain at init | "
      "ρ, measured gain after training |",
      "|---|---|---|---|",
      *rho_rows,
      "",
  ]
