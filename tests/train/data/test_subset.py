"""``--train-subset``: a fixed, seeded, class-balanced training subset.

The subsets are checked against numpy's label counts and the rows of the
whole training set; a tiny run checks that training, ``config.json``, the
run folder's name and the curvature tool's sample all follow the subset.
"""

from __future__ import annotations

import numpy as np
import pytest

from train import configs
from train import main as train_main
from train.curvature import cli as curvature
from train.data import subset
from train.loop import checkpointing
from train.sweep import grid as sweep_grid
from train.sweep import runs as sweep_runs

from tests.helpers.data import random_split
from tests.helpers.training import TINY
from tests.helpers.training import run_quiet
from tests.helpers.training import small_dataset
from tests.helpers.training import synthetic_dataset
from tests.helpers.training import tiny_cli_args
from tests.helpers.training import write_tiny_mnist


def _labels(n: int = 600, classes: int = 10) -> np.ndarray:
  return random_split(7, n, (1,), classes)[1]


@pytest.mark.parametrize("size", [10, 100, 300])
def test_subset_is_class_balanced_and_distinct(size):
  labels = _labels()
  picked = subset.balanced_indices(labels, size, 10, seed=0)
  assert len(picked) == size
  assert len(np.unique(picked)) == size
  assert np.all(np.diff(picked) > 0)  # ascending, so no repeats
  assert picked.min() >= 0 and picked.max() < len(labels)
  np.testing.assert_array_equal(
      np.bincount(labels[picked], minlength=10), np.full(10, size // 10)
  )


def test_subset_depends_on_its_seed_alone():
  labels = _labels()
  first = subset.balanced_indices(labels, 100, 10, seed=0)
  np.testing.assert_array_equal(
      subset.balanced_indices(labels.copy(), 100, 10, seed=0), first
  )
  other = subset.balanced_indices(labels, 100, 10, seed=1)
  assert not np.array_equal(other, first)
  np.testing.assert_array_equal(
      np.bincount(labels[other], minlength=10), np.full(10, 10)
  )
  # For one seed a smaller subset lies inside a larger one.
  small = subset.balanced_indices(labels, 50, 10, seed=0)
  assert set(small) < set(first)


def test_subset_is_the_same_for_every_model_seed_and_norm():
  ds = synthetic_dataset(200, 10)
  runs = [
      TINY.replace(train_subset=50, subset_seed=3, seed=seed, norm=norm)
      for seed in (0, 1, 2)
      for norm in ("bn", "mad", "gn")
  ]
  cut = [subset.for_config(ds, config) for config in runs]
  for other in cut[1:]:
    np.testing.assert_array_equal(other.train_images, cut[0].train_images)
    np.testing.assert_array_equal(other.train_labels, cut[0].train_labels)
  # Each kept image is one of the training set's, with its label.
  rows = {
      (image.tobytes(), label)
      for image, label in zip(ds.train_images, ds.train_labels)
  }
  kept = {
      (image.tobytes(), label)
      for image, label in zip(cut[0].train_images, cut[0].train_labels)
  }
  assert len(kept) == 50 and kept <= rows
  np.testing.assert_array_equal(
      np.bincount(cut[0].train_labels, minlength=10), np.full(10, 5)
  )
  np.testing.assert_array_equal(cut[0].test_images, ds.test_images)
  assert subset.for_config(ds, TINY) is ds
  changed = subset.for_config(ds, runs[0].replace(subset_seed=4))
  assert not np.array_equal(changed.train_images, cut[0].train_images)


@pytest.mark.parametrize("size", [0, -10, 5, 15, 610, True, 20.0])
def test_invalid_sizes_name_the_flag_and_the_valid_values(size):
  with pytest.raises(ValueError) as e:
    subset.balanced_indices(_labels(), size, 10, seed=0)
  assert str(e.value).startswith("--train-subset must be a multiple of 10")
  assert "from 10 to 600" in str(e.value)


def test_a_class_too_small_for_its_share_is_an_error():
  labels = np.repeat(np.arange(10, dtype=np.int32), 6)
  labels[:3] = 1  # class 0 keeps 3 images
  with pytest.raises(ValueError, match="class 0 has 3"):
    subset.balanced_indices(labels, 50, 10, seed=0)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--train-subset", "5001"], "--train-subset must be a multiple of 10"),
        (["--train-subset", "0"], "from 10 to 50000"),
        (["--train-subset", "60000"], "from 10 to 50000"),
        (["--dataset", "cifar100", "--train-subset", "50"], "multiple of 100"),
        (["--subset-seed", "2"], "--subset-seed chooses a --train-subset"),
        (["--train-subset", "500", "--subset-seed", "-1"], "--subset-seed"),
    ],
)
def test_cli_refuses_invalid_subsets(capsys, flags, message):
  with pytest.raises(SystemExit) as exit_info:
    train_main.run(flags, configs.CIFAR, prog="python -m train.cifar")
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_run_folders_name_the_subset():
  plain = train_main.default_workdir(configs.CIFAR)
  sub = train_main.default_workdir(configs.CIFAR.replace(train_subset=5000))
  seeded = train_main.default_workdir(
      configs.CIFAR.replace(train_subset=5000, subset_seed=2)
  )
  assert plain == "workdir/cifar10-resnet20-bn-seed0"
  assert sub == "workdir/cifar10-resnet20-bn-sub5000-seed0"
  assert seeded == "workdir/cifar10-resnet20-bn-sub5000-subseed2-seed0"
  names = [
      run.name
      for run in sweep_grid.expand(
          ["--train-subset", "1000,5000", "--subset-seed", "0,1"]
      )
  ]
  assert len(set(names)) == 4
  assert "cifar10-resnet20-bn-b256-lr0.1-sub1000-subseed1-seed0" in names
  assert "cifar10-resnet20-bn-b256-lr0.1-sub5000-seed0" in names


def test_a_sweep_plans_the_epochs_of_a_subset_run(tmp_path):
  (run,) = sweep_grid.expand(
      ["--train-subset", "1000", "--batch-size", "100", "--steps", "25"]
  )
  # 10 steps an epoch over the subset (500 over the whole training set).
  assert sweep_runs.planned_epochs(run, tmp_path / "none") == 3


def test_training_and_config_follow_the_subset(tmp_path):
  ds = small_dataset()  # 52 images: 3 batches of 16; the subset of 30, 1
  config = TINY.replace(epochs=2, train_subset=30, subset_seed=1)
  history = run_quiet(config, tmp_path / "run", dataset=ds)
  assert [row["step"] for row in history] == [1, 2]
  for row in history:
    assert row["train_error"] * 16 == pytest.approx(
        round(row["train_error"] * 16)
    )
    assert row["test_error"] * 37 == pytest.approx(
        round(row["test_error"] * 37)
    )
  stored = checkpointing.read_config(tmp_path / "run")
  assert (stored.train_subset, stored.subset_seed) == (30, 1)
  assert (
      "training subset of 30 images, 3 per class (subset seed 1)"
      in (tmp_path / "run" / checkpointing.DATA_SOURCE_FILE).read_text()
  )
  whole = run_quiet(TINY.replace(epochs=1), tmp_path / "whole", dataset=ds)
  assert whole[0]["step"] == 3


def test_curvature_samples_the_runs_subset(tmp_path, monkeypatch):
  data = write_tiny_mnist(tmp_path / "data")  # synthetic_dataset(64, 37)
  whole = synthetic_dataset(64, 37)
  run = tmp_path / "run"
  trained = train_main.run(
      tiny_cli_args(data, run, "--epochs", "1", "--norm", "bn",
                    "--train-subset", "30", "--subset-seed", "5"),
      configs.MNIST,
      prog="train.mnist",
  )  # fmt: skip
  assert trained == 0
  seen = []
  sample = curvature.sample_batches

  def recording(dataset, *args):
    seen.append(dataset)
    return sample(dataset, *args)

  monkeypatch.setattr(curvature, "sample_batches", recording)
  small = ["--data-dir", str(data), "--batches", "2", "--batch-size", "8",
           "--eigenvalues", "2", "--iterations", "2", "--probes", "2",
           "--no-progress"]  # fmt: skip
  assert curvature.main([str(run), *small]) == 0
  (dataset,) = seen
  assert len(dataset.train_images) == 30
  np.testing.assert_array_equal(
      np.bincount(dataset.train_labels, minlength=10), np.full(10, 3)
  )
  rows = {image.tobytes() for image in whole.train_images}
  assert all(image.tobytes() in rows for image in dataset.train_images)
  # The run's own steps: 30 images in batches of 16 make 1 step an epoch.
  assert [line["step"] for line in curvature.read_lines(run)] == [1]
