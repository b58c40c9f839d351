"""Import graphs for the structure tests: the cycle finder they share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


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
