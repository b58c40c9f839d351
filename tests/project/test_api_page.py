"""docs/api.rst: each public name documented once, under its home module.

A name's home is the public module whose ``__all__`` lists it
(tests/gbn_jax/test_public_surface.py checks that each has one); the API
page documents each name under that module's path, once, and nothing that
does not resolve.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re
from typing import Any

import pytest

import gbn_jax

API_RST = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.rst"

# The modules users import from: the package and its modules without a
# leading underscore (tests/gbn_jax/test_public_surface.py checks that every
# other module is underscore-named).
PUBLIC_MODULES = ["gbn_jax"] + [
    f"gbn_jax.{m.name}"
    for m in pkgutil.iter_modules(gbn_jax.__path__)
    if not m.name.startswith("_")
]


def _resolve(dotted: str) -> Any:
  """The object at ``dotted``: the longest importable module prefix, then
  attributes."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      obj = getattr(obj, attr)
    return obj
  raise ImportError(dotted)


def _api_entries() -> list[tuple[str, str]]:
  """Each entry of docs/api.rst, in order, as ``(kind, qualified name)``:
  ``kind`` is the ``auto*`` directive (``'autofunction'``, ...) or
  ``'autosummary'`` for a row of a summary table."""
  current, entries, in_summary = "gbn_jax", [], False
  for line in API_RST.read_text().splitlines():
    name = None
    if m := re.match(r"\.\. currentmodule:: (\S+)", line):
      current, in_summary = m.group(1), False
    elif line.startswith(".. autosummary::"):
      in_summary = True
    elif m := re.match(r"\.\. (auto\w+):: (\S+)", line):
      kind, name = m.group(1), m.group(2)
      in_summary = False
    elif (
        in_summary
        and line.startswith("   ")
        and not line.strip().startswith(":")
    ):
      kind, name = "autosummary", line.strip()
    elif in_summary and line and not line.startswith(" "):
      in_summary = False
    if name is not None:
      if not name.startswith("gbn_jax"):
        name = f"{current}.{name}"
      entries.append((kind, name))
  return entries


def _documented() -> dict[str, Any]:
  """Each fully qualified name docs/api.rst documents (an ``auto*``
  directive or an ``autosummary`` entry), to the object it names."""
  return {n: _resolve(n) for _, n in _api_entries()}


def _home(dotted: str) -> tuple[str, str]:
  """``(module, name)`` of a documented ``module.name``: the longest
  importable module prefix, and the rest."""
  parts = dotted.split(".")
  for i in range(len(parts) - 1, 0, -1):
    module = ".".join(parts[:i])
    try:
      importlib.import_module(module)
    except ImportError:
      continue
    return module, ".".join(parts[i:])
  raise ImportError(dotted)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_in_all_is_documented_under_its_module(module_name):
  # Under this module's own path: a re-export documented elsewhere is a
  # second home, not documentation.
  documented = {n for kind, n in _api_entries() if kind != "autosummary"}
  module = importlib.import_module(module_name)
  missing = [
      f"{module_name}.{name}"
      for name in module.__all__
      if f"{module_name}.{name}" not in documented
  ]
  assert not missing, f"not documented in docs/api.rst: {missing}"


def test_every_documented_name_is_in_its_modules_all():
  outside = []
  for _, dotted in _api_entries():
    module, name = _home(dotted)
    if module not in PUBLIC_MODULES or name not in getattr(
        importlib.import_module(module), "__all__", ()
    ):
      outside.append(dotted)
  assert not outside, f"documented but not in their module's __all__: {outside}"


def test_the_api_page_documents_each_name_once():
  directives = [n for kind, n in _api_entries() if kind != "autosummary"]
  twice = sorted({n for n in directives if directives.count(n) > 1})
  assert not twice, twice
  # Every summary row links to a name documented below it.
  rows = {n for kind, n in _api_entries() if kind == "autosummary"}
  assert rows <= set(directives), rows - set(directives)


def test_the_api_page_documents_only_what_resolves():
  documented = _documented()  # raises on a stale name
  assert "gbn_jax.reductions.mean" in documented
  assert "gbn_jax.quantile" in documented
  assert "gbn_jax.selection.selection_config" in documented
  assert "gbn_jax.measures.MEASURE_CONTRACT" not in documented
