"""Datasets from tensorflow-datasets (``tfds.data_source``, without TF).

Data already prepared (array_record files) is read without TensorFlow;
preparing (downloading) it needs TensorFlow and internet access.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from train.data.formats import Arrays
from train.data.info import DatasetInfo
from train.data.info import MalformedDataError
from train.data.info import dataset_info


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


class TfdsUnavailable(Exception):
  """tensorflow-datasets could not provide the data (reason in message).

  Attributes:
    nothing_prepared: Whether it had no prepared copy (or tried to prepare
      one and failed): the routine miss, as opposed to a prepared copy that
      could not be read.
  """

  def __init__(self, reason: str, *, nothing_prepared: bool = True):
    super().__init__(reason)
    self.nothing_prepared = nothing_prepared


def _first_line(error: BaseException, limit: int = 200) -> str:
  """``error``'s first line, shortened: tfds's messages run to pages."""
  return (str(error).strip().splitlines() or [""])[0][:limit]


def load_tfds(
    name: str, data_dir: str | os.PathLike[str] | None, download: bool
) -> tuple[Arrays, str]:
  """Reads both splits with ``tfds.data_source`` (array_record, no TF)."""
  info = dataset_info(name)
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise TfdsUnavailable(f"tensorflow-datasets is not installed ({e})")
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
    # tfds says "not found" as NotImplementedError (no array_record files
    # to read), DatasetNotFoundError, or a KeyError from the empty split
    # table of a dataset never generated; anything else is news.
    missing = isinstance(e, (NotImplementedError, KeyError)) or (
        type(e).__name__ == "DatasetNotFoundError"
    )
    if can_prepare:
      # A failure while it may download is most often the download itself
      # (offline), so it counts as the routine miss.
      reason = f"{call} failed: {type(e).__name__}: {_first_line(e)}"
      raise TfdsUnavailable(reason, nothing_prepared=download or missing) from e
    found = (
        "found"
        if missing
        else f"could be read ({type(e).__name__}: {_first_line(e)})"
    )
    reason = (
        f"no prepared {info.tfds_name!r} {found}, and preparing one "
        "needs TensorFlow, which is not installed"
    )
    raise TfdsUnavailable(reason, nothing_prepared=missing) from e
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
  the array_record file in one batched call, faster than indexing record by
  record (PNG decoding is the rest of the cost).
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
