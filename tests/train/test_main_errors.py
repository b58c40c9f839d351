"""CLI failures that leave nothing behind and say what was wrong in 3 lines.

A run that fails before its first step (no data, say) must not leave a
half-made workdir, but must never remove a workdir that existed before: a
resumable run's checkpoints are work. A bad flag value prints one usage
line, the error and where the help is, not argparse's whole usage block.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from train import configs
from train import main as train_main
from train.loop import checkpointing


def _run_cli(argv, capsys):
  code = train_main.run(argv, configs.MNIST, prog="train.mnist")
  captured = capsys.readouterr()
  return code, captured.out, captured.err


def _no_data(tmp_path: Path) -> list[str]:
  empty = tmp_path / "empty_data"
  empty.mkdir(exist_ok=True)
  return ["--data-dir", str(empty), "--no-progress", "--epochs", "1"]


def _tree(folder: Path) -> dict[str, bytes]:
  return {
      str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
      for p in sorted(folder.rglob("*"))
  }


def test_failure_before_first_step_leaves_no_workdir(tmp_path, capsys):
  workdir = tmp_path / "runs" / "nested" / "run"
  code, _, err = _run_cli(
      ["--workdir", str(workdir), *_no_data(tmp_path)], capsys
  )
  assert code == 1 and "could not find the mnist" in err
  # The run folder and the parents this command made for it are gone.
  assert not (tmp_path / "runs").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty_data"]


def test_failure_keeps_parents_holding_other_runs(tmp_path, capsys):
  other = tmp_path / "runs" / "other"
  other.mkdir(parents=True)
  (other / "metrics.jsonl").write_text('{"epoch": 1}\n')
  workdir = tmp_path / "runs" / "new" / "run"
  code, _, _ = _run_cli(
      ["--workdir", str(workdir), *_no_data(tmp_path)], capsys
  )
  assert code == 1
  assert not (tmp_path / "runs" / "new").exists()
  assert (other / "metrics.jsonl").read_text() == '{"epoch": 1}\n'


def test_failure_never_removes_a_workdir_that_existed(tmp_path, capsys):
  # A resumable run: its config, an epoch's metrics, a checkpoint.
  workdir = tmp_path / "run"
  workdir.mkdir()
  config = configs.MNIST.replace(epochs=1)
  (workdir / checkpointing.CONFIG_FILE).write_text(
      json.dumps({"norm": config.norm, "epochs": 3})
  )
  checkpointing.write_metrics(workdir, [{"epoch": 1}])
  (workdir / checkpointing.CHECKPOINT_DIR / "1").mkdir(parents=True)
  (workdir / checkpointing.CHECKPOINT_DIR / "1" / "state").write_bytes(b"w")
  before = _tree(workdir)
  code, _, err = _run_cli(
      ["--workdir", str(workdir), *_no_data(tmp_path)], capsys
  )
  assert code == 1 and err.startswith("train.mnist: error: ")
  assert _tree(workdir) == before
  # An empty folder made beforehand (as a sweep makes its runs') stays too.
  empty = tmp_path / "made_before"
  empty.mkdir()
  code, _, _ = _run_cli(["--workdir", str(empty), *_no_data(tmp_path)], capsys)
  assert code == 1 and empty.is_dir()


def test_remove_unstarted_keeps_trained_work(tmp_path):
  # Made by this command, but with an epoch or a checkpoint in it: kept.
  for name, make in (
      ("metrics", lambda d: checkpointing.write_metrics(d, [{"epoch": 1}])),
      (
          "checkpoint",
          lambda d: (d / checkpointing.CHECKPOINT_DIR / "2").mkdir(
              parents=True
          ),
      ),
  ):
    workdir = tmp_path / name
    created = train_main._missing_folders(str(workdir))
    assert created == [str(workdir)]
    workdir.mkdir()
    make(workdir)
    train_main._remove_unstarted(created)
    assert workdir.is_dir(), name
  # Made by this command with only the config: removed.
  workdir = tmp_path / "a" / "b"
  created = train_main._missing_folders(str(workdir))
  assert created == [str(workdir), str(tmp_path / "a")]
  workdir.mkdir(parents=True)
  (workdir / checkpointing.CONFIG_FILE).write_text("{}")
  train_main._remove_unstarted(created)
  assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "many"], "argument --batch-size"),
        (["--norm", "nope"], "argument --norm"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--norm-momentum", "1.5"], "--norm-momentum must be in [0, 1)"),
    ],
)
def test_bad_flag_is_three_lines(argv, message, capsys):
  with pytest.raises(SystemExit) as info:
    train_main.run(argv, configs.MNIST, prog="python -m train.mnist")
  assert info.value.code == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 3, lines
  assert lines[0].startswith("usage: python -m train.mnist ")
  assert lines[1].startswith("python -m train.mnist: error: ")
  assert message in lines[1]
  assert "'python -m train.mnist --help'" in lines[2]


def test_help_still_lists_every_flag(capsys):
  with pytest.raises(SystemExit) as info:
    train_main.run(["--help"], configs.MNIST, prog="train.mnist")
  assert info.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--batch-size", "--workdir", "--norm-momentum", "--data-dir"):
    assert flag in out
  assert len(out.splitlines()) > 20


def test_missing_folders_of_an_existing_path_is_empty(tmp_path):
  assert train_main._missing_folders(str(tmp_path)) == []
  relative = os.path.relpath(tmp_path / "x" / "y")
  assert train_main._missing_folders(relative) == [
      str(tmp_path / "x" / "y"),
      str(tmp_path / "x"),
  ]
