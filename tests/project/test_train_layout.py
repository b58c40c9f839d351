"""train/'s layout: its sub-packages import one another in one direction.

Every import of a train module counts, at the top of a module or inside a
function (deferred). An import inside a function is allowed only for load
time (the CLIs answer ``--help`` and flag errors without loading JAX), says
so in a comment, and is listed in `DEFERRED`; it must point the allowed way
like any other, so that no deferred import hides a cycle.
"""

from __future__ import annotations

import ast
import pathlib

from tests.helpers.graph import find_cycle
from tests.helpers.graph import imported_modules
from tests.helpers.graph import module_files

TRAIN = pathlib.Path(__file__).resolve().parents[2] / "train"

# Each part of train/ (a sub-package, or a module at the top) -> the parts it
# may import. Read bottom up: the data, the native kernels and the three
# stdlib-only modules (run_files, compile_cache, config_fields: how a config
# field is declared) import nothing of train;
# models run native convolutions; configs checks model and norm names
# against the models, and a training subset against the dataset's facts;
# the loop trains a configured model on the data; the
# report reads finished runs (run_files, dataset facts: numpy and matplotlib
# only, never the training stack); a sweep expands flags into configs and
# starts training runs, writing through the loop's checkpointing; the CLIs
# sit on top.
ALLOWED: dict[str, set[str]] = {
    "run_files": set(),
    "compile_cache": set(),
    "data": set(),
    "native": {"compile_cache"},
    "model": {"native"},
    "config_fields": set(),
    "configs": {"config_fields", "data", "model"},
    "cli_flags": {"configs"},
    "loop": {"configs", "data", "model", "native", "run_files"},
    "report": {"data", "run_files"},
    "sweep": {"cli_flags", "configs", "data", "loop", "run_files"},
    "main": (
        {"cli_flags", "compile_cache", "configs", "data", "loop", "model"}
        | {"sweep"}
    ),
    "cifar": {"configs", "loop", "main"},
    "mnist": {"configs", "loop", "main"},
    "gain": {"data", "loop"},
    "curvature": {"data", "loop"},
    "plot": {"report"},
}
SUBPACKAGES = {
    "data",
    "model",
    "native",
    "loop",
    "report",
    "sweep",
    "curvature",
}

# (importing module, imported module) for every import inside a function;
# each is for load time, and a comment above it says so.
DEFERRED = {
    ("train.main", "train.data.input_pipeline"),
    ("train.main", "train.loop.checkpointing"),
    ("train.main", "train.loop.trainer"),
    ("train.main", "train.model.activations"),
}


def _targets(
    name: str, node: ast.AST, modules: dict[str, pathlib.Path]
) -> set[str]:
  """The train modules an import statement loads."""
  assert not (
      isinstance(node, ast.ImportFrom) and node.level
  ), "relative import"
  return {
      n
      for n in imported_modules(name, node, modules)
      if n.split(".")[0] == "train"
  }


def _imports() -> list[tuple[str, str, bool, int]]:
  """``(module, imported, deferred, line)`` for every import of train."""
  modules = module_files(TRAIN)
  found = []
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    top = set()
    for node in tree.body:  # run at import, also under a top-level if/try
      top.add(node)
      if isinstance(node, (ast.If, ast.Try)):
        top |= set(ast.walk(node))
    for node in ast.walk(tree):
      for target in sorted(_targets(name, node, modules)):
        found.append((name, target, node not in top, node.lineno))
  return found


def _part(module: str) -> str:
  """The part of train/ that ``module`` belongs to (`ALLOWED`'s keys)."""
  parts = module.split(".")
  assert parts[0] == "train" and len(parts) > 1, module
  return parts[1]


def test_every_module_has_its_place():
  parts = {_part(m) for m in module_files(TRAIN) if m != "train"}
  assert parts == set(ALLOWED), parts ^ set(ALLOWED)
  for name in SUBPACKAGES:
    assert (TRAIN / name / "__init__.py").is_file(), name
  # Package train holds no module named train.
  assert not (TRAIN / "train.py").exists()


def test_the_allowed_order_is_a_partial_order():
  assert find_cycle(ALLOWED) is None, find_cycle(ALLOWED)
  for part, allowed in ALLOWED.items():
    assert allowed <= set(ALLOWED), (part, allowed - set(ALLOWED))


def test_imports_between_parts_point_the_allowed_way():
  found = _imports()
  assert ("train.main", "train.configs") in {(m, t) for m, t, _, _ in found}
  wrong = [
      f"{module}:{line} imports {target}"
      for module, target, _, line in found
      if _part(target) != _part(module)
      and _part(target) not in ALLOWED[_part(module)]
  ]
  assert not wrong, wrong


def test_module_imports_are_acyclic_deferred_ones_included():
  graph: dict[str, set[str]] = {}
  for module, target, _, _ in _imports():
    graph.setdefault(module, set()).add(target)
  assert find_cycle(graph) is None, find_cycle(graph)


def test_deferred_imports_are_the_listed_ones_for_load_time():
  deferred = {
      (m, t): line for m, t, is_deferred, line in _imports() if is_deferred
  }
  assert set(deferred) == DEFERRED, set(deferred) ^ DEFERRED
  modules = module_files(TRAIN)
  for (module, _), line in deferred.items():
    lines = modules[module].read_text().splitlines()
    # The comment above the block of imports that holds this one.
    above = line - 2
    while lines[above].strip().startswith(("from ", "import ")):
      above -= 1
    assert "load time" in lines[above], (module, line, lines[above])


def test_the_data_loader_calls_the_download_not_back():
  imported = {(m, t) for m, t, _, _ in _imports()}
  assert ("train.data.datasets", "train.data.download") in imported
  assert not {t for m, t in imported if m == "train.data.download"} & {
      "train.data.datasets",
      "train.data.input_pipeline",
  }
  defining = [
      name
      for name, path in module_files(TRAIN).items()
      for node in ast.parse(path.read_text()).body
      if isinstance(node, ast.FunctionDef) and node.name == "load_dataset"
  ]
  assert defining == ["train.data.datasets"], defining


def test_the_commands_have_their_entry_points():
  # python -m train.X for each documented command.
  for command in ("cifar", "mnist", "gain", "plot"):
    assert (TRAIN / f"{command}.py").is_file(), command
  for command in ("report", "sweep", "curvature"):
    assert (TRAIN / command / "__main__.py").is_file(), command
