"""train.run_files.read_metrics on hand-written ``metrics.jsonl`` files, and
what each of its callers makes of a missing, an empty and a half-written
file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.device import device_check_compile
from train import run_files
from train.loop import checkpointing
from train.report import plot
from train.report import runs as report_runs
from train.sweep import runs as sweep_runs

from tests.helpers import process

# Two epochs as the trainer writes them, then a third being written.
_TWO_ROWS = (
    '{"epoch": 1, "test_error": 12.5, "seconds": 3.25}\n'
    '{"epoch": 2, "test_error": 10.0, "seconds": 2.0}\n'
)
_HALF_WRITTEN = _TWO_ROWS + '{"epoch": 3, "test_err'


def _run_dir(tmp_path: Path, metrics: str | None) -> Path:
  """A run directory with a config and ``metrics`` (no file if None)."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "config.json").write_text('{"norm": "bn", "epochs": 3}')
  if metrics is not None:
    (run_dir / "metrics.jsonl").write_text(metrics)
  return run_dir


def test_reads_the_rows_in_order_skipping_blank_lines(tmp_path):
  run_dir = _run_dir(
      tmp_path, '\n{"epoch": 1, "x": [1, 2]}\n  \n{"epoch": 2, "x": null}'
  )
  assert run_files.read_metrics(run_dir) == [
      {"epoch": 1, "x": [1, 2]},
      {"epoch": 2, "x": None},
  ]
  assert run_files.read_metrics(str(run_dir)) == run_files.read_metrics(run_dir)


def test_missing_file_has_no_rows_unless_required(tmp_path):
  run_dir = _run_dir(tmp_path, None)
  assert run_files.read_metrics(run_dir) == []
  with pytest.raises(FileNotFoundError):
    run_files.read_metrics(run_dir, missing_ok=False)


def test_empty_file_has_no_rows(tmp_path):
  assert run_files.read_metrics(_run_dir(tmp_path, "")) == []


def test_half_written_line_is_an_error_naming_file_and_line(tmp_path):
  run_dir = _run_dir(tmp_path, _HALF_WRITTEN)
  with pytest.raises(ValueError, match=r"metrics\.jsonl line 3: ") as caught:
    run_files.read_metrics(run_dir)
  assert str(run_dir) in str(caught.value)
  assert isinstance(caught.value.__cause__, json.JSONDecodeError)


def test_the_name_is_the_trainers():
  assert run_files.METRICS_FILE == checkpointing.METRICS_FILE
  assert checkpointing.read_metrics is run_files.read_metrics


def test_written_history_reads_back(tmp_path):
  history = [{"epoch": 1, "test_error": 0.5}, {"epoch": 2, "test_error": 0.25}]
  checkpointing.write_metrics(tmp_path, history)
  assert (tmp_path / "metrics.jsonl").read_text() == (
      '{"epoch": 1, "test_error": 0.5}\n{"epoch": 2, "test_error": 0.25}\n'
  )
  assert run_files.read_metrics(tmp_path) == history


def test_readers_of_reports_and_plots_import_no_jax():
  loaded = process.run_python(
      "import sys; import train.run_files, train.report.cli, train.plot; "
      "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
  )
  assert loaded.strip() == "[]", loaded


# --- each caller on a missing, an empty and a half-written file ------------


def _find_run(run_dir: Path):
  runs = report_runs.find_runs([run_dir])
  return [r.rows for r in runs]


@pytest.mark.parametrize(
    "metrics, rows",
    [(None, [[]]), ("", [[]]), (_TWO_ROWS, [[{"epoch": 1}, {"epoch": 2}]])],
    ids=["missing", "empty", "two-rows"],
)
def test_report_lists_the_run_with_its_rows(tmp_path, capsys, metrics, rows):
  found = _find_run(_run_dir(tmp_path, metrics))
  assert [[{"epoch": r["epoch"]} for r in run] for run in found] == rows
  assert not capsys.readouterr().err


def test_report_skips_a_half_written_run_with_a_warning(tmp_path, capsys):
  run_dir = _run_dir(tmp_path, _HALF_WRITTEN)
  assert not _find_run(run_dir)
  err = capsys.readouterr().err
  assert f"warning: skipped {run_dir}" in err and "line 3" in err, err


@pytest.mark.parametrize(
    "metrics, message",
    [
        (None, "not a readable run directory"),
        ("", "has no finished epoch yet"),
        (_HALF_WRITTEN, "not a readable run directory"),
    ],
    ids=["missing", "empty", "half-written"],
)
def test_plot_refuses(tmp_path, metrics, message):
  with pytest.raises(plot.PlotError, match=message):
    plot.load_run(_run_dir(tmp_path, metrics))


def test_plot_reads_the_rows(tmp_path):
  config, rows = plot.load_run(_run_dir(tmp_path, _TWO_ROWS))
  assert config == {"norm": "bn", "epochs": 3}
  assert [r["test_error"] for r in rows] == [12.5, 10.0]


@pytest.mark.parametrize(
    "metrics, epochs",
    [(None, 0), ("", 0), (_HALF_WRITTEN, 0), (_TWO_ROWS, 2)],
    ids=["missing", "empty", "half-written", "two-rows"],
)
def test_sweep_counts_epochs_done(tmp_path, metrics, epochs):
  # A half-written file counts none: the sweep runs the run again, and the
  # trainer's own read then reports the file.
  assert sweep_runs.epochs_done(_run_dir(tmp_path, metrics)) == epochs


@pytest.mark.parametrize(
    "metrics, seconds",
    [(None, []), ("", []), (_TWO_ROWS, [3.25, 2.0])],
    ids=["missing", "empty", "two-rows"],
)
def test_device_check_epoch_seconds(tmp_path, metrics, seconds):
  run_dir = _run_dir(tmp_path, metrics)
  # pylint: disable-next=protected-access
  assert device_check_compile._epoch_seconds(run_dir) == seconds


def test_device_check_and_trainer_refuse_a_half_written_file(tmp_path):
  run_dir = _run_dir(tmp_path, _HALF_WRITTEN)
  with pytest.raises(ValueError, match="line 3"):
    device_check_compile._epoch_seconds(run_dir)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="line 3"):
    checkpointing.read_metrics(run_dir)
