"""Image-classification datasets as uint8 NHWC numpy arrays.

`load_dataset` reads the canonical distribution files itself (no pickle, no
TensorFlow) and takes the first of these sources that has the dataset:

1. ``data_dir`` when given, holding the dataset's files directly or in a
   subfolder named after it (`dataset_layout` lists the exact names), or
   tensorflow-datasets data prepared there. A ``data_dir`` that lacks the
   dataset is an error: the other sources below are then not searched, so
   that a mistyped folder never trains on another copy:

   * mnist, fashion_mnist: the IDX files ``train-images-idx3-ubyte.gz``,
     ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz`` and
     ``t10k-labels-idx1-ubyte.gz`` (gzipped or not);
   * cifar10: the "binary version", ``cifar-10-batches-bin/data_batch_1.bin``
     .. ``data_batch_5.bin`` and ``test_batch.bin``, or the unextracted
     ``cifar-10-binary.tar.gz``;
   * cifar100: ``cifar-100-binary/train.bin`` and ``test.bin``, or
     ``cifar-100-binary.tar.gz`` (the fine labels, 100 classes, are used);
   * svhn: format 2 (cropped digits), ``train_32x32.mat`` and
     ``test_32x32.mat`` (the ``extra`` set is not used).

2. Installed copies, searched through the dataset's subfolders: each folder of
   ``$GBN_DATA_DIR`` (``os.pathsep``-separated), ``~/.cache/gbn_jax`` and
   `SYSTEM_DATA_DIRS`, where the Debian package ``dataset-fashion-mnist`` puts
   ``fashion-mnist/``.

3. tensorflow-datasets (``tfds.data_source``, array_record files): data
   already prepared under ``data_dir``, ``$TFDS_DATA_DIR`` or
   ``~/tensorflow_datasets`` is read without TensorFlow; preparing
   (downloading) it needs TensorFlow and internet access.

4. With ``fetch=True`` (the training CLI) and no ``data_dir``: the official
   files, downloaded into ``~/.cache/gbn_jax`` and verified (`train.download`).

Nothing is ever unpickled: the CIFAR "python version" is refused with a
pointer to the binary version. A file that is not in its canonical format
(bad IDX magic number, truncated records, wrong dimensions, labels out of
range) raises `MalformedDataError`; a dataset found nowhere raises
`DataNotFoundError`, whose message lists every way to provide it.

``python -m train.datasets NAME [--data-dir DIR]`` loads a dataset and prints
a summary with the load time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping, Sequence
import contextlib
import dataclasses
import gzip
import importlib.util
import io
import logging
import math
import os
from pathlib import Path
import struct
import tarfile
import time
from typing import Any
import zlib

import numpy as np

DATASETS: tuple[str, ...] = (
    "mnist",
    "fashion_mnist",
    "cifar10",
    "cifar100",
    "svhn",
)

# Searched through the datasets' subfolders after data_dir and $GBN_DATA_DIR.
# The Debian package dataset-fashion-mnist installs
# /usr/share/datasets/fashion-mnist/*-ubyte.gz.
SYSTEM_DATA_DIRS: tuple[str, ...] = ("/usr/share/datasets",)

ENV_DATA_DIR = "GBN_DATA_DIR"
USER_DATA_DIR = "~/.cache/gbn_jax"

_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class DataNotFoundError(FileNotFoundError):
  """The dataset was found nowhere; the message says how to provide it."""


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


# The Fashion-MNIST and CIFAR-10 statistics are checked against the data in
# tests/test_input_pipeline.py when it is installed; the others are the values
# published with the datasets' common training recipes.
_INFOS: dict[str, DatasetInfo] = {
    "mnist": DatasetInfo(
        "mnist", 10, (28, 28, 1), (0.1307,), (0.3081,), False, "mnist"
    ),
    "fashion_mnist": DatasetInfo(
        "fashion_mnist",
        10,
        (28, 28, 1),
        (0.2860,),
        (0.3530,),
        False,
        "fashion_mnist",
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        10,
        (32, 32, 3),
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        True,
        "cifar10",
    ),
    "cifar100": DatasetInfo(
        "cifar100",
        100,
        (32, 32, 3),
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
        True,
        "cifar100",
    ),
    "svhn": DatasetInfo(
        "svhn",
        10,
        (32, 32, 3),
        (0.4377, 0.4438, 0.4728),
        (0.1980, 0.2010, 0.1970),
        True,
        "svhn_cropped",
    ),
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


# ---------------------------------------------------------------------------
# Canonical file formats. Parsers take a file's bytes and a name for errors.


def _parse_idx(data: bytes, what: str, ndim: int) -> np.ndarray:
  """Parses an IDX file of unsigned bytes with ``ndim`` dimensions.

  Returns:
    A read-only view of ``data`` (no copy).
  """
  # Magic number: two zero bytes, type code 0x08 (unsigned byte), ndim.
  magic = 0x0800 + ndim
  header_size = 4 + 4 * ndim
  if len(data) < 4:
    raise MalformedDataError(
        f"{what}: {len(data)} bytes is too short for an IDX header"
    )
  found = struct.unpack(">I", data[:4])[0]
  if found != magic:
    raise MalformedDataError(
        f"{what}: bad IDX magic number 0x{found:08x}, expected 0x{magic:08x}"
        f" (unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})"
    )
  if len(data) < header_size:
    raise MalformedDataError(
        f"{what}: {len(data)} bytes is too short for an IDX header"
    )
  dims = struct.unpack(f">{ndim}I", data[4:header_size])
  expected = header_size + math.prod(dims)
  if len(data) != expected:
    raise MalformedDataError(
        f"{what}: the IDX header announces dimensions {dims} ({expected}"
        f" bytes) but the file has {len(data)} bytes (truncated or corrupt)"
    )
  return np.frombuffer(data, np.uint8, offset=header_size).reshape(dims)


def _parse_idx_split(
    image_bytes: bytes, label_bytes: bytes, what: str, info: DatasetInfo
) -> tuple[np.ndarray, np.ndarray]:
  """Parses a pair of IDX files into NHWC uint8 images and int32 labels."""
  images = _parse_idx(image_bytes, f"{what} images", 3)
  labels = _parse_idx(label_bytes, f"{what} labels", 1)
  if images.shape[1:] != info.image_shape[:2]:
    raise MalformedDataError(
        f"{what} images: expected {info.image_shape[0]}x"
        f"{info.image_shape[1]} images, got {images.shape[1]}x"
        f"{images.shape[2]}"
    )
  if len(labels) != len(images):
    raise MalformedDataError(
        f"{what}: {len(images)} images but {len(labels)} labels"
    )
  _check_label_range(labels, info.num_classes, f"{what} labels")
  return images[..., None], labels.astype(np.int32)


def _parse_cifar_records(
    data: bytes,
    what: str,
    label_classes: Sequence[int],
    use_label: int,
) -> tuple[np.ndarray, np.ndarray]:
  """Parses CIFAR binary records: label byte(s), then 3x32x32 pixels.

  Args:
    data: The file's bytes.
    what: Name of the file, for error messages.
    label_classes: Number of classes of each leading label byte: ``(10,)``
      for CIFAR-10, ``(20, 100)`` (coarse, fine) for CIFAR-100.
    use_label: Index of the label byte that becomes the label.

  Returns:
    uint8 images ``(N, 32, 32, 3)`` (a strided view of ``data``) and int32
    labels ``(N,)``.
  """
  num_label_bytes = len(label_classes)
  record_size = num_label_bytes + 3 * 32 * 32
  if not data or len(data) % record_size:
    raise MalformedDataError(
        f"{what}: {len(data)} bytes is not a positive whole number of"
        f" {record_size}-byte records (truncated, or not a CIFAR binary file)"
    )
  records = np.frombuffer(data, np.uint8).reshape(-1, record_size)
  for i, num_classes in enumerate(label_classes):
    _check_label_range(records[:, i], num_classes, f"{what} label byte {i}")
  # Pixels are stored channel-major: the 1024 R values, then G, then B.
  images = records[:, num_label_bytes:].reshape(-1, 3, 32, 32)
  return images.transpose(0, 2, 3, 1), records[:, use_label].astype(np.int32)


def _check_label_range(labels: np.ndarray, num_classes: int, what: str):
  if labels.size and labels.max() >= num_classes:
    raise MalformedDataError(
        f"{what}: found label {labels.max()}, but labels must lie in"
        f" [0, {num_classes})"
    )


def _parse_svhn_mat(data: bytes, what: str) -> tuple[np.ndarray, np.ndarray]:
  """Parses a SVHN format-2 .mat file into NHWC images and labels 0..9.

  The file holds ``X``, uint8 ``(32, 32, 3, N)``, and ``y``, ``(N, 1)`` in
  1..10, where 10 stands for the digit 0.
  """
  try:
    import scipy.io  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"reading SVHN needs scipy: pip install scipy ({e})")
  try:
    mat = scipy.io.loadmat(io.BytesIO(data), variable_names=("X", "y"))
  except Exception as e:  # scipy raises ValueError, TypeError, OSError...
    raise MalformedDataError(
        f"{what}: not a readable MATLAB file ({type(e).__name__}: {e})"
    ) from e
  x, y = mat.get("X"), mat.get("y")
  if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
    raise MalformedDataError(
        f"{what}: expected variables X and y, found"
        f" {sorted(k for k in mat if not k.startswith('__'))}"
    )
  if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
    raise MalformedDataError(
        f"{what}: X must be uint8 (32, 32, 3, N), got {x.dtype} {x.shape}"
    )
  n = x.shape[3]
  if y.shape not in ((n, 1), (n,)) or not np.issubdtype(y.dtype, np.integer):
    raise MalformedDataError(
        f"{what}: y must be integers of shape ({n}, 1) to match X, got"
        f" {y.dtype} {y.shape}"
    )
  y = y.reshape(n)
  if n and (y.min() < 1 or y.max() > 10):
    raise MalformedDataError(
        f"{what}: labels must lie in 1..10 (10 stands for the digit 0), got"
        f" [{y.min()}, {y.max()}]"
    )
  images = np.ascontiguousarray(np.moveaxis(x, 3, 0))
  return images, np.where(y == 10, 0, y).astype(np.int32)


def _read_idx_dataset(
    name: str,
) -> Callable[[Mapping[str, bytes], str], _Arrays]:
  def read(files: Mapping[str, bytes], where: str) -> _Arrays:
    info = _INFOS[name]
    return (
        *_parse_idx_split(
            files[_IDX_FILES[0]], files[_IDX_FILES[1]], f"{where}: train", info
        ),
        *_parse_idx_split(
            files[_IDX_FILES[2]], files[_IDX_FILES[3]], f"{where}: t10k", info
        ),
    )

  return read


def _read_cifar10(files: Mapping[str, bytes], where: str) -> _Arrays:
  parts = [
      _parse_cifar_records(files[f], f"{where}/{f}", (10,), 0)
      for f in _CIFAR10_TRAIN
  ]
  test_images, test_labels = _parse_cifar_records(
      files["test_batch.bin"], f"{where}/test_batch.bin", (10,), 0
  )
  return (
      np.concatenate([images for images, _ in parts]),
      np.concatenate([labels for _, labels in parts]),
      np.ascontiguousarray(test_images),
      test_labels,
  )


def _read_cifar100(files: Mapping[str, bytes], where: str) -> _Arrays:
  # Each record starts with the coarse label (20 classes), then the fine one.
  train_images, train_labels = _parse_cifar_records(
      files["train.bin"], f"{where}/train.bin", (20, 100), 1
  )
  test_images, test_labels = _parse_cifar_records(
      files["test.bin"], f"{where}/test.bin", (20, 100), 1
  )
  return (
      np.ascontiguousarray(train_images),
      train_labels,
      np.ascontiguousarray(test_images),
      test_labels,
  )


def _read_svhn(files: Mapping[str, bytes], where: str) -> _Arrays:
  return (
      *_parse_svhn_mat(files["train_32x32.mat"], f"{where}/train_32x32.mat"),
      *_parse_svhn_mat(files["test_32x32.mat"], f"{where}/test_32x32.mat"),
  )


# ---------------------------------------------------------------------------
# Where the files of each dataset may be.


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The files of one dataset, the folders they may be in, and their reader.

  Attributes:
    files: Names of the required files.
    subdirs: Subfolders of a search location that may hold ``files``.
    read: Turns ``{file name: bytes}`` and a location into the arrays.
    gzip_ok: Whether each file may also be present as ``name + ".gz"``.
    archive: Distribution archive (.tar.gz) read in place of ``files``.
    pickle_markers: Names that show the refused pickled "python version".
  """

  files: tuple[str, ...]
  subdirs: tuple[str, ...]
  read: Callable[[Mapping[str, bytes], str], _Arrays]
  gzip_ok: bool = False
  archive: str | None = None
  pickle_markers: tuple[str, ...] = ()


_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))

_LAYOUTS: dict[str, _Layout] = {
    "mnist": _Layout(
        _IDX_FILES,
        ("mnist", "MNIST", "MNIST/raw"),
        _read_idx_dataset("mnist"),
        gzip_ok=True,
    ),
    "fashion_mnist": _Layout(
        _IDX_FILES,
        ("fashion_mnist", "fashion-mnist", "FashionMNIST", "FashionMNIST/raw"),
        _read_idx_dataset("fashion_mnist"),
        gzip_ok=True,
    ),
    "cifar10": _Layout(
        _CIFAR10_TRAIN + ("test_batch.bin",),
        (
            "cifar-10-batches-bin",
            "cifar10",
            "cifar10/cifar-10-batches-bin",
            "cifar-10",
            "cifar-10/cifar-10-batches-bin",
        ),
        _read_cifar10,
        archive="cifar-10-binary.tar.gz",
        pickle_markers=(
            "cifar-10-batches-py",
            "cifar-10-python.tar.gz",
            "data_batch_1",
        ),
    ),
    "cifar100": _Layout(
        ("train.bin", "test.bin"),
        (
            "cifar-100-binary",
            "cifar100",
            "cifar100/cifar-100-binary",
            "cifar-100",
            "cifar-100/cifar-100-binary",
        ),
        _read_cifar100,
        archive="cifar-100-binary.tar.gz",
        pickle_markers=("cifar-100-python", "cifar-100-python.tar.gz"),
    ),
    "svhn": _Layout(
        ("train_32x32.mat", "test_32x32.mat"),
        ("svhn", "SVHN", "svhn_cropped"),
        _read_svhn,
    ),
}


def dataset_layout(
    name: str,
) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
  """Returns the file names, subfolder names and archive searched for ``name``.

  IDX files (mnist, fashion_mnist) may also carry a ``.gz`` suffix.
  """
  dataset_info(name)
  layout = _LAYOUTS[name]
  return layout.files, layout.subdirs, layout.archive


def search_locations(
    data_dir: str | os.PathLike[str] | None = None,
) -> list[tuple[Path, bool]]:
  """Returns the folders searched, in order, as ``(folder, explicit)`` pairs.

  Only the explicit folder (``data_dir``) may hold a dataset's files directly;
  the others are shared between datasets and are searched through the
  dataset's subfolders only (MNIST and Fashion-MNIST share file names).
  """
  locations = []
  if data_dir is not None:
    locations.append((Path(data_dir).expanduser(), True))
  for entry in os.environ.get(ENV_DATA_DIR, "").split(os.pathsep):
    if entry:
      locations.append((Path(entry).expanduser(), False))
  locations.append((Path(USER_DATA_DIR).expanduser(), False))
  locations.extend((Path(d), False) for d in SYSTEM_DATA_DIRS)
  return locations


@dataclasses.dataclass(frozen=True)
class _Found:
  """Local files of a dataset, ready to be read."""

  read: Callable[[], _Arrays]
  source: str


def _candidate_dirs(
    layout: _Layout, base: Path, explicit: bool
) -> Iterator[Path]:
  if explicit:
    yield base
  for sub in layout.subdirs:
    yield base / sub


def _existing_file(folder: Path, name: str, gzip_ok: bool) -> Path | None:
  for candidate in (name + ".gz", name) if gzip_ok else (name,):
    if (folder / candidate).is_file():
      return folder / candidate
  return None


def _find_in_dir(name: str, folder: Path, notes: list[str]) -> _Found | None:
  """Returns the dataset's files in ``folder``, or None.

  Adds a note to ``notes`` when only the pickled version is there.

  Raises:
    DataNotFoundError: ``folder`` holds some but not all required files.
  """
  layout = _LAYOUTS[name]
  paths = [_existing_file(folder, f, layout.gzip_ok) for f in layout.files]
  if all(paths):
    return _Found(
        read=lambda: layout.read(
            {f: _read_file_bytes(p) for f, p in zip(layout.files, paths)},
            str(folder),
        ),
        source=f"{name} files in {folder}: " + ", ".join(p.name for p in paths),
    )
  if any(paths):
    missing = [f for f, p in zip(layout.files, paths) if p is None]
    raise DataNotFoundError(
        f"{name}: {folder} holds only part of the dataset; missing: "
        + ", ".join(missing)
    )
  if layout.archive and (folder / layout.archive).is_file():
    archive = folder / layout.archive
    return _Found(
        read=lambda: layout.read(
            _read_tar_members(archive, layout.files), str(archive)
        ),
        source=f"{name} archive {archive}",
    )
  _note_pickles(name, folder, notes)
  return None


def _note_pickles(name: str, folder: Path, notes: list[str]) -> None:
  """Notes the pickled "python version" of the dataset in ``folder``."""
  for marker in _LAYOUTS[name].pickle_markers:
    note = (
        f'{folder / marker} is the pickled "python version" of {name},'
        " which is never read here (unpickling can run arbitrary code);"
        " get the binary version instead (see below)."
    )
    if (folder / marker).exists() and note not in notes:
      notes.append(note)


def _read_file_bytes(path: Path) -> bytes:
  data = path.read_bytes()
  if path.suffix != ".gz":
    return data
  try:
    return gzip.decompress(data)
  except (OSError, EOFError, zlib.error) as e:
    raise MalformedDataError(f"{path}: corrupt gzip data ({e})") from e


def _read_tar_members(archive: Path, names: Sequence[str]) -> dict[str, bytes]:
  """Reads the members named ``names`` (base names) in one streaming pass."""
  wanted, out = set(names), {}
  try:
    with tarfile.open(archive, "r|gz") as tar:
      for member in tar:
        base = member.name.rsplit("/", 1)[-1]
        if member.isfile() and base in wanted and base not in out:
          out[base] = tar.extractfile(member).read()
  except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
    raise MalformedDataError(f"{archive}: unreadable archive ({e})") from e
  missing = [n for n in names if n not in out]
  if missing:
    raise MalformedDataError(f"{archive}: lacks {', '.join(missing)}")
  return out


def _find_local(name: str, data_dir, notes: list[str]) -> _Found | None:
  seen = set()
  for base, explicit in search_locations(data_dir):
    if not explicit and base.is_dir():
      _note_pickles(name, base, notes)
    for folder in _candidate_dirs(_LAYOUTS[name], base, explicit):
      if folder in seen or not folder.is_dir():
        continue
      seen.add(folder)
      found = _find_in_dir(name, folder, notes)
      if found is not None:
        return found
  return None


# ---------------------------------------------------------------------------
# tensorflow-datasets.


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
  """Silences absl's warnings (tfds logs its search of empty folders)."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


class _TfdsUnavailable(Exception):
  """tensorflow-datasets could not provide the data (reason in message)."""


def _load_tfds(
    name: str, data_dir: str | os.PathLike[str] | None, download: bool
) -> tuple[_Arrays, str]:
  """Reads both splits with ``tfds.data_source`` (array_record, no TF)."""
  info = _INFOS[name]
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise _TfdsUnavailable(f"tensorflow-datasets is not installed ({e})")
  tfds_dir = (
      None if data_dir is None else os.fspath(Path(data_dir).expanduser())
  )
  # Preparing a dataset (downloading it) needs TensorFlow; without it tfds
  # can only read data prepared earlier, so ask for nothing more.
  can_prepare = importlib.util.find_spec("tensorflow") is not None
  download = download and can_prepare
  call = (
      f"tfds.data_source({info.tfds_name!r}, data_dir={tfds_dir!r},"
      f" download={download})"
  )
  try:
    with _quiet_absl():
      train, test = tfds.data_source(
          info.tfds_name,
          split=["train", "test"],
          data_dir=tfds_dir,
          download=download,
      )
  except Exception as e:  # ImportError, NotImplementedError, OSError, ...
    reason = f"{call} failed: {type(e).__name__}: {e}"
    if not can_prepare:
      # tfds says "not found" as NotImplementedError (no array_record
      # files to read) or DatasetNotFoundError; anything else is news.
      missing = (
          isinstance(e, NotImplementedError)
          or type(e).__name__ == "DatasetNotFoundError"
      )
      detail = (str(e).strip().splitlines() or [""])[0][:200]
      found = (
          "found"
          if missing
          else f"could be read ({type(e).__name__}: {detail})"
      )
      reason = (
          f"no prepared {info.tfds_name!r} {found}, and preparing one "
          "needs TensorFlow, which is not installed"
      )
    raise _TfdsUnavailable(reason) from e
  arrays = (
      *_tfds_split_to_arrays(train, info, "train"),
      *_tfds_split_to_arrays(test, info, "test"),
  )
  where = tfds_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  return arrays, f"tensorflow-datasets {info.tfds_name!r} in {where}"


def _tfds_split_to_arrays(
    source: Sequence[Mapping[str, Any]],
    info: DatasetInfo,
    split: str,
    chunk: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
  """Copies a tfds data source's images and labels into numpy arrays.

  Records are fetched ``chunk`` at a time with ``__getitems__``, which reads
  the array_record file in one batched call: about 3x faster than indexing
  record by record (PNG decoding is the rest of the cost).
  """
  n = len(source)
  images = np.empty((n, *info.image_shape), np.uint8)
  labels = np.empty((n,), np.int64)
  get_many = getattr(source, "__getitems__", None)
  for start in range(0, n, chunk):
    keys = list(range(start, min(n, start + chunk)))
    if get_many is not None:
      records = get_many(keys)
    else:
      records = [source[k] for k in keys]
    for i, record in zip(keys, records):
      image = np.asarray(record["image"])
      if image.shape != info.image_shape:
        raise MalformedDataError(
            f"tfds {info.tfds_name} {split}[{i}]: image shape {image.shape},"
            f" expected {info.image_shape}"
        )
      images[i] = image
      labels[i] = record["label"]
  if n and (labels.min() < 0 or labels.max() >= info.num_classes):
    raise MalformedDataError(
        f"tfds {info.tfds_name} {split}: labels outside [0, {info.num_classes})"
    )
  return images, labels.astype(np.int32)


# ---------------------------------------------------------------------------
# The entry point.

_HOW_TO_GET: dict[str, str] = {
    "mnist": (
        "download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,"
        " t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz from"
        " https://storage.googleapis.com/cvdf-datasets/mnist/ (a mirror of"
        " http://yann.lecun.com/exdb/mnist/) into DIR/mnist/"
    ),
    "fashion_mnist": (
        "on Debian/Ubuntu: apt-get install dataset-fashion-mnist (installs"
        " /usr/share/datasets/fashion-mnist/, found without any flag); or"
        " download train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,"
        " t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz from"
        " http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/ into"
        " DIR/fashion_mnist/"
    ),
    "cifar10": (
        "download the binary version (not the python version)"
        " https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz into DIR/"
        " (read as is) or extract it there (tar xzf cifar-10-binary.tar.gz -C"
        " DIR gives DIR/cifar-10-batches-bin/data_batch_1.bin .."
        " data_batch_5.bin, test_batch.bin)"
    ),
    "cifar100": (
        "download the binary version (not the python version)"
        " https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz into DIR/"
        " (read as is) or extract it there (tar xzf cifar-100-binary.tar.gz"
        " -C DIR gives DIR/cifar-100-binary/train.bin, test.bin)"
    ),
    "svhn": (
        "download format 2 (cropped digits)"
        " http://ufldl.stanford.edu/housenumbers/train_32x32.mat and"
        " http://ufldl.stanford.edu/housenumbers/test_32x32.mat into DIR/svhn/"
    ),
}


def _not_found_message(name: str, data_dir, notes: Sequence[str]) -> str:
  info = _INFOS[name]
  subdirs = ", ".join(_LAYOUTS[name].subdirs)
  searched = []
  for base, explicit in search_locations(data_dir):
    state = "" if base.is_dir() else " (does not exist)"
    scope = "itself and subfolders" if explicit else "subfolders"
    searched.append(f"    {base}{state} [{scope} {subdirs}]")
  return "\n".join(
      [
          f"could not find the {name} dataset.",
          *notes,
          "Searched:",
          *searched,
          "To provide it:",
          f"  * {_HOW_TO_GET[name]};",
          f"    then pass data_dir=DIR (--data-dir DIR) or set {ENV_DATA_DIR}=DIR;",
          "  * or let tensorflow-datasets download and prepare"
          f" {info.tfds_name!r} (needs internet and TensorFlow): pip install"
          " tensorflow-cpu importlib_resources; the data then lives under"
          " data_dir, $TFDS_DATA_DIR or ~/tensorflow_datasets and is read from"
          " there without TensorFlow.",
      ]
  )


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    use_tfds: bool = True,
    download: bool = True,
    fetch: bool = False,
) -> Dataset:
  """Loads a dataset into memory from the first source that has it.

  See the module docstring for the sources and their order.

  Args:
    name: One of `DATASETS`.
    data_dir: A folder holding the dataset's canonical files, directly or in
      a subfolder named after it; also the tensorflow-datasets data folder.
      When given, only this folder is searched.
    use_tfds: Whether to fall back on tensorflow-datasets when no local files
      are found.
    download: Whether tensorflow-datasets may download and prepare data it
      does not have yet.
    fetch: Without ``data_dir``, download what no source has into the user
      folder (`train.download`, off with ``$GBN_NO_DOWNLOAD=1``).

  Returns:
    The dataset, with uint8 NHWC images and int32 labels.

  Raises:
    ValueError: Unknown ``name``.
    DataNotFoundError: The data is nowhere, or not in ``data_dir``; the
      message says how to get it, or which files ``data_dir`` lacks.
    MalformedDataError: A file was found but is not in its canonical format.
  """
  info = dataset_info(name)
  if fetch and data_dir is None:
    from train import download as fetcher  # pylint: disable=g-import-not-at-top

    return fetcher.load_dataset(name, use_tfds=use_tfds, download=download)
  if data_dir is not None:
    return _load_from_data_dir(
        name, data_dir, use_tfds=use_tfds, download=download
    )
  notes: list[str] = []
  found = _find_local(name, data_dir, notes)
  if found is not None:
    arrays, source = found.read(), found.source
  elif not use_tfds:
    notes.append("tensorflow-datasets: not tried (use_tfds=False).")
    raise DataNotFoundError(_not_found_message(name, data_dir, notes))
  else:
    try:
      arrays, source = _load_tfds(name, data_dir, download)
    except _TfdsUnavailable as e:
      notes.append(f"tensorflow-datasets: {e}")
      raise DataNotFoundError(_not_found_message(name, data_dir, notes)) from e
  train_images, train_labels, test_images, test_labels = arrays
  return Dataset(
      name=name,
      train_images=train_images,
      train_labels=train_labels,
      test_images=test_images,
      test_labels=test_labels,
      num_classes=info.num_classes,
      source=source,
  )


def _expected_files(name: str, folder: Path) -> str:
  """The files ``name`` needs in ``folder``, in words, for error messages."""
  layout = _LAYOUTS[name]
  gz = " (gzipped or not)" if layout.gzip_ok else ""
  files = ", ".join(layout.files) + gz
  where = f"{folder}/ or a subfolder {'/, '.join(layout.subdirs)}/"
  archive = f", or {layout.archive}" if layout.archive else ""
  return f"{files} in {where}{archive}"


def _load_from_data_dir(
    name: str,
    data_dir: str | os.PathLike[str],
    *,
    use_tfds: bool,
    download: bool,
) -> Dataset:
  """Loads ``name`` from ``data_dir`` only: its files, else its tfds data.

  A folder that the user named and that lacks the data is a mistake (a typo,
  the wrong mount), not a reason to train quietly on another copy found
  elsewhere, so it is an error; its message's first line says what the
  folder should hold, and copies found elsewhere are mentioned.
  """
  info = dataset_info(name)
  folder = Path(data_dir).expanduser()
  notes: list[str] = []
  arrays = None
  if folder.is_dir():
    state = "does not hold it"
    for candidate in _candidate_dirs(_LAYOUTS[name], folder, True):
      found = candidate.is_dir() and _find_in_dir(name, candidate, notes)
      if found:
        arrays, source = found.read(), found.source
        break
    if arrays is None:
      reason = "tensorflow-datasets not tried (use_tfds=False)"
      if use_tfds:
        try:
          arrays, source = _load_tfds(name, folder, download)
        except _TfdsUnavailable as e:
          reason = f"tensorflow-datasets: {e}"
  else:
    state = "does not exist" if not folder.exists() else "is not a folder"
    reason = "tensorflow-datasets not tried"
  if arrays is None:
    elsewhere = [base for base, explicit in search_locations() if not explicit]
    for base in elsewhere:
      if base.is_dir():
        _note_pickles(name, base, notes)
      for candidate in _candidate_dirs(_LAYOUTS[name], base, False):
        try:
          found = candidate.is_dir() and _find_in_dir(name, candidate, [])
        except DataNotFoundError:  # a partial copy: not worth a note
          found = None
        if found:
          notes.append(
              f"A copy is in {candidate} (used when no data folder "
              "is given)."
          )
    raise DataNotFoundError(
        "\n".join(
            [
                f"could not find the {name} dataset. data_dir (--data-dir) {folder} "
                f"{state}; expected {_expected_files(name, folder)} (or "
                f"tensorflow-datasets {info.tfds_name!r} data there; {reason}).",
                *notes,
                "Other folders are not searched when a data folder is given; "
                "without it: "
                + ", ".join(str(base) for base in elsewhere)
                + ".",
                "To provide it:",
                f"  * {_HOW_TO_GET[name]};",
                "  * or let tensorflow-datasets download and prepare"
                f" {info.tfds_name!r} into DIR (needs internet and TensorFlow): pip"
                " install tensorflow-cpu importlib_resources.",
            ]
        )
    )
  train_images, train_labels, test_images, test_labels = arrays
  return Dataset(
      name=name,
      train_images=train_images,
      train_labels=train_labels,
      test_images=test_images,
      test_labels=test_labels,
      num_classes=info.num_classes,
      source=source,
  )


def _main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description="Load a dataset and print a summary."
  )
  parser.add_argument("name", choices=DATASETS)
  parser.add_argument("--data-dir", default=None)
  parser.add_argument(
      "--no-tfds",
      action="store_true",
      help="do not fall back on tensorflow-datasets",
  )
  args = parser.parse_args(argv)
  start = time.perf_counter()
  try:
    ds = load_dataset(args.name, args.data_dir, use_tfds=not args.no_tfds)
  except (DataNotFoundError, MalformedDataError) as e:
    raise SystemExit(f"error: {e}") from None
  seconds = time.perf_counter() - start
  print(f"{ds.name}: loaded in {seconds:.2f} s from {ds.source}")
  for split in ("train", "test"):
    images = getattr(ds, f"{split}_images")
    labels = getattr(ds, f"{split}_labels")
    mean, std = _channel_stats(images)
    counts = np.bincount(labels, minlength=ds.num_classes)
    print(
        f"  {split}: images {images.shape} {images.dtype}, labels"
        f" {labels.shape} {labels.dtype}; pixel mean {np.round(mean, 4)},"
        f" std {np.round(std, 4)}; images per class"
        f" {counts.min()}..{counts.max()}"
    )


def _channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-channel mean and std of uint8 images, in units of pixel / 255."""
  # From histograms: no float copy of the (possibly 150M-pixel) array.
  levels = np.arange(256) / 255.0
  hists = [
      np.bincount(images[..., c].ravel(), minlength=256)
      for c in range(images.shape[-1])
  ]
  means = np.array([h @ levels / h.sum() for h in hists])
  stds = np.array(
      [np.sqrt(h @ (levels - m) ** 2 / h.sum()) for h, m in zip(hists, means)]
  )
  return means, stds


if __name__ == "__main__":
  _main()
