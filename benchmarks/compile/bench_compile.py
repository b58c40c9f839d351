"""Compile time of the CLI's programs: trace+lower and XLA seconds, HLO size.

What it measured is in docs/performance.md ("Compile time"). This benchmark
builds the programs exactly as the CLI does: each child
process calls ``train.loop.programs.compile_program`` (the function
``train_and_evaluate`` calls) on a synthetic dataset of the real sizes, after
the same pre-JAX setup as ``python -m train.cifar`` / ``train.mnist``
(``host_devices``, ``host_memory``). ``jax.jit`` as ``train.loop.programs`` sees it
is wrapped, so each program's ``.lower()`` (tracing and lowering) and
``.compile()`` (XLA) are timed on their own, and the lowered StableHLO and the
optimized HLO are counted.

Every (model, norm) runs in a fresh child with JAX's persistent compilation
cache off (``JAX_COMPILATION_CACHE_DIR`` removed, ``GBN_COMPILE_CACHE=0``, as
``--no-compile-cache``), so nothing is read back. ``--cached`` instead runs
each child twice over a temporary cache folder and reports the second
child's (cached) seconds next to the first's.

  python -m benchmarks.compile.bench_compile --out results/benchmarks/bench_compile.json
  python -m benchmarks.compile.bench_compile --models lenet --norms bn,sqd2 --batch 64
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODELS = ("lenet", "resnet20")
NORMS = ("bn", "sqd2", "rsd")
#: The programs the table and the ratios report (the others are tiny).
REPORTED = ("step", "evaluate")
#: Optimized-HLO opcodes counted on their own (the costly kinds to compile).
COUNTED_OPS = ("custom-call", "while", "sort", "scatter", "fusion", "call")
#: Every field a program's record has (the test checks them).
PROGRAM_FIELDS = (
    "lower_s",
    "trace_s",
    "compile_s",
    "jaxpr_eqns",
    "jaxpr_eqns_traced",
    "platform_conds",
    "jaxpr_eqns_other_platforms",
    "stablehlo_ops",
    "stablehlo_custom_calls",
    "stablehlo_cases",
    "hlo_instructions",
    "hlo_computations",
    "custom_calls",
    "while_loops",
    "sorts",
    "scatters",
    "fusions",
    "calls",
    "custom_call_targets",
    "top_opcodes",
)
_CACHE_ENV = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
)


# --- counting HLO --------------------------------------------------------------

# An HLO instruction: `[ROOT] name = shape opcode(operands)...`.
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# A StableHLO/MLIR operation that defines values, or a terminator.
_MLIR_DEF = re.compile(r"^\s*%[\w#:, %]*=\s*\"?([a-z_]+(?:\.[a-z_]+)*)")
_MLIR_TERM = re.compile(
    r"^\s*\"?((?:stablehlo|func|mhlo|sdy)\.return|return)\b"
)


def _opcode(rhs: str) -> str | None:
  """The opcode after an instruction's shape (a tuple shape has parentheses)."""
  i = 0
  if rhs.startswith("("):
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    i += 1
  else:
    i = rhs.find(" ")
    if i < 0:
      return None
  match = re.match(r"\s*([a-z][\w\-]*)\(", rhs[i:])
  return match.group(1) if match else None


def count_hlo(text: str) -> dict[str, Any]:
  """Instruction counts of an (optimized) HLO module's text.

  Returns:
    ``hlo_instructions`` (all instructions of all computations, fused ones
    included), ``hlo_computations``, the :data:`COUNTED_OPS` counts,
    ``custom_call_targets`` (target name to count) and ``top_opcodes`` (the
    15 most frequent).
  """
  ops: collections.Counter[str] = collections.Counter()
  targets: collections.Counter[str] = collections.Counter()
  computations = 0
  for line in text.splitlines():
    if line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
      computations += 1
      continue
    match = _HLO_INSTR.match(line)
    if not match:
      continue
    op = _opcode(match.group(1))
    if op is None:
      continue
    ops[op] += 1
    if op == "custom-call":
      target = _TARGET.search(line)
      targets[target.group(1) if target else "?"] += 1
  return {
      "hlo_instructions": sum(ops.values()),
      "hlo_computations": computations,
      "custom_calls": ops["custom-call"],
      "while_loops": ops["while"],
      "sorts": ops["sort"],
      "scatters": ops["scatter"],
      "fusions": ops["fusion"],
      "calls": ops["call"],
      "custom_call_targets": dict(targets.most_common()),
      "top_opcodes": dict(ops.most_common(15)),
  }


def count_stablehlo(text: str) -> dict[str, int]:
  """Operation counts of a lowered module's StableHLO (MLIR) text."""
  ops: collections.Counter[str] = collections.Counter()
  for line in text.splitlines():
    match = _MLIR_DEF.match(line) or _MLIR_TERM.match(line)
    if match:
      ops[match.group(1)] += 1
  return {
      "stablehlo_ops": sum(ops.values()),
      "stablehlo_custom_calls": ops["stablehlo.custom_call"],
      # lax.platform_dependent lowers to a `case` on the platform's index:
      # with one branch (a constant index) when lowered for one platform.
      "stablehlo_cases": ops["stablehlo.case"],
  }


def _runs_on(backend: str, platforms: Sequence[str]) -> bool:
  """Whether a branch for ``platforms`` is ``backend``'s ("gpu": CUDA, ROCm)."""
  return backend in platforms or (
      backend == "gpu" and bool({"cuda", "rocm"} & set(platforms))
  )


def count_jaxpr(closed: Any, backend: str) -> dict[str, int]:
  """Equations of a traced program, sub-programs included.

  ``lax.platform_dependent`` traces every platform's branch (a ``cond`` with
  ``branches_platforms``); lowering for one platform keeps only its own.
  ``jaxpr_eqns_other_platforms`` counts the equations traced for the others.
  ``jaxpr_eqns`` counts a sub-program at every call site; ``jaxpr_eqns_traced``
  once (a nested ``jit`` that several call sites share is traced once).
  """
  totals = {
      "jaxpr_eqns": 0,
      "jaxpr_eqns_traced": 0,
      "platform_conds": 0,
      "jaxpr_eqns_other_platforms": 0,
  }

  def subjaxprs(value: Any) -> list[Any]:
    if hasattr(value, "eqns"):
      return [value]
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
      return [value.jaxpr]
    if isinstance(value, (tuple, list)):
      return [j for v in value for j in subjaxprs(v)]
    return []

  def size(jaxpr: Any) -> int:
    return sum(
        1 + sum(size(j) for v in e.params.values() for j in subjaxprs(v))
        for e in jaxpr.eqns
    )

  seen: set[int] = set()

  def walk(jaxpr: Any, elsewhere: bool) -> None:
    first = id(jaxpr) not in seen
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
      totals["jaxpr_eqns"] += 1
      totals["jaxpr_eqns_traced"] += first
      platforms = eqn.params.get("branches_platforms")
      others: set[int] = set()
      if platforms is not None:
        totals["platform_conds"] += 1
        mine = next(
            (i for i, p in enumerate(platforms) if p and _runs_on(backend, p)),
            next((i for i, p in enumerate(platforms) if p is None), 0),
        )
        others = set(range(len(platforms))) - {mine}
        if not elsewhere:  # a nested one is already counted in its parent
          totals["jaxpr_eqns_other_platforms"] += sum(
              size(eqn.params["branches"][i].jaxpr) for i in others
          )
      for name, value in eqn.params.items():
        for i, sub in enumerate(subjaxprs(value)):
          walk(sub, elsewhere or (name == "branches" and i in others))

  walk(closed.jaxpr if hasattr(closed, "jaxpr") else closed, False)
  return totals


# --- the child: one (model, norm) -----------------------------------------------


class _TimedJit:
  """``jax.jit(fn)`` whose ``.lower().compile()`` is timed and counted."""

  def __init__(
      self,
      jitted: Any,
      name: str,
      records: dict[str, Any],
      backend: str,
      dump: Path | None = None,
  ):
    self._jitted, self._name, self._records = jitted, name, records
    self._dump = dump
    self._backend = backend

  def __call__(self, *args, **kwargs):
    return self._jitted(*args, **kwargs)

  def __getattr__(self, attr: str) -> Any:
    return getattr(self._jitted, attr)

  def lower(self, *args, **kwargs):
    # What `jitted.lower()` does, in its two halves timed apart.
    t0 = time.perf_counter()
    traced = self._jitted.trace(*args, **kwargs)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    text = lowered.as_text()
    record = {
        "lower_s": t2 - t0,
        "trace_s": t1 - t0,
        **count_jaxpr(traced.jaxpr, self._backend),
        **count_stablehlo(text),
    }
    if self._name == "step":
      record["norm_layers"] = _norm_layers(args[0])
    self._records[self._name] = record
    dump = self._dump and self._dump / self._name
    if dump:
      dump.with_suffix(".stablehlo.mlir").write_text(text)
    return _TimedLowered(lowered, record, dump)


class _TimedLowered:
  """A lowered program whose ``.compile()`` is timed and counted."""

  def __init__(self, lowered: Any, record: dict[str, Any], dump: Path | None):
    self._lowered, self._record, self._dump = lowered, record, dump

  def compile(self, *args, **kwargs):
    t0 = time.perf_counter()
    compiled = self._lowered.compile(*args, **kwargs)
    self._record["compile_s"] = time.perf_counter() - t0
    text = compiled.as_text()
    self._record.update(count_hlo(text))
    if self._dump:
      self._dump.with_suffix(".hlo.txt").write_text(text)
    return compiled


def _norm_layers(state: Any) -> int:
  """Norm layers in a train state: the innermost dicts of its batch_stats."""

  def count(tree: Any) -> int:
    if not isinstance(tree, dict):
      return 0
    inner = sum(count(v) for v in tree.values())
    return inner or int(any(not isinstance(v, dict) for v in tree.values()))

  stats = getattr(state, "batch_stats", None)
  return count(dict(stats)) if stats is not None else 0


def _child(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles one config's programs as the CLI does; their records."""
  # The CLI's own setup before JAX starts (python -m train.cifar/mnist).
  from train.loop import host_devices  # pylint: disable=g-import-not-at-top
  from train.loop import host_memory  # pylint: disable=g-import-not-at-top

  host_devices.configure(args.models)
  host_memory.configure()
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np

  from benchmarks.timing import machine_info
  from train import compile_cache
  from train import configs
  from train.data import info as data_info
  from train.loop import programs
  from train.loop import sharding
  from train.loop import trainer as trainlib

  # pylint: enable=g-import-not-at-top
  if args.cache_dir is None:
    jax.config.update("jax_enable_compilation_cache", False)
  compile_cache.configure(disabled_by_flag=True)  # --no-compile-cache
  base = configs.MNIST if args.models == "lenet" else configs.CIFAR
  config = base.replace(model=args.models, norm=args.norms)
  if args.batch is not None:
    config = config.replace(batch_size=args.batch)
  config = trainlib.resolve(config)
  info = data_info.dataset_info(config.dataset)
  n_train = args.train_images or (
      60000 if info.name.endswith("mnist") else 50000
  )
  n_test = args.test_images or 10000
  dataset = data_info.Dataset(
      name=info.name,
      train_images=np.zeros((n_train, *info.image_shape), np.uint8),
      train_labels=np.zeros(n_train, np.int32),
      test_images=np.zeros((n_test, *info.image_shape), np.uint8),
      test_labels=np.zeros(n_test, np.int32),
      num_classes=info.num_classes,
      source="synthetic (bench_compile)",
  )
  records: dict[str, Any] = {}
  real_jit = jax.jit
  dump = None
  if args.dump_hlo:
    dump = Path(args.dump_hlo) / f"{config.model}-{config.norm}"
    dump.mkdir(parents=True, exist_ok=True)

  def timed_jit(fn, *a, **k):
    function = getattr(getattr(fn, "func", fn), "__name__", "")
    name = programs.PROGRAM_FUNCTIONS.get(function, "?")
    jitted = real_jit(fn, *a, **k)
    return _TimedJit(jitted, name, records, jax.default_backend(), dump)

  # Only train.loop.programs' `jax` sees the wrapper: gbn_jax's own jits are
  # untouched.
  proxy = types.ModuleType("jax")
  proxy.__dict__.update(jax.__dict__)
  proxy.jit = timed_jit
  programs.jax = proxy
  try:
    mesh = sharding.make_mesh(sharding.data_parallel_devices(config.batch_size))
    train_data = sharding.place_train(dataset, mesh)
    test_data = sharding.place_test(dataset, mesh, config.batch_size)
    t0 = time.perf_counter()
    _, cached = programs.compile_program(
        config, mesh, train_data, test_data, dataset.num_classes
    )
    total = time.perf_counter() - t0
  finally:
    programs.jax = jax
  if cached:
    raise RuntimeError("compile_program reused an in-process program")
  return {
      "model": config.model,
      "norm": config.norm,
      "dataset": config.dataset,
      "batch_size": config.batch_size,
      "train_images": n_train,
      "test_images": n_test,
      "devices": mesh.size,
      "persistent_cache": args.cache_dir is not None,
      "compile_program_s": total,
      "programs": records,
      "machine": machine_info(),
  }


# --- the parent -----------------------------------------------------------------


def _child_env(cache_dir: str | None) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV}
  env["GBN_COMPILE_CACHE"] = "0"
  if cache_dir is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(REPO), env.get("PYTHONPATH")) if p
  )
  return env


def run_child(
    args: argparse.Namespace, model: str, norm: str, cache_dir: str | None
) -> dict[str, Any]:
  """One fresh process compiling ``model``/``norm``; its record or an error."""
  cmd = [sys.executable, "-m", "benchmarks.compile.bench_compile", "--child"]
  cmd += ["--models", model, "--norms", norm]
  for flag in ("batch", "train_images", "test_images", "dump_hlo"):
    value = getattr(args, flag)
    if value is not None:
      cmd += [f"--{flag.replace('_', '-')}", str(value)]
  if cache_dir is not None:
    cmd += ["--cache-dir", cache_dir]
  try:
    proc = subprocess.run(
        cmd,
        env=_child_env(cache_dir),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=args.timeout,
        check=False,
    )
  except subprocess.TimeoutExpired:
    return {"model": model, "norm": norm, "error": f"timeout {args.timeout}s"}
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    return {
        "model": model,
        "norm": norm,
        "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}",
    }
  return json.loads(lines[-1])


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Each norm's step/evaluate seconds and sizes over ``bn``'s, per model."""
  keys = ("lower_s", "compile_s", "hlo_instructions", "stablehlo_ops")
  out: dict[str, Any] = {}
  by = {(r["model"], r["norm"]): r for r in rows if "error" not in r}
  for (model, norm), row in by.items():
    bn = by.get((model, "bn"))
    if norm == "bn" or bn is None:
      continue
    entry = out.setdefault(model, {}).setdefault(f"{norm}/bn", {})
    for prog in REPORTED:
      mine, ref = row["programs"].get(prog), bn["programs"].get(prog)
      if mine and ref:
        entry[prog] = {
            k: round(mine[k] / ref[k], 3) for k in keys if ref.get(k)
        }
    layers = row["programs"].get("step", {}).get("norm_layers") or 0
    if layers and "step" in bn["programs"]:
      extra = (
          row["programs"]["step"]["hlo_instructions"]
          - bn["programs"]["step"]["hlo_instructions"]
      )
      entry["step_extra_hlo_per_norm_layer"] = round(extra / layers, 1)
  return out


def table(rows: Sequence[dict[str, Any]]) -> str:
  """One line per (model, norm, program)."""
  head = (
      f"{'model':9} {'norm':5} {'prog':8} {'lower s':>8} {'XLA s':>8}"
      f" {'cached s':>8} {'StableHLO':>9} {'HLO':>7} {'cc':>4} {'while':>5}"
      f" {'sort':>4} {'scat':>4}"
  )
  lines = [head]
  for row in rows:
    if "error" in row:
      lines.append(
          f"{row['model']:9} {row['norm']:5} error: {row['error'][:200]}"
      )
      continue
    for prog in REPORTED:
      p = row["programs"].get(prog)
      if p is None:
        continue
      cached = p.get("cached_compile_s")
      lines.append(
          f"{row['model']:9} {row['norm']:5} {prog:8} {p['lower_s']:8.2f}"
          f" {p['compile_s']:8.2f}"
          f" {'' if cached is None else f'{cached:.2f}':>8}"
          f" {p['stablehlo_ops']:9d} {p['hlo_instructions']:7d}"
          f" {p['custom_calls']:4d} {p['while_loops']:5d} {p['sorts']:4d}"
          f" {p['scatters']:4d}"
      )
  return "\n".join(lines)


def _names(text: str, allowed: Sequence[str] | None, flag: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  if not names:
    raise SystemExit(f"{flag} needs at least one name")
  if allowed is not None:
    bad = [n for n in names if n not in allowed]
    if bad:
      raise SystemExit(f"{flag}: unknown {bad}; expected some of {allowed}")
  return names


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--norms", default=",".join(NORMS))
  parser.add_argument(
      "--batch", type=int, default=None, help="default: the CLI's"
  )
  parser.add_argument(
      "--train-images",
      type=int,
      default=None,
      help="synthetic training set size (default: the real one's)",
  )
  parser.add_argument("--test-images", type=int, default=None)
  parser.add_argument(
      "--cached",
      action="store_true",
      help="also a second child over the first one's persistent cache",
  )
  parser.add_argument(
      "--dump-hlo",
      default=None,
      help="folder for each program's StableHLO and optimized HLO text",
  )
  parser.add_argument("--timeout", type=float, default=1800.0)
  parser.add_argument("--out", default=None, help="JSON file to write")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  for flag in ("batch", "train_images", "test_images"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
  if args.child:
    print(json.dumps(_child(args)))
    return 0
  if args.dump_hlo:  # the children run in the repository
    args.dump_hlo = str(Path(args.dump_hlo).resolve())
  models = _names(args.models, MODELS, "--models")
  norms = _names(args.norms, None, "--norms")  # any registered measure
  rows = []
  for model in models:
    for norm in norms:
      if args.cached:
        with tempfile.TemporaryDirectory(prefix="bench_compile_") as cache:
          row = run_child(args, model, norm, cache)
          again = run_child(args, model, norm, cache)
        if "error" not in row and "error" not in again:
          for prog, p in row["programs"].items():
            p["cached_compile_s"] = again["programs"][prog]["compile_s"]
            p["cached_lower_s"] = again["programs"][prog]["lower_s"]
        elif "error" in again:
          row.setdefault("error", again["error"])
      else:
        row = run_child(args, model, norm, None)
      rows.append(row)
      print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
  result = {"rows": rows, "ratios": ratios(rows), "cached": args.cached}
  print(table(rows))
  print(json.dumps(result["ratios"], indent=1))
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
