"""Where the LeNet step's time goes: XLA op times by layer, and layers alone.

:func:`profile_compiled` attributes a ``jax.profiler`` trace's XLA ops to the
model's layers and phases (:func:`hlo_index` reads the compiled HLO);
:func:`layer_costs` times each layer's forward and forward+backward jitted
alone on its step shape, for every formulation (the trace only sees the
launch of Eigen's asynchronous convolution and dot thunks).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from pathlib import Path
import re
import statistics
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.lenet_setup import time_interleaved
from benchmarks.lenet_variants import NUM_CLASSES
from benchmarks.lenet_variants import VariantConv
from benchmarks.lenet_variants import max_pool_2x2
from benchmarks.lenet_variants import max_pool_2x2_mask
from train import models

_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|\S+)\s+([\w\-]+)\(")
_LAYERS = ("conv1", "conv2", "norm1", "norm2", "fc1", "fc2")
_POOL_OPCODES = {"reduce-window", "select-and-scatter"}


def _phase(op_name: str) -> str:
  return (
      "backward"
      if "transpose(" in op_name
      else "forward"
      if "jvp(" in op_name
      else "update/other"
  )


def categorize(
    op_name: str | None, opcodes: frozenset[str] = frozenset()
) -> tuple[str, str]:
  """``(part, phase)`` of an op_name such as ``.../transpose(jvp(LeNet))/conv2/...``.

  ``opcodes``: the HLO opcodes of the op (and of what it calls); a
  reduce-window or select-and-scatter in the model is ``pool``.
  """
  if not op_name:
    return "unattributed", "-"
  phase = _phase(op_name)
  for layer in _LAYERS:
    if f"/{layer}/" in op_name:
      return layer, phase
  in_model = "LeNet" in op_name
  if in_model and (
      opcodes & _POOL_OPCODES
      or any(
          k in op_name
          for k in (
              "reduce_window",
              "select_and_scatter",
              "max_pool",
              "reduce_max",
          )
      )
  ):
    return "pool", phase
  if in_model and (
      "relu" in op_name
      or "/gt" in op_name
      or "/ge" in op_name
      or "select_n" in op_name
  ):
    return "relu", phase
  if in_model:
    return "model-other", phase
  if "jvp(" in op_name or "transpose(" in op_name:
    return "loss", phase
  return "input/update/metrics", phase


def hlo_index(text: str) -> dict[str, dict[str, Any]]:
  """Instruction name -> op_name, opcodes, operands, part and phase.

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
      layered = [n for n in named if any(f"/{l}/" in n for l in _LAYERS)]
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
    compiled, run: Callable[[], Any], steps: int, top: int = 15
) -> dict[str, Any]:
  """Each XLA op's traced time over ``steps`` steps, by layer and phase.

  ``wall_ms``: how long the op was running on any thread (the union of its
  events' intervals); ``thread_ms``: the sum over threads (an op split
  over the thread pool counts once per thread). Ops of one step may run
  concurrently, so the ops' wall times can add up to more than the step's.
  """
  index = hlo_index(compiled.as_text())
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


def layer_pieces(norm: str, batch: int) -> dict[str, tuple]:
  """LeNet's layers on their step shapes: ``name -> (fn, params, x, wrt_x)``.

  ``fn(params, x)`` is the layer's training-mode forward; ``wrt_x`` says
  whether the train step needs the gradient with respect to ``x`` (not for
  conv1, whose input is the data). Alternatives are named ``layer/method``.
  """
  factory = models.make_norm(norm)
  shapes = {
      "x": (batch, 28, 28, 1),
      "a1": (batch, 24, 24, 20),
      "p1": (batch, 12, 12, 20),
      "a2": (batch, 8, 8, 50),
      "flat": (batch, 800),
      "h": (batch, 500),
      "logits": (batch, 10),
  }
  keys = iter(jax.random.split(jax.random.key(5), 64))
  data = {k: jax.random.normal(next(keys), v) for k, v in shapes.items()}
  labels = jax.random.randint(next(keys), (batch,), 0, NUM_CLASSES)

  def module(mod, x, mutable=False):
    variables = mod.init(next(keys), x)
    if mutable:
      fn = lambda p, x: mod.apply(
          {**variables, "params": p}, x, mutable=["batch_stats"]
      )[0]
    else:
      fn = lambda p, x: mod.apply({"params": p}, x)
    return fn, variables["params"]

  def pool(method):
    fn = {
        "window": lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)),
        "reshape": max_pool_2x2,
        "mask": max_pool_2x2_mask,
    }[method]
    return lambda p, x: fn(nn.relu(x))

  pieces = {}
  for method in ("conv", "im2col", "wgrad"):
    pieces[f"conv1/{method}"] = (
        *module(VariantConv(20, method), data["x"]),
        data["x"],
        False,
    )
  pieces["norm1"] = (
      *module(factory(use_running_average=False), data["a1"], mutable=True),
      data["a1"],
      True,
  )
  for method in ("window", "reshape", "mask"):
    pieces[f"relu+pool1/{method}"] = (pool(method), {}, data["a1"], True)
  for method in ("conv", "im2col", "wgrad", "mm_bwd"):
    pieces[f"conv2/{method}"] = (
        *module(VariantConv(50, method), data["p1"]),
        data["p1"],
        True,
    )
  pieces["norm2"] = (
      *module(factory(use_running_average=False), data["a2"], mutable=True),
      data["a2"],
      True,
  )
  for method in ("window", "reshape", "mask"):
    pieces[f"relu+pool2/{method}"] = (pool(method), {}, data["a2"], True)
  pieces["fc1+relu"] = (
      *(lambda f, p: (lambda p_, x: nn.relu(f(p_, x)), p))(
          *module(nn.Dense(500), data["flat"])
      ),
      data["flat"],
      True,
  )
  pieces["fc2"] = (*module(nn.Dense(NUM_CLASSES), data["h"]), data["h"], True)
  pieces["loss"] = (
      lambda p, x: optax.softmax_cross_entropy_with_integer_labels(
          x, labels
      ).mean(),
      {},
      data["logits"],
      True,
  )
  return pieces


def layer_costs(
    norm: str,
    batch: int,
    runs: int,
    warmup: int,
    names: Sequence[str] | None = None,
) -> dict[str, Any]:
  """Forward and forward+backward ms of each layer piece, jitted alone."""
  out = {}
  for name, (fn, params, x, wrt_x) in layer_pieces(norm, batch).items():
    if names is not None and name not in names:
      continue
    y = jax.eval_shape(fn, params, x)
    cot = jax.random.normal(jax.random.key(9), y.shape, y.dtype)
    argnums = (
        (0, 1) if wrt_x and jax.tree.leaves(params) else (1 if wrt_x else 0)
    )
    fwd = jax.jit(fn)
    bwd = jax.jit(
        jax.value_and_grad(
            lambda p, x: jnp.vdot(fn(p, x), cot), argnums=argnums
        )
    )
    try:
      samples = time_interleaved(
          {"fwd": lambda: fwd(params, x), "fwd+bwd": lambda: bwd(params, x)},
          runs,
          warmup,
      )
      out[name] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
  return out
