"""Where the ResNet20 train step's time goes on XLA:CPU, and what makes it faster.

Times the training suite's real jitted step (``train.loop.train_steps.train_step``
and the state, optimizer, mesh and shardings training builds) on random
CIFAR-10-shaped data (``train.cifar``'s defaults: batch 256, 32x32x3, plain
SGD), ``--norm bn`` and ``sqd2``, each section in fresh subprocesses, whose
host memory is set up as the CLI's (:mod:`train.loop.host_memory`):

1. ``convs``: ResNet20's six convolution shapes alone, forward and
   forward+backward, in each exact formulation (:data:`FORMULATIONS`),
   interleaved; weighted by each shape's count, the step's conv time.
2. ``variants``: the whole model with each formulation (:data:`VARIANTS`),
   interleaved with the real model (``base``: ``train.model.models.ResNetConv`` and
   :func:`train.model.models.recompute_elementwise` norms on a CPU),
   ``stored_norm`` (without the recomputation), ``chained``
   (``ResNetConv`` without :func:`train.model.models.computed_once`),
   ``xla_kernel_grad`` (``ResNetConv`` with XLA's kernel gradients, its
   formulation before the compiled one) and ``flax`` (``nn.Conv``, stored
   norms); ``loss_rel``/``update_rel`` against
   ``base`` on the same batch (with a quantile norm, im2col's other forward
   rounding can move a quantile to another element, and its gradient).
3. ``profile``: a traced step of ``base`` and ``flax``: XLA op time by kind
   (conv forward, input and kernel gradients, transposes, reductions,
   elementwise), by phase and by stage, and the top ops.
4. ``flags``: XLA:CPU flag sets (``step_children``'s; ``glibc_malloc``
   is glibc's own malloc settings instead of the CLI's), a process each,
   timing ``base`` against default-flag processes first and last.
5. ``final``: 1 vs 2 host devices (the batch split as the CLI does) x
   default vs the best exact flag set, ``base``, ``stored_norm``,
   ``xla_kernel_grad``, ``chained`` and ``flax``, a process per norm.
6. ``--torch-python``: ``peers/torch_resnet20.py`` (BatchNorm2d, NCHW and
   channels_last; kthvalue SQD2 with ``--torch-sqd``) first and last; steps
   as ratios to PyTorch's best BatchNorm step (target: 1.3).

Medians after warm-up; on a shared machine read only the ratios within one
process. Run it on idle cores (about 25 minutes on 2 cores):

  python -m benchmarks.step.bench_resnet_step \\
      --out results/benchmarks/resnet20_step_cpu.json \\
      --torch-python /tmp/torchvenv/bin/python
  python -m benchmarks.step.bench_resnet_step --quick      # smoke check
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable, Sequence
import functools
import json
import math
import os
from pathlib import Path
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step import step_children
from benchmarks.step import step_profile
from benchmarks.step.resnet_formulations import CONV_SHAPES
from benchmarks.step.resnet_formulations import FINAL_VARIANTS
from benchmarks.step.resnet_formulations import FORMULATIONS
from benchmarks.step.resnet_formulations import VARIANTS
from benchmarks.step.step_children import FLAG_SETS
from benchmarks.step.step_children import INEXACT_FLAG_SETS
from benchmarks.step.step_children import REPO
from benchmarks.step.step_children import run_child
from benchmarks.step.step_report import Report
from benchmarks.step.step_report import format_ms
from benchmarks.step.step_report import measured_runs
from benchmarks.step.step_report import median_ms
from benchmarks.step.step_report import print_ratio_line
from benchmarks.step.step_setup import random_train_step
from benchmarks.step.step_setup import time_variants
from benchmarks.timing import interleaved_samples
from benchmarks.timing import machine_info
from train import configs
from train.loop import sharding
from train.loop import train_state
from train.loop import trainer as trainlib

DEFAULT_PEER = REPO / "peers" / "torch_resnet20.py"
DATASET = "cifar10"
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
TARGET = 1.3  # each step at most 1.3x PyTorch's best BatchNorm step
_MODULE = "benchmarks.step.bench_resnet_step"

DEFAULT_FLAG_SETS = tuple(
    "ynn_off ynn_no_conv ynn_no_dot onednn_dot eigen_1thread "
    "no_concurrency_sched nproc1 glibc_malloc".split()
)

# --- The real step.


class Setup:
  """The real train step's inputs for one norm, laid out as in training.

  ``blocks_per_stage``: the ResNet's blocks per stage, 3 (ResNet20, the
  benchmarked model) unless a caller wants the same layers and variants
  compiled sooner.
  """

  def __init__(
      self,
      norm: str,
      batch: int,
      *,
      seed: int = 0,
      steps: int = 1,
      blocks_per_stage: int = 3,
  ):
    self.config = trainlib.resolve(
        configs.CIFAR.replace(dataset=DATASET, norm=norm, batch_size=batch)
    )
    self.mesh = sharding.make_mesh(sharding.data_parallel_devices(batch))
    self.model = train_state.create_model(self.config, NUM_CLASSES).clone(
        blocks_per_stage=blocks_per_stage
    )
    self.state, self.images, self.labels, self.step = random_train_step(
        self.config, self.model, self.mesh, steps=steps, seed=seed
    )

  def state_for(self, variant: str):
    """The initial state with ``variant``'s apply_fn (same parameters)."""
    if not VARIANTS[variant]:
      return self.state
    model = self.model.clone(**VARIANTS[variant])  # the same tree
    return self.state.replace(apply_fn=model.apply)

  def compile(self, variant: str):
    """``(compiled step, its state, compile seconds)``."""
    state = self.state_for(variant)
    t = time.perf_counter()
    args = (state, self.images, self.labels, np.int32(0))
    return self.step.lower(*args).compile(), state, time.perf_counter() - t

  def runner(self, compiled, state) -> Callable[[], Any]:
    """One dispatch of the step on the first batch per call, not blocked."""
    return functools.partial(
        compiled, state, self.images, self.labels, np.int32(0)
    )


# --- Profile: op time by kind, phase and stage.

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_KERNEL_MAX = 9 * 64 * 64  # the largest kernel gradient's size
_KINDS = (
    ({"reduce"}, "reduce (norm stats, mean)"),
    ({"transpose", "copy"}, "transpose/copy"),
    ({"sort", "while", "custom-call"}, "sort/loop/custom-call"),
    ({"concatenate", "slice", "pad", "dynamic-slice"}, "data movement"),
)


def _sizes(text: str) -> dict[str, int]:
  dims = {m[1]: m[2] for m in map(_SHAPE.match, text.splitlines()) if m}
  return {
      k: math.prod(int(d) for d in v.split(",") if d) for k, v in dims.items()
  }


def op_kind(info: dict[str, Any], size: int) -> str:
  """What an XLA op does, from its opcodes, phase and output size."""
  if info["opcodes"] & {"convolution", "dot"}:
    grad = "kernel grad" if size <= _KERNEL_MAX else "input grad"
    return "conv/dot " + ("forward" if info["phase"] == "forward" else grad)
  for opcodes, kind in _KINDS:
    if info["opcodes"] & opcodes:
      return kind
  return "elementwise"


def _stage(op_name: str | None) -> str:
  m = re.search(r"(stage\d)_block\d|/(conv1|norm1)/", op_name or "")
  if m:
    return m[1] or "stem"
  return "head/loss/update" if op_name else "unattributed"


# An op's part is its stage; fusions take the op_name of a layer in a block.
_categorize = lambda op_name, _: (_stage(op_name), step_profile.phase(op_name))
_LAYERS = ("conv1", "conv2", "norm1", "norm2")


def profile_step(compiled, run, steps: int, top: int = 20) -> dict[str, Any]:
  """``profile_compiled``'s op times, regrouped for ResNet."""
  text = compiled.as_text()
  index, sizes = step_profile.hlo_index(text, _categorize, _LAYERS), _sizes(
      text
  )
  prof = step_profile.profile_compiled(index, run, steps, top=10**9)
  if "top_ops" not in prof:
    return prof
  prof.pop("by_part", None)  # by stage and phase: by_stage and by_phase
  groups = {k: collections.Counter() for k in ("kind", "phase", "stage")}
  rows = []
  for op in prof.pop("top_ops"):
    info = index[op["op"]]
    kind = op_kind(info, sizes.get(op["op"], 0))
    keys = (kind, info["phase"], _stage(info["op_name"]))
    for group, key in zip(groups.values(), keys):
      group[key] += op["wall_ms"]
    rows.append(dict(op, kind=kind, stage=keys[2]))
  total = sum(groups["kind"].values()) or 1.0
  for name, group in groups.items():
    prof[f"by_{name}"] = {
        k: {"wall_ms": round(v, 2), "share": round(v / total, 4)}
        for k, v in group.most_common()
    }
  prof["top_ops"] = rows[:top]
  return prof


# --- Child processes.


def child_convs(spec: dict[str, Any]) -> dict[str, Any]:
  """Each conv shape alone, every formulation, fwd and fwd+bwd (interleaved)."""
  out = {"machine": machine_info(), "shapes": [], "totals_ms": {}}
  names = spec["formulations"]
  totals = collections.Counter()
  for hw, cin, cout, strides, count in CONV_SHAPES:
    keys = jax.random.split(jax.random.key(hw * cin + cout), 3)
    x = jax.random.normal(keys[0], (spec["batch"], hw, hw, cin))
    kernel = jax.random.normal(keys[1], (3, 3, cin, cout))
    cot = jax.random.normal(
        keys[2], (spec["batch"], hw // strides, hw // strides, cout)
    )
    argnums = 1 if cin == 3 else (0, 1)  # the stem needs no input gradient
    fns, grads, row = {}, {}, {"shape": [hw, cin, cout, strides, count]}
    for name in names:
      f = lambda x, k, fn=FORMULATIONS[name], s=strides: fn(x, k, s)
      fwd = jax.jit(f)
      bwd = jax.jit(jax.grad(lambda x, k: jnp.vdot(f(x, k), cot), argnums))
      grads[name] = bwd(x, kernel)
      fns[f"{name}/fwd"] = functools.partial(fwd, x, kernel)
      fns[f"{name}/fwd+bwd"] = functools.partial(bwd, x, kernel)
    samples = interleaved_samples(fns, spec["runs"], spec["warmup"])
    for name in names:
      ms = {
          p: statistics.median(samples[f"{name}/{p}"]) * 1e3
          for p in ("fwd", "fwd+bwd")
      }
      pairs = zip(
          jax.tree.leaves(grads[name]), jax.tree.leaves(grads[names[0]])
      )
      rel = max(
          float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in pairs
      )
      row[name] = dict(ms, grad_rel=rel)
      totals[name] += ms["fwd+bwd"] * count
    out["shapes"].append(row)
  out["totals_ms"] = {k: round(v, 2) for k, v in totals.items()}
  return out


def child_time(spec: dict[str, Any]) -> dict[str, Any]:
  """Times ``spec['variants']`` for each norm in one process (interleaved).

  With ``spec['steps']``: profiles each (``profiles``) instead.
  """
  out = {"machine": machine_info(), "norms": {}, "profiles": {}}
  for norm in spec["norms"]:

    def profile(name, compiled, run, norm=norm):
      interleaved_samples({name: run}, 0, spec["warmup"])
      prof = profile_step(compiled, run, spec["steps"])
      out["profiles"][f"{norm}/{name}"] = prof

    out["norms"][norm] = time_variants(
        Setup(norm, spec["batch"], blocks_per_stage=spec["blocks_per_stage"]),
        spec["variants"],
        spec.get("runs", 0),
        spec["warmup"],
        profile=profile if spec.get("steps") else None,
    )
  return out


CHILDREN = {"convs": child_convs, "time": child_time}


def torch_step(args, channels_last: bool) -> dict[str, Any]:
  """The peer's ResNet20 step in ``args.torch_python`` (one layout)."""
  norms = "bn,sqd" if args.torch_sqd else "bn"
  cmd = [str(args.torch_peer), "--json"] + (
      f"--threads {args.torch_threads} --runs {args.torch_runs} "
      f"--batch {args.batch} --norms {norms}".split()
  )
  layout = ["--channels-last"] if channels_last else []
  return step_children.run_torch(args.torch_python, cmd + layout)


# --- The parent.


def torch_best_bn(runs: Sequence[dict]) -> tuple[float | None, str | None]:
  """PyTorch's best BatchNorm step: the faster layout's median over runs."""
  by_layout = collections.defaultdict(list)
  for r in runs:
    if "bn_ms" in r:
      layout = "channels_last" if r["channels_last"] else "nchw"
      by_layout[layout].append(r["bn_ms"])
  medians = {k: statistics.median(v) for k, v in by_layout.items()}
  best = min(medians, key=medians.get, default=None)
  return medians.get(best), best


def _print_time(result: dict) -> None:
  if "error" in result:
    print("  " + result["error"][:500])
  for norm, row in result.get("norms", {}).items():
    for name, v in row["variants"].items():
      v = collections.defaultdict(lambda: float("nan"), v)
      print(
          f"  {norm:>5} {name:<16} {format_ms(v.get('median_ms'))}  x"
          f"{v['ratio_to_base']:.2f} of base  loss_rel {v['loss_rel']:.1e} "
          f"update_rel {v['update_rel']:.1e} {v.get('error', '')[:200]}",
          flush=True,
      )


def _print_convs(result: dict, names: Sequence[str]) -> None:
  for row in result.get("shapes", []):
    cells = [f"{n} {row[n]['fwd']:.1f}/{row[n]['fwd+bwd']:.1f}" for n in names]
    print(f"  {str(row['shape']):<20} " + " ".join(cells))
  totals = result.get("totals_ms", {})
  for name, ms in totals.items():
    ratio = ms / totals[names[0]]
    print(f"  the step's convs, {name:<16} {ms:8.1f} ms  x{ratio:.2f}")
  print("  " + result.get("error", "")[:500])


def _print_profile(result: dict) -> None:
  if "error" in result:
    print("  " + result["error"][:500])
  for key, prof in step_profile.printable_profiles(result, "by_kind"):
    print(
        f"  {key}: traced step {prof['traced_step_ms']:.0f} ms, ops "
        f"{prof['op_wall_ms_per_step']:.0f} ms; shares of op time:"
    )
    for group in ("kind", "phase", "stage"):
      shares = prof[f"by_{group}"].items()
      print(
          f"    by {group}: "
          + ", ".join(f"{k} {100 * v['share']:.0f}%" for k, v in shares)
      )
    for o in prof["top_ops"][:8]:
      name = (o["op_name"] or "")[-60:]
      print(
          f"    {o['op'][:30]:<30} {o['wall_ms']:6.1f} ms {o['kind']:<24} {name}"
      )


def _per_norm_processes(spec, norms, devices, flag_set) -> dict[str, Any]:
  """``time`` children, one per norm, as one result.

  A process of its own per norm, as the CLI trains one: a second compiled
  step in the same process shares its heap (:mod:`train.loop.host_memory`)
  and slows the other down (docs/performance.md).
  """
  merged = {"norms": {}, "flag_set": flag_set, "wall_s": 0.0}
  for norm in norms:
    one = dict(spec, norms=[norm])
    result = run_child(_MODULE, "time", one, devices=devices, flag_set=flag_set)
    merged["wall_s"] += result.get("wall_s", 0.0)
    merged["norms"].update(result.get("norms", {}))
    merged.setdefault("machine", result.get("machine"))
    if "error" in result:
      merged["error"] = f"{merged.get('error', '')}{norm}: {result['error']} "
  return merged


def _flags(report, args, common) -> str:
  """The flags section; returns the fastest exact flag set (or default)."""
  norm = args.norms[0]
  print(f"flags (1 device, {norm}, base, {args.runs} runs)...", flush=True)
  spec = dict(common, norms=[norm], variants=["base"], runs=args.runs)
  results, ms, loss = [], collections.defaultdict(list), {}
  for flag_set in ["default", *args.flag_sets, "default"]:
    results.append(
        run_child(_MODULE, "time", spec, devices=1, flag_set=flag_set)
    )
    report.put("flags", results)
    row = results[-1].get("norms", {}).get(norm, {"variants": {}})
    v = row["variants"].get("base", {})
    if "median_ms" in v:
      ms[flag_set].append(v["median_ms"])
      loss.setdefault(flag_set, v["loss"])
    ratio = v.get("median_ms", np.nan) / (ms["default"] or [np.nan])[0]
    print(
        f"  {flag_set:<22} {format_ms(v.get('median_ms'))} x{ratio:.2f}  loss "
        f"{v.get('loss')} {results[-1].get('error', '')[:300]}",
        flush=True,
    )
  ref = statistics.median(ms.pop("default", [np.nan]))
  report.data["flags_summary"] = summary = {
      f: dict(median_ms=m[0], ratio_to_default=m[0] / ref, loss=loss[f])
      for f, m in ms.items()
  }
  exact = {f: v for f, v in summary.items() if f not in INEXACT_FLAG_SETS}
  best = min(exact, key=lambda f: exact[f]["median_ms"], default=None)
  return best if best and exact[best]["ratio_to_default"] < 1 else "default"


def _summary(report, args, torch_runs) -> list[dict[str, Any]]:
  tbn, layout = torch_best_bn(torch_runs)
  best = (
      f" (PyTorch's best BatchNorm step: {tbn:.1f} ms, {layout})" if tbn else ""
  )
  print(f"summary{best}:")
  report.data["torch_best_bn"] = {"ms": tbn, "layout": layout}
  rows = []
  for devices, flag_set, r in measured_runs(report.data):
    for norm in args.norms:
      for variant in r.get("norms", {}).get(norm, {}).get("variants", {}):
        ms = median_ms(r, norm, variant)
        if ms is None:
          continue
        ratio = ms / tbn if tbn else None
        met = None if ratio is None else ratio <= TARGET
        keys = ("devices flags norm variant median_ms ratio_to_torch_bn "
                "meets_target").split()  # fmt: skip
        values = (devices, flag_set, norm, variant, ms, ratio, met)
        rows.append(dict(zip(keys, values)))
        label = f"{norm} {variant}, {devices} dev, {flag_set}"
        print_ratio_line(label, ms, tbn, width=40)
  sq = [r["sqd_ms"] for r in torch_runs if "sqd_ms" in r]
  if sq:
    print(f"  PyTorch kthvalue-SQD2 step {statistics.median(sq):.1f} ms")
  return rows


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  cpus = os.cpu_count() or 1
  for flag, default, text in (
      ("--runs", 7, "timed steps or calls per case (median)"),
      ("--warmup", 2, "untimed calls first"),
      ("--batch", 256, "the train step's batch"),
      ("--profile-steps", 2, "traced steps"),
      ("--torch-runs", 11, "the peer's timed steps"),
      ("--torch-threads", cpus, "the peer's torch threads"),
      (
          "--blocks-per-stage",
          3,
          "the ResNet's blocks per stage (3: ResNet20, the peer's model; "
          "fewer: a smoke run whose ratios to the peer mean nothing)",
      ),
  ):
    parser.add_argument(flag, type=int, default=default, help=text)
  sections = ["convs", "variants", "profile", "flags", "final"]
  for flag, default, choices in (
      ("--norms", ["bn", "sqd2"], None),
      ("--sections", sections, sections),
      ("--formulations", list(FORMULATIONS), list(FORMULATIONS)),
      ("--variants", list(VARIANTS), list(VARIANTS)),
      ("--final-variants", FINAL_VARIANTS, list(VARIANTS)),
      ("--flag-sets", list(DEFAULT_FLAG_SETS), list(FLAG_SETS)),
  ):
    parser.add_argument(flag, nargs="+", default=default, choices=choices)
  parser.add_argument("--devices", type=int, nargs="+", default=[1, cpus])
  parser.add_argument(
      "--best-flags",
      choices=list(FLAG_SETS),
      help="the final section's flag set (default: the fastest exact one)",
  )
  parser.add_argument("--torch-python", help="python of a venv with torch")
  parser.add_argument("--torch-peer", type=Path, default=DEFAULT_PEER)
  parser.add_argument(
      "--torch-sqd", action="store_true", help="also the peer's kthvalue SQD2"
  )
  parser.add_argument(
      "--quick",
      action="store_true",
      help="smoke check: batch 32, 2 runs, few formulations and flag sets",
  )
  parser.add_argument(
      "--out",
      default=os.path.join(tempfile.gettempdir(), "bench_resnet_step.json"),
      help="the JSON results (default: %(default)s)",
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.batch, args.runs, args.warmup, args.torch_runs = 32, 2, 1, 2
    args.profile_steps = 1
    args.formulations = ["flax", "resnet", "im2col"]
    args.variants = ["base", "flax", "im2col"]
    args.flag_sets = ["ynn_off"]
    args.devices = [max(args.devices)]
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--child"]:
    return step_children.child_main(CHILDREN, argv[1], json.loads(argv[2]))
  args = parse_args(argv)
  report = Report(args, argv, _MODULE)
  t_start = time.perf_counter()
  common = dict(
      batch=args.batch,
      warmup=args.warmup,
      blocks_per_stage=args.blocks_per_stage,
  )
  torch_runs = []

  def torch_round(label):
    print(f"PyTorch peer ({args.torch_peer.name}), {label}...", flush=True)
    for channels_last in (False, True):
      torch_runs.append(dict(torch_step(args, channels_last), round=label))
      report.put("torch", torch_runs)
      print(f"  {torch_runs[-1]}", flush=True)

  if args.torch_python:
    torch_round("first")
  if "convs" in args.sections:
    print(f"convs (each shape alone, batch {args.batch}; fwd/fwd+bwd ms)...")
    spec = dict(common, formulations=args.formulations, runs=args.runs)
    report.put("convs", run_child(_MODULE, "convs", spec, devices=1))
    _print_convs(report.data["convs"], args.formulations)
  if "variants" in args.sections:
    print(f"variants (1 device, default flags, {args.runs} runs)...")
    spec = dict(
        common, norms=args.norms, variants=args.variants, runs=args.runs
    )
    report.put("variants", run_child(_MODULE, "time", spec, devices=1))
    _print_time(report.data["variants"])
  pair = ["base", "flax"]
  if "profile" in args.sections:
    print("profile (1 device, default flags)...", flush=True)
    spec = dict(common, norms=args.norms, variants=pair)
    spec["steps"] = args.profile_steps
    report.put("profile", run_child(_MODULE, "time", spec, devices=1))
    _print_profile(report.data["profile"])
  best_flags = args.best_flags
  if "flags" in args.sections and best_flags is None:
    best_flags = _flags(report, args, common)
  report.put("best_flags", best_flags or "default")
  if "final" in args.sections:
    print(f"final: devices {args.devices} x flags default/{best_flags}...")
    # Earlier formulations too: which configuration wins can depend on them.
    spec = dict(common, variants=args.final_variants, runs=args.runs)
    finals = []
    for devices in dict.fromkeys(args.devices):
      for flag_set in dict.fromkeys(["default", report.data["best_flags"]]):
        if devices == 1 and flag_set == "default" and "variants" in report.data:
          continue  # measured in the variants section
        result = _per_norm_processes(spec, args.norms, devices, flag_set)
        finals.append(dict(result, devices=devices))
        report.put("final", finals)
        _print_time(result)
  if args.torch_python:
    torch_round("last")
  report.data["summary"] = _summary(report, args, torch_runs)
  report.data["seconds"] = round(time.perf_counter() - t_start, 1)
  report.data["complete"] = True
  report.save()
  print(f"done in {report.data['seconds']:.0f} s; results: {args.out}")
  return report.data


if __name__ == "__main__":
  main()
