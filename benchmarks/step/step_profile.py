"""Where a train step's time goes: a profiler trace's XLA ops by model part.

Shared by ``bench_lenet_step`` and ``bench_resnet_step``: :func:`hlo_index`
reads the compiled HLO and gives each instruction its op_name, opcodes, and
a part and phase of the model (by a benchmark's ``categorize``);
:func:`profile_compiled` times each traced op and sums them by part.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from pathlib import Path
import re
import tempfile
import time
from typing import Any

import jax

_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(")

#: ``categorize(op_name, opcodes) -> (part, phase)`` of one op.
Categorize = Callable[[str, frozenset[str]], tuple[str, str]]


def phase(op_name: str) -> str:
  """The train step's phase an op_name belongs to (by JAX's transforms)."""
  return (
      "backward"
      if "transpose(" in op_name
      else "forward"
      if "jvp(" in op_name
      else "update/other"
  )


def hlo_index(
    text: str, categorize: Categorize, layers: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
  """Instruction name -> op_name, opcodes, operands, part and phase.

  ``categorize`` gives an op its part and phase from its op_name and
  opcodes; ``layers`` are the model's layer names (an op_name with
  ``/layer/`` in it is preferred for a fusion).

  A fusion's op_name is the first of its instructions' (recursively) that
  names a layer, else its root's, else any. An op with none (iotas, copies,
  weight-gradient convolutions) takes its part from its users: a parameter
  update (``state.params['conv2']...`` + ...) makes it that layer's
  backward, otherwise the nearest user's part.
  """
  index, computation = {}, None
  roots, members = {}, collections.defaultdict(list)
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      root, name, rhs = m.groups()
      head = re.split(
          r", (?:metadata|backend_config|calls|to_apply|body|"
          r"condition|branch_computations|frontend_attributes)=",
          rhs,
          maxsplit=1,
      )[0]
      op = re.search(r'op_name="([^"]*)"', rhs)
      opcode = _OPCODE.match(rhs)
      index[name] = {
          "op_name": op.group(1) if op else None,
          "opcode": opcode.group(1) if opcode else None,
          "operands": re.findall(r"%([\w.\-]+)", head),
          "calls": re.findall(
              r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", rhs
          ),
      }
      members[computation].append(name)
      if root:
        roots[computation] = name
      continue
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("{")[0]:
      computation = m.group(2)

  def inside(name, seen):
    """Instructions of ``name``'s called computations, recursively."""
    for comp in index[name]["calls"]:
      if comp in seen:
        continue
      seen.add(comp)
      for member in members.get(comp, ()):
        yield member
        yield from inside(member, seen)

  for name, info in index.items():
    nested = list(inside(name, set()))
    info["opcodes"] = frozenset(
        [info["opcode"]] + [index[n]["opcode"] for n in nested]
    ) - {None}
    if info["op_name"] is None and nested:
      named = [index[n]["op_name"] for n in nested if index[n]["op_name"]]
      rooted = [
          index[roots[c]]["op_name"]
          for c in info["calls"]
          if c in roots and index[roots[c]]["op_name"]
      ]
      layered = [n for n in named if any(f"/{l}/" in n for l in layers)]
      pick = layered or rooted or named
      info["op_name"] = pick[0] if pick else None
  users = collections.defaultdict(list)
  for name, info in index.items():
    for operand in info["operands"]:
      users[operand].append(name)
  for name, info in index.items():
    info["part"], info["phase"] = (
        categorize(info["op_name"], info["opcodes"])
        if info["op_name"]
        else (None, None)
    )

  def param_layer(name):
    for operand in index[name]["operands"]:
      m = re.match(
          r"state\.params\[\\?'(\w+)\\?'\]",
          index.get(operand, {}).get("op_name") or "",
      )
      if m:
        return m.group(1)
    return None

  for name, info in index.items():
    if info["part"] is not None:
      continue
    frontier, seen = list(users.get(name, ())), set()
    while frontier:
      user = frontier.pop(0)
      if user in seen:
        continue
      seen.add(user)
      layer = param_layer(user)
      if layer and index[user]["phase"] == "update/other":
        info["part"], info["phase"] = layer, "backward"
        info["op_name"] = (
            f"(gradient of {layer}, feeds {index[user]['op_name']})"
        )
        break
      if index[user]["part"] is not None and index[user]["op_name"]:
        info["part"], info["phase"] = index[user]["part"], index[user]["phase"]
        info["op_name"] = f"(feeds {index[user]['op_name']})"
        break
      frontier.extend(users.get(user, ()))
    if info["part"] is None:
      info["part"], info["phase"] = "unattributed", "-"
  return index


def _union_ns(intervals: list[tuple[int, int]]) -> int:
  """Total length of the union of ``(start, end)`` intervals."""
  total, end = 0, None
  for a, b in sorted(intervals):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def profile_compiled(
    index: dict[str, dict[str, Any]],
    run: Callable[[], Any],
    steps: int,
    top: int = 15,
) -> dict[str, Any]:
  """Each XLA op's traced time over ``steps`` steps, by part and phase.

  ``index``: the compiled step's :func:`hlo_index`; ``run`` dispatches one
  step of it.

  ``wall_ms``: how long the op was running on any thread (the union of its
  events' intervals); ``thread_ms``: the sum over threads (an op split
  over the thread pool counts once per thread). Ops of one step may run
  concurrently, so the ops' wall times can add up to more than the step's.
  """
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  with tempfile.TemporaryDirectory() as tmp:
    t = time.perf_counter()
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        jax.block_until_ready(run())
      traced = time.perf_counter() - t
    files = sorted(Path(tmp).rglob("*.xplane.pb"))
    if not files:
      return {"error": "no trace written"}
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    thread_ns = collections.Counter()
    spans = collections.defaultdict(list)
    for plane in data.planes:
      for line in plane.lines:
        for event in line.events:
          if event.name in index:
            thread_ns[event.name] += event.duration_ns
            spans[event.name].append((event.start_ns, event.end_ns))
  wall_ns = {name: _union_ns(iv) for name, iv in spans.items()}
  total = sum(wall_ns.values()) or 1
  parts_wall, parts_thread = collections.Counter(), collections.Counter()
  for name in wall_ns:
    part = f"{index[name]['part']}/{index[name]['phase']}"
    parts_wall[part] += wall_ns[name]
    parts_thread[part] += thread_ns[name]
  per = lambda ns: round(ns / 1e6 / steps, 3)
  return {
      "steps": steps,
      "traced_step_ms": traced * 1e3 / steps,
      "op_wall_ms_per_step": per(total),
      "op_thread_ms_per_step": per(sum(thread_ns.values())),
      "by_part": {
          k: {
              "wall_ms": per(v),
              "share": v / total,
              "thread_ms": per(parts_thread[k]),
          }
          for k, v in parts_wall.most_common()
      },
      "top_ops": [
          {
              "op": name,
              "wall_ms": per(ns),
              "share": ns / total,
              "thread_ms": per(thread_ns[name]),
              "part": f"{index[name]['part']}/{index[name]['phase']}",
              "op_name": index[name]["op_name"],
          }
          for name, ns in sorted(wall_ns.items(), key=lambda kv: -kv[1])[:top]
      ],
  }


def printable_profiles(result: dict, key: str):
  """``(name, profile)`` of each of ``result``'s profiles that has ``key``;
  the others (errors, skipped cases) are printed as they are."""
  for name, profile in result.get("profiles", {}).items():
    if key in profile:
      yield name, profile
    else:
      print(f"  {name}: {profile}")
