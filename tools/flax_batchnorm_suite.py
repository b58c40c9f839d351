"""Runs flax's own BatchNorm tests on ``GBatchNorm(..., measure='sd')``, and
its LayerNorm, GroupNorm and InstanceNorm tests on ``GLayerNorm``,
``GGroupNorm`` and ``GInstanceNorm`` (``--layers`` narrows the set).

The README promises that ``GBatchNorm(measure='sd')`` keeps every field,
default and behaviour of flax's BatchNorm. This script checks it with flax's
own tests, of the flax version installed (pinned in ``.ci/constraints.txt``),
without copying them into this repository:

1. ``pip download flax==<installed> --no-binary :all: --no-deps`` into a
   temporary directory (or ``--sdist PATH`` / ``--src DIR``) and unpack it.
2. In every ``tests/**/*_test.py`` that mentions ``BatchNorm``, rewrite each
   construction of flax's BatchNorm, and nothing else:

   * ``nn.BatchNorm(ARGS)``, ``linen.BatchNorm(ARGS)``,
     ``nn.normalization.BatchNorm(ARGS)`` ->
     ``gbn_jax.linen.GBatchNorm(ARGS, measure='sd')``
   * ``nnx.BatchNorm(ARGS)`` -> ``gbn_jax.nnx.GBatchNorm(ARGS, measure='sd')``
   * the class passed as a value to be constructed later (e.g. in a
     parameter list): ``nnx.BatchNorm`` ->
     ``functools.partial(gbn_jax.nnx.GBatchNorm, measure='sd')`` (likewise
     for linen)
   * left alone: ``isinstance(..., nnx.BatchNorm)``,
     ``self.assertIsInstance(..., nnx.BatchNorm)`` and friends (GBatchNorm is
     a subclass), strings and comments.

   ``import functools, gbn_jax.linen, gbn_jax.nnx; `` is put in front of
   the first import of each rewritten file, on its line, so that line numbers
   in tracebacks are flax's.
3. Select the tests that build a BatchNorm: test functions whose body or
   decorators contain one of the rewrites, or use a module-level class or
   function that (transitively) does, or whose class's ``setUp`` does.
4. Run them with pytest (``XLA_FLAGS=--xla_force_host_platform_device_count=4``
   as flax's CI does), recording which tests constructed a GBatchNorm, and
   re-run any failure on unmodified flax to tell GBatchNorm's failures from
   flax's own.

5. Run the tests of :data:`EXPECTED_DIFFERENCES` that failed once more with
   linen's rewrites to ``gbn_jax.linen.BatchNorm(ARGS, measure='sd')``
   (GBatchNorm under flax's class name, hence flax's auto-names): they must
   pass, so that the difference is the auto-name alone.

Exit status 0 only if every test that built a GBatchNorm passed or is one
of :data:`EXPECTED_DIFFERENCES`, and at least :data:`MIN_TESTS` tests built
one (so that a change in flax's layout cannot make it pass by running
nothing). Tests that fail on plain flax too are reported as such, and do
not fail the run. The selection is by function, so a parameterized test
that also runs other layers (nnx's ``linear_test.py`` lists every layer)
runs them all; only the cases that constructed a GBatchNorm are counted.

The other layers are swapped alike (``nn.LayerNorm(ARGS)`` ->
``gbn_jax.linen.GLayerNorm(ARGS, measure='sd')``, and so on), each test is
counted for every layer it built (recorded at run time), and each layer
needs :data:`MIN_TESTS` of its own. flax 0.12.8 (Python 3.11), the
per-example layers alone: 79 tests built one, all pass (GLayerNorm 28,
GGroupNorm 26, GInstanceNorm 30; some build two).

BatchNorm, flax 0.12.8 (Python 3.11): 160 tests selected, 127 built a GBatchNorm: 126
pass, 1 expected difference (``test_module_reuse``: the auto-name
``GBatchNorm_0``; passes with ``gbn_jax.linen.BatchNorm``); 1 skipped by
flax itself on Python 3.11 (``test_cloud_pickle``); 32 are other layers. Modules whose imports are not installed are skipped by name and
listed; ``cloudpickle`` (a test-only dependency of flax) is installed into a
temporary ``--target`` directory, not into the environment.

Usage::

  python tools/flax_batchnorm_suite.py            # downloads the sdist
  python tools/flax_batchnorm_suite.py --src /tmp/flax-0.12.8
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

#: flax's layer -> ours (the same name in gbn_jax.linen and gbn_jax.nnx).
LAYERS = {
    "BatchNorm": "GBatchNorm",
    "LayerNorm": "GLayerNorm",
    "GroupNorm": "GGroupNorm",
    "InstanceNorm": "GInstanceNorm",
}

#: Per layer, fewer tests that built ours than this is a failure (see the
#: module docstring for flax 0.12.8's counts).
MIN_TESTS = {
    "BatchNorm": 120,
    "LayerNorm": 25,
    "GroupNorm": 23,
    "InstanceNorm": 27,
}

#: Tests that fail by design, with the reason (matched on the nodeid).
EXPECTED_DIFFERENCES = {
    "tests/linen/summary_test.py::SummaryTest::test_module_reuse": (
        "linen auto-names a submodule after its class: GBatchNorm_0, not"
        " BatchNorm_0 (pass name='BatchNorm_0', or use"
        " gbn_jax.linen.BatchNorm, to keep flax's names)"
    ),
}

#: Test-only dependencies of flax's tests, installed into a temporary target.
TEST_DEPS = ("cloudpickle",)

_LINEN_BASES = {
    "nn",
    "linen",
    "nn.normalization",
    "linen.normalization",
    "flax.linen",
}
_NNX_BASES = {"nnx", "flax.nnx"}
_TYPE_CHECKS = {"isinstance", "issubclass", "type"}
_TYPE_ASSERTS = {
    "assertIsInstance",
    "assertNotIsInstance",
    "assertIsSubclass",
    "assertNotIsSubclass",
}

_CONFTEST = r"""
import json, os
import pytest
from gbn_jax import _normalization

# Alike tests/gbn_jax/selection/test_radix_sums.py::_SHARD_MAP_SCRIPT: a call counter in
# another process's source; neither can import the other's.
_built = []
_real = _normalization.bind_measure


def _counting(*args, **kwargs):
  # Called once by every layer's constructor (linen and nnx) and call,
  # with the layer's class name (GBatchNorm's by default); only records it,
  # and returns what the real one returns.
  _built.append(kwargs.get("layer", "GBatchNorm"))
  return _real(*args, **kwargs)


_normalization.bind_measure = _counting
_results = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  entry = _results.setdefault(item.nodeid, {"outcome": "passed", "built": False})
  if report.failed:
    entry["outcome"] = "failed"
  elif report.skipped and entry["outcome"] != "failed":
    entry["outcome"] = "skipped"


@pytest.fixture(autouse=True)
def _gbn_track(request):
  _built.clear()
  yield
  entry = _results.setdefault(request.node.nodeid,
                              {"outcome": "passed", "built": False})
  entry["built"] = sorted(set(_built))


def pytest_sessionfinish(session):
  path = os.environ.get("GBN_SUITE_RESULTS")
  if path:
    path += "." + os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(path, "w") as f:
      json.dump(_results, f)
"""


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    base = _dotted(node.value)
    return None if base is None else f"{base}.{node.attr}"
  return None


def _flavour(node: ast.AST, layers=("BatchNorm",)) -> str | None:
  """'linen' or 'nnx' if ``node`` is a reference to one of flax's
  ``layers``."""
  if not (isinstance(node, ast.Attribute) and node.attr in layers):
    return None
  base = _dotted(node.value)
  if base in _LINEN_BASES:
    return "linen"
  if base in _NNX_BASES:
    return "nnx"
  return None


class _Edit:
  """A text replacement at (line, col) spans of the original source."""

  def __init__(self, start, end, text, what):
    self.start, self.end, self.text, self.what = start, end, text, what


def _offsets(source: str) -> list[int]:
  out, pos = [0], 0
  for line in source.splitlines(keepends=True):
    pos += len(line)
    out.append(pos)
  return out


def rewrite(
    source: str,
    linen_class: str = "GBatchNorm",
    layers: tuple[str, ...] = ("BatchNorm",),
) -> tuple[str, list[str], dict[str, set[int]], ast.Module]:
  """(rewritten source, one line per rewrite, per flax layer the ids of its
  rewritten nodes in the returned tree, that tree).

  ``layers`` are flax's class names to swap (:data:`LAYERS`);
  ``linen_class`` is linen's BatchNorm's replacement. Positions come from
  the AST; the text between them is kept verbatim.
  """
  _flavour_of = lambda node: _flavour(node, layers)

  def cls_of(flavour, node):
    if node.attr == "BatchNorm" and flavour == "linen":
      return linen_class
    return LAYERS[node.attr]

  tree = ast.parse(source)
  lines = _offsets(source)
  # ast columns are UTF-8 byte offsets; flax's test files are ASCII.
  pos = lambda lineno, col: lines[lineno - 1] + col
  edits: list[_Edit] = []
  handled: set[int] = set()
  by_layer: dict[str, set[int]] = {name: set() for name in layers}
  type_checked: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and (
        isinstance(node.func, ast.Name)
        and node.func.id in _TYPE_CHECKS
        or isinstance(node.func, ast.Attribute)
        and node.func.attr in _TYPE_ASSERTS
    ):
      for arg in node.args[1:]:
        for sub in ast.walk(arg):
          type_checked.add(id(sub))
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and _flavour_of(node.func):
      flavour = _flavour_of(node.func)
      f = node.func
      cls = cls_of(flavour, f)
      edits.append(
          _Edit(
              pos(f.lineno, f.col_offset),
              pos(f.end_lineno, f.end_col_offset),
              f"gbn_jax.{flavour}.{cls}",
              None,
          )
      )
      last = node.args + node.keywords
      if last:
        tail = max(last, key=lambda n: (n.end_lineno, n.end_col_offset))
        at = pos(tail.end_lineno, tail.end_col_offset)
        extra = ", measure='sd'"
      else:
        at = pos(f.end_lineno, f.end_col_offset) + 1  # after '('
        assert source[at - 1] == "(", source[at - 5 : at + 5]
        extra = "measure='sd'"
      edits.append(
          _Edit(
              at,
              at,
              extra,
              f"line {node.lineno}: {_dotted(f)}(...) ->"
              f" gbn_jax.{flavour}.{cls}(..., measure='sd')",
          )
      )
      handled.add(id(f))
      by_layer[f.attr].add(id(f))
  for node in ast.walk(tree):
    flavour = _flavour_of(node)
    if flavour and id(node) not in handled and id(node) not in type_checked:
      cls = cls_of(flavour, node)
      edits.append(
          _Edit(
              pos(node.lineno, node.col_offset),
              pos(node.end_lineno, node.end_col_offset),
              f"functools.partial(gbn_jax.{flavour}.{cls}, measure='sd')",
              f"line {node.lineno}: {_dotted(node)} (as a value) ->"
              f" functools.partial(gbn_jax.{flavour}.{cls},"
              " measure='sd')",
          )
      )
      handled.add(id(node))
      by_layer[node.attr].add(id(node))
  if edits:
    # The imports go in front of the first import, on its line, so that line
    # numbers in tracebacks stay flax's (class bodies need them at import).
    first = next(
        n
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
    )
    at = pos(first.lineno, 0)
    edits.append(
        _Edit(at, at, "import functools, gbn_jax.linen, gbn_jax.nnx; ", None)
    )
  out = source
  for e in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
    out = out[: e.start] + e.text + out[e.end :]
  whats = sorted((e.start, e.what) for e in edits if e.what)
  return out, [what for _, what in whats], by_layer, tree


def _uses(node: ast.AST, names: set[str], refs: set[int]) -> bool:
  for sub in ast.walk(node):
    if id(sub) in refs:
      return True
    if isinstance(sub, ast.Name) and sub.id in names:
      return True
  return False


def select(
    source: str, refs: set[int], tree: ast.Module
) -> list[tuple[str | None, str]]:
  """(class or None, test function name) of the tests that build a BatchNorm."""
  defs = {
      n.name: n
      for n in tree.body
      if isinstance(n, (ast.ClassDef, ast.FunctionDef))
  }
  carrying: set[str] = set()
  changed = True
  while changed:
    changed = False
    for name, node in defs.items():
      if name in carrying or name.startswith("Test") or name.endswith("Test"):
        continue
      if _uses(node, carrying, refs):
        carrying.add(name)
        changed = True
  selected = []
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
      if _uses(node, carrying, refs):
        selected.append((None, node.name))
    elif isinstance(node, ast.ClassDef):
      methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
      setup = any(
          m.name in ("setUp", "setUpClass") and _uses(m, carrying, refs)
          for m in methods
      )
      for m in methods:
        if m.name.startswith("test") and (setup or _uses(m, carrying, refs)):
          selected.append((node.name, m.name))
  return selected


def _unpack(args, work: pathlib.Path) -> pathlib.Path:
  if args.src:
    return pathlib.Path(args.src)
  sdist = args.sdist
  if sdist is None:
    version = importlib.metadata.version("flax")
    print(f"downloading the flax {version} sdist from PyPI ...", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            f"flax=={version}",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(work),
        ],
        check=True,
    )
    sdist = next(work.glob("flax-*.tar.gz"))
  with tarfile.open(sdist) as tar:
    tar.extractall(work, filter="data")
  return next(
      p for p in work.iterdir() if p.is_dir() and p.name.startswith("flax-")
  )


def _missing_imports(source: str, extra_path: list[str]) -> list[str]:
  missing = []
  for node in ast.parse(source).body:
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module]
    for name in names:
      top = name.split(".")[0]
      found = importlib.util.find_spec(top) is not None or any(
          (pathlib.Path(p) / top).exists() for p in extra_path
      )
      if not found:
        missing.append(top)
  return missing


def _run_pytest(
    root: pathlib.Path,
    ids: list[str],
    results: pathlib.Path,
    env: dict[str, str],
) -> dict:
  (root / "pytest.ini").write_text("[pytest]\n")
  workers = []
  if importlib.util.find_spec("xdist") and (os.cpu_count() or 1) >= 4:
    workers = ["-n", str(min(8, os.cpu_count()))]
  cmd = [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      *workers,
      "--import-mode=importlib",
      "-o",
      "addopts=",
      "-W",
      "ignore",
      "--rootdir",
      str(root),
      "-c",
      str(root / "pytest.ini"),
      "--tb=short",
      "-rf",
      *ids,
  ]
  env = {**env, "GBN_SUITE_RESULTS": str(results)}
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
  merged = {}
  for part in results.parent.glob(results.name + ".*"):
    merged.update(json.loads(part.read_text()))
  if not merged or proc.returncode not in (0, 1):
    print(proc.stdout[-5000:], proc.stderr[-5000:])
    raise SystemExit(f"pytest did not run (exit {proc.returncode}).")
  return merged, proc


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--sdist", help="a flax sdist .tar.gz (default: download)"
  )
  parser.add_argument("--src", help="an unpacked flax source tree")
  parser.add_argument(
      "-v",
      "--verbose",
      action="store_true",
      help="list every rewrite and every test",
  )
  parser.add_argument(
      "--layers",
      nargs="+",
      choices=sorted(LAYERS),
      default=list(LAYERS),
      help="flax's layers to swap (default: all)",
  )
  args = parser.parse_args(argv)
  layers = tuple(args.layers)

  with tempfile.TemporaryDirectory(prefix="gbn_flax_suite_") as tmp:
    work = pathlib.Path(tmp)
    src = _unpack(args, work)
    tests_root = work / "swapped"
    plain_root = work / "plain"
    names_root = work / "names"
    deps = work / "deps"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    missing_deps = [d for d in TEST_DEPS if importlib.util.find_spec(d) is None]
    if missing_deps:
      proc = subprocess.run(
          [
              sys.executable,
              "-m",
              "pip",
              "install",
              "-q",
              "--target",
              str(deps),
              *missing_deps,
          ],
          capture_output=True,
          text=True,
      )
      if proc.returncode == 0:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(deps)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        print(
            f"installed flax's test dependencies {missing_deps} into a"
            " temporary --target directory"
        )
      else:
        print(f"could not install {missing_deps}: {proc.stderr[-500:]}")
    extra_path = [str(deps)] if deps.exists() else []

    ids, skipped_modules, n_rewrites = [], {}, 0
    for path in sorted((src / "tests").rglob("*_test.py")):
      source = path.read_text()
      if not any(name in source for name in layers):
        continue
      rel = path.relative_to(src)
      new, whats, by_layer, tree = rewrite(source, layers=layers)
      if not whats:
        continue
      refs = set().union(*by_layer.values())
      tests = select(source, refs, tree)
      missing = _missing_imports(source, extra_path)
      print(
          f"{rel}: {len(whats)} rewrite(s), {len(tests)} test function(s)"
          f" that build one of {', '.join(layers)}"
      )
      for what in whats:
        print(f"    {what}")
      n_rewrites += len(whats)
      if missing:
        skipped_modules[str(rel)] = missing
        continue
      named = rewrite(source, linen_class="BatchNorm", layers=layers)[0]
      for root, text in (
          (tests_root, new),
          (plain_root, source),
          (names_root, named),
      ):
        out = root / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
      for cls, name in tests:
        nodeid = f"{rel}::{cls}::{name}" if cls else f"{rel}::{name}"
        ids.append(nodeid)
    if not ids:
      raise SystemExit(
          f"no test that builds one of {layers} was found under {src}/tests."
      )
    (tests_root / "conftest.py").write_text(_CONFTEST)
    (plain_root / "conftest.py").write_text(_CONFTEST)
    if skipped_modules:
      print("SKIPPED modules (imports not installed):")
      for rel, missing in skipped_modules.items():
        print(f"    {rel}: {', '.join(missing)}")

    # absl's parameterized tests are collected as name0, name1, ...: select
    # by the class and the function's name, not pytest's nodeid.
    wanted = {tuple(i.split("::")) for i in ids}
    origins: dict[str, list[str]] = {}
    for path in sorted(tests_root.rglob("*_test.py")):
      tree = ast.parse(path.read_text())
      origins[str(path.relative_to(tests_root))] = sorted(
          {
              n.name
              for n in ast.walk(tree)
              if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
          }
      )
    select_plugin = (
        f"_WANTED = {sorted(wanted)!r}\n"
        f"_ORIGINS = {origins!r}\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "  wanted = {tuple(w) for w in _WANTED}\n"
        "  keep = []\n"
        "  for item in items:\n"
        "    *head, name = item.nodeid.split('::')\n"
        "    # The longest test function name that the item's name extends.\n"
        "    origin = max((o for o in _ORIGINS.get(head[0], ())\n"
        "                  if name.startswith(o)), key=len, default=name)\n"
        "    if (*head, origin) in wanted:\n"
        "      keep.append(item)\n"
        "  items[:] = keep\n"
    )
    (names_root / "conftest.py").write_text(_CONFTEST)
    for root in (tests_root, plain_root, names_root):
      with open(root / "conftest.py", "a") as f:
        f.write("\n" + select_plugin)

    files = sorted({i.split("::")[0] for i in ids})
    print(
        f"\nrunning {len(ids)} selected test functions from {len(files)}"
        f" modules on {', '.join(LAYERS[n] for n in layers)} ...",
        flush=True,
    )
    results, proc = _run_pytest(tests_root, files, work / "swapped.json", env)
    # A test counts if it built one of ours, or was skipped by flax before
    # it could (e.g. test_cloud_pickle on Python 3.11); the rest of the
    # selection are other layers sharing a parameterized test.
    skipped = sorted(k for k, v in results.items() if v["outcome"] == "skipped")
    built = {
        k: v
        for k, v in results.items()
        if v["built"] and v["outcome"] != "skipped"
    }
    unbuilt = sorted(
        k
        for k, v in results.items()
        if not v["built"] and v["outcome"] != "skipped"
    )
    outcome = lambda o: sorted(k for k, v in built.items() if v["outcome"] == o)
    passed, failed = outcome("passed"), outcome("failed")
    print(
        f"\n{len(built)} tests built one of ours: {len(passed)} passed,"
        f" {len(failed)} failed; {len(skipped)} skipped by flax itself"
    )
    # Per layer: the tests that built it (a test may build several).
    per_layer = {}
    for name in layers:
      ran = [k for k, v in built.items() if LAYERS[name] in v["built"]]
      ok = [k for k in ran if built[k]["outcome"] == "passed"]
      per_layer[name] = (len(ran), len(ok))
      print(f"    {LAYERS[name]}: {len(ran)} tests built it, {len(ok)} passed")
    for k in skipped:
      print(f"    skipped: {k}")
    if unbuilt:
      print(
          f"{len(unbuilt)} selected tests built none (other layers in a"
          " shared parameter list; not counted)"
      )
      if args.verbose:
        for k in unbuilt:
          print(f"    {k}")
    if args.verbose:
      for k in passed:
        print(f"  PASSED {k}")
    plain = {}
    if failed:
      print(proc.stdout[-8000:])
      plain, _ = _run_pytest(plain_root, failed, work / "plain.json", env)
    status = 0
    for k in failed:
      base = re.sub(r"(::test\w*?)\d+$", r"\1", k)
      expected = EXPECTED_DIFFERENCES.get(k) or EXPECTED_DIFFERENCES.get(base)
      on_flax = plain.get(k, {}).get("outcome", "not run")
      if expected:
        print(f"  EXPECTED DIFFERENCE {k}: {expected}")
      elif on_flax == "failed":
        print(f"  FAILED ON PLAIN FLAX TOO {k}")
      else:
        print(f"  FAILED {k} (on plain flax: {on_flax})")
        status = 1
    named_failures = [k for k in failed if k in EXPECTED_DIFFERENCES]
    if named_failures:
      # The same tests with gbn_jax.linen.BatchNorm (GBatchNorm under flax's
      # class name) for linen: the difference must be the name alone.
      named, _ = _run_pytest(
          names_root, named_failures, work / "names.json", env
      )
      for k in named_failures:
        result = named.get(k, {}).get("outcome", "not run")
        print(
            f"  with gbn_jax.linen.BatchNorm(..., measure='sd') instead:"
            f" {k} {result}"
        )
        if result != "passed":
          status = 1
    for k, reason in EXPECTED_DIFFERENCES.items():
      if k in passed:
        print(
            f"  note: {k} passed; the expected difference ({reason}) is"
            " gone: drop it from EXPECTED_DIFFERENCES"
        )
    for name, (ran, _) in per_layer.items():
      if ran < MIN_TESTS[name]:
        print(
            f"ERROR: only {ran} tests built a {LAYERS[name]}; expected at"
            f" least {MIN_TESTS[name]}: the selection or flax's layout"
            " changed."
        )
        status = 1
    print(
        f"\n{n_rewrites} rewrites; {len(built)} tests on"
        f" {', '.join(LAYERS[n] for n in layers)}:"
        f" {len(passed)} passed, {len(failed)} failed"
        f" ({sum(k in EXPECTED_DIFFERENCES for k in failed)} expected),"
        f" {len(skipped)} skipped by flax; {len(skipped_modules)} modules skipped"
        f" for missing imports; exit {status}"
    )
    return status


if __name__ == "__main__":
  sys.exit(main())
