"""Tests of ``train.sweep`` (grid runner) and ``train.report`` (tables, curves).

The report's numbers are checked against numpy computations written here
from the metrics rows; the sweep runs real ``train.mnist`` subprocesses on a
tiny IDX dataset, including a ``kill -9`` of the sweep mid-run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
import re
import sys
import time

import numpy as np
import pytest

from train import configs
from train import gain as gain_lib
from train.loop import capture
from train.loop import checkpointing
from train.report import cli as report
from train.sweep import cli as sweep
from train.sweep import grid as sweep_grid
from train.sweep import runs as sweep_runs

from tests.helpers.process import run_module
from tests.helpers.process import start_module
from tests.helpers.process import unoptimized_codegen
from tests.helpers.run_folders import saved_figures
from tests.helpers.run_folders import write_run
from tests.helpers.training import exact
from tests.helpers.training import kill_after_epochs
from tests.helpers.training import write_tiny_mnist

# --- grid expansion -------------------------------------------------------------


def test_expand_cross_product_in_flag_order():
  runs = sweep_grid.expand(
      [
          "--seed",
          "0,1",
          "--norm",
          "bn,sqd:0.3",
          "--lr",
          "0.1,0.01",
          "--epochs",
          "3",
          "--momentum=0.9",
      ]
  )
  assert len(runs) == 8
  # The last list varies fastest; seed (first) slowest.
  assert [
      (r.config.seed, r.config.norm, r.config.learning_rate) for r in runs[:4]
  ] == [
      (0, "bn", 0.1),
      (0, "bn", 0.01),
      (0, "sqd:0.3", 0.1),
      (0, "sqd:0.3", 0.01),
  ]
  assert all(r.config.momentum == 0.9 and r.config.epochs == 3 for r in runs)
  assert runs[2].name == "cifar10-resnet20-sqd_0.3-b256-lr0.1-m0.9-seed0"
  assert len({r.name for r in runs}) == 8
  # A run's flags reproduce its config through the CLI's own parser.
  from train import cli_flags  # pylint: disable=g-import-not-at-top

  parser = cli_flags.build_parser(configs.CIFAR, "x")
  args = parser.parse_args(runs[5].argv)
  assert (
      cli_flags.config_from_args(args, configs.CIFAR).replace(augment=True)
      == runs[5].config
  )


def test_expand_names_ignore_epochs_and_defaults():
  a = sweep_grid.expand(
      ["--dataset", "fashion_mnist", "--epochs", "3"], "mnist"
  )
  b = sweep_grid.expand(
      [
          "--dataset",
          "fashion_mnist",
          "--epochs",
          "5",
          "--weight-decay",
          "5e-4",
          "--no-augment",
      ],
      "mnist",
  )
  assert a[0].name == b[0].name == "fashion_mnist-lenet-bn-b1000-lr0.01-seed0"
  c = sweep_grid.expand(["--dataset", "fashion_mnist", "--augment"], "mnist")
  assert c[0].name == "fashion_mnist-lenet-bn-b1000-lr0.01-aug-seed0"
  # Repeated values are one run.
  assert len(sweep_grid.expand(["--norm", "bn,bn,mad"])) == 2


def test_expand_steps_and_group_norms_name_every_run(tmp_path, capsys):
  argv = [
      "--model",
      "lenet",
      "--norm",
      "gn,gn:sqd2,gn:sqd:0.9,bn",
      "--batch-size",
      "2,32",
      "--steps",
      "200",
  ]
  runs = sweep_grid.expand(argv)
  assert [r.name for r in runs] == [
      f"cifar10-lenet-{norm}-b{batch}-steps200-lr0.1-seed0"
      for norm in ("gn", "gn_sqd2", "gn_sqd_0.9", "bn")
      for batch in (2, 32)
  ]
  assert {r.config.steps for r in runs} == {200}
  assert {r.config.norm_groups for r in runs} == {5}
  more = sweep_grid.expand(
      ["--model", "lenet", "--norm", "gn", "--steps", "100,200"]
      + ["--norm-groups", "5,10"]
  )
  assert [r.name for r in more] == [
      "cifar10-lenet-gn-b256-steps100-lr0.1-seed0",
      "cifar10-lenet-gn-b256-steps100-lr0.1-groups10-seed0",
      "cifar10-lenet-gn-b256-steps200-lr0.1-seed0",
      "cifar10-lenet-gn-b256-steps200-lr0.1-groups10-seed0",
  ]
  with pytest.raises(ValueError, match="--renorm is batch renormalization"):
    sweep_grid.expand(["--norm", "bn,gn", "--renorm"])

  # A --steps run is finished once its rows reach the step, whatever
  # --epochs says; before its first row its epochs come from the dataset.
  run = runs[1]  # batch 32: 50000 // 32 = 1562 steps an epoch
  run_dir = tmp_path / run.name
  assert sweep_runs.planned_epochs(run, run_dir) == 1
  assert sweep_runs.planned_epochs(runs[0], tmp_path / "none") == 1
  long = sweep_grid.expand(
      ["--model", "lenet", "--batch-size", "32", "--steps", "2000"]
  )[0]
  assert sweep_runs.planned_epochs(long, tmp_path / "none") == 2
  run_dir.mkdir()
  checkpointing.write_config(run_dir, run.config)
  checkpointing.write_metrics(run_dir, [{"epoch": 1, "step": 150}])
  assert sweep_runs.steps_done(run_dir) == 150
  assert not sweep_runs.is_finished(run, run_dir)
  checkpointing.write_metrics(
      run_dir, [{"epoch": 1, "step": 150}, {"epoch": 2, "step": 200}]
  )
  assert sweep_runs.is_finished(run, run_dir)
  # A small copy of the data: the first row says the steps per epoch.
  assert sweep_runs.planned_epochs(run, run_dir) == 2
  assert not sweep_runs.is_finished(runs[0], tmp_path / runs[0].name)
  assert sweep.main(["--sweep-dir", str(tmp_path), "--dry-run", *argv]) == 0
  out = capsys.readouterr().out
  assert f"{run.name}: 200/200 steps" in out
  assert f"{runs[0].name}: 0/200 steps" in out


@pytest.mark.parametrize(
    "argv, implied",
    [
        ([], "cifar"),
        (["--dataset", "svhn,cifar100"], "cifar"),
        (["--dataset", "fashion_mnist"], "mnist"),
        (["--norm", "bn", "--dataset=mnist,fashion_mnist"], "mnist"),
    ],
)
def test_defaults_follow_the_dataset(argv, implied, tmp_path, capsys):
  assert sweep_grid.implied_defaults(argv) == implied
  # Without --defaults, the runs are those of the implied CLI: Fashion-MNIST
  # gets LeNet and batch 1000 (train.mnist's), not CIFAR's ResNet20.
  assert sweep.main(["--sweep-dir", str(tmp_path), "--dry-run", *argv]) == 0
  names = capsys.readouterr().out.splitlines()
  model = "lenet" if implied == "mnist" else "resnet20"
  assert names and all(f"-{model}-" in name for name in names)


def test_defaults_required_for_mixed_datasets(tmp_path, capsys):
  argv = [
      "--sweep-dir",
      str(tmp_path),
      "--dry-run",
      "--dataset",
      "cifar10,fashion_mnist",
  ]
  with pytest.raises(SystemExit):
    sweep.main(argv)
  assert "pass --defaults" in capsys.readouterr().err
  assert sweep.main([*argv, "--defaults", "cifar"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workdir", "x"], "set by the sweep"),
        (["--overwrite"], "set by the sweep"),
        (["--lr", "0.1,-1"], "--lr must be a positive number"),
        (["--norm", "bn,,mad"], "empty item"),
        (["--norm", "bn,foo"], "unknown norm 'foo'"),
        (["--frobnicate", "1"], "unrecognized argument"),
        (["--epochs"], "needs a value"),
    ],
)
def test_expand_errors(argv, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    sweep_grid.expand(argv)


def test_sweep_cli_errors(tmp_path, capsys):
  with pytest.raises(SystemExit) as info:
    sweep.main(["--sweep-dir", str(tmp_path), "--jobs", "0"])
  assert info.value.code == 2 and "--jobs must be" in capsys.readouterr().err
  (tmp_path / "file").write_text("x")
  with pytest.raises(SystemExit):
    sweep.main(["--sweep-dir", str(tmp_path / "file"), "--norm", "bn"])
  assert "is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--jobs", "0"], "--jobs must be 'auto' or a positive integer"),
        (["--defaults", "nope"], "argument --defaults: invalid choice"),
        (["--frobnicate", "1"], "unrecognized argument '--frobnicate'"),
        ([], "the following arguments are required: --sweep-dir"),
    ],
)
def test_bad_sweep_flag_is_three_lines(argv, message, tmp_path, capsys):
  # As train.cifar's: one usage line, the error, where the help is; never
  # argparse's usage block, which buries the error.
  sweep_dir = ["--sweep-dir", str(tmp_path)] if argv else []
  with pytest.raises(SystemExit) as info:
    sweep.main([*sweep_dir, "--dry-run", *argv])
  assert info.value.code == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 3, lines
  assert lines[0].startswith("usage: python -m train.sweep ")
  assert lines[1].startswith("python -m train.sweep: error: ")
  assert message in lines[1], lines[1]
  assert "'python -m train.sweep --help'" in lines[2]


# --- real sweeps -----------------------------------------------------------------


def _sweep_args(sweep_dir: Path, data: Path, *grid: str) -> list[str]:
  """``train.sweep``'s arguments: LeNet on the tiny MNIST, then ``grid``."""
  return [
      "--sweep-dir",
      str(sweep_dir),
      "--defaults",
      "mnist",
      "--data-dir",
      str(data),
      "--batch-size",
      "16",
      "--lr",
      "0.05",
      "--devices-per-run",
      "1",
      *grid,
  ]


def _processes_running(path_part: str) -> list[str]:
  found = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
      continue
    if path_part.encode() in cmdline and b"train.mnist" in cmdline:
      found.append(cmdline.decode(errors="replace"))
  return found


@pytest.mark.slow
@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the sweep's runs die with it through prctl",
)
def test_sweep_kill_9_then_rerun_continues_and_matches(tmp_path):
  data = write_tiny_mnist(tmp_path / "data", n_train=96)
  sweep_dir = tmp_path / "sweep"
  grid = ["--norm", "mad,bn", "--epochs", "25"]
  env = unoptimized_codegen(
      {
          "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      }
  )
  process = start_module(
      "train.sweep", *_sweep_args(sweep_dir, data, *grid), env=env
  )
  first = sweep_dir / "mnist-lenet-mad-b16-lr0.05-seed0"
  done = kill_after_epochs(process, first, 3)
  assert 3 <= done < 25
  # The run died with the sweep (no orphan keeps writing the folder).
  deadline = time.monotonic() + 30
  while _processes_running(str(first)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _processes_running(str(first))

  result = run_module(
      "train.sweep", *_sweep_args(sweep_dir, data, *grid), env=env, timeout=600
  )
  assert result.returncode == 0, result.stderr
  assert "runs 2/2, epochs 50/50" in result.stderr
  log = (first / sweep_runs.LOG_FILE).read_text()
  assert "resumed from" in log  # continued, not restarted
  rows = checkpointing.read_metrics(first)
  assert [r["epoch"] for r in rows] == list(range(1, 26))

  # The interrupted run equals an uninterrupted one (a second sweep dir).
  other = tmp_path / "other"
  result = run_module(
      "train.sweep",
      *_sweep_args(other, data, "--norm", "mad", "--epochs", "25"),
      env=env,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr
  assert exact(rows) == exact(checkpointing.read_metrics(other / first.name))

  # Finished runs are skipped: the rerun starts no process.
  before = log
  result = run_module(
      "train.sweep", *_sweep_args(sweep_dir, data, *grid), env=env, timeout=120
  )
  assert result.returncode == 0 and "runs 2/2" in result.stderr
  assert (first / sweep_runs.LOG_FILE).read_text() == before
  # Raising --epochs extends the same runs.
  dry = sweep.main(
      [
          "--sweep-dir",
          str(sweep_dir),
          "--defaults",
          "mnist",
          "--batch-size",
          "16",
          "--lr",
          "0.05",
          "--norm",
          "mad,bn",
          "--epochs",
          "30",
          "--dry-run",
      ]
  )
  assert dry == 0


@pytest.mark.slow
def test_sweep_failed_run_is_recorded_and_others_go_on(tmp_path):
  data = write_tiny_mnist(tmp_path / "data", n_train=96)
  sweep_dir = tmp_path / "sweep"
  result = run_module(
      "train.sweep",
      *_sweep_args(
          sweep_dir, data, "--norm", "bn", "--lr", "1e30,0.05", "--epochs", "2"
      ),
      timeout=600,
  )
  assert result.returncode == 1
  assert "failed" in result.stderr and "diverged" in result.stderr
  # --lr given twice: the grid's list wins over the helper's 0.05.
  bad = sweep_dir / "mnist-lenet-bn-b16-lr1e+30-seed0"
  status = json.loads((bad / sweep_runs.STATUS_FILE).read_text())
  assert status["returncode"] == 1 and "diverged" in status["error"]
  good = sweep_dir / "mnist-lenet-bn-b16-lr0.05-seed0"
  assert len(checkpointing.read_metrics(good)) == 2
  runs = {r.path.name: r for r in report.find_runs([sweep_dir])}
  assert runs[bad.name].state == "failed"
  assert runs[good.name].state == "finished"


# --- report ----------------------------------------------------------------------


@pytest.fixture()
def fake_sweep(tmp_path):
  """3 norms x 3 seeds x 2 learning rates, random curves; plus odd runs."""
  rng = np.random.default_rng(0)
  data = {}
  for lr in (0.01, 0.1):
    for norm in ("bn", "sqd1", "rsd"):
      for seed in range(3):
        errors = np.sort(rng.uniform(0.1, 0.4, 4))[::-1]
        if norm == "bn" and seed == 1:  # best error before the last epoch
          errors[2] = errors[3] - 0.02
        seconds = rng.uniform(20, 40, 4)
        name = f"{norm}-lr{lr}-seed{seed}"
        write_run(
            tmp_path / "sweep" / name,
            norm,
            seed,
            lr,
            errors.tolist(),
            seconds.tolist(),
        )
        data[(lr, norm, seed)] = (errors, seconds)
  # An unfinished run (2 of 4 epochs) and a failed one: shown, not averaged.
  write_run(
      tmp_path / "sweep" / "sqd1-lr0.01-seed3",
      "sqd1",
      3,
      0.01,
      [0.05, 0.04],
      [30, 30],
      epochs=4,
  )
  failed = write_run(
      tmp_path / "sweep" / "rsd-lr0.01-seed3",
      "rsd",
      3,
      0.01,
      [0.35],
      [30],
      epochs=4,
  )
  (failed / "sweep_status.json").write_text(
      json.dumps({"status": "failed", "error": "training loss became nan"})
  )
  # A rerun of one config (as an activation-recording run is): counted once.
  import shutil  # pylint: disable=g-import-not-at-top

  shutil.copytree(
      tmp_path / "sweep" / "bn-lr0.1-seed0",
      tmp_path / "sweep" / "zz-rerun" / "bn-lr0.1-seed0",
  )
  return tmp_path / "sweep", data


def _pm(values, digits=2):
  values = np.asarray(values, np.float64)
  return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def test_report_numbers_equal_numpy(fake_sweep, tmp_path, capsys):
  sweep_dir, data = fake_sweep
  out = tmp_path / "out"
  assert report.main([str(sweep_dir), "--out", str(out)]) == 0
  text = (out / "report.md").read_text()
  table = {}
  for line in text.splitlines():
    match = re.match(r"\| (dataset=[^|]*) \| (.*) \|$", line)
    if match and "epochs to target" not in line:
      table.setdefault(match.group(1), match.group(2).split(" | "))
  header = next(
      line for line in text.splitlines() if line.startswith("| setting |")
  )
  norms = header.strip("| ").split(" | ")[1:]
  assert norms == ["bn", "rsd", "sqd1"]  # the paper's order
  for lr in (0.01, 0.1):
    row = next(v for k, v in table.items() if f"lr={lr}," in k)
    means = {}
    for norm, cell in zip(norms, row):
      best = [100 * data[(lr, norm, s)][0].min() for s in range(3)]
      means[norm] = np.mean(best)
      assert f"{_pm(best)} (n=3)" in cell.replace("**", ""), (norm, cell)
    bold = min(means, key=means.get)
    assert row[norms.index(bold)].startswith("**")
    assert sum(cell.startswith("**") for cell in row) == 1
    if lr == 0.01:
      assert "1 unfinished (2/4 epochs)" in row[norms.index("sqd1")]
      assert "1 failed (1/4 epochs)" in row[norms.index("rsd")]

    # Convergence: target = bn's mean final error; first epoch at or below.
    target = np.mean([100 * data[(lr, "bn", s)][0][-1] for s in range(3)])
    assert f"Target: {target:.2f} %" in text
    section = text.split(f"lr={lr}, batch=1000")[2]
    for norm in norms:
      epochs, seconds = [], []
      for s in range(3):
        errors, secs = data[(lr, norm, s)]
        hit = np.flatnonzero(100 * errors <= target)
        if hit.size:
          epochs.append(hit[0] + 1)
          seconds.append(np.cumsum(secs)[hit[0]])
      line = next(
          l for l in section.splitlines() if l.startswith(f"| {norm} |")
      )
      if len(epochs) == 3:
        assert f"| {_pm(epochs, 1)} | {_pm(seconds, 0)} |" in line
      elif not epochs:
        assert "not reached (0 of 3 runs)" in line
      else:
        note = f"{len(epochs)} of 3 runs reached it"
        if norm == "bn":  # its target is its own mean: say so
          note += " (the target is their own mean)"
        assert f"{note} |" in line, line
  # Without timing runs, no (always empty) quiet-speed columns.
  assert "quiet" not in text

  # Best learning rate per norm.
  lr_section = text.split("## Best learning rate")[1].split("## Curves")[0]
  for norm in norms:
    per_lr = {
        lr: np.mean([100 * data[(lr, norm, s)][0].min() for s in range(3)])
        for lr in (0.01, 0.1)
    }
    best_lr = min(per_lr, key=per_lr.get)
    line = next(
        l for l in lr_section.splitlines() if l.startswith(f"| {norm} |")
    )
    assert f"| {best_lr} |" in line and f"{per_lr[best_lr]:.2f} ±" in line
  # Every run is listed, with its state.
  assert text.count("| finished |") == 19  # the rerun is listed
  assert "(and 1 repeated configs, counted once)" in text
  assert "unfinished |" in text and "failed: training loss became nan" in text
  pngs = sorted(p.name for p in out.glob("curves_*.png"))
  assert len(pngs) == 2
  assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in pngs)


def test_report_errors(tmp_path, capsys):
  assert report.main([str(tmp_path / "missing"), "--out", str(tmp_path)]) == 1
  assert "is not a folder" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert report.main([str(tmp_path / "empty"), "--out", str(tmp_path)]) == 1
  assert "no run directories" in capsys.readouterr().err


def test_report_paper_row_for_table2_setting(tmp_path):
  folder = write_run(
      tmp_path / "c" / "bn",
      "bn",
      0,
      0.1,
      [0.5, 0.4],
      [100, 100],
      dataset="cifar10",
  )
  config = checkpointing.read_config(folder).replace(
      model="lenet", batch_size=1024
  )
  checkpointing.write_config(folder, config)
  report.write_report([tmp_path / "c"], tmp_path / "out")
  text = (tmp_path / "out" / "report.md").read_text()
  assert "paper, Table 2" in text and "28.74 ± 0.36" in text


def test_report_precise_statistics_table(tmp_path):
  rng = np.random.default_rng(1)
  finals = {}
  for norm in ("bn", "sqd2"):
    for seed in range(3):
      ema = rng.uniform(0.1, 0.4, 3)
      precise = ema + rng.normal(0, 0.02, 3)
      write_run(
          tmp_path / "s" / f"{norm}{seed}",
          norm,
          seed,
          0.01,
          ema.tolist(),
          [10, 10, 10],
          precise_errors=precise.tolist(),
      )
      finals.setdefault(norm, []).append((100 * ema[-1], 100 * precise[-1]))
  # Without precise statistics: not part of the table.
  write_run(
      tmp_path / "s" / "rsd0", "rsd", 0, 0.01, [0.3, 0.2, 0.1], [10, 10, 10]
  )
  report.write_report([tmp_path / "s"], tmp_path / "out")
  text = (tmp_path / "out" / "report.md").read_text()
  section = text.split("## Precise statistics")[1].split("## Curves")[0]
  for norm, pairs in finals.items():
    ema, precise = np.array(pairs).T
    line = next(l for l in section.splitlines() if l.startswith(f"| {norm} |"))
    assert line == (
        f"| {norm} | {_pm(ema)} | {_pm(precise)} | "
        f"{_pm(precise - ema)} | 3 |"
    ), line
  assert "| rsd |" not in section


def test_report_without_precise_runs_has_no_precise_section(
    fake_sweep, tmp_path
):
  report.write_report([fake_sweep[0]], tmp_path / "out")
  assert (
      "Precise statistics" not in (tmp_path / "out" / "report.md").read_text()
  )


def test_report_quiet_speed_from_timing_runs(fake_sweep, tmp_path):
  sweep_dir, data = fake_sweep
  timing = tmp_path / "timing"
  quiet = {"bn": [20.0, 22.0, 30.0], "sqd1": [25.0], "rsd": [21.0, 23.0]}
  for norm, seconds in quiet.items():
    write_run(timing / norm, norm, 0, 0.01, [0.5] * len(seconds), seconds)
  report.write_report([sweep_dir], tmp_path / "out", timing=[timing])
  text = (tmp_path / "out" / "report.md").read_text()
  section = text.split("lr=0.01, batch=1000")[2].split("**dataset")[0]
  target = np.mean([100 * data[(0.01, "bn", s)][0][-1] for s in range(3)])
  for norm, seconds in quiet.items():
    speed = float(np.median(seconds))
    epochs = [
        np.flatnonzero(100 * data[(0.01, norm, s)][0] <= target)
        for s in range(3)
    ]
    reached = [e[0] + 1 for e in epochs if e.size]
    line = next(l for l in section.splitlines() if l.startswith(f"| {norm} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == f"{speed:.1f}"
    if reached:
      assert (
          cells[5] == _pm(np.multiply(reached, speed), 0)
          if len(reached) > 1
          else f"{reached[0] * speed:.0f}"
      )
    else:
      assert cells[5] == "not reached"
  # lr 0.1 has no timing runs: the columns stay empty.
  other = text.split("lr=0.1, batch=1000")[2].split("**dataset")[0]
  line = next(l for l in other.splitlines() if l.startswith("| bn |"))
  assert [c.strip() for c in line.strip("|").split("|")][4:6] == ["", ""]


def test_report_runs_without_added_fields_share_a_setting(tmp_path):
  """A config.json written before renorm existed is the renorm=False setting."""
  old = write_run(tmp_path / "s" / "old", "bn", 0, 0.01, [0.3, 0.2], [1, 1])
  data = json.loads((old / "config.json").read_text())
  for field in configs.ADDED_FIELDS:
    data.pop(field)
  (old / "config.json").write_text(json.dumps(data))
  write_run(tmp_path / "s" / "new", "bn", 1, 0.01, [0.3, 0.1], [1, 1])
  report.write_report([tmp_path / "s"], tmp_path / "out")
  text = (tmp_path / "out" / "report.md").read_text()
  row = next(l for l in text.splitlines() if l.startswith("| dataset="))
  assert "renorm" not in row and "(n=2)" in row, row


def test_report_rerun_removes_its_stale_figures(fake_sweep, tmp_path):
  out = tmp_path / "out"
  (out).mkdir()
  (out / "curves_09_gone.png").write_bytes(b"old")
  (out / "activations_07.png").write_bytes(b"old")
  (out / "mine.png").write_bytes(b"keep")
  report.write_report([fake_sweep[0]], out)
  names = {p.name for p in out.glob("*.png")}
  assert "curves_09_gone.png" not in names and "activations_07.png" not in names
  assert (
      "mine.png" in names
      and len([n for n in names if n.startswith("curves_")]) == 2
  )


# --- the gain study: gain table, rank correlation, calibrated vs raw ---------


def _gain_json(folder: Path, norm: str, init: float, final: float | None):
  """A ``gain.json`` as ``python -m train.gain`` writes it (two layers)."""

  def stage(overall):
    layers = {
        name: {
            "median": overall * k,
            "q25": overall * k * 0.9,
            "q75": overall * k * 1.1,
        }
        for name, k in (("norm1", 0.9), ("norm2", 1.1))
    }
    return {"layers": layers, "overall": overall}

  data = {"norm": norm, "init": stage(init), "final": None}
  if final is not None:
    data["final"] = {**stage(final), "epoch": 2}
  (folder / "gain.json").write_text(json.dumps(data))


def _calibrate(folder: Path) -> Path:
  config = checkpointing.read_config(folder).replace(calibration="normal")
  checkpointing.write_config(folder, config)
  return folder


def _normal_e_max(n: int) -> float:
  """E[max of n standard normals] by quadrature of n x phi(x) Phi(x)^(n-1)."""
  from scipy import integrate  # pylint: disable=g-import-not-at-top
  from scipy import stats  # pylint: disable=g-import-not-at-top

  density = (
      lambda x: x
      * n
      * np.exp(stats.norm.logpdf(x) + (n - 1) * stats.norm.logcdf(x))
  )
  return integrate.quad(density, -10, 10, limit=200)[0]


def test_gaussian_gain_equals_definitions():
  from scipy import stats  # pylint: disable=g-import-not-at-top

  def sqd(alpha):  # D of a standard normal: phi(Phi^-1(alpha)) / (1 - alpha)
    return (1 - alpha) / stats.norm.pdf(stats.norm.ppf(alpha))

  expected = {
      "bn": 1.0,
      "sd": 1.0,
      "mad": math.sqrt(math.pi / 2),
      "bpoe": math.sqrt(math.pi / 2),
      "rsd": math.sqrt(2 * math.pi),
      "sqd1": sqd(0.25),
      "sqd2": sqd(0.5),
      "sqd3": sqd(0.75),
      "sqd:0.9": sqd(0.9),
      "rbd": 1 / (2 * _normal_e_max(50)),
      "wcd": 1 / _normal_e_max(50),
      "bn_gain:rsd": math.sqrt(2 * math.pi),
      "bn_gain:rbd": 1 / (2 * _normal_e_max(50)),
  }
  for norm, gain in expected.items():
    assert capture.gaussian_gain(norm, "none", 50) == pytest.approx(
        gain, rel=1e-6
    ), norm
    # Calibration gives every measure BatchNorm's gain; bn_gain keeps its own.
    assert capture.gaussian_gain(norm, "normal", 50) == pytest.approx(
        gain if norm.startswith("bn_gain:") else 1.0, rel=1e-6
    ), norm
  # And on a large Gaussian sample, sigma / D of the measure itself.
  import gbn_jax  # pylint: disable=g-import-not-at-top

  x = np.random.default_rng(0).standard_normal((200_000, 1))
  for norm in ("mad", "rsd", "sqd1", "sqd3"):
    _, d = gbn_jax.get_measure(norm)(x, (0,))
    assert x.std() / float(d[0]) == pytest.approx(
        capture.gaussian_gain(norm, None, x.size), rel=0.01
    ), norm
  with pytest.raises(ValueError, match="unknown norm"):
    capture.gaussian_gain("nope", None, 50)


def test_gaussian_layer_gains_take_n_from_the_model(tmp_path):
  run = write_run(tmp_path / "r", "rbd", 0, 0.01, [0.3], [1])
  gain_lib.record_norm_layers(run)  # what training writes beside metrics
  # LeNet on 28x28: conv 5x5 -> 24x24 (norm1); pool -> 12; conv 5x5 -> 8x8.
  sizes = {"norm1": 1000 * 24 * 24, "norm2": 1000 * 8 * 8}
  record = json.loads((run / capture.NORM_LAYERS_FILE).read_text())
  assert {k: v["n"] for k, v in record["layers"].items()} == sizes
  gains = report.gaussian_layer_gains(report.find_runs([run])[0])
  assert set(gains) == set(sizes)
  for layer, n in sizes.items():
    assert gains[layer] == pytest.approx(
        1 / (2 * _normal_e_max(n)), rel=1e-5
    ), layer
  config = checkpointing.read_config(run)
  checkpointing.write_config(run, config.replace(dataset="cifar10"))
  # A record of another config is not used; its own is rewritten.
  assert report.gaussian_layer_gains(report.find_runs([run])[0]) is None
  checkpointing.write_config(run, config.replace(batch_size=8))
  gain_lib.record_norm_layers(run)
  gains = report.gaussian_layer_gains(report.find_runs([run])[0])
  assert gains["norm2"] == pytest.approx(  # 28 -> 24 -> 12 -> 8
      1 / (2 * _normal_e_max(8 * 64)), rel=1e-5
  )
  checkpointing.write_config(
      run, config.replace(dataset="cifar10", batch_size=8)
  )
  gain_lib.record_norm_layers(run)
  gains = report.gaussian_layer_gains(report.find_runs([run])[0])
  assert gains["norm2"] == pytest.approx(  # 32 -> 28 -> 14 -> 10
      1 / (2 * _normal_e_max(8 * 100)), rel=1e-5
  )


@pytest.fixture()
def gain_sweep(tmp_path):
  """bn, rsd, sqd2, rbd raw (3 seeds), and mad raw and calibrated, gain.json
  for most runs; bn_gain:rsd."""
  rng = np.random.default_rng(3)
  runs = {}
  for norm in ("bn", "rsd", "sqd2", "rbd", "mad", "bn_gain:rsd"):
    for calibration in ("none", "normal"):
      if calibration == "normal" and norm not in ("mad", "rsd", "rbd"):
        continue
      for seed in range(3):
        errors = np.sort(rng.uniform(0.1, 0.4, 3))[::-1]
        folder = write_run(
            tmp_path / "g" / f"{norm}-{calibration}-{seed}".replace(":", "_"),
            norm,
            seed,
            0.01,
            errors.tolist(),
            [5, 5, 5],
        )
        if calibration == "normal":
          _calibrate(folder)
        gain_lib.record_norm_layers(folder)
        init, final = rng.uniform(0.1, 3), rng.uniform(0.1, 3)
        has_gain = not (norm == "sqd2" or (norm == "rsd" and seed == 2))
        if has_gain:
          _gain_json(folder, norm, init, final if seed else None)
        runs[(norm, calibration, seed)] = (
            100 * errors.min(),
            init if has_gain else None,
            final if has_gain and seed else None,
        )
  return tmp_path / "g", runs


def _section(text: str, start: str, end: str = "\n## ") -> str:
  return text.split(start, 1)[1].split(end, 1)[0]


def _cells(section: str, norm: str, after: str = "") -> list[str]:
  part = section.split(after, 1)[1] if after else section
  line = next(l for l in part.splitlines() if l.startswith(f"| {norm} |"))
  return [c.strip() for c in line.strip("|").split("|")]


def test_report_gain_table_and_rank_correlation(gain_sweep, tmp_path):
  from scipy import stats  # pylint: disable=g-import-not-at-top

  folder, runs = gain_sweep
  report.write_report([folder], tmp_path / "out")
  text = (tmp_path / "out" / "report.md").read_text()
  gain = _section(text, "## Gain")
  raw = gain.split("calibration=none")[1].split("**dataset")[0]
  pairs = {"gaussian": [], "init": [], "final": []}
  for norm in ("bn", "rsd", "sqd2", "rbd", "mad", "bn_gain:rsd"):
    best = [runs[(norm, "none", s)][0] for s in range(3)]
    cells = _cells(raw, norm)
    assert cells[4] == f"{_pm(best)} (n=3)"
    for column, index in (("init", 1), ("final", 2)):
      measured = [
          v[index]
          for (n, c, _), v in runs.items()
          if n == norm and c == "none" and v[index] is not None
      ]
      text_ = cells[2 if column == "init" else 3]
      if not measured:
        assert text_ == "–"
        continue
      expect = (
          f"{np.mean(measured):.3f}" if len(measured) == 1 else _pm(measured, 3)
      )
      assert text_ == f"{expect} (n={len(measured)})", (norm, column)
      pairs[column].append((np.mean(measured), np.mean(best)))
    # Gaussian gain: LeNet's two layers (n = 1000 x 24 x 24, 1000 x 8 x 8).
    ns = (1000 * 24 * 24, 1000 * 8 * 8)
    per_layer = {
        "bn": (1, 1),
        "mad": (math.sqrt(math.pi / 2),) * 2,
        "rsd": (math.sqrt(2 * math.pi),) * 2,
        "bn_gain:rsd": (math.sqrt(2 * math.pi),) * 2,
        "sqd2": (math.sqrt(math.pi / 2),) * 2,
        "rbd": tuple(1 / (2 * _normal_e_max(n)) for n in ns),
    }[norm]
    low, high = min(per_layer), max(per_layer)
    assert cells[1] == (
        f"{low:.3f}"
        if f"{low:.3f}" == f"{high:.3f}"
        else f"{low:.3f}–{high:.3f}"
    ), norm
    pairs["gaussian"].append((np.median(per_layer), np.mean(best)))
  rho_line = next(
      l
      for l in gain.splitlines()
      if l.startswith("| dataset=") and "calibration=none" in l
  )
  rho_cells = [c.strip() for c in rho_line.strip("|").split("|")][1:]
  for cell, key in zip(rho_cells, ("gaussian", "init", "final")):
    x, y = zip(*pairs[key])
    result = stats.spearmanr(x, y)
    assert cell == (
        f"{result.statistic:+.2f} (p={result.pvalue:.2g}, " f"{len(x)} norms)"
    ), (key, cell)
  # Calibrated: every Gaussian gain is 1, so rho is undefined there.
  cal_line = next(
      l
      for l in gain.splitlines()
      if l.startswith("| dataset=") and "calibration=normal" in l
  )
  assert "– (3 norms, gain constant)" in cal_line
  cal = gain.split("calibration=normal")[1]
  assert _cells(cal, "rbd")[1] == "1.000"


def test_report_calibrated_minus_batchnorm_and_raw(gain_sweep, tmp_path):
  folder, runs = gain_sweep
  assert report.main([str(folder), "--out", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "report.md").read_text()
  section = _section(text, "## Calibrated against raw measures and BatchNorm")
  assert "sqrt(s_a²/n_a + s_b²/n_b)" in section
  best = lambda norm, cal: np.array([runs[(norm, cal, s)][0] for s in range(3)])

  def diff(a, b):  # independent seeds: standard error of the difference
    se = np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    return f"{a.mean() - b.mean():+.2f} ± {se:.2f} (n={a.size}, {b.size})"

  bn = best("bn", "none")
  assert _cells(section, "bn")[1] == f"{_pm(bn)} (n=3)"
  for norm in ("mad", "rsd", "rbd"):
    raw, cal = best(norm, "none"), best(norm, "normal")
    cells = _cells(section, norm)
    assert cells[1:3] == [f"{_pm(raw)} (n=3)", f"{_pm(cal)} (n=3)"]
    assert cells[4] == diff(cal, bn) and cells[5] == diff(raw, cal), norm
    if norm == "rsd":
      gain = best("bn_gain:rsd", "none")
      assert cells[3] == f"{_pm(gain)} (n=3)" and cells[6] == diff(gain, bn)
    else:
      assert cells[3] == "–" and cells[6] == ""
  assert "| bn_gain:rsd |" not in section and "| sqd2 |" in section


def test_report_without_gain_or_calibrated_runs(fake_sweep, tmp_path):
  report.write_report([fake_sweep[0]], tmp_path / "out")
  text = (tmp_path / "out" / "report.md").read_text()
  assert "## Gain" not in text and "## Calibrated" not in text
  # --gain writes the Gaussian gains anyway; measured ones are "–".
  for run in report.find_runs([fake_sweep[0]]):
    gain_lib.record_norm_layers(run.path)
  report.main([str(fake_sweep[0]), "--out", str(tmp_path / "g"), "--gain"])
  gain = _section((tmp_path / "g" / "report.md").read_text(), "## Gain")
  cells = _cells(gain, "rsd")
  assert cells[1] == f"{math.sqrt(2 * math.pi):.3f}" and cells[2:4] == [
      "–",
      "–",
  ]


# --- figures: readable colours and scales ----------------------------------


def test_plot_one_colour_per_norm_and_dataset_in_title(tmp_path, monkeypatch):
  from matplotlib import colors  # pylint: disable=g-import-not-at-top

  from train.report import plot  # pylint: disable=g-import-not-at-top

  runs = [
      write_run(
          tmp_path / f"{norm}{seed}", norm, seed, 0.01, [0.3, 0.2], [1, 1]
      )
      for norm, seed in (("bn", 0), ("bn", 1), ("rsd", 0), ("bn", 2))
  ]
  figures = saved_figures(monkeypatch)
  plot.plot_runs(runs, tmp_path / "out")
  assert len(figures) == 4
  for fig in figures:
    ax = fig.axes[0]
    assert "fashion_mnist, lenet" in ax.get_title()
    lines = {l.get_label(): l for l in ax.get_lines()}
    bn = [lines[f"bn seed{s}"] for s in range(3)]
    rsd = lines["rsd seed0"]
    assert len({colors.to_hex(l.get_color()) for l in bn}) == 1
    assert colors.to_hex(rsd.get_color()) != colors.to_hex(bn[0].get_color())
    assert len({str(l.get_linestyle()) for l in bn}) == 3


def test_activations_figure_shares_y_and_tells_bands_apart(
    tmp_path, monkeypatch
):
  from matplotlib import colors  # pylint: disable=g-import-not-at-top

  runs = []
  for norm, scale in (("bn", 1.0), ("sqd1", 5.0)):
    folder = write_run(tmp_path / norm, norm, 0, 0.01, [0.3], [1])
    rows = [
        {
            "step": step,
            "epoch": 1,
            "layer": "norm2",
            "feature": 0,
            "percentiles": [5.0, 15.0, 50.0, 85.0, 95.0],
            "before": [scale * v for v in (-2, -1, 0, 1, 2)],
            "after": [scale * v for v in (-1.6, -1, 0, 1, 1.6)],
        }
        for step in (0, 10, 20)
    ]
    (folder / report.ACTIVATIONS_FILE).write_text(
        "\n".join(json.dumps(r) for r in rows)
    )
    runs.append(report.find_runs([folder])[0])
  figures = saved_figures(monkeypatch)
  assert report.activations_figure(runs, tmp_path / "a.png")
  axes = figures[0].axes
  for row in (axes[0:2], axes[2:4]):
    assert row[0].get_ylim() == row[1].get_ylim()  # one scale per row
    assert row[0].get_ylim()[1] >= 5.0 * 1.6  # sqd1's spread fits
  bands = [c for c in axes[0].collections if c.get_label().endswith("th")]
  rgb = [np.array(colors.to_rgb(b.get_facecolor()[0])) for b in bands]
  assert len(bands) == 2 and np.abs(rgb[0] - rgb[1]).max() > 0.15
