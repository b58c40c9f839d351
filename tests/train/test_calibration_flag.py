"""The training suite's --calibration: flags, configs, models, sweeps, a run.

``calibration='normal'`` itself (the layers and measures) is tested in
tests/gbn_jax/test_calibration.py.
"""

import json
import os

import flax.linen as nn
import numpy as np
import pytest

from gbn_jax import GBatchNorm
from train import cli_flags
from train import configs
from train import main as train_main
from train.loop import checkpointing
from train.loop import train_state
from train.loop import trainer as train
from train.model import models
from train.sweep import grid as sweep_grid
from train.sweep import runs as sweep_runs

from tests.helpers.training import TINY
from tests.helpers.training import run_quiet
from tests.helpers.training import small_dataset


def test_cli_config_and_models():
  parser = cli_flags.build_parser(configs.MNIST, "x")
  args = parser.parse_args(["--norm", "rsd", "--calibration", "normal"])
  config = configs.validate(cli_flags.config_from_args(args, configs.MNIST))
  assert config.calibration == "normal"
  assert (
      cli_flags.config_from_args(
          parser.parse_args([]), configs.MNIST
      ).calibration
      == "none"
  )
  assert train_main.default_workdir(config) == os.path.join(
      "workdir", "mnist-lenet-rsd-cal_normal-seed0"
  )
  assert train_main.default_workdir(
      config.replace(calibration="none")
  ) == os.path.join("workdir", "mnist-lenet-rsd-seed0")
  with pytest.raises(SystemExit):
    parser.parse_args(["--calibration", "gaussian"])
  with pytest.raises(ValueError, match="--calibration 'x' is not one of"):
    configs.validate(config.replace(calibration="x"))
  # config.json written before the field existed: calibration none.
  data = config.to_json()
  del data["calibration"]
  assert configs.Config.from_json(data) == config.replace(calibration="none")
  # bn stays flax's BatchNorm, sd the module without calibration; others get it.
  norm = models.make_norm("bn", calibration="normal")
  assert norm.func is nn.BatchNorm and "calibration" not in norm.keywords
  norm = models.make_norm(
      "bn", calibration="normal", renorm_clipping={"rmax": 2}
  )
  assert norm.keywords["measure"] == "sd" and "calibration" not in norm.keywords
  assert (
      "calibration" not in models.make_norm("sd", calibration="normal").keywords
  )
  assert (
      models.make_norm("sqd:0.3", calibration="normal").keywords["calibration"]
      == "normal"
  )
  assert (
      "calibration" not in models.make_norm("mad", calibration="none").keywords
  )
  with pytest.raises(ValueError, match="calibration 'x'"):
    models.make_norm("mad", calibration="x")


def test_help_says_calibration_is_a_no_op_for_bn_and_sd(capsys):
  with pytest.raises(SystemExit):
    train_main.run(["--help"], configs.MNIST, prog="train.mnist")
  text = " ".join(capsys.readouterr().out.split())
  assert "--calibration {none,normal}" in text
  assert "a no-op for bn and sd" in text


def test_sweep_names_and_old_run_dirs(tmp_path):
  runs = sweep_grid.expand(
      ["--norm", "bn,mad", "--calibration", "none,normal", "--epochs", "2"],
      "mnist",
  )
  assert [r.name for r in runs] == [
      "mnist-lenet-bn-b1000-lr0.01-seed0",
      "mnist-lenet-bn-b1000-lr0.01-cal_normal-seed0",
      "mnist-lenet-mad-b1000-lr0.01-seed0",
      "mnist-lenet-mad-b1000-lr0.01-cal_normal-seed0",
  ]
  assert [r.config.calibration for r in runs] == ["none", "normal"] * 2
  # A finished run written before the field existed keeps its name and is
  # skipped; its calibrated twin is not.
  old = runs[2]
  run_dir = tmp_path / old.name
  run_dir.mkdir()
  checkpointing.write_config(run_dir, old.config)
  data = json.loads((run_dir / "config.json").read_text())
  del data["calibration"]
  (run_dir / "config.json").write_text(json.dumps(data))
  checkpointing.write_metrics(run_dir, [{"epoch": e} for e in (1, 2)])
  assert checkpointing.read_config(run_dir) == old.config
  assert sweep_runs.is_finished(old, run_dir)
  assert not sweep_runs.is_finished(runs[3], run_dir)
  assert configs.differences(
      checkpointing.read_config(run_dir), runs[3].config
  ) == ['calibration: "none" -> "normal"']


def test_training_with_calibration(tmp_path):
  config = train.resolve(
      TINY.replace(norm="rsd", calibration="normal", epochs=1)
  )
  model = train_state.create_model(config, 10)
  norm = model.norm(use_running_average=False)
  assert isinstance(norm, GBatchNorm) and norm.calibration == "normal"
  cal = run_quiet(config, tmp_path / "cal", dataset=small_dataset())
  raw = run_quiet(
      config.replace(calibration="none"),
      tmp_path / "raw",
      dataset=small_dataset(),
  )
  assert np.isfinite(cal[-1]["train_loss"])
  assert cal[-1]["train_loss"] != raw[-1]["train_loss"]
