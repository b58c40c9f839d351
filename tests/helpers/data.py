"""Writers of tiny dataset files in the canonical distribution formats.

Each writer follows the published description of its format, independently
of the loaders in `train.data.datasets`, so tests can check that what a loader
reads is exactly what was written:

* IDX (MNIST, Fashion-MNIST): big-endian int32 magic ``0x00000800 + ndim``
  (unsigned bytes), ``ndim`` big-endian int32 sizes, then the row-major data.
* CIFAR-10 binary: records of 1 label byte + 3072 pixel bytes: the 1024 red
  values of the 32x32 image row by row, then the green, then the blue.
* CIFAR-100 binary: the same with 2 label bytes (coarse, then fine).
* SVHN format 2: a MATLAB file with ``X``, uint8 ``(32, 32, 3, N)``, and
  ``y``, ``(N, 1)`` with digits 1..9 as themselves and 0 as 10.
* tensorflow-datasets: a real prepared dataset (array_record files) built
  with the registered builder's own features, so that ``tfds.data_source``
  reads it like a downloaded one.
"""

from __future__ import annotations

from collections.abc import Sequence
import gzip
from pathlib import Path
import struct
import tarfile

import numpy as np

IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def random_split(
    seed: int, n: int, image_shape: Sequence[int], num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
  """Random uint8 images ``(n, *image_shape)`` and int32 labels."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, *image_shape), dtype=np.uint8)
  labels = rng.integers(0, num_classes, n).astype(np.int32)
  return images, labels


def idx_bytes(array: np.ndarray) -> bytes:
  """Encodes a uint8 array as an IDX file."""
  array = np.asarray(array)
  assert array.dtype == np.uint8
  header = bytes([0, 0, 0x08, array.ndim])
  header += b"".join(struct.pack(">i", size) for size in array.shape)
  return header + array.tobytes(order="C")


def write_file(path: Path, data: bytes) -> Path:
  """Writes ``data``, gzip-compressed when ``path`` ends in ``.gz``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
  return path


def write_idx_dataset(
    folder: Path,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    gz: bool = True,
) -> Path:
  """Writes MNIST-style IDX files; images may be ``(N, H, W)`` or NHWC, C=1."""
  arrays = (train[0], train[1], test[0], test[1])
  for name, array in zip(IDX_NAMES, arrays):
    array = np.asarray(array)
    if array.ndim == 4:
      assert array.shape[-1] == 1
      array = array[..., 0]
    write_file(
        folder / (name + (".gz" if gz else "")),
        idx_bytes(array.astype(np.uint8)),
    )
  return folder


def cifar_records(images: np.ndarray, *label_columns: np.ndarray) -> bytes:
  """Encodes NHWC 32x32x3 images as CIFAR binary records, label bytes first."""
  out = bytearray()
  for n, image in enumerate(images):
    assert image.shape == (32, 32, 3)
    out += bytes(int(labels[n]) for labels in label_columns)
    for channel in range(3):  # red plane, then green, then blue
      for row in range(32):
        out += bytes(int(v) for v in image[row, :, channel])
  return bytes(out)


def write_cifar10(
    folder: Path,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
) -> Path:
  """Writes ``folder/cifar-10-batches-bin``, the train split over 5 batches.

  Returns:
    The ``cifar-10-batches-bin`` folder.
  """
  out = folder / "cifar-10-batches-bin"
  out.mkdir(parents=True, exist_ok=True)
  bounds = np.linspace(0, len(train[0]), 6).astype(int)
  for i in range(5):
    part = slice(bounds[i], bounds[i + 1])
    (out / f"data_batch_{i + 1}.bin").write_bytes(
        cifar_records(train[0][part], train[1][part])
    )
  (out / "test_batch.bin").write_bytes(cifar_records(test[0], test[1]))
  (out / "batches.meta.txt").write_text(
      "".join(f"class{i}\n" for i in range(10))
  )
  return out


def write_cifar100(
    folder: Path,
    train: tuple[np.ndarray, np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> Path:
  """Writes ``folder/cifar-100-binary``; splits are (images, coarse, fine).

  Returns:
    The ``cifar-100-binary`` folder.
  """
  out = folder / "cifar-100-binary"
  out.mkdir(parents=True, exist_ok=True)
  (out / "train.bin").write_bytes(cifar_records(*train))
  (out / "test.bin").write_bytes(cifar_records(*test))
  return out


def write_tar_gz(archive: Path, folder: Path) -> Path:
  """Packs ``folder``, under its own name, into ``archive`` (a .tar.gz)."""
  archive.parent.mkdir(parents=True, exist_ok=True)
  with tarfile.open(archive, "w:gz") as tar:
    tar.add(folder, arcname=folder.name)
  return archive


def svhn_mat_arrays(
    images: np.ndarray, digits: np.ndarray
) -> dict[str, np.ndarray]:
  """The ``X`` and ``y`` of a SVHN format-2 file for NHWC images and digits."""
  n = len(images)
  x = np.empty((32, 32, 3, n), np.uint8)
  for i in range(n):
    x[:, :, :, i] = images[i]
  y = np.where(np.asarray(digits) == 0, 10, digits).astype(np.uint8)
  return {"X": x, "y": y.reshape(n, 1)}


def write_svhn(
    folder: Path,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
) -> Path:
  """Writes ``train_32x32.mat`` and ``test_32x32.mat`` into ``folder``."""
  import scipy.io  # pylint: disable=g-import-not-at-top

  folder.mkdir(parents=True, exist_ok=True)
  scipy.io.savemat(folder / "train_32x32.mat", svhn_mat_arrays(*train))
  scipy.io.savemat(folder / "test_32x32.mat", svhn_mat_arrays(*test))
  return folder


def write_tfds_dataset(
    data_dir: Path,
    tfds_name: str,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
) -> Path:
  """Prepares ``tfds_name`` under ``data_dir`` from the given splits.

  Subclasses the registered builder (same name, version and features) with
  generators yielding the given images (PNG-encoded by PIL, lossless) and
  labels; other features (CIFAR's ``id`` and ``coarse_label``) get valid
  filler values. tfds shuffles the records, so compare sets, not orders.

  Returns:
    The prepared dataset's version folder.
  """
  import PIL.Image  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  base = tfds.builder_cls(tfds_name)

  def generate(self, images, labels, split):
    for i, (image, label) in enumerate(zip(images, labels)):
      array = image[..., 0] if image.shape[-1] == 1 else image
      example = {
          "image": PIL.Image.fromarray(np.asarray(array)),
          "label": int(label),
      }
      for key, feature in self.info.features.items():
        if key == "id":
          example[key] = f"{split}_{i:05d}"
        elif key not in example:
          example[key] = int(label) % feature.num_classes
      yield f"{split}_{i}", example

  def split_generators(self, dl_manager):
    del dl_manager
    return {
        "train": self._generate_examples(*train, "train"),
        "test": self._generate_examples(*test, "test"),
    }

  builder_cls = type(
      base.__name__ + "Fake",
      (base,),
      {
          "name": tfds_name,
          "_split_generators": split_generators,
          "_generate_examples": generate,
      },
      skip_registration=True,
  )
  builder = builder_cls(data_dir=str(data_dir), file_format="array_record")
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False)
  )
  return Path(builder.data_dir)
