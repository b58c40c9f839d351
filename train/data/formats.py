"""The datasets' canonical distribution files, parsed without pickle or TF.

Parsers take a file's bytes and a name for error messages; a file that is not
in its format (bad IDX magic number, truncated records, wrong dimensions,
labels out of range) raises `MalformedDataError`. Readers turn a dataset's
``{file name: bytes}`` into its four arrays (train images and labels, test
images and labels).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import gzip
import io
import math
from pathlib import Path
import struct
import tarfile
import zlib

import numpy as np

from train.data.info import DatasetInfo
from train.data.info import MalformedDataError
from train.data.info import dataset_info

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))


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


def read_idx_dataset(
    name: str,
) -> Callable[[Mapping[str, bytes], str], Arrays]:
  def read(files: Mapping[str, bytes], where: str) -> Arrays:
    info = dataset_info(name)
    return (
        *_parse_idx_split(
            files[IDX_FILES[0]], files[IDX_FILES[1]], f"{where}: train", info
        ),
        *_parse_idx_split(
            files[IDX_FILES[2]], files[IDX_FILES[3]], f"{where}: t10k", info
        ),
    )

  return read


def read_cifar10(files: Mapping[str, bytes], where: str) -> Arrays:
  parts = [
      _parse_cifar_records(files[f], f"{where}/{f}", (10,), 0)
      for f in CIFAR10_TRAIN
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


def read_cifar100(files: Mapping[str, bytes], where: str) -> Arrays:
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


def read_svhn(files: Mapping[str, bytes], where: str) -> Arrays:
  return (
      *_parse_svhn_mat(files["train_32x32.mat"], f"{where}/train_32x32.mat"),
      *_parse_svhn_mat(files["test_32x32.mat"], f"{where}/test_32x32.mat"),
  )


def read_file_bytes(path: Path) -> bytes:
  data = path.read_bytes()
  if path.suffix != ".gz":
    return data
  try:
    return gzip.decompress(data)
  except (OSError, EOFError, zlib.error) as e:
    raise MalformedDataError(f"{path}: corrupt gzip data ({e})") from e


def read_tar_members(archive: Path, names: Sequence[str]) -> dict[str, bytes]:
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
