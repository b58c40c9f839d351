"""``train.report``'s batch-size study: a table of conditions by batch size.

The same conditions (norms and their options) trained for the same number
of optimizer steps at several batch sizes, each with its own learning rate,
are one table and one figure, not a row of the other tables per batch size.
"""

from __future__ import annotations

from pathlib import Path
import statistics

import pytest

from train import run_files
from train.loop import checkpointing
from train.report import cli as report

from tests.helpers.run_folders import report_written_twice
from tests.helpers.run_folders import write_run

STEPS = 6
#: ``(condition, batch size, seed)``: each epoch's test error, written by
#: hand; the best is not always the last.
ERRORS = {
    ("bn", 4, 0): [0.52, 0.47],
    ("bn", 4, 1): [0.50, 0.51],
    ("bn", 16, 0): [0.44, 0.40],
    ("bn", 16, 1): [0.43, 0.37],
    ("sqd2, renorm", 4, 0): [0.49, 0.45],
    ("sqd2, renorm", 4, 1): [0.47, 0.46],
    ("sqd2, renorm", 16, 0): [0.45, 0.42],
    ("sqd2, renorm", 16, 1): [0.41, 0.44],
}


def _lr(batch: int) -> float:
  return 0.1 * batch / 256


def _write_steps_run(
    folder: Path,
    condition: str,
    batch: int,
    seed: int,
    errors,
    done: int | None = None,
) -> Path:
  """A ``--steps`` run: two epochs of ``STEPS // 2`` steps each; with
  ``done``, only its first ``done`` epochs."""
  norm = condition.split(",")[0]
  write_run(
      folder,
      norm,
      seed,
      _lr(batch),
      errors[:done] if done else errors,
      [1.0] * len(errors),
      epochs=100,
      dataset="cifar10",
      batch_size=batch,
      steps=STEPS,
      renorm="renorm" in condition,
  )
  rows = run_files.read_metrics(folder)
  for row in rows:
    row["step"] = row["epoch"] * STEPS // 2
  checkpointing.write_metrics(folder, rows)
  return folder


def _study(top: Path, keep=lambda condition, batch: True) -> Path:
  """The hand-written study under ``top/sweep`` (the runs ``keep`` keeps),
  plus an unfinished run."""
  sweep = top / "sweep"
  for (condition, batch, seed), errors in ERRORS.items():
    if not keep(condition, batch):
      continue
    name = f"{condition.replace(', ', '-')}-b{batch}-seed{seed}"
    _write_steps_run(sweep / name, condition, batch, seed, errors)
  # Stopped after its first epoch (3 of 6 steps): listed, not averaged.
  _write_steps_run(sweep / "bn-b4-seed2", "bn", 4, 2, [0.10, 0.10], done=1)
  return sweep


def _section(text: str) -> str:
  return text.split("## Batch size\n", 1)[1].split("\n## ", 1)[0]


def _table(section: str) -> list[list[str]]:
  return [
      [c.strip() for c in line.strip().strip("|").split("|")]
      for line in section.splitlines()
      if line.startswith("|")
  ]


def _expected_cell(condition: str, batch: int) -> tuple[float, str]:
  best = [
      100 * min(errors)
      for (c, b, _), errors in ERRORS.items()
      if (c, b) == (condition, batch)
  ]
  mean = statistics.mean(best)
  return mean, f"{mean:.2f} ± {statistics.stdev(best):.2f}"


def test_batch_size_table_has_a_row_per_condition(tmp_path):
  out = tmp_path / "out"
  report.write_report([_study(tmp_path)], out)
  section = _section((out / "report.md").read_text())
  header, rule, *rows = _table(section)
  assert header == ["condition", "batch 4", "batch 16"]  # ascending
  assert rule == ["---"] * 3
  assert [r[0] for r in rows] == ["bn", "sqd2, renorm"]
  for column, batch in enumerate((4, 16), start=1):
    expected = {c: _expected_cell(c, batch) for c in ("bn", "sqd2, renorm")}
    lowest = min(mean for mean, _ in expected.values())
    for row in rows:
      mean, text = expected[row[0]]
      text = f"**{text}**" if mean == lowest else text
      if row[0] == "bn" and batch == 4:
        text += " (n=2); 1 unfinished (3/6 steps)"
      else:
        text += " (n=2)"
      assert row[column] == text, (row, batch)
  assert (
      f"Learning rate by batch size: 4: {_lr(4)}; 16: {_lr(16)}. "
      f"{STEPS} optimizer steps at every batch size."
  ) in section
  assert "![best test error against batch size](batch_size.png)" in section
  assert (out / "batch_size.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "keep",
    [
        lambda condition, batch: batch == 4,
        # Two batch sizes, but no condition at both: no study.
        lambda condition, batch: (condition == "bn") == (batch == 4),
    ],
    ids=["one batch size", "one batch size per condition"],
)
def test_no_batch_size_section_without_a_study(tmp_path, keep):
  out = tmp_path / "out"
  out.mkdir()
  (out / "batch_size.png").write_bytes(b"old")  # of an earlier report
  report.write_report([_study(tmp_path, keep)], out)
  text = (out / "report.md").read_text()
  assert "## Best test error" in text and "## Batch size" not in text
  assert not (out / "batch_size.png").exists()


def test_report_is_byte_identical_when_written_twice(tmp_path):
  sweep = _study(tmp_path)
  written, again = report_written_twice(sweep, tmp_path)
  assert "batch_size.png" in written and "report.md" in written
  assert written == again
