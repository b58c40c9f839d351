"""The report's tables: test error, convergence, learning rate, precise
statistics, calibration (markdown lines)."""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
from typing import Any

import numpy as np

from train.report.runs import Cell
from train.report.runs import Run
from train.report.runs import first_config
from train.report.runs import group_runs
from train.report.runs import mean_std
from train.report.runs import norm_order
from train.report.runs import pm
from train.report.runs import row_extra
from train.report.runs import setting_key
from train.report.runs import setting_label

#: The paper's Table 2 (original CIFAR-10, LeNet, batch 1024, lr 0.1,
#: 200 epochs; best test error %, mean ± std over runs). Its SD is BatchNorm.
PAPER_TABLE2_CIFAR10_LENET = {
    "bn": (28.74, 0.36),
    "mad": (29.03, 0.37),
    "rsd": (29.19, 0.45),
    "rbd": (31.16, 0.30),
    "sqd1": (46.64, 4.05),
    "sqd2": (27.23, 0.19),
    "sqd3": (27.17, 0.27),
}


def error_table(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Markdown lines of the test-error table (paper layout)."""
  norms = norm_order(n for g in groups.values() for n in g)
  extra = row_extra(groups)
  lines = [
      "| setting | " + " | ".join(norms) + " |",
      "|---|" + "---|" * len(norms),
  ]
  for by_norm in groups.values():
    config = first_config(by_norm)
    cells = {n: Cell.of(by_norm.get(n, [])) for n in norms}
    means = {
        n: mean_std(c.best_errors())[0]
        for n, c in cells.items()
        if c.best_errors()
    }
    best = min(means.values()) if means else None
    texts = []
    for n in norms:
      cell = cells[n]
      text = ""
      if cell.best_errors():
        mean, std = mean_std(cell.best_errors())
        text = pm(mean, std)
        if mean == best:
          text = f"**{text}**"
        text += f" (n={len(cell.best_errors())})"
      if cell.others:
        text = (text + "; " if text else "") + cell.others_text()
      texts.append(text or "–")
    lines.append(
        f"| {setting_label(config, extra)} | " + " | ".join(texts) + " |"
    )
    if _is_paper_table2(config):
      paper = [
          (
              pm(*PAPER_TABLE2_CIFAR10_LENET[n])
              if n in PAPER_TABLE2_CIFAR10_LENET
              else ""
          )
          for n in norms
      ]
      lines.append(
          "| *paper, Table 2 (original CIFAR-10, 200 epochs)* | "
          + " | ".join(paper)
          + " |"
      )
  return lines


def _is_paper_table2(config: dict[str, Any]) -> bool:
  return (
      config.get("dataset") == "cifar10"
      and config.get("model") == "lenet"
      and config.get("batch_size") == 1024
      and config.get("learning_rate") == 0.1
  )


@dataclasses.dataclass
class Reach:
  """When each run of a cell first reached a target error."""

  epochs: list[int]
  seconds: list[float]
  total: int

  @classmethod
  def of(cls, runs: Sequence[Run], target: float) -> Reach:
    epochs, seconds = [], []
    for run in runs:
      for row in run.rows:
        error = row.get("test_error")
        if error is not None and 100 * error <= target:
          epochs.append(row["epoch"])
          seconds.append(row["elapsed_seconds"])
          break
    return cls(epochs, seconds, len(runs))

  def text(self, own_target: bool = False) -> tuple[str, str]:
    """``(epochs, seconds)`` cells; ``own_target``: the target is the mean
    final error of these very runs (BatchNorm's row), which those above
    their mean never reach."""
    if not self.epochs:
      return f"not reached (0 of {self.total} runs)", "not reached"
    note = (
        ""
        if len(self.epochs) == self.total
        else (
            f", {len(self.epochs)} of {self.total} runs reached it"
            + (" (the target is their own mean)" if own_target else "")
        )
    )
    epochs = pm(*mean_std(self.epochs), digits=1) + note
    seconds = pm(*mean_std(self.seconds), digits=0) + note
    return epochs, seconds


def _speed_key(config: dict[str, Any]) -> str:
  return setting_key(config, ("epochs", "eval_every")) + config["norm"]


def epoch_seconds(timing_runs: Sequence[Run]) -> dict[str, float]:
  """Median seconds per epoch of each (setting, norm) among ``timing_runs``.

  Timing runs are separate runs on an otherwise idle machine; their epochs
  give each norm's speed where the runs of a sweep shared the machine.
  """
  by_key: dict[str, list[float]] = {}
  for run in timing_runs:
    by_key.setdefault(_speed_key(run.config), []).extend(
        row["seconds"] for row in run.rows
    )
  return {k: float(np.median(v)) for k, v in by_key.items() if v}


def convergence_table(
    groups: dict[str, dict[str, list[Run]]],
    quiet: dict[str, float] | None = None,
) -> list[str]:
  """Markdown lines: epochs and seconds to reach BatchNorm's final error.

  With ``quiet`` (:func:`epoch_seconds`), also the seconds to target at the
  timing runs' speed: the epochs to target times their seconds per epoch
  (columns left out without timing runs; empty for a norm without one).
  """
  extra = row_extra(groups)
  quiet = quiet or {}
  lines = []
  for by_norm in groups.values():
    config = first_config(by_norm)
    baseline = Cell.of(by_norm.get("bn", []))
    lines.append(f"**{setting_label(config, extra)}**")
    lines.append("")
    if not baseline.final_errors():
      lines += ["No finished BatchNorm (`bn`) run here, so no target.", ""]
      continue
    target = mean_std(baseline.final_errors())[0]
    quiet_header = (
        "quiet seconds per epoch | seconds to target at quiet " "speed | "
        if quiet
        else ""
    )
    lines += [
        f"Target: {target:.2f} % (BatchNorm's mean final test error, "
        f"n={len(baseline.final_errors())}).",
        "",
        "| norm | epochs to target | seconds to target | "
        f"seconds per epoch | {quiet_header}final test error (%) |",
        "|---|---|---|---|" + ("---|---|" if quiet else "") + "---|",
    ]
    for norm in norm_order(by_norm):
      cell = Cell.of(by_norm[norm])
      if not cell.finished:
        lines.append(
            f"| {norm} | {cell.others_text()} | | |"
            + (" | |" if quiet else "")
            + " |"
        )
        continue
      reach = Reach.of(cell.finished, target)
      epochs, seconds = reach.text(own_target=norm == "bn")
      per_epoch = [r["seconds"] for run in cell.finished for r in run.rows]
      final = pm(*mean_std(cell.final_errors()))
      speed = quiet.get(_speed_key(cell.finished[0].config))
      quiet_text = quiet_reach = ""
      if speed is not None:
        quiet_text = f"{speed:.1f}"
        quiet_reach = (
            pm(*mean_std([e * speed for e in reach.epochs]), digits=0)
            if reach.epochs
            else "not reached"
        )
      quiet_cells = f"{quiet_text} | {quiet_reach} | " if quiet else ""
      lines.append(
          f"| {norm} | {epochs} | {seconds} | "
          f"{pm(*mean_std(per_epoch), digits=1)} | {quiet_cells}"
          f"{final} |"
      )
    lines.append("")
  return lines


def best_lr_table(runs: Sequence[Run]) -> list[str]:
  """Markdown lines: each norm's best mean over the learning-rate grid."""
  groups = group_runs(runs, drop=("learning_rate",))
  lines = []
  for by_norm in groups.values():
    rates = sorted(
        {r.config["learning_rate"] for rs in by_norm.values() for r in rs}
    )
    if len(rates) < 2:
      continue
    config = dict(first_config(by_norm), learning_rate="grid")
    lines += [
        f"**{setting_label(config, [])}**, learning rates "
        + ", ".join(map(str, rates)),
        "",
        "| norm | best mean test error (%) | at lr | mean per lr |",
        "|---|---|---|---|",
    ]
    for norm in norm_order(by_norm):
      per_lr = {}
      for rate in rates:
        cell = Cell.of(
            [r for r in by_norm[norm] if r.config["learning_rate"] == rate]
        )
        if cell.best_errors():
          per_lr[rate] = mean_std(cell.best_errors())
      if not per_lr:
        lines.append(f"| {norm} | no finished run | | |")
        continue
      rate = min(per_lr, key=lambda k: per_lr[k][0])
      listing = ", ".join(f"{k}: {v[0]:.2f}" for k, v in per_lr.items())
      lines.append(f"| {norm} | {pm(*per_lr[rate])} | {rate} | {listing} |")
    lines.append("")
  return lines


def precise_table(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Markdown lines: final test error with running averages vs precise stats.

  Only finished runs whose last evaluation has ``test_error_precise`` (runs
  trained with ``--precise-stats``) enter; the difference is paired per run
  (precise minus EMA, percentage points), negative when precise statistics
  help.
  """
  extra = row_extra(groups)
  lines = []
  for by_norm in groups.values():
    rows = []
    for norm in norm_order(by_norm):
      pairs = [
          (100 * run.final_error(), 100 * run.final_error("test_error_precise"))
          for run in Cell.of(by_norm[norm]).finished
          if run.rows[-1].get("test_error_precise") is not None
      ]
      if not pairs:
        continue
      ema, precise = (list(v) for v in zip(*pairs))
      rows.append(
          f"| {norm} | {pm(*mean_std(ema))} | "
          f"{pm(*mean_std(precise))} | "
          f"{pm(*mean_std([p - e for e, p in pairs]))} | "
          f"{len(pairs)} |"
      )
    if rows:
      lines += [
          f"**{setting_label(first_config(by_norm), extra)}**",
          "",
          "| norm | final test error, running averages (%) | "
          "final test error, precise statistics (%) | precise − "
          "running (points, paired) | n |",
          "|---|---|---|---|---|",
          *rows,
          "",
      ]
  return lines


def _difference(a: Sequence[float], b: Sequence[float]) -> str:
  """``mean(a) - mean(b) ± sqrt(var_a/n_a + var_b/n_b)`` (sample variances)."""
  if not a or not b:
    return ""
  diff = float(np.mean(a) - np.mean(b))
  if len(a) < 2 or len(b) < 2:
    return f"{diff:+.2f} (n={len(a)}, {len(b)})"
  se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
  return f"{diff:+.2f} ± {se:.2f} (n={len(a)}, {len(b)})"


def _is_calibrated(config: dict[str, Any]) -> bool:
  # "none" (the CLI's spelling and the added field's default) or None: raw.
  return config.get("calibration") == "normal"


def calibration_table(runs: Sequence[Run]) -> list[str]:
  """Markdown lines: raw vs calibrated measures vs BatchNorm, per setting.

  A setting here is a config less norm, seed and calibration, so that a
  measure's raw and calibrated runs and BatchNorm's share a row group; only
  settings with a calibrated run are shown. Cells are best test errors
  (mean ± std over seeds); differences are of means, ± their standard error
  over independent seeds.
  """
  groups = group_runs(runs, drop=("calibration",))
  extra = row_extra(groups)
  lines = []
  for by_norm in groups.values():

    def errors(
        norm: str, calibrated: bool | None = None, by_norm=by_norm
    ) -> list[float]:
      chosen = [
          r
          for r in by_norm.get(norm, [])
          if calibrated is None or _is_calibrated(r.config) == calibrated
      ]
      return Cell.of(chosen).best_errors()

    calibrated = [
        n for n in by_norm if errors(n, True) and n not in ("bn", "sd")
    ]
    if not calibrated:
      continue
    bn = errors("bn")  # bn ignores calibration: all its runs are BatchNorm
    config = dict(first_config(by_norm), calibration="none|normal")
    lines += [
        f"**{setting_label(config, extra)}**",
        "",
        "| norm | raw | calibrated | BatchNorm with its Gaussian gain "
        "(`bn_gain:`) | calibrated − BatchNorm | raw − calibrated | "
        "`bn_gain:` − BatchNorm |",
        "|---|---|---|---|---|---|---|",
    ]
    if bn:
      lines.append(f"| bn | {pm(*mean_std(bn))} (n={len(bn)}) | | | | | |")
    for norm in norm_order(n for n in by_norm if not n.startswith("bn_gain:")):
      if norm == "bn":
        continue
      raw, cal = errors(norm, False), errors(norm, True)
      gain = errors(f"bn_gain:{norm}")
      if not raw and not cal:
        continue
      cells = [
          f"{pm(*mean_std(v))} (n={len(v)})" if v else "–"
          for v in (raw, cal, gain)
      ]
      lines.append(
          f"| {norm} | " + " | ".join(cells) + " | "
          f"{_difference(cal, bn)} | {_difference(raw, cal)} | "
          f"{_difference(gain, bn)} |"
      )
    lines.append("")
  return lines
