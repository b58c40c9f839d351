"""train.native.build: the training suite's C++ kernels, compiled on first use.

A tiny library built through a compiler wrapper that counts its compiles:
built once and reused, by threads at once too (the file lock), rebuilt when a
source changes, a failure raised with its log and not retried. Then the
convolution's fallbacks, in fresh processes (``native_available`` is cached
per process): no compiler or ``GBN_CONV_NATIVE=0`` is XLA's convolution
without a word, a failing compiler one warning naming its log. And a
library that is found but does not load: one warning per library.
"""

from __future__ import annotations

from concurrent import futures
import ctypes
import json
import os
import pathlib
import stat
import textwrap

import pytest

from gbn_jax._selection import native
from train.native import build as native_build

from tests.helpers.process import run_python

needs_compiler = pytest.mark.skipif(
    native_build.compiler() is None, reason="no C++ compiler"
)


def _wrapper(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """A ``$CXX`` that runs the real compiler and logs each compile (``-c``)."""
  count = tmp_path / "compiles"
  wrapper = tmp_path / "cxx"
  wrapper.write_text(
      "#!/bin/sh\n"
      f'case " $* " in *" -c "*) echo x >> "{count}";; esac\n'
      f'exec "{native_build.compiler()}" "$@"\n'
  )
  wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
  return wrapper, count


def _compiles(count: pathlib.Path) -> int:
  return len(count.read_text().split()) if count.exists() else 0


def _answer_source(folder: pathlib.Path, value: int) -> native_build.Source:
  folder.mkdir(exist_ok=True)
  path = folder / "answer.cc"
  path.write_text(f'extern "C" int answer() {{ return {value}; }}\n')
  return native_build.Source(path)


def _build(source, root, flags=("-O1", "-fPIC")):
  return native_build.build("answer", [source], flags, root=root)


def _answer(library: pathlib.Path) -> int:
  return ctypes.CDLL(str(library)).answer()


@needs_compiler
def test_a_library_is_built_once_and_rebuilt_when_its_source_changes(
    tmp_path, monkeypatch
):
  wrapper, count = _wrapper(tmp_path)
  monkeypatch.setenv("CXX", str(wrapper))
  source = _answer_source(tmp_path / "src", 42)
  library = _build(source, tmp_path / "cache")
  assert _compiles(count) == 1 and _answer(library) == 42
  assert _build(source, tmp_path / "cache") == library
  assert _compiles(count) == 1  # found, not compiled again
  log = (library.parent / "build.log").read_text()
  assert f"-c {source.path}" in log and "(exit status 0)" in log
  changed = _build(_answer_source(tmp_path / "src", 7), tmp_path / "cache")
  assert changed.parent != library.parent and _compiles(count) == 2
  assert _answer(changed) == 7
  # Other flags are another build too.
  _build(source, tmp_path / "cache", flags=("-O2", "-fPIC"))
  assert _compiles(count) == 3


@needs_compiler
def test_builds_at_once_compile_once(tmp_path, monkeypatch):
  wrapper, count = _wrapper(tmp_path)
  monkeypatch.setenv("CXX", str(wrapper))
  source = _answer_source(tmp_path / "src", 5)
  with futures.ThreadPoolExecutor(4) as pool:
    built = list(pool.map(lambda _: _build(source, tmp_path / "c"), range(4)))
  assert len(set(built)) == 1 and _compiles(count) == 1
  assert _answer(built[0]) == 5
  # Nothing left behind but the library, its log and the lock.
  assert sorted(p.name for p in built[0].parent.iterdir()) == [
      "answer.so",
      "build.log",
      "lock",
  ]


@needs_compiler
def test_a_failed_build_raises_with_its_log_and_is_not_retried(
    tmp_path, monkeypatch
):
  wrapper, count = _wrapper(tmp_path)
  monkeypatch.setenv("CXX", str(wrapper))
  broken = tmp_path / "src" / "broken.cc"
  broken.parent.mkdir()
  broken.write_text("int f( {\n")
  source = native_build.Source(broken)
  with pytest.raises(native_build.BuildFailed) as first:
    _build(source, tmp_path / "cache")
  assert "broken.cc" in first.value.output and "error" in first.value.output
  log = first.value.log.read_text()
  assert f"-c {broken}" in log and first.value.output in log
  with pytest.raises(native_build.BuildFailed, match="earlier") as again:
    _build(source, tmp_path / "cache")
  assert again.value.output == first.value.output
  assert _compiles(count) == 1
  assert not list(first.value.log.parent.glob("*.so"))


def test_no_compiler_builds_nothing(tmp_path, monkeypatch):
  assert native_build.compiler({"PATH": str(tmp_path)}) is None
  assert native_build.compiler({"CXX": str(tmp_path / "missing")}) is None
  monkeypatch.setenv("CXX", str(tmp_path / "missing"))
  assert _build(_answer_source(tmp_path, 1), tmp_path / "cache") is None
  assert not (tmp_path / "cache").exists()


def test_the_cache_follows_xdg_cache_home(tmp_path):
  assert native_build.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == (
      tmp_path / "gbn_jax" / "native"
  )
  home = pathlib.Path(os.path.expanduser("~"))
  assert native_build.cache_dir({}) == home / ".cache" / "gbn_jax" / "native"


# In a fresh process: whether the kernels loaded, the warnings, and whether
# a CPU program holds XLA's convolution.
_CONV_PROCESS = """
import json, warnings
import jax, jax.numpy as jnp
from train.native import convolution
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  loaded = [convolution.native_available(), convolution.native_available()]
x = jnp.ones((1, 4, 4, 8))
text = jax.jit(convolution.conv).lower(x, jnp.ones((3, 3, 8, 8))).as_text()
print(json.dumps({"loaded": loaded, "xla": "stablehlo.convolution" in text,
                  "warnings": [str(w.message) for w in caught]}))
"""


def _conv_process(tmp_path, **env) -> dict:
  env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
  return json.loads(run_python(_CONV_PROCESS, env, drop=["GBN_CONV_NATIVE"]))


def test_without_a_compiler_the_convolutions_are_xla_s_without_a_word(
    tmp_path,
):
  got = _conv_process(tmp_path, CXX=str(tmp_path / "missing"))
  assert got == {"loaded": [False, False], "xla": True, "warnings": []}
  assert not (tmp_path / "cache").exists()


@needs_compiler
def test_gbn_conv_native_0_builds_nothing(tmp_path):
  got = _conv_process(tmp_path, GBN_CONV_NATIVE="0")
  assert got == {"loaded": [False, False], "xla": True, "warnings": []}
  assert not (tmp_path / "cache").exists()


def test_a_failing_compiler_warns_once_naming_its_log(tmp_path):
  failing = tmp_path / "failing-cxx"
  failing.write_text("#!/bin/sh\necho 'no such compiler' >&2\nexit 3\n")
  failing.chmod(failing.stat().st_mode | stat.S_IXUSR)
  got = _conv_process(tmp_path, CXX=str(failing))
  assert got["loaded"] == [False, False] and got["xla"]
  (warning,) = got["warnings"]
  logs = list((tmp_path / "cache").rglob("build.log"))
  assert len(logs) == 1 and str(logs[0]) in warning
  assert (
      "failed to build" in warning and "no such compiler" in logs[0].read_text()
  )


# A compiled extension that is found but does not load: both libraries at
# once, each warning once (the library's alone is in
# tests/gbn_jax/test_export_lowering.py).
_BROKEN = textwrap.dedent("""
    import json, pathlib, sys, warnings
    from gbn_jax._selection import native
    from train.native import build as native_build, convolution
    native.library_path = lambda: sys.argv[1]
    native_build.conv_library = lambda: pathlib.Path(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      loaded = [native.available(), native.available(),
                convolution.native_available(), convolution.native_available()]
    print(json.dumps({"loaded": loaded, "warnings": [
        [w.category.__name__, str(w.message)] for w in caught]}))
""")


def test_broken_extensions_warn_once_naming_path_and_error(tmp_path):
  bogus = tmp_path / "_kth_cpu.so"
  bogus.write_bytes(b"")  # found, but not a shared object
  out = json.loads(
      run_python(_BROKEN, args=[str(bogus)], drop=[native.LIBRARY_ENV])
  )
  assert out["loaded"] == [False] * 4
  assert len(out["warnings"]) == 2, out  # once per library
  for (category, message), what in zip(
      out["warnings"], ("selection kernel", "convolution kernels")
  ):
    assert category == "RuntimeWarning"
    assert what in message and str(bogus) in message
    assert "not load (" in message and "too short" in message  # dlopen's error
