"""Tests of train.data.datasets and train.data.input_pipeline.

The loaders are checked on tiny files written in the canonical formats by
tests/helpers/data.py, a real tensorflow-datasets dataset prepared in a
temporary folder, and tfds.testing.mock_data. Tests on the real datasets skip
when the data is not installed.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.data import datasets
from train.data import input_pipeline as ip

from tests.helpers import data as dh
from tests.helpers.training import empty_data_places

IDX_SHAPE = (28, 28, 1)
# One compilation per shape instead of one per operation.
_augment = jax.jit(ip.augment, static_argnames="pad")
_sample = jax.jit(ip.sample_augment_params, static_argnums=(1, 2))
RGB_SHAPE = (32, 32, 3)


@pytest.fixture
def places(tmp_path, monkeypatch):
  """Points every search location at an empty temporary folder (and makes
  one more, "data")."""
  return empty_data_places(tmp_path, monkeypatch, "data")


def _idx_splits(seed, num_train=7, num_test=3):
  return (
      dh.random_split(seed, num_train, IDX_SHAPE, 10),
      dh.random_split(seed + 1000, num_test, IDX_SHAPE, 10),
  )


def _assert_split(ds, split, images, labels):
  got_images = getattr(ds, f"{split}_images")
  got_labels = getattr(ds, f"{split}_labels")
  assert got_images.dtype == np.uint8 and got_labels.dtype == np.int32
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)


def _assert_same_examples(got_images, got_labels, images, labels):
  """Equal as multisets of (image, label): tfds shuffles the records."""
  assert got_images.shape == images.shape
  assert got_labels.dtype == np.int32

  def key(pairs):
    return sorted(im.tobytes() + bytes([lab]) for im, lab in zip(*pairs))

  assert key((got_images, got_labels)) == key((images, labels))


# ---------------------------------------------------------------------------
# Canonical files, read back exactly.


@pytest.mark.parametrize(
    "name, subdir, gz",
    [
        ("mnist", "", True),
        ("mnist", "MNIST/raw", False),
        ("fashion_mnist", "fashion-mnist", True),
        ("fashion_mnist", "fashion_mnist", False),
    ],
)
def test_idx_round_trip(places, name, subdir, gz):
  train, test = _idx_splits(1)
  dh.write_idx_dataset(places["data"] / subdir, train, test, gz=gz)
  ds = datasets.load_dataset(name, places["data"], use_tfds=False)
  assert ds.name == name and ds.num_classes == 10
  _assert_split(ds, "train", *train)
  _assert_split(ds, "test", *test)
  assert str(places["data"] / subdir) in ds.source


def test_cifar10_round_trip(places):
  train = dh.random_split(2, 10, RGB_SHAPE, 10)
  test = dh.random_split(3, 4, RGB_SHAPE, 10)
  dh.write_cifar10(places["data"], train, test)
  ds = datasets.load_dataset("cifar10", places["data"], use_tfds=False)
  _assert_split(ds, "train", *train)
  _assert_split(ds, "test", *test)
  # The format by its definition: byte 1 + c * 1024 + r * 32 + x of record n.
  raw = (places["data"] / "cifar-10-batches-bin/test_batch.bin").read_bytes()
  n, r, x, c = 2, 5, 17, 2
  assert ds.test_images[n, r, x, c] == raw[n * 3073 + 1 + c * 1024 + r * 32 + x]
  assert ds.test_labels[n] == raw[n * 3073]


def test_cifar10_from_the_archive(places, tmp_path):
  train = dh.random_split(4, 5, RGB_SHAPE, 10)
  test = dh.random_split(5, 2, RGB_SHAPE, 10)
  folder = dh.write_cifar10(tmp_path / "unpacked", train, test)
  dh.write_tar_gz(places["data"] / "cifar-10-binary.tar.gz", folder)
  ds = datasets.load_dataset("cifar10", places["data"], use_tfds=False)
  _assert_split(ds, "train", *train)
  _assert_split(ds, "test", *test)
  assert "cifar-10-binary.tar.gz" in ds.source


def test_cifar100_uses_fine_labels(places):
  rng = np.random.default_rng(6)
  splits = []
  for n in (6, 3):
    images = rng.integers(0, 256, (n, *RGB_SHAPE), dtype=np.uint8)
    coarse = rng.integers(0, 20, n).astype(np.int32)
    fine = rng.integers(20, 100, n).astype(np.int32)  # never equal to coarse
    splits.append((images, coarse, fine))
  dh.write_cifar100(places["data"], *splits)
  ds = datasets.load_dataset("cifar100", places["data"], use_tfds=False)
  assert ds.num_classes == 100
  _assert_split(ds, "train", splits[0][0], splits[0][2])
  _assert_split(ds, "test", splits[1][0], splits[1][2])


def test_svhn_round_trip_maps_10_to_0(places):
  import scipy.io

  rng = np.random.default_rng(7)
  train = dh.random_split(8, 12, RGB_SHAPE, 10)
  train[1][:3] = 0  # digit 0 is stored as label 10
  test = dh.random_split(9, 4, RGB_SHAPE, 10)
  dh.write_svhn(places["data"] / "svhn", train, test)
  ds = datasets.load_dataset("svhn", places["data"], use_tfds=False)
  _assert_split(ds, "train", *train)
  _assert_split(ds, "test", *test)
  mat = scipy.io.loadmat(places["data"] / "svhn" / "train_32x32.mat")
  assert mat["y"][0, 0] == 10 and ds.train_labels[0] == 0
  n, r, x, c = rng.integers(0, 12), 3, 30, 1
  assert ds.train_images[n, r, x, c] == mat["X"][r, x, c, n]


def test_dataset_arrays_are_read_only(places):
  dh.write_idx_dataset(places["data"], *_idx_splits(1))
  ds = datasets.load_dataset("mnist", places["data"], use_tfds=False)
  for array in (
      ds.train_images,
      ds.train_labels,
      ds.test_images,
      ds.test_labels,
  ):
    with pytest.raises(ValueError, match="read-only"):
      array[0] = 0
  # The caller's own arrays stay writable.
  images, labels = dh.random_split(0, 4, IDX_SHAPE, 10)
  datasets.Dataset("mnist", images, labels, images, labels, 10, "test")
  images[0] = labels[0] = 1


def test_dataset_rejects_inconsistent_arrays():
  images, labels = dh.random_split(0, 4, IDX_SHAPE, 10)
  good = dict(
      name="mnist",
      train_images=images,
      train_labels=labels,
      test_images=images.copy(),
      test_labels=labels.copy(),
      num_classes=10,
      source="test",
  )
  datasets.Dataset(**good)
  bad = [
      dict(train_images=images.astype(np.float32)),
      dict(train_images=images[..., 0]),
      dict(test_images=np.zeros((4, *RGB_SHAPE), np.uint8)),
      dict(train_labels=labels.astype(np.int64)),
      dict(train_labels=labels[:3]),
      dict(test_labels=np.full(4, 10, np.int32)),
      dict(num_classes=100),
  ]
  for change in bad:
    with pytest.raises(ValueError):
      datasets.Dataset(**{**good, **change})
  with pytest.raises(ValueError, match="unknown dataset"):
    datasets.Dataset(**{**good, "name": "imagenet"})


# ---------------------------------------------------------------------------
# Where the data is searched for.


def test_search_order(places):
  variants = {}
  for seed, place in enumerate(("data", "env", "user", "system")):
    variants[place] = _idx_splits(10 * seed)
    dh.write_idx_dataset(places[place] / "mnist", *variants[place])
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("PIL")  # tfds encodes and decodes images with it
  variants["tfds"] = _idx_splits(50)
  dh.write_tfds_dataset(places["tfds"], "mnist", *variants["tfds"])

  def load(data_dir=None):
    return datasets.load_dataset("mnist", data_dir, download=False)

  _assert_split(load(places["data"]), "train", *variants["data"][0])
  _assert_split(load(), "train", *variants["env"][0])
  os.environ[datasets.ENV_DATA_DIR] = ""
  _assert_split(load(), "train", *variants["user"][0])
  shutil.rmtree(places["user"])
  _assert_split(load(), "train", *variants["system"][0])
  # Without data_dir, an installed copy beats tfds data ($TFDS_DATA_DIR) ...
  _assert_split(load(), "train", *variants["system"][0])
  # ... but an explicit data_dir is the only place searched: its tfds data
  # wins over the installed copy.
  ds = load(places["tfds"])
  assert "tensorflow-datasets" in ds.source
  _assert_same_examples(ds.train_images, ds.train_labels, *variants["tfds"][0])


@pytest.mark.parametrize("missing", ["absent", "empty"])
def test_data_dir_without_the_dataset_is_an_error(places, missing):
  # An installed copy exists, but the folder the user named is what counts.
  dh.write_idx_dataset(places["system"] / "mnist", *_idx_splits(3))
  data_dir = places["data"] / "typo" if missing == "absent" else places["data"]
  with pytest.raises(datasets.DataNotFoundError) as e:
    datasets.load_dataset("mnist", data_dir, use_tfds=False)
  # The first line alone says what is wrong and what the folder should hold.
  first = str(e.value).splitlines()[0]
  assert str(data_dir) in first
  assert ("does not exist" in first) == (missing == "absent")
  for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
    assert name in first
  assert str(places["system"] / "mnist") in str(e.value)  # the copy, named
  # Without data_dir the installed copy is found as before.
  ds = datasets.load_dataset("mnist", use_tfds=False)
  assert str(places["system"] / "mnist") in ds.source


def test_shared_locations_need_the_dataset_subfolder(places):
  # MNIST files at the top of $GBN_DATA_DIR could as well be Fashion-MNIST.
  dh.write_idx_dataset(places["env"], *_idx_splits(1))
  with pytest.raises(datasets.DataNotFoundError):
    datasets.load_dataset("mnist", use_tfds=False)
  with pytest.raises(datasets.DataNotFoundError):
    datasets.load_dataset("fashion_mnist", use_tfds=False)
  dh.write_idx_dataset(places["env"] / "fashion-mnist", *_idx_splits(2))
  ds = datasets.load_dataset("fashion_mnist", use_tfds=False)
  _assert_split(ds, "test", *_idx_splits(2)[1])


def test_search_locations_lists_env_folders_in_order(places, monkeypatch):
  monkeypatch.setenv(datasets.ENV_DATA_DIR, os.pathsep.join(["/a", "", "/b"]))
  assert datasets.search_locations("/x") == [
      (Path("/x"), True),
      (Path("/a"), False),
      (Path("/b"), False),
      (places["user"], False),
      (places["system"], False),
  ]


# ---------------------------------------------------------------------------
# tensorflow-datasets.


@pytest.mark.parametrize("name", datasets.DATASETS)
def test_tfds_prepared_data_round_trip(places, name):
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("PIL")  # tfds encodes and decodes images with it
  info = datasets.dataset_info(name)
  train = dh.random_split(20, 6, info.image_shape, info.num_classes)
  test = dh.random_split(21, 3, info.image_shape, info.num_classes)
  dh.write_tfds_dataset(places["tfds"], info.tfds_name, train, test)
  # download=True is a no-op for prepared data: TensorFlow is not needed.
  ds = datasets.load_dataset(name, places["tfds"])
  assert repr(info.tfds_name) in ds.source
  _assert_same_examples(ds.train_images, ds.train_labels, *train)
  _assert_same_examples(ds.test_images, ds.test_labels, *test)


@pytest.fixture
def mock_tfds(monkeypatch):
  """tfds.testing.mock_data, with the mock's __getitems__ repaired.

  In tfds 4.9.10 mock_data sets ``__getitems__`` on a MagicMock instance,
  where it is not bound, so every batched read fails with a TypeError.
  """
  tfds = pytest.importorskip("tensorflow_datasets")
  from tensorflow_datasets.testing import mocking

  def getitems(*args, generator, serialized=False):
    # args is (record_keys,) as called in 4.9.10, (self, record_keys) if bound.
    assert not serialized
    return [generator[key] for key in args[-1]]

  monkeypatch.setattr(mocking, "_getitems", getitems)
  return tfds


@pytest.mark.parametrize("name", ["fashion_mnist", "cifar100", "svhn"])
def test_tfds_mock_data(places, mock_tfds, name):
  tfds = mock_tfds
  info = datasets.dataset_info(name)
  with tfds.testing.mock_data(num_examples=9):
    ds = datasets.load_dataset(name, places["data"])
    reference = tfds.data_source(info.tfds_name, split="test")
    expected = [reference[i] for i in range(len(reference))]
  assert "tensorflow-datasets" in ds.source
  assert ds.train_images.shape == (9, *info.image_shape)
  np.testing.assert_array_equal(
      ds.test_images, np.stack([e["image"] for e in expected])
  )
  np.testing.assert_array_equal(ds.test_labels, [e["label"] for e in expected])


def test_tfds_failure_is_reported(places, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")

  def fail(*args, **kwargs):
    raise RuntimeError("no route to host")

  monkeypatch.setattr(tfds, "data_source", fail)
  with pytest.raises(datasets.DataNotFoundError, match="no route to host"):
    datasets.load_dataset("cifar10", places["data"])


# ---------------------------------------------------------------------------
# Clear errors.


@pytest.mark.parametrize("name", datasets.DATASETS)
def test_missing_data_says_how_to_get_it(places, name):
  with pytest.raises(datasets.DataNotFoundError) as error:
    datasets.load_dataset(name, places["data"], use_tfds=False)
  assert isinstance(error.value, FileNotFoundError)
  message = str(error.value)
  files, _, archive = datasets.dataset_layout(name)
  for needed in (archive,) if archive else files:
    assert needed in message
  assert "http" in message and "tensorflow-cpu" in message
  assert str(places["data"]) in message and str(places["system"]) in message
  if name == "fashion_mnist":
    assert "apt-get install dataset-fashion-mnist" in message


def test_partial_file_set_is_an_error(places):
  dh.write_idx_dataset(places["data"], *_idx_splits(1))
  (places["data"] / "t10k-labels-idx1-ubyte.gz").unlink()
  with pytest.raises(datasets.DataNotFoundError, match="t10k-labels-idx1"):
    datasets.load_dataset("mnist", places["data"], use_tfds=False)


def _write_mnist_with(folder, name, data, gz=False):
  train, test = _idx_splits(1)
  dh.write_idx_dataset(folder, train, test, gz=gz)
  for existing in folder.glob(name + "*"):
    existing.unlink()
  dh.write_file(folder / (name + (".gz" if gz else "")), data)


@pytest.mark.parametrize(
    "name, data, match",
    [
        # Type code 0x0D (float) instead of 0x08 (unsigned byte).
        (
            "train-images-idx3-ubyte",
            b"\0\0\x0d\x03" + dh.idx_bytes(np.zeros((2, 28, 28), np.uint8))[4:],
            "magic",
        ),
        # A labels header on the images file.
        (
            "train-images-idx3-ubyte",
            dh.idx_bytes(np.zeros(7, np.uint8)),
            "magic",
        ),
        (
            "train-images-idx3-ubyte",
            dh.idx_bytes(np.zeros((7, 28, 28), np.uint8))[:-1],
            "truncated",
        ),
        (
            "train-images-idx3-ubyte",
            dh.idx_bytes(np.zeros((7, 27, 28), np.uint8)),
            "28x28",
        ),
        ("train-images-idx3-ubyte", b"\0\0\x08", "too short"),
        (
            "train-labels-idx1-ubyte",
            dh.idx_bytes(np.zeros(6, np.uint8)),
            "7 images but 6 labels",
        ),
        (
            "t10k-labels-idx1-ubyte",
            dh.idx_bytes(np.array([1, 10, 2], np.uint8)),
            "label 10",
        ),
    ],
)
def test_malformed_idx(places, name, data, match):
  _write_mnist_with(places["data"], name, data)
  with pytest.raises(datasets.MalformedDataError, match=match):
    datasets.load_dataset("mnist", places["data"], use_tfds=False)


def test_corrupt_gzip(places):
  _write_mnist_with(places["data"], "train-images-idx3-ubyte", b"")
  bad = places["data"] / "train-images-idx3-ubyte.gz"
  bad.write_bytes(gzip.compress(b"x" * 1000)[:30])
  (places["data"] / "train-images-idx3-ubyte").unlink()
  with pytest.raises(datasets.MalformedDataError, match="gzip"):
    datasets.load_dataset("mnist", places["data"], use_tfds=False)


def test_malformed_cifar(places):
  train = dh.random_split(2, 5, RGB_SHAPE, 10)
  test = dh.random_split(3, 2, RGB_SHAPE, 10)
  folder = dh.write_cifar10(places["data"], train, test)
  test_file = folder / "test_batch.bin"
  test_file.write_bytes(test_file.read_bytes()[:-1])
  with pytest.raises(datasets.MalformedDataError, match="3073-byte records"):
    datasets.load_dataset("cifar10", places["data"], use_tfds=False)
  test_file.write_bytes(dh.cifar_records(test[0], np.array([3, 10])))
  with pytest.raises(datasets.MalformedDataError, match="label 10"):
    datasets.load_dataset("cifar10", places["data"], use_tfds=False)


@pytest.mark.parametrize("coarse, fine", [(20, 5), (5, 100)])
def test_malformed_cifar100_labels(places, coarse, fine):
  images = dh.random_split(2, 2, RGB_SHAPE, 10)[0]
  good = (images, np.array([1, 2]), np.array([3, 4]))
  bad = (images, np.array([1, coarse]), np.array([3, fine]))
  dh.write_cifar100(places["data"], good, bad)
  match = f"label {max(coarse, fine)}"
  with pytest.raises(datasets.MalformedDataError, match=match):
    datasets.load_dataset("cifar100", places["data"], use_tfds=False)


@pytest.mark.parametrize(
    "arrays, match",
    [
        (
            {
                "X": np.zeros((28, 28, 3, 2), np.uint8),
                "y": np.ones((2, 1), np.uint8),
            },
            "X must be",
        ),
        (
            {
                "X": np.zeros((32, 32, 3, 2), np.float64),
                "y": np.ones((2, 1), np.uint8),
            },
            "X must be",
        ),
        (
            {
                "X": np.zeros((32, 32, 3, 2), np.uint8),
                "y": np.ones((3, 1), np.uint8),
            },
            "y must be",
        ),
        (
            {
                "X": np.zeros((32, 32, 3, 2), np.uint8),
                "y": np.array([[1], [0]], np.uint8),
            },
            "1..10",
        ),
        ({"X": np.zeros((32, 32, 3, 2), np.uint8)}, "expected variables"),
    ],
)
def test_malformed_svhn(places, arrays, match):
  import scipy.io

  folder = dh.write_svhn(
      places["data"],
      dh.random_split(1, 2, RGB_SHAPE, 10),
      dh.random_split(2, 2, RGB_SHAPE, 10),
  )
  scipy.io.savemat(folder / "test_32x32.mat", arrays)
  with pytest.raises(datasets.MalformedDataError, match=match):
    datasets.load_dataset("svhn", places["data"], use_tfds=False)
  (folder / "test_32x32.mat").write_bytes(b"not a MATLAB file" * 20)
  with pytest.raises(datasets.MalformedDataError, match="MATLAB"):
    datasets.load_dataset("svhn", places["data"], use_tfds=False)


class _Trap:
  """Unpickling this creates a file: proof that a pickle was loaded."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return Path.touch, (Path(self.path),)


@pytest.mark.parametrize("place", ["data", "env"])
@pytest.mark.parametrize(
    "name, folder, member",
    [
        ("cifar10", "cifar-10-batches-py", "data_batch_1"),
        ("cifar100", "cifar-100-python", "train"),
    ],
)
def test_pickled_python_version_is_refused(
    places, tmp_path, place, name, folder, member
):
  trap = tmp_path / "unpickled"
  (places[place] / folder).mkdir()
  (places[place] / folder / member).write_bytes(pickle.dumps(_Trap(trap)))
  with pytest.raises(datasets.DataNotFoundError) as error:
    datasets.load_dataset(name, places["data"], use_tfds=False)
  message = str(error.value)
  assert "python version" in message and "binary version" in message
  assert str(places[place] / folder) in message
  assert not trap.exists()


def test_unknown_dataset():
  for call in (
      lambda: datasets.load_dataset("imagenet"),
      lambda: datasets.dataset_info("imagenet"),
      lambda: ip.normalize_images(
          jnp.zeros((1, 2, 2, 1), jnp.uint8), "imagenet"
      ),
  ):
    with pytest.raises(ValueError, match="unknown dataset"):
      call()


# ---------------------------------------------------------------------------
# Normalisation.


@pytest.mark.parametrize("name", datasets.DATASETS)
def test_normalize_images(name):
  info = ip.dataset_info(name)
  images = dh.random_split(0, 3, info.image_shape, 10)[0]
  mean = np.array(info.mean, np.float64)
  std = np.array(info.std, np.float64)
  expected = (images.astype(np.float64) / 255 - mean) / std
  normalize = jax.jit(ip.normalize_images, static_argnames="name")
  got = normalize(jnp.asarray(images), name=name)
  assert got.dtype == jnp.float32 and got.shape == images.shape
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_normalize_images_rejects_bad_input():
  with pytest.raises(TypeError, match="uint8"):
    ip.normalize_images(jnp.zeros((1, 32, 32, 3), jnp.float32), "cifar10")
  with pytest.raises(ValueError, match="channel"):
    ip.normalize_images(jnp.zeros((1, 28, 28, 1), jnp.uint8), "cifar10")


def test_augment_by_default():
  assert {n for n in ip.DATASETS if ip.dataset_info(n).augment_by_default} == {
      "cifar10",
      "cifar100",
      "svhn",
  }


# ---------------------------------------------------------------------------
# Augmentation.


def _augment_reference(images, offsets, flips, pad):
  """Crop-with-zero-padding and flip, pixel by pixel from the definition."""
  out = np.zeros_like(images)
  _, height, width, _ = images.shape
  for b, ((row, col), flip) in enumerate(zip(offsets, flips)):
    for y in range(height):
      for x in range(width):
        source_y, source_x = y + row - pad, x + col - pad
        if 0 <= source_y < height and 0 <= source_x < width:
          out[b, y, x] = images[b, source_y, source_x]
    if flip:
      out[b] = out[b, :, ::-1]
  return out


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("pad", [4, 2])
def test_augment_matches_reference(dtype, pad):
  images = dh.random_split(0, 16, (12, 10, 3), 10)[0].astype(dtype)
  key = jax.random.key(3)
  got = _augment(key, images, pad=pad)
  params = _sample(key, 16, pad)
  offsets = np.asarray(params.offsets)
  assert got.dtype == dtype and got.shape == images.shape
  assert offsets.min() >= 0 and offsets.max() <= 2 * pad
  expected = _augment_reference(images, offsets, np.asarray(params.flips), pad)
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_augment_zero_fill_area():
  # Of a constant image shifted by (dy, dx), exactly the uncovered band of
  # |dy| rows and |dx| columns is zero.
  images = np.full((64, 8, 8, 1), 255, np.uint8)
  key = jax.random.key(5)
  got = np.asarray(_augment(key, images))
  shift = np.abs(np.asarray(_sample(key, 64, ip.PAD).offsets) - ip.PAD)
  zeros = (got == 0).sum(axis=(1, 2, 3))
  expected = shift[:, 0] * 8 + shift[:, 1] * 8 - shift[:, 0] * shift[:, 1]
  np.testing.assert_array_equal(zeros, expected)
  assert (got[zeros == 0] == 255).all() and (zeros > 0).any()


def test_augment_flip_mirrors():
  images = dh.random_split(1, 32, (6, 7, 2), 10)[0]
  key = jax.random.key(8)
  flips = np.asarray(_sample(key, 32, 0).flips)
  got = np.asarray(_augment(key, images, pad=0))
  assert flips.any() and not flips.all()
  for b in range(32):
    for x in range(7):
      expected_column = images[b, :, 6 - x] if flips[b] else images[b, :, x]
      np.testing.assert_array_equal(got[b, :, x], expected_column)


def test_augment_randomness():
  images = dh.random_split(2, 8, RGB_SHAPE, 10)[0]
  first = _augment(jax.random.key(0), images)
  np.testing.assert_array_equal(first, _augment(jax.random.key(0), images))
  assert not np.array_equal(first, _augment(jax.random.key(1), images))
  # Each image gets its own draw: offsets take all 2 * PAD + 1 values about
  # equally often and half the images are flipped.
  params = _sample(jax.random.key(2), 9000, ip.PAD)
  counts = np.bincount(np.asarray(params.offsets).ravel(), minlength=9)
  assert len(counts) == 2 * ip.PAD + 1
  np.testing.assert_allclose(counts / counts.sum(), 1 / 9, atol=0.02)
  assert abs(np.asarray(params.flips).mean() - 0.5) < 0.03


def test_augment_under_vmap_matches_per_step_calls():
  # The training loop augments a whole epoch (steps, B, H, W, C) at once.
  images = dh.random_split(3, 3 * 4, (8, 8, 3), 10)[0].reshape(3, 4, 8, 8, 3)
  keys = jax.random.split(jax.random.key(4), 3)
  got = jax.jit(jax.vmap(ip.augment))(keys, images)
  for step in range(3):
    np.testing.assert_array_equal(got[step], _augment(keys[step], images[step]))


def test_augment_rejects_bad_input():
  with pytest.raises(ValueError, match="NHWC"):
    ip.augment(jax.random.key(0), jnp.zeros((32, 32, 3)))
  with pytest.raises(ValueError, match="pad"):
    ip.augment(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), pad=-1)
  params = ip.sample_augment_params(jax.random.key(0), 3)
  with pytest.raises(ValueError, match="params for 3 images"):
    ip.apply_augment(jnp.zeros((2, 32, 32, 3)), params)


# ---------------------------------------------------------------------------
# The real datasets, when installed (skipped otherwise).


def _channel_stats(images):
  """Per-channel pixel mean and std (pixel / 255) from exact histograms."""
  means, stds = [], []
  for c in range(images.shape[-1]):
    hist = np.bincount(images[..., c].ravel(), minlength=256)
    levels = np.arange(256) / 255.0
    means.append(hist @ levels / hist.sum())
    stds.append(np.sqrt(hist @ (levels - means[-1]) ** 2 / hist.sum()))
  return np.array(means), np.array(stds)


def _load_installed(name):
  try:
    return datasets.load_dataset(name, use_tfds=False)
  except datasets.DataNotFoundError:
    pytest.skip(f"{name} is not installed (see datasets.load_dataset)")


@pytest.mark.parametrize(
    "name,train_per_class,atol",
    [
        ("fashion_mnist", 6000, 1e-3),
        # Loose enough for the JPEG-compressed copy of CIFAR-10 (std ~0.002
        # lower).
        ("cifar10", 5000, 3e-3),
    ],
)
def test_real_dataset(name, train_per_class, atol):
  ds = _load_installed(name)
  info = ds.info
  assert ds.train_images.shape == (10 * train_per_class, *info.image_shape)
  assert ds.test_images.shape == (10000, *info.image_shape)
  assert set(np.bincount(ds.train_labels)) == {train_per_class}
  assert set(np.bincount(ds.test_labels)) == {1000}
  mean, std = _channel_stats(ds.train_images)
  np.testing.assert_allclose(mean, info.mean, atol=atol)
  np.testing.assert_allclose(std, info.std, atol=atol)
