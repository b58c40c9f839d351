"""Tiny synthetic data and quiet runs of the training loop, for train/ tests.

Shared by the tests of the training suite (tests/test_train.py and the
tests of activations, gain, precise statistics, distributed runs, the first
hour). Equal shapes reuse compiled programs, so most runs here train on
:func:`small_dataset` with :data:`TINY`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from train import configs
from train import input_pipeline
from train import train

import data_helpers

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
  return data_helpers.write_idx_dataset(
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
