"""The report's curvature study: the loss's Hessian along training.

``python -m train.curvature RUN_DIR`` adds one line per measured checkpoint
to ``RUN_DIR/curvature.jsonl``: the top Hessian eigenvalues, Hutchinson's
trace and the gradient noise scale of the training loss, weight decay's
penalty included. Here each line is joined with the run's ``metrics.jsonl``
row of the same epoch, the decay's constant shift is taken off, and the
runs are pooled over seeds into conditions (the norm and the fields that
differ between conditions), one summary per condition and measured epoch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
import dataclasses
import json
import math
from typing import Any

from train.report.labels import condition_text
from train.report.labels import run_dir_names
from train.report.labels import varying_fields
from train.report.runs import Run
from train.report.runs import mean_std
from train.report.runs import norm_order
from train.report.runs import pm
from train.report.runs import warn
from train.run_files import CURVATURE_FILE

#: Fields a line must have to be summarized.
_REQUIRED = ("epoch", "eigenvalues", "trace", "weight_decay", "parameters")


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured checkpoint of one run, the weight decay's shift taken off.

  Attributes:
    run: The run's folder.
    epoch: The checkpoint's epoch (0: the initial parameters).
    top_eigenvalue: The largest Hessian eigenvalue less ``weight_decay``.
    trace: The Hessian's trace less ``weight_decay * parameters``.
    noise_scale: The gradient noise scale as recorded (``None``: undefined).
    train_error: ``metrics.jsonl``'s training error of the epoch, in %.
    test_error: Its test error, in %.
  """

  run: str
  epoch: int
  top_eigenvalue: float
  trace: float
  noise_scale: float | None
  train_error: float | None
  test_error: float | None

  @property
  def gap(self) -> float | None:
    """Test less training error, in percentage points."""
    if self.train_error is None or self.test_error is None:
      return None
    return self.test_error - self.train_error


#: A table column: (header, value of a point).
COLUMNS = (
    ("top eigenvalue", lambda p: p.top_eigenvalue),
    ("trace", lambda p: p.trace),
    ("noise scale", lambda p: p.noise_scale),
    ("train error (%)", lambda p: p.train_error),
    ("test error (%)", lambda p: p.test_error),
    ("gap (points)", lambda p: p.gap),
)
#: Columns shown to significant digits; the others (errors) to two decimals.
_SIGNIFICANT = {"top eigenvalue", "trace", "noise scale"}


@dataclasses.dataclass
class CurvatureStudy:
  """The measured checkpoints of a report's runs, by condition.

  Attributes:
    conditions: ``{condition label: {epoch: points}}``, one point per run
      measured at that epoch; conditions in the norms' column order.
    settings: The measurement settings of every point (``None``: no
      point).
    notes: Sentences on what was left out and why.
  """

  conditions: dict[str, dict[int, list[Point]]]
  settings: dict[str, Any] | None
  notes: list[str]


def read_curvature(run: Run) -> tuple[list[dict[str, Any]], list[str]]:
  """The usable lines of the run's ``curvature.jsonl`` and the problems.

  A missing file has no lines; a line that is not JSON or lacks a field is
  left out, with a problem naming its number (and a warning), so that one
  bad line costs one checkpoint, not the run.
  """
  path = run.path / CURVATURE_FILE
  try:
    text = path.read_text()
  except FileNotFoundError:
    return [], []
  except OSError as e:
    warn(f"skipped {path}: {e}")
    return [], [f"unreadable ({e.strerror or e})"]
  lines, problems = [], []
  for number, text_line in enumerate(text.splitlines(), start=1):
    if not text_line.strip():
      continue
    try:
      line = json.loads(text_line)
    except ValueError:
      problems.append(f"line {number} is not JSON")
      continue
    if not isinstance(line, dict):
      problems.append(f"line {number} is not a JSON object")
      continue
    missing = [f for f in _REQUIRED if f not in line]
    if missing or not line["eigenvalues"]:
      problems.append(
          f"line {number} lacks {', '.join(missing) or 'eigenvalues'}"
      )
      continue
    lines.append(line)
  for problem in problems:
    warn(f"{path}: {problem}, left out")
  return lines, problems


def settings_key(line: dict[str, Any]) -> str:
  """A line's measurement settings as comparable text."""
  return json.dumps(line.get("settings"), sort_keys=True)


def shifted(line: dict[str, Any]) -> tuple[float, float]:
  """``(top eigenvalue, trace)`` of a line less the weight decay's shift.

  The penalty ``weight_decay / 2 * |w|^2`` adds ``weight_decay`` to every
  eigenvalue and ``weight_decay * parameters`` to the trace.
  """
  decay = float(line["weight_decay"])
  return (
      float(line["eigenvalues"][0]) - decay,
      float(line["trace"]) - decay * float(line["parameters"]),
  )


def _percent(row: dict[str, Any] | None, key: str) -> float | None:
  value = None if row is None else row.get(key)
  return None if value is None else 100 * float(value)


def _point(run: Run, line: dict[str, Any]) -> Point:
  """A line of ``run`` joined with its metrics row of the same epoch (the
  last, should a resumed run have written one twice)."""
  row = None
  for candidate in run.rows:
    if candidate.get("epoch") == line["epoch"]:
      row = candidate
  noise = line.get("noise_scale")
  top, trace = shifted(line)
  return Point(
      run=str(run.path),
      epoch=int(line["epoch"]),
      top_eigenvalue=top,
      trace=trace,
      noise_scale=None if noise is None else float(noise),
      train_error=_percent(row, "train_error"),
      test_error=_percent(row, "test_error"),
  )


def _setting(config: dict[str, Any]) -> str:
  """A run's condition and setting: its config less the seed."""
  return json.dumps(
      {k: v for k, v in sorted(config.items()) if k != "seed"}, default=str
  )


def _names(runs: Sequence[Run], names: dict[str, str]) -> str:
  return ", ".join(names[str(r.path)] for r in runs)


def curvature_study(runs: Sequence[Run]) -> CurvatureStudy | None:
  """The curvature of ``runs``; ``None`` where none has ``curvature.jsonl``.

  The study holds the runs with a ``curvature.jsonl`` and the other seeds
  of their configs (listed in a note where they have none). Every point is
  of one settings group, the one most checkpoints were measured with:
  curvature measured on other samples or with other iterations would not
  average with it. Unfinished runs enter with the checkpoints they have; a
  checkpoint is the same whether or not its run went on.
  """
  measured = {str(r.path) for r in runs if (r.path / CURVATURE_FILE).exists()}
  if not measured:
    return None
  settings_of = {_setting(r.config) for r in runs if str(r.path) in measured}
  study = [r for r in runs if _setting(r.config) in settings_of]
  names = dict(
      zip((str(r.path) for r in study), run_dir_names([r.path for r in study]))
  )
  read = {str(r.path): read_curvature(r) for r in study}
  # One line per checkpoint and settings: the file's last, should a line
  # have been written twice.
  latest: dict[str, dict[tuple[int, str], dict[str, Any]]] = {}
  for run in study:
    lines = read[str(run.path)][0]
    latest[str(run.path)] = {
        (line["epoch"], settings_key(line)): line for line in lines
    }
  counts = Counter(key for by_epoch in latest.values() for _, key in by_epoch)
  # Most checkpoints first; the smaller text breaks a tie, so that the
  # choice is the same whichever order the files are read in.
  chosen = min(counts, key=lambda k: (-counts[k], k)) if counts else None
  notes = []
  others = sorted(k for k in counts if k != chosen)
  if others:
    notes.append(
        f"{sum(counts[k] for k in others)} measurement(s) with other "
        "settings left out ("
        + "; ".join(_settings_text(json.loads(k)) for k in others)
        + "): every number here is of the one settings group most "
        "checkpoints were measured with, so that all compare."
    )
  fields = varying_fields([r.config for r in study], exclude=("norm", "seed"))
  by_label: dict[str, dict[int, list[Point]]] = {}
  label_runs: dict[str, list[Run]] = {}
  norms: dict[str, str] = {}
  for run in study:
    label = condition_text(run.config, fields)
    norms[label] = run.config["norm"]
    label_runs.setdefault(label, []).append(run)
    epochs = by_label.setdefault(label, {})
    for (epoch, key), line in sorted(latest[str(run.path)].items()):
      if key == chosen:
        epochs.setdefault(epoch, []).append(_point(run, line))
  rank = {n: i for i, n in enumerate(norm_order(norms.values()))}
  order = sorted(by_label, key=lambda k: (rank[norms[k]], k))
  conditions = {label: dict(sorted(by_label[label].items())) for label in order}
  notes += _coverage_notes(
      {label: label_runs[label] for label in order}, conditions, read, names
  )
  return CurvatureStudy(
      conditions, json.loads(chosen) if chosen else None, notes
  )


def _coverage_notes(
    label_runs: dict[str, list[Run]],
    conditions: dict[str, dict[int, list[Point]]],
    read: dict[str, tuple[list[dict[str, Any]], list[str]]],
    names: dict[str, str],
) -> list[str]:
  """Notes on runs without a file, with bad lines or fewer checkpoints
  than their condition, and on unfinished runs."""
  runs = [r for group in label_runs.values() for r in group]
  notes = []
  missing = [r for r in runs if not (r.path / CURVATURE_FILE).exists()]
  absent = {str(r.path) for r in missing}
  if missing:
    notes.append(
        f"Without {CURVATURE_FILE} (not in the table): "
        f"{_names(missing, names)}."
    )
  problems = [
      f"{names[str(r.path)]}: {'; '.join(read[str(r.path)][1])}"
      for r in runs
      if read[str(r.path)][1]
  ]
  if problems:
    notes.append(f"Lines of {CURVATURE_FILE} left out: {'; '.join(problems)}.")
  partial = []
  for label, group in label_runs.items():
    epochs = conditions[label]
    for run in group:
      if str(run.path) in absent:
        continue
      lacking = [
          e
          for e, points in epochs.items()
          if all(p.run != str(run.path) for p in points)
      ]
      if lacking:
        partial.append(
            f"{names[str(run.path)]} lacks epoch(s) "
            f"{', '.join(map(str, lacking))}"
        )
  if partial:
    notes.append(
        "Measured at fewer epochs than its condition (n counts the runs "
        f"measured): {'; '.join(partial)}."
    )
  unfinished = [r for r in runs if not r.finished and str(r.path) not in absent]
  if unfinished:
    notes.append(
        "Unfinished runs, in with the checkpoints they have: "
        f"{_names(unfinished, names)}."
    )
  return notes


def _settings_text(settings: Any) -> str:
  if not isinstance(settings, dict):
    return "no settings recorded"
  return ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))


def settings_note(study: CurvatureStudy) -> str:
  """The measurement settings, as a sentence."""
  if not any(study.conditions.values()):
    return f"No usable line in any {CURVATURE_FILE}."
  return (
      f"Measured with `python -m train.curvature`'s settings "
      f"{_settings_text(study.settings)}."
  )


def significant(mean: float, std: float | None, digits: int = 4) -> str:
  """``mean ± std`` to ``digits`` significant digits of the mean, both with
  the mean's decimals (no exponent, so that columns read alike)."""
  magnitude = math.floor(math.log10(abs(mean))) if mean else 0
  decimals = min(max(digits - 1 - magnitude, 0), 8)
  return pm(mean, std, digits=decimals)


def curvature_table(study: CurvatureStudy) -> list[str]:
  """Markdown lines: one row per condition and measured epoch.

  Each cell is the mean ± sample std over the runs (seeds) measured at that
  epoch; ``n`` counts them, and a cell where fewer have a value (no noise
  scale, no metrics row) names its own n; '–' where none has.
  """
  lines = [
      "| condition | epoch | n | "
      + " | ".join(header for header, _ in COLUMNS)
      + " |",
      "|---|---|---|" + "---|" * len(COLUMNS),
  ]
  for label, by_epoch in study.conditions.items():
    for epoch, points in by_epoch.items():
      cells = []
      for header, value in COLUMNS:
        values = [v for v in map(value, points) if v is not None]
        if not values:
          cells.append("–")
          continue
        mean, std = mean_std(values)
        text = (
            significant(mean, std) if header in _SIGNIFICANT else pm(mean, std)
        )
        if len(values) < len(points):
          text += f" (n={len(values)})"
        cells.append(text)
      lines.append(
          f"| {label} | {epoch} | {len(points)} | " + " | ".join(cells) + " |"
      )
  return lines


#: What the section says of its numbers.
_ABOUT = (
    f"From each run's `{CURVATURE_FILE}` (`python -m train.curvature`): at "
    "each measured checkpoint (epoch 0: the initial parameters), the Hessian "
    "of the training loss (the mean cross-entropy in training mode on a "
    "fixed sample of training images, plus the weight decay's penalty "
    "weight_decay/2 · |w|²): its top eigenvalue (Lanczos) and its trace "
    "(Hutchinson); and the gradient noise scale tr(Σ)/|G|², as recorded. "
    "The penalty adds weight_decay to every eigenvalue and weight_decay × "
    "parameters to the trace; both are taken off here (top eigenvalue − "
    "weight_decay, trace − weight_decay × parameters, from each line's own "
    "record), so these are the cross-entropy's. Errors are "
    "`metrics.jsonl`'s of the same epoch: the training error over that "
    "epoch's steps (training mode) and the test error after it; the gap "
    "is test − training error of each run, in points. Conditions: the norm "
    "and the fields that differ between conditions, seeds pooled. Each "
    "cell: mean ± std over the seeds measured at that epoch (n; a cell's "
    "own n where fewer have a value), '–' where none has. Checkpoints of "
    "unfinished runs are in. The figure: the mean over seeds, each seed "
    "thin; the log panels leave out values that are not positive."
)


def curvature_section(study: CurvatureStudy, figure: str | None) -> list[str]:
  """The report's markdown lines of ``study``, ``figure`` linked if any."""
  lines = ["## Curvature", "", _ABOUT, "", settings_note(study), ""]
  if any(study.conditions.values()):
    lines += [*curvature_table(study), ""]
  for note in study.notes:
    lines += [note, ""]
  if figure:
    lines += [f"![curvature against epoch]({figure})", ""]
  return lines
