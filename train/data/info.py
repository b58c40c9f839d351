"""What the datasets are: their names, static facts and in-memory container.

`DatasetInfo` holds what is known about a dataset without reading it (shape,
classes, normalisation statistics, tensorflow-datasets name); `Dataset` holds
one loaded into memory and checks its arrays. The loaders are in
`train.data.datasets` (entry point), `train.data.formats` (file formats),
`train.data.locate` (where the files may be) and `train.data.tfds`.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from typing import Any

import numpy as np

DATASETS: tuple[str, ...] = (
    "mnist",
    "fashion_mnist",
    "cifar10",
    "cifar100",
    "svhn",
)


class DataNotFoundError(FileNotFoundError):
  """The dataset was found nowhere; the message says how to provide it.

  Attributes:
    notes: What the search noticed that a reader should know (a pickled or
      partial copy, a tensorflow-datasets copy that could not be read), for
      a caller that words its own message; routine misses are left out.
  """

  def __init__(self, message: str = "", *, notes: Sequence[str] = ()):
    super().__init__(message)
    self.notes = tuple(notes)


class MalformedDataError(ValueError):
  """A dataset file exists but is not in its canonical format."""


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """Static facts about a dataset.

  Attributes:
    name: One of `DATASETS`.
    num_classes: Number of labels; labels are ``0 .. num_classes - 1``.
    image_shape: ``(height, width, channels)``.
    mean: Per-channel mean of the training pixels, in units of pixel / 255.
    std: Per-channel standard deviation of the training pixels (over all
      pixels of the channel), same units.
    augment_by_default: Whether training normally uses random crops and flips
      (not for digits and clothes: centred, and orientation matters).
    tfds_name: The tensorflow-datasets builder holding the same data.
  """

  name: str
  num_classes: int
  image_shape: tuple[int, int, int]
  mean: tuple[float, ...]
  std: tuple[float, ...]
  augment_by_default: bool
  tfds_name: str


# Each dataset's facts in DatasetInfo's field order: name, classes, image
# shape, then the per-channel mean and std, augment by default, tfds name.
# The Fashion-MNIST and CIFAR-10 statistics are checked against the data in
# tests/train/data/test_input_pipeline.py when it is installed; the others are the values
# published with the datasets' common training recipes.
# fmt: off
_FACTS = (
    ("mnist", 10, (28, 28, 1),
     (0.1307,), (0.3081,), False, "mnist"),
    ("fashion_mnist", 10, (28, 28, 1),
     (0.2860,), (0.3530,), False, "fashion_mnist"),
    ("cifar10", 10, (32, 32, 3),
     (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True, "cifar10"),
    ("cifar100", 100, (32, 32, 3),
     (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), True, "cifar100"),
    ("svhn", 10, (32, 32, 3),
     (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970), True, "svhn_cropped"),
)
# fmt: on
_INFOS: dict[str, DatasetInfo] = {row[0]: DatasetInfo(*row) for row in _FACTS}

#: Training images of each dataset's canonical split: the epochs of a
#: ``--steps`` run before it has run (``train.sweep.runs.planned_epochs``).
TRAIN_IMAGES: dict[str, int] = {
    "mnist": 60000,
    "fashion_mnist": 60000,
    "cifar10": 50000,
    "cifar100": 50000,
    "svhn": 73257,
}


def dataset_info(name: str) -> DatasetInfo:
  """Returns the static facts about dataset ``name``.

  Raises:
    ValueError: ``name`` is not one of `DATASETS`.
  """
  if not isinstance(name, str) or name not in _INFOS:
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
  return _INFOS[name]


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """A dataset held in memory; the arrays are read-only views.

  Attributes:
    name: One of `DATASETS`.
    train_images: uint8, ``(N, H, W, C)``.
    train_labels: int32, ``(N,)``, in ``[0, num_classes)``.
    test_images: uint8, ``(M, H, W, C)``.
    test_labels: int32, ``(M,)``.
    num_classes: Number of classes.
    source: Which files (or which tfds dataset) the arrays were read from.
  """

  name: str
  train_images: np.ndarray = dataclasses.field(repr=False)
  train_labels: np.ndarray = dataclasses.field(repr=False)
  test_images: np.ndarray = dataclasses.field(repr=False)
  test_labels: np.ndarray = dataclasses.field(repr=False)
  num_classes: int
  source: str

  def __post_init__(self):
    info = dataset_info(self.name)
    if self.num_classes != info.num_classes:
      raise ValueError(
          f"{self.name} has {info.num_classes} classes, got {self.num_classes}"
      )
    _check_split(self.train_images, self.train_labels, info, "train split")
    _check_split(self.test_images, self.test_labels, info, "test split")
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
      # A read-only view: the caller's own array keeps its flags.
      view = getattr(self, field).view()
      view.setflags(write=False)
      object.__setattr__(self, field, view)

  @property
  def info(self) -> DatasetInfo:
    return dataset_info(self.name)


def _check_split(images: Any, labels: Any, info: DatasetInfo, what: str):
  """Raises ValueError unless (images, labels) is a split of ``info``."""
  where = f"{info.name} {what}"
  if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
    raise ValueError(f"{where}: images must be a uint8 numpy array")
  if images.ndim != 4 or images.shape[1:] != info.image_shape:
    raise ValueError(
        f"{where}: images must have shape (N, *{info.image_shape}), got"
        f" {images.shape}"
    )
  if (
      not isinstance(labels, np.ndarray)
      or labels.dtype != np.int32
      or labels.shape != images.shape[:1]
  ):
    raise ValueError(
        f"{where}: labels must be an int32 numpy array of shape"
        f" ({len(images)},), got {getattr(labels, 'dtype', type(labels))}"
        f" {getattr(labels, 'shape', '')}"
    )
  if labels.size and (labels.min() < 0 or labels.max() >= info.num_classes):
    raise ValueError(
        f"{where}: labels must lie in [0, {info.num_classes}), got"
        f" [{labels.min()}, {labels.max()}]"
    )
