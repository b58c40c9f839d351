"""Where each dataset's files may be, and what to say when they are nowhere.

The search order (see `train.data.datasets`): ``data_dir`` itself and its
subfolders; else the subfolders of each ``$GBN_DATA_DIR`` entry,
`USER_DATA_DIR` and `SYSTEM_DATA_DIRS`. `search_locations` reads these
module attributes at each call, so tests patch them here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
import os
from pathlib import Path

from train.data.formats import CIFAR10_TRAIN
from train.data.formats import IDX_FILES
from train.data.formats import Arrays
from train.data.formats import read_cifar10
from train.data.formats import read_cifar100
from train.data.formats import read_file_bytes
from train.data.formats import read_idx_dataset
from train.data.formats import read_svhn
from train.data.formats import read_tar_members
from train.data.info import DataNotFoundError
from train.data.info import dataset_info

# Searched through the datasets' subfolders after data_dir and $GBN_DATA_DIR.
# The Debian package dataset-fashion-mnist installs
# /usr/share/datasets/fashion-mnist/*-ubyte.gz.
SYSTEM_DATA_DIRS: tuple[str, ...] = ("/usr/share/datasets",)

ENV_DATA_DIR = "GBN_DATA_DIR"
USER_DATA_DIR = "~/.cache/gbn_jax"


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
  read: Callable[[Mapping[str, bytes], str], Arrays]
  gzip_ok: bool = False
  archive: str | None = None
  pickle_markers: tuple[str, ...] = ()


LAYOUTS: dict[str, _Layout] = {
    "mnist": _Layout(
        IDX_FILES,
        ("mnist", "MNIST", "MNIST/raw"),
        read_idx_dataset("mnist"),
        gzip_ok=True,
    ),
    "fashion_mnist": _Layout(
        IDX_FILES,
        ("fashion_mnist", "fashion-mnist", "FashionMNIST", "FashionMNIST/raw"),
        read_idx_dataset("fashion_mnist"),
        gzip_ok=True,
    ),
    "cifar10": _Layout(
        CIFAR10_TRAIN + ("test_batch.bin",),
        (
            "cifar-10-batches-bin",
            "cifar10",
            "cifar10/cifar-10-batches-bin",
            "cifar-10",
            "cifar-10/cifar-10-batches-bin",
        ),
        read_cifar10,
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
        read_cifar100,
        archive="cifar-100-binary.tar.gz",
        pickle_markers=("cifar-100-python", "cifar-100-python.tar.gz"),
    ),
    "svhn": _Layout(
        ("train_32x32.mat", "test_32x32.mat"),
        ("svhn", "SVHN", "svhn_cropped"),
        read_svhn,
    ),
}


def dataset_layout(
    name: str,
) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
  """Returns the file names, subfolder names and archive searched for ``name``.

  IDX files (mnist, fashion_mnist) may also carry a ``.gz`` suffix.
  """
  dataset_info(name)
  layout = LAYOUTS[name]
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

  read: Callable[[], Arrays]
  source: str


def candidate_dirs(
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


def find_in_dir(name: str, folder: Path, notes: list[str]) -> _Found | None:
  """Returns the dataset's files in ``folder``, or None.

  Adds a note to ``notes`` when only the pickled version is there.

  Raises:
    DataNotFoundError: ``folder`` holds some but not all required files.
  """
  layout = LAYOUTS[name]
  paths = [_existing_file(folder, f, layout.gzip_ok) for f in layout.files]
  if all(paths):
    return _Found(
        read=lambda: layout.read(
            {f: read_file_bytes(p) for f, p in zip(layout.files, paths)},
            str(folder),
        ),
        source=f"{name} files in {folder}: " + ", ".join(p.name for p in paths),
    )
  if any(paths):
    missing = [f for f, p in zip(layout.files, paths) if p is None]
    partial = f"{name}: {folder} holds only part of the dataset; missing: "
    partial += ", ".join(missing)
    raise DataNotFoundError(partial, notes=[partial])
  if layout.archive and (folder / layout.archive).is_file():
    archive = folder / layout.archive
    return _Found(
        read=lambda: layout.read(
            read_tar_members(archive, layout.files), str(archive)
        ),
        source=f"{name} archive {archive}",
    )
  note_pickles(name, folder, notes)
  return None


def note_pickles(name: str, folder: Path, notes: list[str]) -> None:
  """Notes the pickled "python version" of the dataset in ``folder``."""
  for marker in LAYOUTS[name].pickle_markers:
    note = (
        f'{folder / marker} is the pickled "python version" of {name},'
        " which is never read here (unpickling can run arbitrary code);"
        " get the binary version instead (see below)."
    )
    if (folder / marker).exists() and note not in notes:
      notes.append(note)


def find_local(name: str, data_dir, notes: list[str]) -> _Found | None:
  seen = set()
  for base, explicit in search_locations(data_dir):
    if not explicit and base.is_dir():
      note_pickles(name, base, notes)
    for folder in candidate_dirs(LAYOUTS[name], base, explicit):
      if folder in seen or not folder.is_dir():
        continue
      seen.add(folder)
      found = find_in_dir(name, folder, notes)
      if found is not None:
        return found
  return None


HOW_TO_GET: dict[str, str] = {
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


def without_download(name: str) -> str:
  """How to train on a machine without internet: a packaged dataset."""
  if name == "fashion_mnist":
    return (
        "Without internet: on Debian/Ubuntu, apt-get install"
        " dataset-fashion-mnist installs it where it is found without any"
        " flag (/usr/share/datasets/fashion-mnist/)."
    )
  return (
      "Without internet: Fashion-MNIST needs no download on Debian/Ubuntu:"
      " apt-get install dataset-fashion-mnist, then"
      " python -m train.mnist --dataset fashion_mnist."
  )


def not_found_message(name: str, data_dir, notes: Sequence[str]) -> str:
  info = dataset_info(name)
  subdirs = ", ".join(LAYOUTS[name].subdirs)
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
          f"  * {HOW_TO_GET[name]};",
          f"    then pass data_dir=DIR (--data-dir DIR) or set {ENV_DATA_DIR}=DIR;",
          "  * or let tensorflow-datasets download and prepare"
          f" {info.tfds_name!r} (needs internet and TensorFlow): pip install"
          " tensorflow-cpu importlib_resources; the data then lives under"
          " data_dir, $TFDS_DATA_DIR or ~/tensorflow_datasets and is read from"
          " there without TensorFlow.",
      ]
  )


def expected_files(name: str, folder: Path) -> str:
  """The files ``name`` needs in ``folder``, in words, for error messages."""
  layout = LAYOUTS[name]
  gz = " (gzipped or not)" if layout.gzip_ok else ""
  files = ", ".join(layout.files) + gz
  where = f"{folder}/ or a subfolder {'/, '.join(layout.subdirs)}/"
  archive = f", or {layout.archive}" if layout.archive else ""
  return f"{files} in {where}{archive}"
