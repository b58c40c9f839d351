"""Import graphs for the structure tests: the cycle finder they share."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
import pathlib


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
  """A cycle of ``graph`` (node -> the nodes it points to) as a closed path
  ``[a, b, ..., a]``, or None; nodes visited in sorted order, so the same
  graph always gives the same cycle.

  >>> find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}})
  ['a', 'b', 'c', 'a']
  >>> find_cycle({"a": {"b"}, "b": set()}) is None
  True
  """
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def module_files(*roots: pathlib.Path) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the packages at
  ``roots``."""
  found = {}
  for root in roots:
    for path in sorted(root.rglob("*.py")):
      parts = path.relative_to(root.parent).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join(parts)] = path
  return found


def imported_modules(
    module: str, node: ast.AST, modules: Mapping[str, pathlib.Path]
) -> set[str]:
  """The modules of ``modules`` (other than ``module``) that the import
  statement ``node`` in ``module`` loads; relative imports resolved."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  elif isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:  # relative: resolve against the importing package
      package = module.split(".")
      if not modules[module].name == "__init__.py":
        package = package[:-1]
      package = package[: len(package) - node.level + 1]
      base = ".".join(package + ([base] if base else []))
    # "from a import b" loads a.b where b is a module, else a.
    names = [
        f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
        for a in node.names
    ]
  else:
    return set()
  return {n for n in names if n in modules and n != module}
