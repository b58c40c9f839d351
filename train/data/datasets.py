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
   ``/usr/share/datasets`` (`train.data.locate`'s `USER_DATA_DIR` and
   `SYSTEM_DATA_DIRS`), where the Debian package ``dataset-fashion-mnist``
   puts ``fashion-mnist/``.

3. tensorflow-datasets (``tfds.data_source``, array_record files): data
   already prepared under ``data_dir``, ``$TFDS_DATA_DIR`` or
   ``~/tensorflow_datasets`` is read without TensorFlow; preparing
   (downloading) it needs TensorFlow and internet access.

4. With ``fetch=True`` (the training CLI) and no ``data_dir``: the official
   files, downloaded into ``~/.cache/gbn_jax`` and verified
   (`train.data.download`).

Nothing is ever unpickled: the CIFAR "python version" is refused with a
pointer to the binary version. A file that is not in its canonical format
(bad IDX magic number, truncated records, wrong dimensions, labels out of
range) raises `MalformedDataError`; a dataset found nowhere raises
`DataNotFoundError`, whose message lists every way to provide it.

This module is the entry point (`load_dataset`, which calls
`train.data.download` on a miss); the file formats are read in
`train.data.formats`, the folders searched are `train.data.locate`'s,
tensorflow-datasets is read in `train.data.tfds`, and `Dataset`,
`DatasetInfo` and the errors are defined in `train.data.info` (all
re-exported here).

``python -m train.data.datasets NAME [--data-dir DIR]`` loads a dataset and
prints a summary with the load time.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import os
from pathlib import Path
import time

import numpy as np

from train.data import download as fetcher
from train.data import formats as data_formats
from train.data import locate as data_locate
from train.data import tfds as data_tfds

# Re-exported: the names that callers, tests and docs use as
# train.data.datasets.*.
from train.data.info import DATASETS as DATASETS
from train.data.info import DataNotFoundError as DataNotFoundError
from train.data.info import Dataset as Dataset
from train.data.info import DatasetInfo as DatasetInfo
from train.data.info import MalformedDataError as MalformedDataError
from train.data.info import dataset_info as dataset_info
from train.data.locate import ENV_DATA_DIR as ENV_DATA_DIR
from train.data.locate import dataset_layout as dataset_layout
from train.data.locate import search_locations as search_locations


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
      folder (`train.data.download`, off with ``$GBN_NO_DOWNLOAD=1``).

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
    return _load_fetching(name, use_tfds=use_tfds, download=download)
  if data_dir is not None:
    return _load_from_data_dir(
        name, data_dir, use_tfds=use_tfds, download=download
    )
  notes: list[str] = []
  found = data_locate.find_local(name, data_dir, notes)
  if found is not None:
    arrays, source = found.read(), found.source
  elif not use_tfds:
    raise DataNotFoundError(
        data_locate.not_found_message(
            name,
            data_dir,
            [*notes, "tensorflow-datasets: not tried (use_tfds=False)."],
        ),
        notes=notes,
    )
  else:
    try:
      arrays, source = data_tfds.load_tfds(name, data_dir, download)
    except data_tfds.TfdsUnavailable as e:
      tfds_note = f"tensorflow-datasets: {e}"
      raise DataNotFoundError(
          data_locate.not_found_message(name, data_dir, [*notes, tfds_note]),
          notes=notes if e.nothing_prepared else [*notes, tfds_note],
      ) from e
  return _as_dataset(info, arrays, source)


def _load_fetching(
    name: str, *, use_tfds: bool, download: bool, progress: bool = True
) -> Dataset:
  """`load_dataset` without a data folder, fetching on a miss.

  The usual sources come first; only when none has the dataset are its
  files downloaded (`train.data.download.fetch`), into the user folder that
  those sources include (``train.data.locate.USER_DATA_DIR``), and read from
  there.

  Raises:
    DataNotFoundError: No source has it and the download failed or is off;
      the message leads with the download's error, then the commands that do
      it by hand and a dataset that needs no download.
    MalformedDataError: A file is not in its format.
  """
  try:
    return load_dataset(name, use_tfds=use_tfds, download=download)
  except DataNotFoundError as missing:
    try:
      folder = fetcher.fetch(name, data_locate.USER_DATA_DIR, progress=progress)
    except fetcher.DownloadError as e:
      raise DataNotFoundError(
          fetcher.not_downloaded_message(name, missing.notes, e),
          notes=missing.notes,
      ) from e
  return load_dataset(name, folder, use_tfds=False)


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
    for candidate in data_locate.candidate_dirs(
        data_locate.LAYOUTS[name], folder, True
    ):
      found = candidate.is_dir() and data_locate.find_in_dir(
          name, candidate, notes
      )
      if found:
        arrays, source = found.read(), found.source
        break
    if arrays is None:
      reason = "tensorflow-datasets not tried (use_tfds=False)"
      if use_tfds:
        try:
          arrays, source = data_tfds.load_tfds(name, folder, download)
        except data_tfds.TfdsUnavailable as e:
          reason = f"tensorflow-datasets: {e}"
  else:
    state = "does not exist" if not folder.exists() else "is not a folder"
    reason = "tensorflow-datasets not tried"
  if arrays is None:
    elsewhere = [base for base, explicit in search_locations() if not explicit]
    for base in elsewhere:
      if base.is_dir():
        data_locate.note_pickles(name, base, notes)
      for candidate in data_locate.candidate_dirs(
          data_locate.LAYOUTS[name], base, False
      ):
        try:
          found = candidate.is_dir() and data_locate.find_in_dir(
              name, candidate, []
          )
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
                f"{state}; expected {data_locate.expected_files(name, folder)} (or "
                f"tensorflow-datasets {info.tfds_name!r} data there; {reason}).",
                *notes,
                "Other folders are not searched when a data folder is given; "
                "without it: "
                + ", ".join(str(base) for base in elsewhere)
                + ".",
                "To provide it:",
                f"  * {data_locate.HOW_TO_GET[name]};",
                "  * or let tensorflow-datasets download and prepare"
                f" {info.tfds_name!r} into DIR (needs internet and TensorFlow): pip"
                " install tensorflow-cpu importlib_resources.",
            ]
        )
    )
  return _as_dataset(info, arrays, source)


def _as_dataset(
    info: DatasetInfo,
    arrays: data_formats.Arrays,
    source: str,
) -> Dataset:
  """Wraps the arrays that a reader returned for ``info``'s dataset.

  Args:
    info: The dataset's facts.
    arrays: Train images, train labels, test images, test labels.
    source: Where they were read from.

  Returns:
    The `Dataset`.
  """
  train_images, train_labels, test_images, test_labels = arrays
  return Dataset(
      name=info.name,
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
