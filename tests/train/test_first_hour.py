"""What a new user hits first: CLI failures and messages, plots, ``gbn_jax.nnx``."""

from __future__ import annotations

import json
import os
import stat

import pytest

from train import configs
from train import main as train_main
from train.loop import checkpointing
from train.report import plot

from tests.helpers.process import run_module
from tests.helpers.process import run_python_result
from tests.helpers.run_folders import saved_figures
from tests.helpers.run_folders import write_random_run
from tests.helpers.training import TINY
from tests.helpers.training import tiny_cli_args
from tests.helpers.training import write_tiny_mnist


def _run_cli(argv, capsys):
  code = train_main.run(argv, configs.MNIST, prog="train.mnist")
  captured = capsys.readouterr()
  return code, captured.out, captured.err


def test_workdir_that_is_a_file_is_one_clean_line(tmp_path, capsys):
  (tmp_path / "file").write_text("x")
  code, _, err = _run_cli(["--workdir", str(tmp_path / "file")], capsys)
  assert code == 1
  assert err.strip() == (
      f"train.mnist: error: --workdir {tmp_path / 'file'} "
      "exists and is not a folder"
  )


def test_workdir_that_cannot_be_created_is_one_clean_line(tmp_path, capsys):
  (tmp_path / "file").write_text("x")
  data = write_tiny_mnist(tmp_path / "data")
  code, _, err = _run_cli(
      [
          "--workdir",
          str(tmp_path / "file" / "run"),
          "--data-dir",
          str(data),
          "--no-progress",
      ],
      capsys,
  )
  assert code == 1
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train.mnist: error: ")
  assert "Not a directory" in lines[0] and "Traceback" not in err


def test_run_that_failed_before_its_first_epoch_does_not_block(
    tmp_path, capsys
):
  workdir = tmp_path / "run"
  code, _, err = _run_cli(
      [
          "--workdir",
          str(workdir),
          "--data-dir",
          str(tmp_path / "nowhere"),
          "--dataset",
          "svhn",
      ],
      capsys,
  )
  assert code == 1 and "could not find the svhn dataset" in err
  data = write_tiny_mnist(tmp_path / "data")
  code, out, err = _run_cli(
      tiny_cli_args(data, workdir, "--epochs", "1"), capsys
  )
  assert code == 0, err
  assert "1 epoch," in out and "1 epochs" not in out
  assert checkpointing.read_config(workdir).dataset == "mnist"
  # Outputs are readable by others, as the umask allows.
  umask = os.umask(0o022)
  os.umask(umask)
  for name in ("config.json", "metrics.jsonl"):
    mode = stat.S_IMODE((workdir / name).stat().st_mode)
    assert mode == 0o666 & ~umask, (name, oct(mode))
  # A run that did finish an epoch still refuses a different config.
  code, _, err = _run_cli(
      tiny_cli_args(data, workdir, "--epochs", "1", "--norm", "mad"), capsys
  )
  assert code == 1 and "different config" in err


def test_first_epoch_notes():
  import jax  # pylint: disable=g-import-not-at-top

  cpu = jax.devices("cpu")
  lines = train_main._first_epoch_notes(configs.CIFAR, 300.0, cpu, prog="p")
  assert lines[0] == (
      "p: the first epoch took 300s; the remaining 99 epochs "
      "should take about 8.2 h"
  )
  assert "meant for a GPU" in lines[1] and "--model lenet" in lines[1]
  assert train_main._first_epoch_notes(
      configs.MNIST.replace(epochs=3), 30.0, cpu, prog="p"
  ) == [
      "p: the first epoch took 30s; the remaining 2 epochs should take "
      "about 60s"
  ]
  assert (
      train_main._first_epoch_notes(
          configs.MNIST.replace(epochs=1), 30.0, cpu, prog="p"
      )
      == []
  )
  # After a resume, only the epochs after the first one trained remain.
  assert train_main._first_epoch_notes(
      configs.MNIST.replace(epochs=5), 30.0, cpu, prog="p", epoch=3
  ) == [
      "p: epoch 3 (the first this command trained) took 30s; the remaining "
      "2 epochs should take about 60s"
  ]
  assert (
      train_main._first_epoch_notes(
          configs.MNIST.replace(epochs=5), 30.0, cpu, prog="p", epoch=5
      )
      == []
  )


def test_resumed_run_estimates_its_remaining_epochs_and_names_its_data(
    tmp_path, capsys
):
  data = write_tiny_mnist(tmp_path / "data")  # 64 images: 4 batches of 16
  run = tiny_cli_args(data, tmp_path / "run")
  code, _, err = _run_cli([*run, "--epochs", "1"], capsys)
  assert code == 0, err
  assert "(4 batches of 16), " in err and "dropped" not in err
  assert f"data: mnist files in {data}" in err
  # Resumed at epoch 2 of 3: one epoch remains after it, not two.
  code, _, err = _run_cli([*run, "--epochs", "3"], capsys)
  assert code == 0, err
  assert "epoch 2 (the first this command trained) took " in err
  assert "the first epoch" not in err
  assert "the remaining 1 epoch should take" in err
  # Resumed at the final epoch: nothing remains to estimate.
  code, _, err = _run_cli([*run, "--epochs", "4"], capsys)
  assert code == 0, err
  assert "remaining" not in err
  assert (tmp_path / "run" / checkpointing.DATA_SOURCE_FILE).read_text() == (
      "".join(
          f"from epoch {e}: mnist files in {data}: train-images-idx3-"
          "ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-"
          "ubyte.gz, t10k-labels-idx1-ubyte.gz\n"
          for e in (1, 2, 4)
      )
  )


def test_data_dir_without_the_data_is_an_error_not_another_copy(
    tmp_path, capsys, monkeypatch
):
  # pylint: disable-next=g-import-not-at-top
  from train.data import locate as data_locate

  installed = write_tiny_mnist(tmp_path / "installed" / "mnist")
  monkeypatch.setattr(
      data_locate, "SYSTEM_DATA_DIRS", (str(tmp_path / "installed"),)
  )
  empty = tmp_path / "empty"
  empty.mkdir()
  for data_dir in (empty, tmp_path / "typo"):
    code, _, err = _run_cli(
        tiny_cli_args(data_dir, tmp_path / "run", "--epochs", "1"), capsys
    )
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith("train.mnist: error: could not find the mnist")
    assert str(data_dir) in first and "train-images-idx3-ubyte" in first
    assert str(installed) in err  # the copy it did not use, named


@pytest.mark.slow
def test_cli_prints_estimate_after_first_epoch(tmp_path):
  data = write_tiny_mnist(tmp_path / "data")
  args = tiny_cli_args(data, tmp_path / "run", "--epochs", "3")
  result = run_module("train.mnist", *args, timeout=300)
  assert result.returncode == 0, result.stderr
  lines = result.stderr.splitlines()
  at = next(i for i, l in enumerate(lines) if l.startswith("epoch 1/3"))
  assert "remaining 2 epochs should take about" in lines[at + 1]


def test_interrupt_before_first_epoch_says_nothing_was_saved(tmp_path):
  assert "nothing was saved" in train_main._resume_hint(str(tmp_path / "x"))
  checkpointing.write_metrics(tmp_path, [{"epoch": 1}, {"epoch": 2}])
  hint = train_main._resume_hint(str(tmp_path))
  assert "epochs 1-2 are saved" in hint and "resume" in hint
  checkpointing.write_metrics(tmp_path, [{"epoch": 1}])
  hint = train_main._resume_hint(str(tmp_path))
  assert hint.startswith("epoch 1 is saved in") and "1-1" not in hint


# --- the default run folder: named after what differs from the defaults ------


def _workdir(name: str) -> str:
  return os.path.join("workdir", name)


def test_default_workdir_names_the_settings_that_differ():
  mnist, cifar = configs.MNIST, configs.CIFAR
  fashion = mnist.replace(dataset="fashion_mnist", norm="sqd2")
  # The defaults keep the short names that runs and docs already use.
  assert train_main.default_workdir(fashion, mnist) == _workdir(
      "fashion_mnist-lenet-sqd2-seed0"
  )
  assert train_main.default_workdir(
      cifar.replace(norm="sqd2"), cifar
  ) == _workdir("cifar10-resnet20-sqd2-seed0")
  assert train_main.default_workdir(
      mnist.replace(norm="rsd", calibration="normal", seed=4), mnist
  ) == _workdir("mnist-lenet-rsd-cal_normal-seed4")
  # Another learning rate is another folder, named for it.
  assert train_main.default_workdir(
      fashion.replace(learning_rate=0.1), mnist
  ) == _workdir("fashion_mnist-lenet-sqd2-lr0.1-seed0")
  changed = cifar.replace(
      norm="sqd:0.3",
      batch_size=128,
      momentum=0.9,
      weight_decay=0.0,
      augment=False,
      eval_every=5,
      renorm=True,
      calibration="normal",
      seed=3,
  )
  assert train_main.default_workdir(changed, cifar) == _workdir(
      "cifar10-resnet20-sqd_0.3-b128-m0.9-wd0.0-ev5-renorm-cal_normal-noaug"
      "-seed3"
  )
  # A setting given at its default value, or epochs, changes nothing.
  assert train_main.default_workdir(
      cifar.replace(augment=True, learning_rate=0.1, epochs=3), cifar
  ) == _workdir("cifar10-resnet20-bn-seed0")
  # Without the command's defaults: the ones the dataset implies.
  assert train_main.default_workdir(fashion) == _workdir(
      "fashion_mnist-lenet-sqd2-seed0"
  )


def _another_value(name, value):
  """A valid value of field ``name`` other than ``value``."""
  spec = configs.FIELDS[name]
  if spec.choices:
    return next(c for c in spec.choices if c != value)
  if name == "norm":
    return "mad"
  if name in ("steps", "train_subset"):  # None: train --epochs, all images
    return 100
  if value is None or isinstance(value, bool):  # augment: None is False here
    return not value
  if isinstance(value, int):
    return value + 1
  if isinstance(value, float):
    return value / 2 + 0.25
  raise AssertionError(f"no other value of {name} to try: add one here")


def test_every_setting_a_resume_checks_is_in_the_folder_name():
  """Any field that a resume compares (all but ``epochs``) shows in the
  folder name when it differs, so that changing it never meets a refusal to
  resume; fields added later too."""
  for name, value in configs.MNIST.to_json().items():
    # A subset seed chooses a subset: both runs have one.
    base = configs.MNIST.replace(
        **({"train_subset": 100} if name == "subset_seed" else {})
    )
    default = train_main.default_workdir(base, configs.MNIST)
    config = configs.validate(
        base.replace(**{name: _another_value(name, value)})
    )
    workdir = train_main.default_workdir(config, configs.MNIST)
    if name in configs.RESUMABLE_FIELDS:
      assert workdir == default, name
    else:
      assert workdir != default, name


def test_flags_that_leave_the_results_alone_keep_the_folder():
  from train import cli_flags  # pylint: disable=g-import-not-at-top

  parser = cli_flags.build_parser(configs.MNIST, "p")
  args = parser.parse_args(
      "--data-dir d --no-progress --checkpoint-every 5 --precise-stats 2 "
      "--record-activations 10 --overwrite --no-compile-cache "
      "--keep-checkpoints-every 10".split()
  )
  config = cli_flags.config_from_args(args, configs.MNIST)
  assert train_main.default_workdir(config, configs.MNIST) == _workdir(
      "mnist-lenet-bn-seed0"
  )


@pytest.mark.slow
def test_changed_setting_trains_in_its_own_folder_and_each_resumes(
    tmp_path, capsys, monkeypatch
):
  data = write_tiny_mnist(tmp_path / "data")  # 64 images: 4 batches of 16
  monkeypatch.chdir(tmp_path)
  first = tmp_path / _workdir("mnist-lenet-bn-b16-seed0")
  code, out, err = _run_cli(tiny_cli_args(data, None, "--epochs", "1"), capsys)
  assert code == 0, err
  assert out.rstrip().endswith(_workdir(first.name))
  # Another learning rate: a new run in a folder of its own, not a refusal.
  code, out, err = _run_cli(
      tiny_cli_args(data, None, "--epochs", "1", "--lr", "0.05"), capsys
  )
  assert code == 0, err
  other = tmp_path / _workdir("mnist-lenet-bn-b16-lr0.05-seed0")
  assert out.rstrip().endswith(_workdir(other.name))
  assert "resumed" not in err
  assert checkpointing.read_config(other).learning_rate == 0.05
  # The first command, with more epochs, resumes its own run.
  code, _, err = _run_cli(tiny_cli_args(data, None, "--epochs", "2"), capsys)
  assert code == 0, err
  assert "resumed from" in err
  assert [r["epoch"] for r in checkpointing.read_metrics(first)] == [1, 2]
  assert [r["epoch"] for r in checkpointing.read_metrics(other)] == [1]
  # A run of the same config in the folder named after dataset, model, norm
  # and seed alone is resumed there, not started again beside it.
  short = tmp_path / _workdir("mnist-lenet-bn-seed1")
  code, _, err = _run_cli(
      tiny_cli_args(data, short, "--epochs", "1", "--seed", "1"), capsys
  )
  assert code == 0, err
  code, out, err = _run_cli(
      tiny_cli_args(data, None, "--epochs", "2", "--seed", "1"), capsys
  )
  assert code == 0, err
  assert "resumed from" in err and out.rstrip().endswith(_workdir(short.name))
  assert [r["epoch"] for r in checkpointing.read_metrics(short)] == [1, 2]
  assert sorted(os.listdir("workdir")) == sorted(
      [first.name, other.name, short.name]
  )


def test_norm_momentum_error_names_the_flag(capsys):
  with pytest.raises(SystemExit):
    train_main.run(["--norm-momentum", "1.5"], configs.MNIST, prog="p")
  assert "--norm-momentum must be in [0, 1)" in capsys.readouterr().err


def test_data_not_found_is_quiet_without_tensorflow(tmp_path):
  result = run_module(
      "train.cifar",
      "--dataset",
      "svhn",
      "--model",
      "lenet",
      "--data-dir",
      str(tmp_path / "nowhere"),
      "--workdir",
      str(tmp_path / "run"),
      timeout=120,
      env={
          "TFDS_DATA_DIR": str(tmp_path / "tfds"),
          "GBN_DATA_DIR": "",
          "HOME": str(tmp_path),
      },
  )
  assert result.returncode == 1
  assert result.stderr.startswith(
      "python -m train.cifar: error: could not find the svhn dataset."
  )
  for noise in (
      "WARNING:absl",
      "Downloading and preparing",
      "importlib_resources'",
      "Traceback",
  ):
    assert noise not in result.stderr


# --- plots -----------------------------------------------------------------------


def _tick_labels(ax, axis):
  ax.figure.canvas.draw()
  ticks = ax.get_yticklabels() if axis == "y" else ax.get_xticklabels()
  low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
  locs = ax.get_yticks() if axis == "y" else ax.get_xticks()
  return [
      t.get_text()
      for t, loc in zip(ticks, locs)
      if low <= loc <= high and t.get_text()
  ]


def test_plot_labels_tell_runs_apart(tmp_path):
  a = write_random_run(tmp_path / "a", "bn", 0)
  b = write_random_run(tmp_path / "b", "bn", 1)
  config = json.loads((b / "config.json").read_text())
  config["epochs"] = 7
  (b / "config.json").write_text(json.dumps(config))
  configs_ = [json.loads((d / "config.json").read_text()) for d in (a, b)]
  assert plot.run_labels(configs_) == ["bn epochs=3", "bn epochs=7"]
  configs_[1]["momentum"] = 0.5
  labels = plot.run_labels(configs_)
  assert len(set(labels)) == 2 and "m0.5" in labels[1].split()


def test_plot_axes_legend_ticks(tmp_path, monkeypatch):
  runs = [
      write_random_run(tmp_path / n, n, i) for i, n in enumerate(("bn", "mad"))
  ]
  figures = saved_figures(monkeypatch)
  plot.plot_runs(runs, tmp_path / "out")
  assert len(figures) == 4
  for fig, (metric, _, xkey, _) in zip(figures, plot.CURVES):
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = (fig.legends or [ax.get_legend()])[0].get_window_extent()
    assert not legend.overlaps(ax.get_window_extent())  # beside, not on, data
    if xkey == "epoch":
      labels = _tick_labels(ax, "x")
      assert all(float(t.replace("−", "-")).is_integer() for t in labels)
    if metric == "train_loss":  # 2/epoch: 2 .. 0.4, a log axis
      assert ax.get_yscale() == "log"
      assert len(_tick_labels(ax, "y")) >= 3


def test_plot_skips_run_without_epochs_and_defaults_out_beside_runs(
    tmp_path, capsys
):
  good = write_random_run(tmp_path / "runs" / "bn", "bn", 0)
  empty = tmp_path / "runs" / "empty"
  empty.mkdir()
  (empty / "config.json").write_text(json.dumps(TINY.to_json()))
  checkpointing.write_metrics(empty, [])
  assert plot.main([str(good), str(empty)]) == 0
  captured = capsys.readouterr()
  assert f"skipped {empty}" in captured.err
  assert (tmp_path / "runs" / "plots" / "test_error_vs_epoch.png").exists()
  assert plot.main([str(empty)]) == 1
  assert "none of the runs" in capsys.readouterr().err


def test_plot_takes_a_sweep_glob_and_a_folder_above_the_runs(tmp_path, capsys):
  sweep = tmp_path / "sweeps" / "x"
  write_random_run(sweep / "bn", "bn", 0)
  write_random_run(sweep / "mad", "mad", 1)
  (sweep / "report").mkdir()  # what train.report writes beside the runs
  (sweep / "report" / "report.md").write_text("# report\n")
  # The shell's expansion of sweeps/x/*/: two runs and the report folder.
  assert (
      plot.main(
          [
              str(sweep / "bn"),
              str(sweep / "mad"),
              str(sweep / "report"),
              "--out",
              str(tmp_path / "a"),
          ]
      )
      == 0
  )
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if str(sweep / "report") in l] == [
      f"note: skipped {sweep / 'report'}: not a run directory (no "
      "config.json in or under it)"
  ]
  assert len(list((tmp_path / "a").glob("*.png"))) == 4
  # The sweep folder itself; the PNGs go beside its runs by default.
  assert plot.main([str(sweep)]) == 0
  assert len(list((sweep / "plots").glob("*.png"))) == 4
  # Nothing but a report folder: an error.
  assert plot.main([str(sweep / "report")]) == 1
  assert "none of the given folders holds a run" in capsys.readouterr().err


# --- library ---------------------------------------------------------------------


def test_gbn_jax_nnx_after_plain_import():
  result = run_python_result(
      "import sys, gbn_jax\n"
      "assert 'gbn_jax.nnx' not in sys.modules\n"
      "from flax import nnx\n"
      "layer = gbn_jax.nnx.GBatchNorm(4, measure='sqd1', rngs=nnx.Rngs(0))\n"
      "print(type(layer).__module__)",
      timeout=120,
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "gbn_jax.nnx"
  import gbn_jax  # pylint: disable=g-import-not-at-top

  with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
    gbn_jax.nonexistent  # pylint: disable=pointless-statement
