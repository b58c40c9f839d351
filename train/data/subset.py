"""A fixed, class-balanced subset of a dataset's training split.

``--train-subset N`` trains on :func:`train_subset`'s ``N`` images: ``N /
num_classes`` of each class, drawn by ``--subset-seed`` alone, so that runs
of any model seed and any norm see the same images. The trainer and the
curvature tool both call :func:`for_config`, so that they read the same
images; the test split is kept whole.

The subset of size ``N`` holds, for each class, that class's first images
in one seeded permutation of the training split, so for one seed a smaller
subset lies inside a larger one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from train.data.info import Dataset

# Mixed into the seed: the subset's stream is none of the trainer's.
_STREAM = 0x5B5E7


def subset_problem(
    size: Any, num_classes: int, train_images: int
) -> str | None:
  """What is wrong with a subset of ``size`` images, else ``None``.

  Args:
    size: The requested number of images.
    num_classes: The dataset's classes.
    train_images: The size of its training split.
  """
  valid = (
      f"a multiple of {num_classes} (the classes) from {num_classes} to "
      f"{train_images - train_images % num_classes} (the training images)"
  )
  if (
      isinstance(size, bool)
      or not isinstance(size, int)
      or size < num_classes
      or size % num_classes
      or size > train_images
  ):
    return f"must be {valid}, got {size!r}"
  return None


def balanced_indices(
    labels: np.ndarray, size: int, num_classes: int, seed: int
) -> np.ndarray:
  """The ascending indices of the class-balanced subset of ``labels``.

  Args:
    labels: The training labels, in ``[0, num_classes)``.
    size: How many indices; a multiple of ``num_classes``.
    num_classes: The number of classes.
    seed: Chooses the subset.

  Raises:
    ValueError: ``size`` is invalid, or a class has fewer than ``size /
      num_classes`` images.
  """
  problem = subset_problem(size, num_classes, len(labels))
  if problem is not None:
    raise ValueError(f"--train-subset {problem}")
  per_class = size // num_classes
  order = np.random.default_rng([seed, _STREAM]).permutation(len(labels))
  shuffled = np.asarray(labels)[order]
  chosen = []
  for label in range(num_classes):
    members = order[shuffled == label]
    if len(members) < per_class:
      raise ValueError(
          f"--train-subset {size} takes {per_class} images of each class, "
          f"but class {label} has {len(members)}"
      )
    chosen.append(members[:per_class])
  return np.sort(np.concatenate(chosen))


def train_subset(dataset: Dataset, size: int, seed: int) -> Dataset:
  """``dataset`` with its training split cut to :func:`balanced_indices`.

  Raises:
    ValueError: See :func:`balanced_indices`.
  """
  keep = balanced_indices(dataset.train_labels, size, dataset.num_classes, seed)
  return dataclasses.replace(
      dataset,
      train_images=dataset.train_images[keep],
      train_labels=dataset.train_labels[keep],
      source=f"{dataset.source}; training subset of {size} images, "
      f"{size // dataset.num_classes} per class (subset seed {seed})",
  )


def for_config(dataset: Dataset, config: Any) -> Dataset:
  """The training data of a run: ``dataset``, cut to ``config.train_subset``
  images chosen by ``config.subset_seed`` when it is set.

  Args:
    dataset: The whole dataset.
    config: A ``train.configs.Config``.

  Raises:
    ValueError: See :func:`balanced_indices`.
  """
  if config.train_subset is None:
    return dataset
  return train_subset(dataset, config.train_subset, config.subset_seed)
