"""The package's shape: acyclic imports, no deferred imports in the
selection package, no module over the size limit, no tunable globals; and the
same caps and acyclic imports for train/, benchmarks/ and tests/."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import gbn_jax
from gbn_jax._selection import dispatch
from gbn_jax._selection import native

from tests.helpers.graph import find_cycle
from tests.helpers.graph import imported_modules
from tests.helpers.graph import module_files

PACKAGE = pathlib.Path(gbn_jax.__file__).parent
MAX_LINES = 550
# Modules over MAX_LINES whose split is still to come; each entry says why.
OVER_LIMIT: dict[str, str] = {}


def _graph(*roots: pathlib.Path) -> dict[str, set[str]]:
  """Module-level imports (executed at import) between the modules of the
  packages at ``roots`` (default: gbn_jax)."""
  modules = module_files(*roots or (PACKAGE,))
  graph = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    edges = set()
    for node in tree.body:  # top level only: function bodies run later
      for sub in (
          ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]
      ):
        edges |= imported_modules(name, sub, modules)
    graph[name] = edges
  return graph


def test_module_imports_are_acyclic():
  graph = _graph()
  assert (
      "gbn_jax._selection.dispatch" in graph["gbn_jax._quantiles"]
  )  # the walk sees edges
  assert find_cycle(graph) is None, find_cycle(graph)


def test_cycle_finder_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [
      "a",
      "b",
      "c",
      "a",
  ]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_selection_layers_point_down():
  # common/config at the bottom; backends above them; the dispatcher above the
  # backends; fused sums above the dispatcher; quantiles and measures on top.
  rank = {
      "config": 0,
      "common": 0,
      "reductions": 1,
      "sort": 2,
      "passes": 2,
      "loop": 3,
      "native": 2,
      "radix": 3,
      "bracket": 4,
      "pallas": 4,
      "dispatch": 5,
      "fused": 6,
  }
  graph = _graph()
  for module, edges in graph.items():
    if not module.startswith("gbn_jax._selection."):
      continue
    here = rank[module.rsplit(".", 1)[1]]
    for target in edges:
      assert target.startswith("gbn_jax._selection."), (module, target)
      assert rank[target.rsplit(".", 1)[1]] < here, (module, target)


def test_no_deferred_imports_in_the_selection_code():
  # An import inside a function is how a circle gets dodged; the selection
  # package and the quantiles on it have none (of anything).
  paths = sorted((PACKAGE / "_selection").glob("*.py")) + [
      PACKAGE / "_quantiles.py"
  ]
  deferred = []
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        deferred += [
            f"{path.name}:{sub.lineno}"
            for sub in ast.walk(node)
            if isinstance(sub, (ast.Import, ast.ImportFrom))
        ]
  assert not deferred, deferred


def test_no_module_over_the_size_limit():
  over = {
      path.relative_to(PACKAGE).as_posix(): n
      for path in PACKAGE.rglob("*.py")
      if (n := len(path.read_text().splitlines())) > MAX_LINES
  }
  assert set(over) <= set(OVER_LIMIT), over
  # The exceptions must still be needed (a split one comes off the list).
  assert set(OVER_LIMIT) <= set(over), set(OVER_LIMIT) - set(over)


@pytest.mark.parametrize("name", ["DEFAULT_METHOD", "BRACKET_SIGMAS"])
def test_tunables_are_not_module_globals(name):
  # They were read at trace time, so a jitted function ignored later changes;
  # gbn_jax.selection_config scopes them inside the trace context instead.
  for module in module_files(PACKAGE):
    tree = ast.parse(module_files(PACKAGE)[module].read_text())
    assigned = {
        t.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (
            node.targets if isinstance(node, ast.Assign) else [node.target]
        )
        if isinstance(t, ast.Name)
    }
    assert name not in assigned, module
  assert not hasattr(dispatch, name) and not hasattr(native, name)


REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
BENCHMARK_MAX_LINES = 700


def test_no_benchmark_module_over_the_size_limit():
  # A tripwire: a module this long has more than one concept in it.
  sizes = {
      path.relative_to(BENCHMARKS).as_posix(): len(
          path.read_text().splitlines()
      )
      for path in sorted(BENCHMARKS.rglob("*.py"))
  }
  assert "step/bench_lenet_step.py" in sizes, sorted(sizes)
  over = {name: n for name, n in sizes.items() if n > BENCHMARK_MAX_LINES}
  assert not over, over


def test_benchmarks_share_one_machine_info():
  # Every benchmark's JSON records its machine in one shape.
  defined = [
      path.name
      for path in sorted(BENCHMARKS.rglob("*.py"))
      for node in ast.walk(ast.parse(path.read_text()))
      if isinstance(node, ast.FunctionDef) and node.name == "machine_info"
  ]
  assert defined == ["timing.py"], defined


TRAIN = REPO / "train"
TESTS = REPO / "tests"
TRAIN_MAX_LINES = 500
TEST_MAX_LINES = 1000
# Modules over their cap whose split is still to come; each entry says why.
TRAIN_OVER_LIMIT: dict[str, str] = {}
TEST_OVER_LIMIT: dict[str, str] = {}


def _over(root: pathlib.Path, cap: int) -> dict[str, int]:
  """Files under ``root`` longer than ``cap`` lines -> their lengths."""
  return {
      path.relative_to(root).as_posix(): n
      for path in sorted(root.rglob("*.py"))
      if (n := len(path.read_text().splitlines())) > cap
  }


@pytest.mark.parametrize(
    "root, cap, allowed",
    [
        (TRAIN, TRAIN_MAX_LINES, TRAIN_OVER_LIMIT),
        (TESTS, TEST_MAX_LINES, TEST_OVER_LIMIT),
    ],
    ids=["train", "tests"],
)
def test_no_train_or_test_module_over_the_size_limit(root, cap, allowed):
  over = _over(root, cap)
  assert set(over) <= set(allowed), {
      name: n for name, n in over.items() if name not in allowed
  }
  # The exceptions must still be needed (a split one comes off the list).
  assert set(allowed) <= set(over), set(allowed) - set(over)


def test_size_check_sees_long_files(tmp_path):
  (tmp_path / "short.py").write_text("x = 1\n" * 3)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 4)
  assert _over(tmp_path, 3) == {"sub/long.py": 4}


def test_train_and_benchmark_imports_are_acyclic():
  # One graph over both: benchmarks import train, so a circle could span them.
  graph = _graph(TRAIN, BENCHMARKS)
  assert "train.configs" in graph["train.main"]  # the walk sees edges
  assert "train.loop.trainer" in graph["benchmarks.step.bench_resnet_step"]
  assert find_cycle(graph) is None, find_cycle(graph)


def _absolute_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """``(line, module)`` for each absolute import in ``path``, deferred or
  not (``from a import b`` counts as ``a``)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      found.append((node.lineno, node.module or ""))
  return found


def test_library_does_not_import_train_or_benchmarks():
  # gbn_jax is the installed package; train/ and benchmarks/ are not in the
  # distributions, so no import of them anywhere in it, deferred or not.
  found = [
      f"{name}:{line} {target}"
      for name, path in module_files(PACKAGE).items()
      for line, target in _absolute_imports(path)
      if target.split(".")[0] in ("train", "benchmarks")
  ]
  assert not found, found


# The one module of tests/ that starts processes: one place for
# their environment, working folder and captured output.
PROCESS_MODULES = {"helpers/process.py"}


def _subprocess_importers(root: pathlib.Path) -> set[str]:
  """Files under ``root`` that import ``subprocess``, deferred or not."""
  return {
      path.relative_to(root).as_posix()
      for path in root.rglob("*.py")
      if any(
          m.split(".")[0] == "subprocess" for _, m in _absolute_imports(path)
      )
  }


def test_only_the_process_helpers_import_subprocess():
  found = _subprocess_importers(TESTS)
  assert found == PROCESS_MODULES, sorted(found - PROCESS_MODULES)


def test_subprocess_check_sees_every_form_of_import(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "plain.py").write_text("import os, subprocess as sp\n")
  (tmp_path / "sub" / "deferred.py").write_text(
      "def f():\n  from subprocess import run\n"
  )
  (tmp_path / "clean.py").write_text("import os\nfrom . import subprocess\n")
  assert _subprocess_importers(tmp_path) == {"plain.py", "sub/deferred.py"}


# What a module of tests/ may import from tests/: the shared code
# (tests/helpers, conftest), never a test module (importing one runs its
# module code again under another name and ties the importer to the other's
# internals).
_SHARED_TEST_CODE = ("helpers",)
# An import statement at the start of a line, in code or in the text of a
# script a test runs in a subprocess.
_IMPORT_LINE = re.compile(
    r"^[ \t]*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+))", re.M
)


def _test_module_imports(root: pathlib.Path) -> list[str]:
  """``'file:line module'`` for each import, under ``root``, of a module of
  ``root`` that is not shared code (deferred and in script text too)."""
  local = {
      path.stem
      for path in root.rglob("*.py")
      if path.relative_to(root).parts[0] not in _SHARED_TEST_CODE
      and path.stem not in ("conftest", "__init__")
  }
  found = []
  for path in sorted(root.rglob("*.py")):
    text = path.read_text()
    for match in _IMPORT_LINE.finditer(text):
      for part in (match[1] or match[2]).split("."):  # sub.test_x too
        if part in local:
          line = text.count("\n", 0, match.start()) + 1
          found.append(f"{path.relative_to(root).as_posix()}:{line} {part}")
  return found


def test_no_test_module_imports_another():
  found = _test_module_imports(TESTS)
  assert not found, found


def test_test_import_check_sees_every_form(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "test_a.py").write_text("import os\nfrom test_b import x\n")
  (tmp_path / "sub" / "test_b.py").write_text(
      "def f():\n  import test_a as a\n"
  )
  (tmp_path / "test_c.py").write_text(
      'SCRIPT = """\nimport sys\nfrom sub.test_b import x\n"""\n'
  )
  (tmp_path / "test_d.py").write_text(
      "from helpers import reference\nfrom helpers.x import y\n"
      "import conftest\n"
  )
  (tmp_path / "helpers").mkdir()
  for name in (
      "helpers/__init__",
      "helpers/reference",
      "helpers/x",
      "conftest",
  ):
    (tmp_path / f"{name}.py").write_text("")
  assert _test_module_imports(tmp_path) == [
      "sub/test_b.py:2 test_a",
      "test_a.py:2 test_b",
      "test_c.py:3 test_b",
  ]


def test_library_uses_public_jax_only():
  # jax._src and the DO_NOT_USE names change without notice between JAX
  # releases; the library must build on what JAX documents.
  private = re.compile(r"jax\._src|DO_NOT_USE")
  found = [
      f"{path.relative_to(REPO)}:{number}"
      for path in sorted(PACKAGE.rglob("*.py"))
      for number, line in enumerate(path.read_text().splitlines(), 1)
      if private.search(line)
  ]
  assert not found, found


def test_library_text_does_not_narrate_measurements_or_history():
  # Code, comments and docstrings say what the code does and why; figures
  # measured on a machine (with their sources) belong in docs/performance.md,
  # history in the changelog and git.
  narration = {
      "hardware name": (
          r"\b(?:[ABHLV]100|H200|GH200|B200|MI\d{3}X?|EPYC|Xeon|Ryzen"
          r"|TPU ?v\d\w*)\b"
      ),
      "timing figure": (
          r"\b\d+(?:\.\d+)?(?:[-/]\d+(?:\.\d+)?)? ?(?:ms|µs|us|ns|s)\b(?!\w)"
      ),
      "speed-up figure": (
          r"(?i)~?\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?[x×]"
          r" (?:faster|slower|BatchNorm|the cost)"
      ),
      "issue reference": r"(?i)\b(?:issue|bug|PR)s? #?\d+|\(#\d+\)",
      # 7+ hex digits with a letter and a digit, not part of a 0x literal.
      "commit hash": (
          r"(?<![0-9A-Za-z_\\])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])"
          r"[0-9a-f]{7,40}\b"
      ),
      "history": (
          r"(?i)\b(?:used to|previously|formerly|no longer|as before"
          r"|(?:was|were) (?:replaced|removed|renamed|moved|changed"
          r"|rewritten|added)|(?:was|were) [\w ]{1,30}, now)\b"
      ),
  }
  patterns = {what: re.compile(p) for what, p in narration.items()}
  sources = sorted(PACKAGE.rglob("*.py")) + sorted(
      p for p in (PACKAGE / "csrc").glob("*") if p.suffix in (".cc", ".h")
  )
  found = [
      f"{path.relative_to(REPO)}:{number}: {what}: {m.group(0)!r}"
      for path in sources
      for number, line in enumerate(path.read_text().splitlines(), 1)
      for what, pattern in patterns.items()
      if (m := pattern.search(line))
  ]
  assert not found, "\n".join(found)
  # The patterns catch what they are for, and leave constants alone.
  caught = [
      "Measured on an H100",
      "0.66-2.4 ms a pass",
      "0.13 ms",
      "~60x slower",
      "(issue 36: an",
      "as in 1f6af19",
      "runs op by op as before",
      "was a loop, now a scan",
  ]
  for text in caught:
    assert any(p.search(text) for p in patterns.values()), text
  for text in ["0x80000000", "kGolden = 0.6180339887498949", "float32 x 16"]:
    assert not any(p.search(text) for p in patterns.values()), text
