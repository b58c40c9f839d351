"""Tests of train.data.download against a local HTTP server (no internet
needed).

The server (http.server on 127.0.0.1, in a thread) serves tiny files in the
official layouts written by tests/helpers/data.py; it can also corrupt a
file, cut a transfer short, or answer 404. The published checksums are
compared with tensorflow-datasets' own files when it is installed.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import os
from pathlib import Path
import socket
import threading

import numpy as np
import pytest

from train.data import datasets
from train.data import download
from train.data import tfds as data_tfds

from tests.helpers import data as dh
from tests.helpers.process import run_module
from tests.helpers.training import empty_data_places

# Seconds: every test's transfers are local, so anything slower is a hang.
_TIMEOUT = 10


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.files: dict[str, bytes] = {}
    self.cut: dict[str, int] = {}  # path -> bytes sent before hanging up
    self.requests: list[str] = []

  def url(self, path: str) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}{path}"


class _Handler(http.server.BaseHTTPRequestHandler):

  def do_GET(self):  # pylint: disable=invalid-name
    server = self.server
    server.requests.append(self.path)
    body = server.files.get(self.path)
    if body is None:
      self.send_error(404, "Not Found")
      return
    self.send_response(200)
    # The full length is announced even when the body is then cut short, as
    # a server that dies mid-transfer does.
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body[: server.cut.get(self.path, len(body))])
    self.wfile.flush()
    self.close_connection = True

  def log_message(self, *args):  # keep the test output clean
    del args


@pytest.fixture
def server():
  srv = _Server()
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  yield srv
  srv.shutdown()
  srv.server_close()
  thread.join(_TIMEOUT)


def _serve(server, path: str, body: bytes, **kwargs) -> download.Remote:
  """Serves ``body`` at ``path``; its Remote, with its true checksum."""
  server.files[path] = body
  return download.Remote(
      server.url(path), hashlib.sha256(body).hexdigest(), len(body), **kwargs
  )


def _tiny_cifar10(tmp_path: Path):
  train = dh.random_split(1, 10, (32, 32, 3), 10)
  test = dh.random_split(2, 4, (32, 32, 3), 10)
  folder = dh.write_cifar10(tmp_path / "src", train, test)
  archive = dh.write_tar_gz(tmp_path / "cifar-10-binary.tar.gz", folder)
  return archive.read_bytes(), train, test


def _files_in(folder: Path) -> list[str]:
  return sorted(os.listdir(folder)) if folder.exists() else []


@pytest.fixture
def fetch(server):
  del server  # started for the test
  return lambda name, cache, sources: download.fetch(
      name, cache, sources=sources, progress=False, timeout=_TIMEOUT
  )


def test_fetch_downloads_verifies_and_the_loader_reads_it(
    server, tmp_path, capsys
):
  body, train, test = _tiny_cifar10(tmp_path)
  remote = _serve(server, "/kriz/cifar-10-binary.tar.gz", body)
  cache = tmp_path / "cache"
  folder = download.fetch(
      "cifar10", cache, sources={"cifar10": (remote,)}, timeout=_TIMEOUT
  )
  assert folder == cache / download.SUBDIRS["cifar10"]
  assert _files_in(folder) == ["cifar-10-binary.tar.gz"]  # no temp file
  assert (folder / "cifar-10-binary.tar.gz").read_bytes() == body
  assert "cifar-10-binary.tar.gz" in capsys.readouterr().err  # the bar
  ds = datasets.load_dataset("cifar10", folder, use_tfds=False)
  np.testing.assert_array_equal(ds.train_images, train[0])
  np.testing.assert_array_equal(ds.test_labels, test[1])
  # A file under its final name was verified: it is not fetched again.
  download.fetch("cifar10", cache, sources={"cifar10": (remote,)})
  assert server.requests == ["/kriz/cifar-10-binary.tar.gz"]


def test_checksum_mismatch_is_an_error_and_leaves_nothing(
    server, tmp_path, fetch
):
  body, _, _ = _tiny_cifar10(tmp_path)
  remote = _serve(server, "/c.tar.gz", body, filename="cifar-10-binary.tar.gz")
  corrupt = bytearray(body)
  corrupt[len(corrupt) // 2] ^= 0xFF
  server.files["/c.tar.gz"] = bytes(corrupt)  # same size, other bytes
  with pytest.raises(download.DownloadError) as e:
    fetch("cifar10", tmp_path / "cache", {"cifar10": (remote,)})
  message = str(e.value)
  assert "SHA-256" in message and remote.sha256 in message
  assert hashlib.sha256(corrupt).hexdigest() in message
  # The manual steps: where to put the file, and the checksum to expect.
  assert f"curl -fL -o {tmp_path / 'cache' / 'cifar10'}" in message
  assert f"must print {remote.sha256}" in message
  assert _files_in(tmp_path / "cache" / "cifar10") == []


@pytest.mark.parametrize("sent", ["half", "none", "more"])
def test_interrupted_transfer_is_an_error_and_leaves_nothing(
    server, tmp_path, fetch, sent
):
  body = os.urandom(3 * download._CHUNK + 17)  # pylint: disable=protected-access
  remote = _serve(server, "/mnist/t.gz", body)
  if sent == "more":  # a server that sends more than the published size
    remote = download.Remote(remote.url, remote.sha256, remote.size - 100)
  else:
    server.cut["/mnist/t.gz"] = len(body) // 2 if sent == "half" else 0
  with pytest.raises(download.DownloadError) as e:
    fetch("mnist", tmp_path / "cache", {"mnist": (remote,)})
  if sent == "more":
    assert f"got more than the expected {remote.size} bytes" in str(e.value)
  else:
    got = server.cut["/mnist/t.gz"]
    assert f"got {got} bytes, expected {remote.size}" in str(e.value)
    assert "stopped early" in str(e.value)
  assert _files_in(tmp_path / "cache" / "mnist") == []


def test_a_failed_file_keeps_those_already_verified(server, tmp_path, fetch):
  good = _serve(server, "/a.gz", b"first file")
  bad = download.Remote(server.url("/missing.gz"), "0" * 64, 5)
  with pytest.raises(download.DownloadError, match="HTTP 404"):
    fetch("mnist", tmp_path / "cache", {"mnist": (good, bad)})
  assert _files_in(tmp_path / "cache" / "mnist") == ["a.gz"]
  assert (tmp_path / "cache" / "mnist" / "a.gz").read_bytes() == b"first file"


def test_offline_is_a_clear_error(tmp_path, fetch):
  with socket.socket() as s:  # a port that nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  remote = download.Remote(f"http://127.0.0.1:{port}/x.gz", "0" * 64, 5)
  with pytest.raises(download.DownloadError) as e:
    fetch("mnist", tmp_path / "cache", {"mnist": (remote,)})
  message = str(e.value)
  assert message.startswith("Automatic download of mnist failed")
  assert "offline" in message and "curl" in message
  assert not (tmp_path / "cache" / "mnist").exists()  # created, then removed


def test_no_download_env_turns_it_off(server, tmp_path, fetch, monkeypatch):
  remote = _serve(server, "/x.gz", b"data")
  monkeypatch.setenv(download.ENV_NO_DOWNLOAD, "1")
  with pytest.raises(download.DownloadError, match=download.ENV_NO_DOWNLOAD):
    fetch("mnist", tmp_path / "cache", {"mnist": (remote,)})
  assert server.requests == []
  monkeypatch.setenv(download.ENV_NO_DOWNLOAD, "0")
  assert fetch("mnist", tmp_path / "cache", {"mnist": (remote,)}).is_dir()


def test_command_line(server, tmp_path, monkeypatch, capsys):
  monkeypatch.delenv(download.ENV_NO_DOWNLOAD, raising=False)
  remote = _serve(server, "/svhn/test_32x32.mat", b"matlab bytes")
  monkeypatch.setitem(download.SOURCES, "svhn", (remote,))
  argv = ["svhn", "--cache-dir", str(tmp_path), "--no-progress"]
  assert download._main(argv) == 0  # pylint: disable=protected-access
  assert capsys.readouterr().out == f"svhn: {tmp_path / 'svhn'}\n"
  assert (tmp_path / "svhn" / "test_32x32.mat").read_bytes() == b"matlab bytes"
  server.cut["/svhn/test_32x32.mat"] = 0
  (tmp_path / "svhn" / "test_32x32.mat").unlink()
  assert download._main(argv) == 1  # pylint: disable=protected-access
  err = capsys.readouterr().err
  assert err.startswith(
      "python -m train.data.download: error: Automatic download"
  )


def test_remote_rejects_bad_entries():
  url = "http://example.invalid/f.gz"
  with pytest.raises(ValueError, match="sha256"):
    download.Remote(url, "ABC", 1)
  with pytest.raises(ValueError, match="size"):
    download.Remote(url, "0" * 64, -1)
  with pytest.raises(ValueError, match="filename"):
    download.Remote("http://example.invalid/", "0" * 64, 1)
  with pytest.raises(ValueError, match="name: no download known"):
    download.fetch("imagenet", "/nonexistent")


# ---------------------------------------------------------------------------
# The loader's hook (load_dataset(fetch=True)).


@pytest.fixture
def places(tmp_path, monkeypatch):
  """Every search location an empty temporary folder, downloads allowed."""
  paths = empty_data_places(tmp_path, monkeypatch)
  monkeypatch.delenv(download.ENV_NO_DOWNLOAD, raising=False)
  return paths


def _serve_mnist(server, monkeypatch, n_train=7, n_test=3):
  """Serves a tiny MNIST as the four official .gz files; its splits."""
  train = dh.random_split(3, n_train, (28, 28, 1), 10)
  test = dh.random_split(4, n_test, (28, 28, 1), 10)
  remotes = []
  for split, (images, labels) in (("train", train), ("t10k", test)):
    for kind, array in (
        ("images-idx3", images[..., 0]),
        ("labels-idx1", labels),
    ):
      name = f"{split}-{kind}-ubyte.gz"
      body = gzip.compress(dh.idx_bytes(array.astype(np.uint8)))
      remotes.append(_serve(server, f"/mnist/{name}", body))
  monkeypatch.setitem(download.SOURCES, "mnist", tuple(remotes))
  return train, test


def test_load_dataset_fetches_into_the_searched_user_folder(
    server, places, monkeypatch
):
  train, test = _serve_mnist(server, monkeypatch)
  ds = datasets.load_dataset("mnist", use_tfds=False, fetch=True)
  np.testing.assert_array_equal(ds.train_images, train[0])
  np.testing.assert_array_equal(ds.test_labels, test[1])
  assert str(places["user"] / "mnist") in ds.source
  assert len(server.requests) == 4
  # The next load finds the files without fetching, and so does a loader
  # that never downloads: the cache is the user folder it searches.
  again = datasets.load_dataset("mnist", use_tfds=False)
  np.testing.assert_array_equal(again.train_images, train[0])
  datasets.load_dataset("mnist", use_tfds=False, fetch=True)
  assert len(server.requests) == 4


def test_load_dataset_data_dir_means_only_there(
    server, places, monkeypatch, tmp_path
):
  _serve_mnist(server, monkeypatch)
  with pytest.raises(datasets.DataNotFoundError, match="could not find"):
    datasets.load_dataset("mnist", tmp_path / "empty", fetch=True)
  assert server.requests == []
  # And without fetch nothing is downloaded either.
  with pytest.raises(datasets.DataNotFoundError):
    datasets.load_dataset("mnist", use_tfds=False)
  assert server.requests == []


def test_load_dataset_failed_download_explains(server, places, monkeypatch):
  train_images = _serve(server, "/t.gz", b"not the file")
  monkeypatch.setitem(download.SOURCES, "mnist", (train_images,))
  server.cut["/t.gz"] = 3
  with pytest.raises(datasets.DataNotFoundError) as e:
    datasets.load_dataset("mnist", use_tfds=False, fetch=True)
  message = str(e.value)
  assert message.startswith(
      "could not find the mnist dataset. Automatic download of mnist failed"
  )
  assert "stopped early" in message.splitlines()[0]
  assert "curl -fL" in message
  assert _files_in(places["user"] / "mnist") == []


def _tfds_says(monkeypatch, error: Exception, tensorflow: bool = False):
  """tensorflow-datasets raises ``error`` when asked for data; TensorFlow
  is installed or not, as ``tensorflow`` says."""
  tfds = pytest.importorskip("tensorflow_datasets")

  def data_source(*args, **kwargs):
    del args, kwargs
    raise error

  monkeypatch.setattr(tfds, "data_source", data_source)
  find_spec = data_tfds.importlib.util.find_spec
  monkeypatch.setattr(
      data_tfds.importlib.util,
      "find_spec",
      lambda name, *a: (
          (find_spec("os") if tensorflow else None)
          if name == "tensorflow"
          else find_spec(name, *a)
      ),
  )


# What tensorflow-datasets 4.9 raises for a dataset never generated, read
# without TensorFlow.
_NOT_GENERATED = KeyError(
    "Trying to access `splits['train']` but `splits` is empty. This likely"
    " indicates the dataset has not been generated yet."
)


def test_tfds_miss_is_a_miss_not_its_error(monkeypatch, tmp_path):
  _tfds_says(monkeypatch, _NOT_GENERATED)
  with pytest.raises(data_tfds.TfdsUnavailable) as e:
    data_tfds.load_tfds("cifar10", tmp_path, download=True)
  assert str(e.value) == (
      "no prepared 'cifar10' found, and preparing one needs TensorFlow,"
      " which is not installed"
  )
  assert e.value.nothing_prepared
  # With TensorFlow, tfds tries to prepare the data: its error, which may
  # run to pages, is cut to its first line.
  _tfds_says(monkeypatch, OSError("no route\n  File x\n" * 50), True)
  with pytest.raises(data_tfds.TfdsUnavailable) as e:
    data_tfds.load_tfds("cifar10", tmp_path, download=True)
  assert "\n" not in str(e.value) and str(e.value).endswith("OSError: no route")
  assert e.value.nothing_prepared


def test_offline_error_leads_with_the_download_and_ends_without_one(
    server, places, monkeypatch, tmp_path
):
  with socket.socket() as s:  # a port that nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}/cifar-10-binary.tar.gz"
  monkeypatch.setitem(
      download.SOURCES, "cifar10", (download.Remote(url, "0" * 64, 5),)
  )
  _tfds_says(monkeypatch, _NOT_GENERATED)
  # Only the pickled version is here: worth saying, download or not.
  (places["env"] / "cifar-10-batches-py").mkdir()
  with pytest.raises(datasets.DataNotFoundError) as e:
    datasets.load_dataset("cifar10", fetch=True)
  lines = str(e.value).splitlines()
  assert lines[0].startswith(
      f"could not find the cifar10 dataset. Automatic download of cifar10"
      f" failed: {url}: "
  )
  assert "offline" in lines[0]
  assert 'is the pickled "python version"' in lines[1]
  assert not any(
      "KeyError" in line or "tensorflow-datasets:" in line for line in lines
  )
  steps = lines.index("Nothing half-written was kept. To download it by hand:")
  assert lines[steps + 2].startswith(
      f"    curl -fL -o {places['user'] / 'cifar10' / 'cifar-10-binary.tar.gz'}"
  )
  assert lines[-1] == (
      "Without internet: Fashion-MNIST needs no download on Debian/Ubuntu:"
      " apt-get install dataset-fashion-mnist, then"
      " python -m train.mnist --dataset fashion_mnist."
  )
  # Fashion-MNIST itself: its package.
  monkeypatch.setitem(
      download.SOURCES, "fashion_mnist", (download.Remote(url, "0" * 64, 5),)
  )
  with pytest.raises(datasets.DataNotFoundError) as e:
    datasets.load_dataset("fashion_mnist", fetch=True)
  assert "apt-get install dataset-fashion-mnist installs it" in str(e.value)
  # A partial copy is named too.
  (places["user"] / "mnist").mkdir()
  (places["user"] / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(b"")
  monkeypatch.setitem(
      download.SOURCES, "mnist", (download.Remote(url, "0" * 64, 5),)
  )
  with pytest.raises(datasets.DataNotFoundError) as e:
    datasets.load_dataset("mnist", fetch=True)
  assert (
      str(e.value)
      .splitlines()[1]
      .startswith(
          f"mnist: {places['user'] / 'mnist'} holds only part of the dataset"
      )
  )


def test_offline_training_cli_says_only_its_own_message(tmp_path):
  with socket.socket() as s:  # a port that nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # The official URL through a proxy that is not there: nothing leaves
  # the machine, and the command is the one a user types.
  proxy = f"http://127.0.0.1:{port}"
  result = run_module(
      "train.cifar",
      "--norm",
      "sqd2",
      "--epochs",
      "1",
      "--workdir",
      str(tmp_path / "run"),
      env={
          "HOME": str(tmp_path),
          "XDG_CACHE_HOME": str(tmp_path / ".cache"),
          "JAX_PLATFORMS": "cpu",
          **{k: proxy for k in ("http_proxy", "https_proxy")},
          **{k.upper(): proxy for k in ("http_proxy", "https_proxy")},
      },
      drop=(
          "no_proxy",
          "NO_PROXY",
          "TFDS_DATA_DIR",
          datasets.ENV_DATA_DIR,
          download.ENV_NO_DOWNLOAD,
      ),
      timeout=300,
  )
  assert result.returncode == 1, result.stderr
  assert result.stdout == ""
  err = result.stderr
  assert err.splitlines()[0].startswith(
      "python -m train.cifar: error: could not find the cifar10 dataset."
      " Automatic download of cifar10 failed:"
      " https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz: "
  )
  for noise in ("KeyError", "Traceback", "splits", "WARNING", "absl"):
    assert noise not in err
  assert "curl -fL" in err and "sha256sum" in err
  assert "apt-get install dataset-fashion-mnist" in err
  assert "python -m train.mnist --dataset fashion_mnist" in err
  assert not (tmp_path / "run").exists()


def _no_tfds(*args, **kwargs):
  del args, kwargs
  raise data_tfds.TfdsUnavailable("not in this test")


@pytest.mark.slow
def test_training_cli_downloads_only_without_data_dir(
    server, places, monkeypatch, tmp_path, capsys
):
  from train import configs  # pylint: disable=g-import-not-at-top
  from train import main as train_main  # pylint: disable=g-import-not-at-top
  from train.loop import checkpointing  # pylint: disable=g-import-not-at-top

  _serve_mnist(server, monkeypatch, n_train=32, n_test=8)
  # tensorflow-datasets reads TFDS_DATA_DIR once, when first imported: a test
  # that ran before in this process may have left it a folder holding MNIST.
  monkeypatch.setattr(data_tfds, "load_tfds", _no_tfds)
  run = ["--batch-size", "16", "--epochs", "1", "--no-progress"]
  monkeypatch.setenv(download.ENV_NO_DOWNLOAD, "1")
  code = train_main.run(
      [*run, "--workdir", str(tmp_path / "off")], configs.MNIST, "train.mnist"
  )
  err = capsys.readouterr().err
  assert code == 1 and server.requests == []
  assert err.startswith("train.mnist: error: could not find the mnist dataset")
  assert download.ENV_NO_DOWNLOAD in err and "curl -fL" in err
  monkeypatch.delenv(download.ENV_NO_DOWNLOAD)
  code = train_main.run(
      [*run, "--workdir", str(tmp_path / "run")], configs.MNIST, "train.mnist"
  )
  assert code == 0, capsys.readouterr().err
  assert len(server.requests) == 4
  source = (tmp_path / "run" / checkpointing.DATA_SOURCE_FILE).read_text()
  assert str(places["user"] / "mnist") in source


# ---------------------------------------------------------------------------
# The published table.


@pytest.mark.parametrize("name", datasets.DATASETS)
def test_sources_match_the_loader_layout(name):
  files, subdirs, archive = datasets.dataset_layout(name)
  assert download.SUBDIRS[name] in subdirs
  names = {r.filename for r in download.SOURCES[name]}
  if archive is not None:
    assert names == {archive}
  elif name in ("mnist", "fashion_mnist"):
    assert names == {f + ".gz" for f in files}
  else:
    assert names == set(files)


@pytest.mark.parametrize("name", datasets.DATASETS)
def test_sources_match_tensorflow_datasets_checksums(name):
  tfds_dir = _tfds_package_dir()
  tsv = [
      tfds_dir / "url_checksums" / f"{name}.txt",
      tfds_dir
      / "datasets"
      / f"{datasets.dataset_info(name).tfds_name}"
      / "checksums.tsv",
  ]
  published = {}
  for path in tsv:
    if path.is_file():
      for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and not line.startswith("#"):
          published[fields[0]] = (int(fields[1]), fields[2])
  if not published:
    pytest.skip(f"no tensorflow-datasets checksum file for {name}")
  for remote in download.SOURCES[name]:
    assert published[remote.url] == (remote.size, remote.sha256), remote.url


def _tfds_package_dir() -> Path:
  import importlib.util  # pylint: disable=g-import-not-at-top

  # find_spec does not import the (slow) package itself.
  spec = importlib.util.find_spec("tensorflow_datasets")
  if spec is None or not spec.submodule_search_locations:
    pytest.skip("tensorflow-datasets is not installed")
  return Path(list(spec.submodule_search_locations)[0])
