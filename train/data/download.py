"""Downloads a dataset's canonical files into the user's cache, verified.

`fetch` puts the files that `train.data.datasets` reads (the CIFAR *binary
version* archives, the gzipped IDX files, SVHN's format-2 ``.mat`` files)
into ``CACHE/SUBDIR``, where ``CACHE`` is the folder `train.data.datasets`
searches as the user's (``~/.cache/gbn_jax``) and ``SUBDIR`` one of the
dataset's subfolder names there, so every later command finds them without a
flag and without this module.

Each file is downloaded from its official URL into a temporary file in the
same folder, checked against the size and SHA-256 that tensorflow-datasets
publishes for that URL, and only then renamed to its final name
(``os.replace``, atomic on one file system): an interrupted or corrupt
download leaves nothing under a name a reader would take, and a file that
has its final name was verified. ``GBN_NO_DOWNLOAD=1`` turns downloads off.

``python -m train.data.download NAME...`` fetches ahead of time.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
import contextlib
import dataclasses
import hashlib
import http.client
import os
from pathlib import Path
import shlex
import sys
import tempfile
import urllib.error
import urllib.request

from train.data import locate as data_locate

ENV_NO_DOWNLOAD = "GBN_NO_DOWNLOAD"

# Large enough to keep Python's per-call cost out of a 170 MB transfer, small
# enough for a progress bar that moves.
_CHUNK = 1 << 20


class DownloadError(OSError):
  """A download failed or is off; the message says how to get the file."""


@dataclasses.dataclass(frozen=True)
class Remote:
  """One file to download.

  Attributes:
    url: Where it is.
    sha256: Its SHA-256, lowercase hex.
    size: Its size in bytes.
    filename: Its name in the cache (default: the URL's last part).
  """

  url: str
  sha256: str
  size: int
  filename: str = ""

  def __post_init__(self):
    if not self.filename:
      object.__setattr__(self, "filename", self.url.rsplit("/", 1)[-1])
    if not self.filename or "/" in self.filename or self.filename[0] == ".":
      raise ValueError(f"filename: not a plain file name: {self.filename!r}")
    if len(self.sha256) != 64 or self.sha256.strip("0123456789abcdef"):
      raise ValueError(
          f"sha256: expected 64 lowercase hex digits for {self.url}"
      )
    if self.size < 0:
      raise ValueError(f"size: must be >= 0, got {self.size} for {self.url}")


def _remotes(base: str, table: str) -> tuple[Remote, ...]:
  """Remotes from ``file size sha256`` lines, each at ``base + file``."""
  rows = (line.split() for line in table.strip().splitlines())
  return tuple(Remote(base + name, sha, int(size)) for name, size, sha in rows)


# Sizes and SHA-256s as tensorflow-datasets 4.9.10 publishes them for these
# URLs: tensorflow_datasets/url_checksums/{mnist,fashion_mnist,cifar10,
# cifar100}.txt and tensorflow_datasets/datasets/svhn_cropped/checksums.tsv.
# MNIST's files come from Google's CVDF mirror, as tfds's and Keras's do
# (yann.lecun.com now asks for a login).
SOURCES: Mapping[str, tuple[Remote, ...]] = {
    "mnist": _remotes(
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        """
        train-images-idx3-ubyte.gz 9912422 440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609
        train-labels-idx1-ubyte.gz 28881 3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c
        t10k-images-idx3-ubyte.gz 1648877 8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6
        t10k-labels-idx1-ubyte.gz 4542 f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6
        """,
    ),
    "fashion_mnist": _remotes(
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        """
        train-images-idx3-ubyte.gz 26421880 3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84
        train-labels-idx1-ubyte.gz 29515 a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845
        t10k-images-idx3-ubyte.gz 4422102 346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073
        t10k-labels-idx1-ubyte.gz 5148 67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5
        """,
    ),
    "cifar10": _remotes(
        "https://www.cs.toronto.edu/~kriz/",
        "cifar-10-binary.tar.gz 170052171 c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
    ),
    "cifar100": _remotes(
        "https://www.cs.toronto.edu/~kriz/",
        "cifar-100-binary.tar.gz 168513733 58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
    ),
    # Format 2 without the 1.3 GB "extra" set, which train.data.datasets
    # ignores.
    "svhn": _remotes(
        "http://ufldl.stanford.edu/housenumbers/",
        """
        train_32x32.mat 182040794 435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8
        test_32x32.mat 64275384 cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b
        """,
    ),
}

#: The cache subfolder of each dataset: one of the subfolders that
#: ``train.data.datasets`` searches for it (its archive is read in place there).
SUBDIRS: Mapping[str, str] = {
    "mnist": "mnist",
    "fashion_mnist": "fashion_mnist",
    "cifar10": "cifar10",
    "cifar100": "cifar100",
    "svhn": "svhn",
}


def disabled() -> bool:
  """Whether ``$GBN_NO_DOWNLOAD`` turns downloads off."""
  return os.environ.get(ENV_NO_DOWNLOAD, "").strip().lower() not in (
      "",
      "0",
      "false",
      "no",
  )


def manual_steps(remotes: Sequence[Remote], folder: Path) -> str:
  """Shell commands that do by hand what `fetch` does, checks included."""
  where = shlex.quote(str(folder))
  lines = [f"mkdir -p {where}"]
  for r in remotes:
    target = shlex.quote(str(folder / r.filename))
    lines.append(f"curl -fL -o {target} {shlex.quote(r.url)}")
  for r in remotes:
    target = shlex.quote(str(folder / r.filename))
    lines.append(f"sha256sum {target}  # must print {r.sha256}")
  return "\n".join("    " + line for line in lines)


def fetch(
    name: str,
    cache_dir: str | os.PathLike[str],
    *,
    sources: Mapping[str, Sequence[Remote]] | None = None,
    progress: bool = True,
    timeout: float = 60.0,
) -> Path:
  """Makes sure dataset ``name``'s files are in ``cache_dir``; downloads them.

  Files already there under their final name are kept as they are (only a
  verified download gets that name).

  Args:
    name: A dataset of ``sources``.
    cache_dir: The cache; the files go into its subfolder ``SUBDIRS[name]``.
    sources: The files of each dataset (default `SOURCES`); tests point it
      at a local server.
    progress: Show a progress bar on stderr.
    timeout: Seconds without a byte from the server before giving up.

  Returns:
    The folder holding the files.

  Raises:
    ValueError: Unknown ``name``.
    DownloadError: Downloads are off, or one failed (offline, HTTP error,
      transfer cut short, checksum mismatch); nothing half-written is left.
  """
  sources = SOURCES if sources is None else sources
  if name not in sources:
    raise ValueError(
        f"name: no download known for {name!r}; expected one of"
        f" {', '.join(sources)}"
    )
  folder = Path(cache_dir).expanduser() / SUBDIRS.get(name, name)
  remotes = tuple(sources[name])
  missing = [r for r in remotes if not (folder / r.filename).is_file()]
  if missing and disabled():
    raise DownloadError(
        f"Automatic download of {name} is off ({ENV_NO_DOWNLOAD} is set).\n"
        f"To download it by hand:\n{manual_steps(missing, folder)}"
    )
  created = not folder.exists()
  for remote in missing:
    try:
      _download(remote, folder, progress=progress, timeout=timeout)
    except DownloadError as e:
      if created:  # leave the cache as it was; a folder with files stays
        with contextlib.suppress(OSError):
          folder.rmdir()
      raise DownloadError(
          f"Automatic download of {name} failed: {e}\nNothing half-written"
          f" was kept. To download it by hand:\n"
          f"{manual_steps(missing, folder)}"
      ) from e
  return folder


def not_downloaded_message(
    name: str, notes: Sequence[str], error: DownloadError
) -> str:
  """The message for a dataset that no source has and that did not download.

  The download's failure comes first and its commands by hand next: the
  search's own message would bury them under ways to provide the data that
  offline are no use. tensorflow-datasets' routine miss is left out, what
  else the search noticed is kept.
  """
  failure, _, by_hand = str(error).partition("\n")
  places = ", ".join(
      str(base) + ("" if base.is_dir() else " (does not exist)")
      for base, _ in data_locate.search_locations()
  )
  return "\n".join(
      [
          f"could not find the {name} dataset. {failure}",
          *notes,
          f"Searched first: {places} and tensorflow-datasets; none has it.",
          by_hand,
          "  then run the same command again: the data is found there"
          " without a flag.",
          data_locate.without_download(name),
      ]
  )


def _download(
    remote: Remote, folder: Path, *, progress: bool, timeout: float
) -> None:
  """Downloads ``remote`` into ``folder``, verified, or raises DownloadError."""
  try:
    folder.mkdir(parents=True, exist_ok=True)
    # In the same folder, so that os.replace is a rename, never a copy.
    handle, part = tempfile.mkstemp(
        dir=folder, prefix=f".{remote.filename}.", suffix=".part"
    )
  except OSError as e:
    raise DownloadError(f"cannot write into {folder}: {e}") from e
  try:
    with os.fdopen(handle, "wb") as out:
      digest, received = _transfer(remote, out, progress, timeout)
      out.flush()
      os.fsync(out.fileno())
    if received < remote.size:
      raise DownloadError(
          f"{remote.url}: got {received} bytes, expected {remote.size}"
          " (the transfer stopped early)"
      )
    if received > remote.size:
      raise DownloadError(
          f"{remote.url}: got more than the expected {remote.size} bytes"
      )
    if digest != remote.sha256:
      raise DownloadError(
          f"{remote.url}: SHA-256 {digest} does not match the published"
          f" {remote.sha256} (a corrupt transfer, or the file changed)"
      )
    os.replace(part, folder / remote.filename)
  finally:
    # Whatever went wrong (KeyboardInterrupt included), no partial file.
    if os.path.exists(part):
      os.unlink(part)


def _transfer(
    remote: Remote, out, progress: bool, timeout: float
) -> tuple[str, int]:
  """Streams ``remote`` into ``out``; returns its SHA-256 and size."""
  digest = hashlib.sha256()
  received = 0
  try:
    import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:  # the train extra has it; a bare install goes without
    tqdm = None
  try:
    with urllib.request.urlopen(remote.url, timeout=timeout) as response:
      bar = (
          tqdm.tqdm(
              total=remote.size,
              desc=remote.filename,
              unit="B",
              unit_scale=True,
              unit_divisor=1024,
              file=sys.stderr,
              disable=not progress,
              dynamic_ncols=True,
          )
          if tqdm is not None
          else None
      )
      try:
        # A server that sends more than the published size is wrong too;
        # reading one byte past it is enough to tell.
        while received <= remote.size:
          chunk = response.read(_CHUNK)
          if not chunk:
            break
          digest.update(chunk)
          out.write(chunk)
          received += len(chunk)
          if bar is not None:
            bar.update(len(chunk))
      finally:
        if bar is not None:
          bar.close()
  except urllib.error.HTTPError as e:
    raise DownloadError(f"{remote.url}: HTTP {e.code} {e.reason}") from e
  except urllib.error.URLError as e:
    raise DownloadError(
        f"{remote.url}: {e.reason} (offline, or the server is unreachable)"
    ) from e
  except (OSError, http.client.HTTPException) as e:  # timeouts, resets
    raise DownloadError(f"{remote.url}: {type(e).__name__}: {e}") from e
  return digest.hexdigest(), received


def _main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m train.data.download",
      description=(
          "Download datasets into the cache that the training CLI searches"
          " (~/.cache/gbn_jax), checked against the published SHA-256."
      ),
  )
  parser.add_argument("names", nargs="+", choices=sorted(SOURCES))
  parser.add_argument("--cache-dir", default=data_locate.USER_DATA_DIR)
  parser.add_argument(
      "--no-progress", action="store_true", help="no progress bar on stderr"
  )
  args = parser.parse_args(argv)
  for name in args.names:
    try:
      folder = fetch(name, args.cache_dir, progress=not args.no_progress)
    except DownloadError as e:
      print(f"{parser.prog}: error: {e}", file=sys.stderr)
      return 1
    print(f"{name}: {folder}")
  return 0


if __name__ == "__main__":
  sys.exit(_main())
