"""Compiles the training suite's C++ kernels on first use, into a user cache.

The training suite's compiled convolutions (:mod:`train.native.convolution`,
sources in ``train/native/csrc``) are no part of the gbn_jax distribution, so
no ``pip install`` builds them: the first process that needs them compiles them
(:func:`conv_library`, a few seconds) with the system's C++ compiler
(``$CXX``, else ``c++``, ``g++`` or ``clang++``) against the XLA FFI headers
that jaxlib ships (``jax.ffi.include_dir()``), and later processes load the
library it left. ``GBN_CONV_NATIVE=0`` builds nothing (XLA's convolutions).

The library goes to ``$XDG_CACHE_HOME/gbn_jax/native/`` (else
``~/.cache/gbn_jax/native/``), in a folder named by a hash of all it is built
from: the compiler's version, the commands, and every file in the sources'
and headers' folders. An edited source, another jaxlib or another compiler
builds anew; nothing stale loads. Processes that need the library at once
(pytest-xdist workers) build it once: the first takes a file lock, the
others wait for it and load its result. The library is linked under another
name and renamed, so one that exists is whole. A build's commands and
compiler output stay beside it (``build.log``); a build that failed leaves a
mark there too, so that later processes do not run the failing compile
again (delete the folder to retry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import fcntl
import hashlib
import os
from pathlib import Path
import platform
import shutil
import subprocess
import tempfile

import jax

from train import compile_cache

#: The training suite's C++ sources.
CSRC = Path(__file__).resolve().parent / "csrc"
#: Set to 0 (or false, no, off) for XLA's convolutions: nothing is built.
CONV_NATIVE_ENV = "GBN_CONV_NATIVE"
#: The convolution kernels' flags: as setuptools compiled them when gbn_jax's
#: install built them (Python's own CFLAGS add -DNDEBUG -fwrapv), for the
#: same code and so the same speed.
CONV_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-DNDEBUG", "-fwrapv")
# Seconds one compiler command may take.
_TIMEOUT = 600


@dataclasses.dataclass(frozen=True)
class Source:
  """A C++ source and the flags its compile alone takes (an instruction set).

  The same file may be listed twice with different flags: each is an object.
  """

  path: Path
  flags: tuple[str, ...] = ()


class BuildFailed(RuntimeError):
  """The compiler failed.

  Attributes:
    log: The file with the build's commands and the compiler's output.
    output: What the failed commands printed.
  """

  def __init__(self, message: str, log: Path, output: str = ""):
    super().__init__(message)
    self.log = log
    self.output = output


def compiler(env: Mapping[str, str] | None = None) -> str | None:
  """The C++ compiler's path: ``$CXX``, else ``c++``, ``g++`` or ``clang++``.

  None where there is none (a ``$CXX`` that is not found counts as none).
  """
  env = os.environ if env is None else env
  path = env.get("PATH")
  names = [env["CXX"]] if env.get("CXX") else ["c++", "g++", "clang++"]
  for name in names:
    if found := shutil.which(name, path=path):
      return found
  return None


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
  """``$XDG_CACHE_HOME/gbn_jax/native``, else ``~/.cache/gbn_jax/native``."""
  return compile_cache.user_cache_root(env) / "native"


def _run(command: Sequence[str]) -> subprocess.CompletedProcess:
  return subprocess.run(
      list(command),
      capture_output=True,
      text=True,
      timeout=_TIMEOUT,
      check=False,
  )


def _version(cxx: str) -> str:
  try:
    return _run([cxx, "--version"]).stdout
  except (OSError, subprocess.SubprocessError):
    return ""  # the compile that follows says what is wrong


def _build_key(cxx: str, commands: Sequence[Sequence[str]], folders) -> str:
  """A hash of the compiler's version, the commands and the folders' files."""
  digest = hashlib.sha256(_version(cxx).encode())
  for command in commands:
    digest.update("\0".join(command).encode() + b"\n")
  for folder in sorted(set(folders)):
    for path in sorted(folder.rglob("*")):
      if path.is_file():
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(path.read_bytes())
  return digest.hexdigest()[:24]


def _compile_all(commands: Sequence[Sequence[str]]) -> list[tuple]:
  """Runs the compile commands side by side.

  Args:
    commands: Compiler command lines.

  Returns:
    ``(command, returncode, output)`` for each.
  """
  running = [
      (
          command,
          subprocess.Popen(
              list(command),
              stdout=subprocess.PIPE,
              stderr=subprocess.STDOUT,
              text=True,
          ),
      )
      for command in commands
  ]
  finished = []
  for command, process in running:
    try:
      output = process.communicate(timeout=_TIMEOUT)[0]
    except subprocess.TimeoutExpired:
      process.kill()
      output = process.communicate()[0] + f"\n(killed after {_TIMEOUT} s)"
    finished.append((command, process.returncode, output))
  return finished


def _write_log(log: Path, steps: Sequence[tuple]) -> None:
  text = "".join(
      f"$ {' '.join(command)}\n{output}(exit status {status})\n\n"
      for command, status, output in steps
  )
  log.write_text(text)


def build(
    name: str,
    sources: Sequence[Source],
    flags: Sequence[str],
    include_dirs: Sequence[str | Path] = (),
    link_flags: Sequence[str] = ("-shared", "-pthread"),
    root: Path | None = None,
) -> Path | None:
  """The shared library ``name``, compiled from ``sources`` unless cached.

  Args:
    name: The library's name (``NAME.so``) and its cache folder's prefix.
    sources: What to compile, each to an object, then linked together.
    flags: The flags of every compile and of the link.
    include_dirs: Header folders (``-I``); their files count in the hash.
    link_flags: The link's own flags.
    root: The cache folder (default :func:`cache_dir`).

  Returns:
    The library's path; None where there is no C++ compiler.

  Raises:
    BuildFailed: the compiler failed, now or in an earlier process.
    OSError: the cache folder cannot be written.
  """
  cxx = compiler()
  if cxx is None:
    return None
  includes = [f"-I{folder}" for folder in include_dirs]
  compiles = [
      [cxx, *flags, *source.flags, *includes, "-c", str(source.path)]
      for source in sources
  ]
  link = [cxx, *flags, *link_flags]
  folders = [s.path.parent for s in sources] + [Path(d) for d in include_dirs]
  key = _build_key(cxx, [*compiles, link], folders)
  directory = (root or cache_dir()) / f"{name}-{key}"
  library, log, failed = (
      directory / f"{name}.so",
      directory / "build.log",
      directory / "failed",
  )
  if library.exists():
    return library
  directory.mkdir(parents=True, exist_ok=True)
  with open(directory / "lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if library.exists():
      return library
    if failed.exists():
      output = failed.read_text()
      raise BuildFailed(f"an earlier build of {name} failed", log, output)
    with tempfile.TemporaryDirectory(dir=directory) as work:
      objects = [f"{work}/{i}.o" for i in range(len(sources))]
      steps = _compile_all([[*c, "-o", o] for c, o in zip(compiles, objects)])
      partial = f"{work}/{name}.so"
      if all(status == 0 for _, status, _ in steps):
        command = [*link, *objects, "-o", partial]
        linked = _run(command)
        steps.append(
            (command, linked.returncode, linked.stdout + linked.stderr)
        )
      _write_log(log, steps)
      if any(status != 0 for _, status, _ in steps):
        output = "".join(out for _, status, out in steps if status != 0)
        failed.write_text(output)
        raise BuildFailed(f"the compiler failed to build {name}", log, output)
      os.replace(partial, library)
  return library


def conv_sources() -> list[Source]:
  """The convolution kernels' sources: the handlers, and on x86 the register
  tiles once per instruction set (``train/native/csrc/conv_isa.h``)."""
  sources = [Source(CSRC / "conv_cpu.cc")]
  if platform.machine().lower() in ("x86_64", "amd64"):
    tiles = CSRC / "conv_tiles_x86.cc"
    sources += [
        Source(tiles, ("-mavx2", "-mfma")),
        Source(tiles, ("-mavx512f",)),
    ]
  return sources


def conv_library() -> Path | None:
  """The compiled convolution kernels (``csrc/conv_cpu.cc``), built if need be.

  Returns:
    The library's path; None without a C++ compiler or with
    ``GBN_CONV_NATIVE=0``.

  Raises:
    BuildFailed: the compiler failed (its log is named).
    OSError: the cache folder cannot be written.
  """
  setting = os.environ.get(CONV_NATIVE_ENV, "").strip().lower()
  if setting in ("0", "false", "no", "off"):
    return None
  return build(
      "conv_cpu",
      conv_sources(),
      CONV_FLAGS,
      include_dirs=[jax.ffi.include_dir()],
  )
