"""Tiny synthetic data and quiet runs of the training loop, for train/ tests:
also the CLI's arguments for a tiny run, a run killed mid-way and data
search places that hold nothing.

Shared by the tests of the training suite (tests/train/loop/test_trainer.py and the
tests of activations, gain, precise statistics, distributed runs, the first
hour). Equal shapes reuse compiled programs, so most runs here train on
:func:`small_dataset` with :data:`TINY`.
"""

from __future__ import annotations

import functools
from pathlib import Path
import signal
import time
from typing import Any

import numpy as np
import pytest

from train import configs
from train.data import datasets
from train.data import input_pipeline
from train.data import locate as data_locate
from train.loop import checkpointing
from train.loop import trainer as train
from train.model import models

from tests.helpers.data import write_idx_dataset

#: ResNet20 with one block per stage, for the tests that compare two
#: formulations of a model: every stage, stride-2 transition, shortcut, norm
#: and convolution kind is still there, with a third of the blocks to compile.
RESNET8 = functools.partial(models.ResNet, blocks_per_stage=1)

#: The small models those tests build, by the name in their test ids.
FORMULATION_MODELS = {"lenet": models.LeNet, "resnet8": RESNET8}

# Metrics that must match between runs; the rest are timings.
EXACT_KEYS = (
    "epoch",
    "train_loss",
    "train_error",
    "test_loss",
    "test_error",
    "best_test_error",
)

TINY = configs.MNIST.replace(
    epochs=3, batch_size=16, learning_rate=0.05, momentum=0.9, norm="mad"
)


def synthetic_arrays(n: int, seed: int, shape=(28, 28, 1), classes: int = 10):
  """Learnable images: class k has a bright 4x4 patch at a class position."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, classes, n).astype(np.int32)
  images = rng.integers(0, 60, (n, *shape)).astype(np.uint8)
  for i, k in enumerate(labels):
    row, col = 2 + 6 * (k // 4), 2 + 6 * (k % 4)
    images[i, row : row + 4, col : col + 4, :] = 250
  return images, labels


def synthetic_dataset(
    n_train: int = 64, n_test: int = 37, name: str = "mnist"
) -> input_pipeline.Dataset:
  shape = input_pipeline.dataset_info(name).image_shape
  train_images, train_labels = synthetic_arrays(n_train, 0, shape)
  test_images, test_labels = synthetic_arrays(n_test, 1, shape)
  return input_pipeline.Dataset(
      name=name,
      train_images=train_images,
      train_labels=train_labels,
      test_images=test_images,
      test_labels=test_labels,
      num_classes=10,
      source="synthetic",
  )


def small_dataset() -> input_pipeline.Dataset:
  """The dataset of most runs here: equal shapes reuse compiled programs."""
  return synthetic_dataset(52, 37)


def write_tiny_mnist(folder: Path, n_train: int = 64, n_test: int = 37) -> Path:
  """The synthetic dataset as canonical (gzipped IDX) MNIST files."""
  ds = synthetic_dataset(n_train, n_test)
  return write_idx_dataset(
      folder,
      (ds.train_images, ds.train_labels),
      (ds.test_images, ds.test_labels),
  )


def exact(history):
  """The metrics rows without their timings: what equal runs share."""
  return [{k: row[k] for k in EXACT_KEYS} for row in history]


def run_quiet(config, workdir, **kwargs):
  """``train_and_evaluate`` with no progress and no log lines."""
  return train.train_and_evaluate(
      config, workdir, progress=False, log=lambda line: None, **kwargs
  )


def tiny_cli_args(data: Path, workdir: Path | None, *more: str) -> list[str]:
  """``train.mnist``'s arguments for a run on :func:`write_tiny_mnist`'s
  files in ``data``: batches of 16, no progress bar, then ``more``."""
  where = [] if workdir is None else ["--workdir", str(workdir)]
  return [
      "--data-dir",
      str(data),
      *where,
      "--batch-size",
      "16",
      "--no-progress",
      *more,
  ]


def kill_after_epochs(
    process: Any, workdir: Path, epochs: int, timeout: float = 240
) -> int:
  """SIGKILLs ``process`` (started by ``tests.helpers.process.start_module``) once
  ``workdir`` records ``epochs`` epochs, it exits or ``timeout`` seconds
  pass; the epochs ``workdir`` records then."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and process.poll() is None:
    if len(checkpointing.read_metrics(workdir)) >= epochs:
      break
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  process.wait()
  return len(checkpointing.read_metrics(workdir))


def empty_data_places(
    root: Path, monkeypatch: pytest.MonkeyPatch, *more: str
) -> dict[str, Path]:
  """Points every place the loaders search for data at an empty folder
  under ``root``; the folders by name (also one for each of ``more``)."""
  paths = {k: root / k for k in ("env", "user", "system", "tfds", *more)}
  for path in paths.values():
    path.mkdir()
  monkeypatch.setenv(datasets.ENV_DATA_DIR, str(paths["env"]))
  monkeypatch.setattr(data_locate, "USER_DATA_DIR", str(paths["user"]))
  monkeypatch.setattr(data_locate, "SYSTEM_DATA_DIRS", (str(paths["system"]),))
  monkeypatch.setenv("TFDS_DATA_DIR", str(paths["tfds"]))
  return paths
