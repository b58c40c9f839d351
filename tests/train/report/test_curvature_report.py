"""``train.report``'s curvature section: the Hessian along training.

Small run folders with made-up ``curvature.jsonl`` lines; the table's
numbers are checked against numpy means and standard deviations of those
lines, computed here, with the weight decay's shift taken off here too.
"""

from __future__ import annotations

import json
from pathlib import Path
import re

import numpy as np
import pytest

from train import run_files
from train.loop import checkpointing
from train.report import cli as report
from train.report import curvature as report_curvature

from tests.helpers.run_folders import curvature_line
from tests.helpers.run_folders import report_written_twice
from tests.helpers.run_folders import write_run

#: ``(norm, calibration)`` of each condition, and its label in the table.
CONDITIONS = {
    ("bn", "none"): "bn",
    ("rbd", "none"): "rbd",
    ("rbd", "normal"): "rbd, calibration=normal",
    ("bn_gain:rbd", "none"): "bn_gain:rbd",
}
SEEDS = (0, 1)
EPOCHS = 4
MEASURED = (0, 2, 4)
WEIGHT_DECAY = 0.05
PARAMETERS = 2000
SETTINGS = {"batches": 2, "batch_size": 8, "eigenvalues": 2, "seed": 0}
COLUMNS = (
    "top eigenvalue",
    "trace",
    "noise scale",
    "train error (%)",
    "test error (%)",
    "gap (points)",
)


def _line(rng, epoch: int, settings=None, noise=True) -> dict:
  """A curvature line of values drawn from ``rng``; no noise scale where
  ``noise`` is false."""
  top = float(rng.uniform(5, 60))
  loss = float(rng.uniform(0.5, 2))
  trace = float(rng.uniform(200, 900))
  return curvature_line(
      epoch,
      top,
      trace,
      parameters=PARAMETERS,
      weight_decay=WEIGHT_DECAY,
      noise_scale=float(rng.uniform(20, 200)) if noise else None,
      loss=loss,
      settings=settings or SETTINGS,
  )


def _write_lines(folder: Path, lines, extra: str = "") -> None:
  (folder / report_curvature.CURVATURE_FILE).write_text(
      "".join(json.dumps(line) + "\n" for line in lines) + extra
  )


def _write_run(
    sweep: Path, norm: str, calibration: str, seed: int, done: int = EPOCHS
):
  """A run with its own training and test errors, finished or stopped after
  ``done`` epochs, and the rng that made them (for its curvature lines)."""
  rng = np.random.default_rng(
      [list(CONDITIONS).index((norm, calibration)), seed]
  )
  name = f"{norm.replace(':', '_')}-cal_{calibration}-seed{seed}"
  folder = write_run(
      sweep / name,
      norm,
      seed,
      0.1,
      list(rng.uniform(0.2, 0.6, EPOCHS)),
      [1.0] * EPOCHS,
      calibration=calibration,
  )
  rows = run_files.read_metrics(folder)[:done]
  for row in rows:
    row["train_error"] = float(rng.uniform(0.0, 0.3))
  checkpointing.write_metrics(folder, rows)
  return folder, rng


def _study(top: Path, with_curvature=True) -> tuple[Path, dict]:
  """Every condition and seed under ``top/sweep``; returns the sweep and
  ``{(condition label, seed): (metrics rows, curvature lines)}``."""
  sweep, written = top / "sweep", {}
  for (norm, calibration), label in CONDITIONS.items():
    for seed in SEEDS:
      folder, rng = _write_run(sweep, norm, calibration, seed)
      lines = [_line(rng, e, noise=(e, seed) != (2, 1)) for e in MEASURED]
      if with_curvature:
        _write_lines(folder, lines)
      written[label, seed] = (run_files.read_metrics(folder), lines)
  return sweep, written


def _section(text: str) -> str:
  return text.split("## Curvature\n", 1)[1].split("\n## ", 1)[0]


def _table(section: str) -> dict[tuple[str, int], dict[str, str]]:
  """``{(condition, epoch): {column: cell}}`` of the section's table."""
  rows = [
      [c.strip() for c in line.strip().strip("|").split("|")]
      for line in section.splitlines()
      if line.startswith("|")
  ]
  header = rows[0]
  assert header == ["condition", "epoch", "n", *COLUMNS]
  return {
      (row[0], int(row[1])): dict(zip(header[2:], row[2:])) for row in rows[2:]
  }


_CELL = re.compile(r"^(-?[\d.]+)(?: ± ([\d.]+))?(?: \(n=(\d+)\))?$")


def _assert_cell(text: str, values, n_row: int) -> None:
  """``text`` is the mean ± sample std of ``values`` to its printed
  decimals, with ``(n=k)`` where fewer values than the row's runs."""
  values = [v for v in values if v is not None]
  if not values:
    assert text == "–"
    return
  match = _CELL.match(text)
  assert match, text
  mean, std, n = match.groups()
  decimals = len(mean.split(".")[1]) if "." in mean else 0
  tolerance = 0.5 * 10**-decimals * (1 + 1e-9)
  assert abs(float(mean) - np.mean(values)) <= tolerance, (text, values)
  if len(values) > 1:
    assert abs(float(std) - np.std(values, ddof=1)) <= tolerance, text
  else:
    assert std is None, text
  assert (int(n) if n else n_row) == len(values), text


def _expected(metrics, line) -> dict[str, float | None]:
  """One run's values at a line's epoch, computed from the written files."""
  row = next((r for r in metrics if r["epoch"] == line["epoch"]), None)
  train = None if row is None else 100 * row["train_error"]
  test = None if row is None else 100 * row["test_error"]
  return {
      "top eigenvalue": line["eigenvalues"][0] - line["weight_decay"],
      "trace": line["trace"] - line["weight_decay"] * line["parameters"],
      "noise scale": line["noise_scale"],
      "train error (%)": train,
      "test error (%)": test,
      "gap (points)": None if row is None else test - train,
  }


def test_curvature_table_equals_numpy_with_the_decay_taken_off(tmp_path):
  sweep, written = _study(tmp_path)
  out = tmp_path / "out"
  report.write_report([sweep], out)
  section = _section((out / "report.md").read_text())
  table = _table(section)
  # Conditions apart by norm and calibration, in the norms' column order.
  assert list(dict.fromkeys(c for c, _ in table)) == [
      "bn",
      "rbd",
      "rbd, calibration=normal",
      "bn_gain:rbd",
  ]
  assert sorted(table) == sorted(
      (label, e) for label in CONDITIONS.values() for e in MEASURED
  )
  for (label, epoch), cells in table.items():
    runs = [
        _expected(metrics, next(l for l in lines if l["epoch"] == epoch))
        for (other, _), (metrics, lines) in written.items()
        if other == label
    ]
    assert cells["n"] == str(len(SEEDS))
    for column in COLUMNS:
      _assert_cell(cells[column], [r[column] for r in runs], len(SEEDS))
  # Epoch 0 (the initial parameters) has no metrics row; one noise scale
  # is null at epoch 2.
  assert table["bn", 0]["test error (%)"] == "–"
  assert table["bn", 2]["noise scale"].endswith("(n=1)")
  # The recorded (shifted) values would be other numbers.
  raw = [l for (c, _), (_, ls) in written.items() if c == "rbd" for l in ls]
  raw_trace = np.mean([l["trace"] for l in raw if l["epoch"] == 4])
  printed = float(table["rbd", 4]["trace"].split(" ")[0])
  assert abs(printed - raw_trace) > 50
  assert "trace − weight_decay × parameters" in section
  assert "top eigenvalue − weight_decay" in section
  assert "![curvature against epoch](curvature.png)" in section
  assert (out / "curvature.png").read_bytes().startswith(b"\x89PNG")
  assert "batch_size=8, batches=2, eigenvalues=2, seed=0" in section


def test_shifted_takes_off_the_decay():
  line = {
      "eigenvalues": [3.0, 1.0],
      "trace": 10.0,
      "weight_decay": 0.5,
      "parameters": 4,
  }
  assert report_curvature.shifted(line) == (2.5, 8.0)


def test_no_curvature_section_without_curvature_files(tmp_path):
  sweep, _ = _study(tmp_path, with_curvature=False)
  out = tmp_path / "out"
  out.mkdir()
  (out / "curvature.png").write_bytes(b"old")  # of an earlier report
  report.write_report([sweep], out)
  text = (out / "report.md").read_text()
  assert "## Best test error" in text and "## Curvature" not in text
  assert not (out / "curvature.png").exists()


def test_report_is_byte_identical_when_written_twice(tmp_path):
  sweep, _ = _study(tmp_path)
  written, again = report_written_twice(sweep, tmp_path)
  assert "curvature.png" in written and "report.md" in written
  assert written == again


def test_missing_and_partial_files_are_noted(tmp_path, capsys):
  sweep, written = _study(tmp_path)
  # One seed never measured; another with a line cut short and one epoch
  # fewer.
  (sweep / "rbd-cal_none-seed1" / "curvature.jsonl").unlink()
  _, lines = written["bn", 1]
  _write_lines(sweep / "bn-cal_none-seed1", lines[:2], extra='{"epoch": 4, "ei')
  out = tmp_path / "out"
  report.write_report([sweep], out)
  section = _section((out / "report.md").read_text())
  table = _table(section)
  assert table["rbd", 2]["n"] == "1"
  assert table["bn", 2]["n"] == "2" and table["bn", 4]["n"] == "1"
  _assert_cell(
      table["bn", 4]["top eigenvalue"],
      [written["bn", 0][1][2]["eigenvalues"][0] - WEIGHT_DECAY],
      1,
  )
  assert (
      "Without curvature.jsonl (not in the table): sweep/rbd-cal_none-seed1."
      in (section)
  )
  assert (
      "Lines of curvature.jsonl left out: sweep/bn-cal_none-seed1: line 3 is "
      "not JSON." in section
  )
  assert "sweep/bn-cal_none-seed1 lacks epoch(s) 4" in section
  assert "line 3 is not JSON" in capsys.readouterr().err


def test_other_settings_are_left_out_and_said(tmp_path):
  sweep, written = _study(tmp_path)
  other = {**SETTINGS, "batches": 4}
  folder = sweep / "rbd-cal_normal-seed0"
  _, lines = written["rbd, calibration=normal", 0]
  rng = np.random.default_rng(99)
  extra = [_line(rng, e, settings=other) for e in (2, 4)]
  _write_lines(folder, [lines[0], extra[0], lines[1], lines[2], extra[1]])
  out = tmp_path / "out"
  report.write_report([sweep], out)
  section = _section((out / "report.md").read_text())
  table = _table(section)
  label = "rbd, calibration=normal"
  for index, epoch in enumerate(MEASURED):
    tops = [
        written[label, seed][1][index]["eigenvalues"][0] - WEIGHT_DECAY
        for seed in SEEDS
    ]
    _assert_cell(table[label, epoch]["top eigenvalue"], tops, 2)
  assert "2 measurement(s) with other settings left out (batch_size=8, " in (
      section
  )
  assert "batches=4" in section


def test_unfinished_runs_enter_and_are_named(tmp_path):
  sweep, _ = _study(tmp_path)
  folder, rng = _write_run(sweep, "bn", "none", 2, done=2)
  _write_lines(folder, [_line(rng, 0), _line(rng, 2)])
  out = tmp_path / "out"
  report.write_report([sweep], out)
  section = _section((out / "report.md").read_text())
  table = _table(section)
  assert table["bn", 0]["n"] == "3" and table["bn", 4]["n"] == "2"
  assert "Unfinished runs, in with the checkpoints they have: " in section
  assert "bn-cal_none-seed2" in section
  assert "sweep/bn-cal_none-seed2 lacks epoch(s) 4" in section


def test_curvature_file_name_is_the_curvature_tools():
  pytest.importorskip("jax")
  from train.curvature import cli as curvature_cli  # pylint: disable=g-import-not-at-top

  assert report_curvature.CURVATURE_FILE == curvature_cli.CURVATURE_FILE
