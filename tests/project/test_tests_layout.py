"""tests/'s layout: it mirrors the code, and the library's tests stand alone.

Every test module lives in a folder that mirrors a package of the code
(``tests/gbn_jax/selection`` for ``gbn_jax/_selection``, ``tests/train/loop``
for ``train/loop``, ...) or in ``tests/project`` (the README, the
documentation, the notebooks, the layout); the code they share is
``tests/helpers``. Every folder is a package, so that pytest imports
``tests.gbn_jax`` by its full name and ``tests/gbn_jax`` never stands in for
``gbn_jax``.

``tests/gbn_jax`` is what ``.ci/newest_jax.sh`` runs against the installed
wheel, from a copy without the checkout: its modules, and the helpers they
import, import nothing of ``train``, ``benchmarks`` or ``notebooks``
(deferred or in a subprocess's script text too) and name none of their
modules in a string (``python -m train.mnist`` would be one).
"""

from __future__ import annotations

import ast
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# The code whose packages tests/ mirrors, and the folders of tests/ that
# mirror nothing: the checks of the project as a whole, the shared code.
MIRRORED = ("gbn_jax", "train", "benchmarks")
PROJECT = "project"
HELPERS = "helpers"
LIBRARY_TESTS = TESTS / "gbn_jax"
# What the library's tests may not use: the repository's other code.
NOT_THE_LIBRARY = ("train", "benchmarks", "notebooks")
_MODULE_STRING = re.compile(
    rf"(?<![\w./-])(?:{'|'.join(NOT_THE_LIBRARY)})\.[A-Za-z_][\w.]*"
)
# An import statement at the start of a line, in code or in the text of a
# script a test runs in a subprocess.
_IMPORT_LINE = re.compile(
    r"^[ \t]*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+))", re.M
)


def _mirror(folder: pathlib.PurePosixPath, repo: pathlib.Path) -> bool:
  """Whether ``folder`` (relative to tests/) mirrors a package of ``repo``:
  ``gbn_jax/selection`` mirrors ``gbn_jax/_selection`` as well."""
  if not folder.parts or folder.parts[0] not in MIRRORED:
    return False
  code = repo / folder.parts[0]
  for part in folder.parts[1:]:
    code = next(
        (code / p for p in (part, f"_{part}") if (code / p).is_dir()), None
    )
    if code is None:
      return False
  return (code / "__init__.py").is_file()


def _misplaced(tests: pathlib.Path, repo: pathlib.Path) -> list[str]:
  """Files of ``tests`` outside their place: test modules outside a mirror
  folder or tests/project, other modules outside tests/helpers."""
  found = []
  for path in sorted(tests.rglob("*.py")):
    relative = pathlib.PurePosixPath(path.relative_to(tests).as_posix())
    folder, name = relative.parent, relative.name
    if name == "__init__.py" or relative.as_posix() == "conftest.py":
      continue
    if name.startswith("test_"):
      ok = folder.as_posix() == PROJECT or _mirror(folder, repo)
    else:
      ok = folder.parts[:1] == (HELPERS,)
    if not ok:
      found.append(relative.as_posix())
  return found


def _not_packages(tests: pathlib.Path) -> list[str]:
  """Folders of ``tests`` (itself included) that hold Python files but no
  ``__init__.py``."""
  folders = {tests} | {p.parent for p in tests.rglob("*.py")}
  return sorted(
      folder.relative_to(tests.parent).as_posix()
      for folder in folders
      if not (folder / "__init__.py").is_file()
  )


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """``(line, module)`` for each import in ``path``: statements anywhere
  (deferred too; ``from a import b`` counts as ``a``, and as ``a.b`` too
  where ``a`` is of tests/, whose ``b`` may be a module) and import lines in
  the text of its strings (scripts for a subprocess)."""
  text = path.read_text()
  found = []
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.Import):
      found += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      found.append((node.lineno, node.module or ""))
      if (node.module or "").split(".")[0] == TESTS.name:
        found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
  for match in _IMPORT_LINE.finditer(text):
    found.append((text.count("\n", 0, match.start()) + 1, match[1] or match[2]))
  return found


def _helper_file(module: str, tests: pathlib.Path) -> pathlib.Path | None:
  """The file of ``tests.helpers.X`` (``module``) under ``tests``."""
  parts = module.split(".")
  if parts[:2] != [tests.name, HELPERS] or len(parts) < 3:
    return None
  path = tests.joinpath(*parts[1:3]).with_suffix(".py")
  return path if path.is_file() else None


def _library_test_violations(tests: pathlib.Path) -> list[str]:
  """``'file:line what'`` for each use, by a module of ``tests/gbn_jax`` or
  a helper it imports (followed to the helpers those import), of a module
  of ``NOT_THE_LIBRARY``: an import of one, or its name in a string."""
  found, seen = [], set()
  todo = sorted((tests / "gbn_jax").rglob("*.py"))
  while todo:
    path = todo.pop(0)
    if path in seen:
      continue
    seen.add(path)
    where = path.relative_to(tests.parent).as_posix()
    for line, module in _imports(path):
      if module.split(".")[0] in NOT_THE_LIBRARY:
        found.append(f"{where}:{line} imports {module}")
      elif (helper := _helper_file(module, tests)) is not None:
        todo.append(helper)
    for node in ast.walk(ast.parse(path.read_text())):
      if (
          isinstance(node, ast.Constant)
          and isinstance(node.value, str)
          and (m := _MODULE_STRING.search(node.value))
      ):
        found.append(f"{where}:{node.lineno} names {m.group(0)}")
  return sorted(set(found))


def test_every_test_module_lives_in_a_mirror_folder():
  assert not _misplaced(TESTS, REPO), _misplaced(TESTS, REPO)
  # The mirrors are there, and the check sees into them.
  assert _mirror(pathlib.PurePosixPath("gbn_jax/selection"), REPO)
  assert _mirror(pathlib.PurePosixPath("train/loop"), REPO)
  assert list(LIBRARY_TESTS.glob("test_*.py"))


def test_every_folder_is_a_package():
  assert not _not_packages(TESTS), _not_packages(TESTS)


def test_the_library_tests_use_nothing_but_the_library():
  assert not _library_test_violations(TESTS), _library_test_violations(TESTS)


def test_layout_checks_see_what_they_are_for(tmp_path):
  repo, tests = tmp_path, tmp_path / "tests"
  for package in ("gbn_jax", "gbn_jax/_selection", "train", "train/loop"):
    (repo / package).mkdir(parents=True)
    (repo / package / "__init__.py").write_text("")
  files = {
      "__init__.py": "",
      "conftest.py": "",
      "helpers/__init__.py": "",
      "helpers/clean.py": "import numpy\n",
      "helpers/training.py": "from train.loop import trainer\n",
      "gbn_jax/__init__.py": "",
      "gbn_jax/test_a.py": "from tests.helpers import clean\n",
      "gbn_jax/selection/test_b.py": (
          "def f():\n  from benchmarks import timing\n"
      ),
      "gbn_jax/test_c.py": 'SCRIPT = """\nimport train.mnist\n"""\n',
      "gbn_jax/test_d.py": 'ARGS = ["-m", "train.sweep"]\n',
      "gbn_jax/test_e.py": "from tests.helpers import training\n",
      "train/loop/__init__.py": "",
      "train/loop/test_f.py": "import train\n",
      "train/test_g.py": "",
      "train/nowhere/test_h.py": "",
      "test_i.py": "",
      "project/__init__.py": "",
      "project/test_j.py": "",
      "gbn_jax/shared.py": "",
  }
  for name, text in files.items():
    (tests / name).parent.mkdir(parents=True, exist_ok=True)
    (tests / name).write_text(text)
  assert _misplaced(tests, repo) == [
      "gbn_jax/shared.py",
      "test_i.py",
      "train/nowhere/test_h.py",
  ]
  assert _not_packages(tests) == [
      "tests/gbn_jax/selection",
      "tests/train",
      "tests/train/nowhere",
  ]
  assert _library_test_violations(tests) == [
      "tests/gbn_jax/selection/test_b.py:2 imports benchmarks",
      "tests/gbn_jax/test_c.py:1 names train.mnist",
      "tests/gbn_jax/test_c.py:2 imports train.mnist",
      "tests/gbn_jax/test_d.py:1 names train.sweep",
      "tests/helpers/training.py:1 imports train.loop",
  ]
