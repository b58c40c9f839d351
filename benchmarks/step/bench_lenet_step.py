"""Where the LeNet train step's time goes on XLA:CPU, and what makes it faster.

Times the training suite's real jitted step (``train.loop.train_steps.train_step``,
with ``train.loop.train_state.create_train_state``/``create_optimizer`` and the
mesh and shardings of ``train.loop.programs.compile_program``) on
Fashion-MNIST-shaped random data (batch 1000, 28x28x1), ``--norm bn`` and
``sqd2``. Each section runs in fresh subprocesses (XLA flags and the host
device count are fixed when JAX starts):

1. ``variants``: exact reformulations of the model with the same parameter
   tree, fed through the same ``train_step`` (``state.apply_fn`` swapped):
   max-pool as reshape + max or with a mask backward instead of
   ``select_and_scatter``, convolutions (or only their backward passes) as
   im2col matmuls, NCHW layout. Timed interleaved with the real model in one
   process; the fastest for the first norm is the "winner".
2. ``profile``: a traced step (``jax.profiler``) of the real model and the
   winner, XLA op times by layer and phase; and each layer's forward and
   forward+backward jitted alone on its step shape, for every formulation
   (``layers``; the trace only sees the launch of Eigen's asynchronous
   convolution and dot thunks, these timings see everything).
3. ``flags``: XLA:CPU flags and intra-op thread-pool sizes (``PJRT_NPROC``),
   one process each, timing the winner; ratios are to the median of the
   default-flag processes run first and last.
4. ``final``: 1 vs 2 host devices x default vs the best exact flag set, real
   model and winner, both norms.
5. ``--torch-python``: the peer's (``peers/torch_sqd.py``) LeNet
   step with ``BatchNorm2d`` (and its kthvalue SQD with ``--torch-sqd``) in
   that interpreter, first and last; every step time is also given as a
   ratio to PyTorch's BatchNorm step.

Each variant's loss and parameter update are compared with the real model's
on the same batch (``loss_rel``, ``update_rel``), each flag set's loss with
the default flags'. Medians after warm-up. On a shared machine the ms are
noisy: read the ratios, and run it when the cores are idle (about 6 minutes
on 2 idle cores).

  python -m benchmarks.step.bench_lenet_step \\
      --out results/benchmarks/lenet_step_cpu.json \\
      --torch-python /work/torchvenv/bin/python
  python -m benchmarks.step.bench_lenet_step --quick      # smoke check

The pieces: ``benchmarks.step.lenet_variants`` (the reformulations),
``lenet_setup`` (the real step and the exactness checks), ``lenet_profile``
(LeNet's layers in a trace, layers alone), ``lenet_children`` (the
subprocesses); the step-benchmark harness it shares with
``bench_resnet_step``: ``step_setup`` (the step on random data, timing
variants), ``step_children`` (flag sets, child processes), ``step_profile``
(trace attribution), ``step_report`` (the JSON report); this module is the
command line and the sections.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import os
from pathlib import Path
import statistics
import sys
import time
from typing import Any

from benchmarks.step.lenet_children import DEFAULT_FLAG_SETS
from benchmarks.step.lenet_children import MODULE
from benchmarks.step.lenet_children import child_main
from benchmarks.step.lenet_children import torch_step
from benchmarks.step.lenet_variants import DEFAULT_VARIANTS
from benchmarks.step.lenet_variants import VARIANTS
from benchmarks.step.step_children import FLAG_SETS
from benchmarks.step.step_children import INEXACT_FLAG_SETS
from benchmarks.step.step_children import REPO
from benchmarks.step.step_children import run_child
from benchmarks.step.step_profile import printable_profiles
from benchmarks.step.step_report import Report
from benchmarks.step.step_report import format_ms
from benchmarks.step.step_report import measured_runs
from benchmarks.step.step_report import median_ms
from benchmarks.step.step_report import print_ratio_line

DEFAULT_PEER = REPO / "peers" / "torch_sqd.py"
SECTIONS = ("variants", "profile", "flags", "final")


# ---------------------------------------------------------------------------
# The report's printing.


def torch_bn(report: Report) -> float | None:
  vals = [r["bn_ms"] for r in report.data.get("torch", []) if "bn_ms" in r]
  return statistics.median(vals) if vals else None


def _print_profile(result: dict) -> None:
  for key, prof in printable_profiles(result, "by_part"):
    print(
        f"  {key}: traced step {prof['traced_step_ms']:.0f} ms; ops "
        f"{prof['op_wall_ms_per_step']:.0f} ms; share of op time by "
        "layer/phase (Eigen conv/dot thunks run asynchronously: only their "
        "launch is traced, see 'layers'):"
    )
    for part, v in list(prof["by_part"].items())[:12]:
      print(f"    {part:<32} {100 * v['share']:5.1f}%  {v['wall_ms']:7.1f} ms")
    print(
        "    top ops: "
        + ", ".join(
            f"{o['op']} ({o['part']}) {100 * o['share']:.0f}%"
            for o in prof["top_ops"][:6]
        )
    )
  for norm, layers in result.get("layers", {}).items():
    print(f"  {norm}: each layer jitted alone, fwd / fwd+bwd ms:")
    for name, v in layers.items():
      if "error" in v:
        print(f"    {name:<22} {v['error'][:150]}")
      else:
        print(f"    {name:<22} {v['fwd']:8.1f} {v['fwd+bwd']:8.1f}")
  if "error" in result:
    print("  " + result["error"])


# ---------------------------------------------------------------------------
# The command line and the sections, in the order they run.


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The flags (``--quick`` applied: it overrides the sizes)."""
  # One call per flag: alike in shape to the other benchmarks' flags (the
  # duplicates tool pairs them), but no logic is repeated.
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      "--runs", type=int, default=7, help="timed steps per variant (median)"
  )
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch", type=int, default=1000)
  parser.add_argument("--norms", nargs="+", default=["bn", "sqd2"])
  parser.add_argument(
      "--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS)
  )
  parser.add_argument(
      "--variants",
      nargs="+",
      default=list(DEFAULT_VARIANTS),
      choices=list(VARIANTS),
  )
  parser.add_argument(
      "--adaptive",
      type=int,
      default=2,
      help="after the first norm, time only base and this "
      "many of its fastest variants (0: all)",
  )
  parser.add_argument(
      "--winner",
      choices=list(VARIANTS),
      help="the variant for profile/flags/final (default: the "
      "fastest bn variant of the variants section)",
  )
  parser.add_argument(
      "--flag-sets",
      nargs="+",
      default=list(DEFAULT_FLAG_SETS),
      choices=[f for f in FLAG_SETS if f != "default"],
  )
  parser.add_argument(
      "--flag-variants",
      nargs="+",
      default=["winner"],
      help="variants timed in each flags process ('winner' "
      "is replaced by the winner)",
  )
  parser.add_argument(
      "--flag-runs",
      type=int,
      default=7,
      help="timed steps per variant in each flags process",
  )
  parser.add_argument(
      "--best-flags",
      choices=list(FLAG_SETS),
      help="flag set for the final section (default: the "
      "fastest exact one of the flags section)",
  )
  parser.add_argument(
      "--devices",
      type=int,
      nargs="+",
      default=[1, os.cpu_count() or 1],
      help="host device counts for the final section",
  )
  parser.add_argument("--profile-steps", type=int, default=2)
  parser.add_argument(
      "--layer-runs",
      type=int,
      default=5,
      help="timed runs per layer piece (0: no layer timing)",
  )
  parser.add_argument(
      "--torch-python",
      help="python of a venv with torch: also time the "
      "peer's LeNet BatchNorm step (at --batch)",
  )
  parser.add_argument("--torch-peer", type=Path, default=DEFAULT_PEER)
  parser.add_argument("--torch-runs", type=int, default=11)
  parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
  parser.add_argument(
      "--torch-sqd",
      action="store_true",
      help="also time the peer's kthvalue-SQD step",
  )
  parser.add_argument(
      "--quick",
      action="store_true",
      help="smoke check: batch 64, 1-2 runs, few variants, "
      "one flag set, 2 devices only in final",
  )
  parser.add_argument("--out", help="write the results as JSON here")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch, args.runs, args.flag_runs, args.warmup = 64, 2, 2, 1
    args.torch_runs, args.profile_steps, args.layer_runs = 2, 1, 1
    args.variants = ["base", "pool_mask", "pool_mask+wgrad"]
    args.flag_sets = ["ynn_off"]
    args.devices = [max(args.devices)]
  return args


def _spec(args, **fields) -> dict[str, Any]:
  """A child's spec: the batch and warm-up of every section, and ``fields``."""
  return dict(batch=args.batch, warmup=args.warmup, **fields)


def torch_first(report: Report, args) -> None:
  """The PyTorch peer, first (it runs again last)."""
  print(
      f"PyTorch peer ({args.torch_peer.name}, {args.torch_threads} "
      f"threads, batch {args.batch})...",
      flush=True,
  )
  report.put("torch", [torch_step(args)])
  print(f"  {report.data['torch'][0]}", flush=True)


def _print_variants(result: dict) -> None:
  if "error" in result:
    print("  " + result["error"])
  for norm, row in result.get("norms", {}).items():
    for name, v in row["variants"].items():
      if "error" in v:
        print(f"  {norm:>5} {name:<20} {v['error'][:200]}")
        continue
      diff = (
          f"  loss_rel {v['loss_rel']:.1e} update_rel {v['update_rel']:.1e}"
          if "loss_rel" in v
          else ""
      )
      print(
          f"  {norm:>5} {name:<20} {format_ms(v.get('median_ms'))}  "
          f"x{v.get('ratio_to_base', float('nan')):.2f} of base{diff}",
          flush=True,
      )


def section_variants(report: Report, args) -> str | None:
  """Times every variant; returns the first norm's fastest (not base)."""
  print(f"variants (1 device, default flags, {args.runs} runs)...", flush=True)
  result = run_child(
      MODULE,
      "time",
      _spec(
          args,
          norms=args.norms,
          variants=args.variants,
          runs=args.runs,
          adaptive=args.adaptive,
      ),
      devices=1,
  )
  report.put("variants", result)
  _print_variants(result)
  first = result.get("norms", {}).get(args.norms[0], {}).get("variants", {})
  timed = {
      k: v["median_ms"]
      for k, v in first.items()
      if k not in ("base", "flax_ops") and "median_ms" in v
  }
  return min(timed, key=timed.get) if timed else None


def section_profile(report: Report, args, winner: str) -> None:
  """Traces the real model and the winner, and times the layers alone."""
  print("profile (1 device, default flags)...", flush=True)
  result = run_child(
      MODULE,
      "profile",
      _spec(
          args,
          norms=args.norms,
          variants=list(dict.fromkeys(["base", winner])),
          steps=args.profile_steps,
          layers=args.layer_runs > 0,
          layer_runs=args.layer_runs,
      ),
      devices=1,
  )
  report.put("profile", result)
  _print_profile(result)


def _flags_summary(results: list[dict], norm: str, fvars: list[str]):
  """Each flag set's ms and loss against the default-flag processes'.

  Returns ``(summary, ref)``: ``flag set -> [entry per process]`` (printed
  as it goes) and the default processes' median ms per variant.
  """
  defaults = [r for r in results if r["flag_set"] == "default"]
  ref = {
      v: statistics.median(
          [median_ms(r, norm, v) for r in defaults if median_ms(r, norm, v)]
          or [float("nan")]
      )
      for v in fvars
  }
  ref_loss = next(
      (
          r["norms"][norm]["variants"][fvars[0]].get("loss")
          for r in defaults
          if "norms" in r
      ),
      None,
  )
  summary = {}
  for r in results:
    if "error" in r:
      print(f"  {r['flag_set']:<22} {r['error'][:300]}")
      continue
    row = r["norms"][norm]["variants"]
    loss = row.get(fvars[0], {}).get("loss")
    entry = {
        v: {
            "median_ms": median_ms(r, norm, v),
            "ratio_to_default": (
                (median_ms(r, norm, v) or float("nan")) / ref[v]
            ),
        }
        for v in fvars
    }
    entry["loss_rel_to_default"] = (
        abs(loss - ref_loss) / abs(ref_loss)
        if loss is not None and ref_loss
        else float("nan")
    )
    summary.setdefault(r["flag_set"], []).append(entry)
    print(
        f"  {r['flag_set']:<22} "
        + "   ".join(
            f"{v} {format_ms(entry[v]['median_ms'])} "
            f"(x{entry[v]['ratio_to_default']:.2f})"
            for v in fvars
        )
        + f"   loss_rel {entry['loss_rel_to_default']:.1e}",
        flush=True,
    )
  return summary, ref


def section_flags(report: Report, args, winner: str) -> str | None:
  """One process per flag set (default first and last), the first norm only.

  Returns the fastest exact flag set for the winner if it beats the default
  ("default" if none does), or None where the winner was not timed.
  """
  norm = args.norms[0]
  fvars = list(
      dict.fromkeys(winner if v == "winner" else v for v in args.flag_variants)
  )
  print(
      f"flags (1 device, {norm}, {', '.join(fvars)}, {args.flag_runs} "
      "runs)...",
      flush=True,
  )
  spec = _spec(args, norms=[norm], variants=fvars, runs=args.flag_runs)
  order = ["default", *args.flag_sets] + (["default"] if args.flag_sets else [])
  results = []
  for flag_set in order:
    results.append(
        run_child(MODULE, "time", spec, devices=1, flag_set=flag_set)
    )
    report.put("flags", results)
  summary, ref = _flags_summary(results, norm, fvars)
  report.data["flags_summary"] = summary
  if winner not in fvars:
    return None
  candidates = {
      f: e[0][winner]["median_ms"]
      for f, e in summary.items()
      if f != "default"
      and f not in INEXACT_FLAG_SETS
      and e[0][winner]["median_ms"]
  }
  if not candidates:
    return None
  best = min(candidates, key=candidates.get)
  return best if candidates[best] < ref[winner] else "default"


def section_final(report: Report, args, winner: str, best_flags: str) -> None:
  """Host device counts x default and best flags: base and winner, all norms."""
  print(
      f"final: devices {args.devices} x flags default/{best_flags}, "
      f"base and {winner}, {', '.join(args.norms)}, {args.runs} runs...",
      flush=True,
  )
  spec = _spec(
      args,
      norms=args.norms,
      variants=list(dict.fromkeys(["base", winner])),
      runs=args.runs,
  )
  finals = []
  for devices in args.devices:
    for flag_set in dict.fromkeys(["default", best_flags]):
      if (
          devices == 1
          and flag_set == "default"
          and "norms" in report.data.get("variants", {})
      ):
        continue  # measured in the variants section
      finals.append(
          dict(
              run_child(
                  MODULE, "time", spec, devices=devices, flag_set=flag_set
              ),
              devices=devices,
          )
      )
      report.put("final", finals)
      if "error" in finals[-1]:
        print("  " + finals[-1]["error"][:300])


def torch_last(report: Report, args) -> None:
  """The PyTorch peer again, after everything else."""
  report.data["torch"].append(torch_step(args))
  report.save()
  print(f"  PyTorch again: {report.data['torch'][-1]}", flush=True)


def summary_rows(report: Report, args, winner: str) -> list[dict[str, Any]]:
  """Every measured configuration against PyTorch's BatchNorm step (printed)."""
  tbn = torch_bn(report)
  print(
      "summary"
      + (
          f" (PyTorch {report.data['torch'][0].get('torch')} "
          f"BatchNorm step {tbn:.1f} ms, median of "
          f"{len(report.data['torch'])} processes)"
          if tbn
          else ""
      )
      + ":"
  )
  rows = []
  for devices, flag_set, r in measured_runs(report.data):
    for norm in args.norms:
      for variant in dict.fromkeys(("base", winner)):
        ms = median_ms(r, norm, variant)
        if ms is None:
          continue
        rows.append(
            {
                "devices": devices,
                "flags": flag_set,
                "norm": norm,
                "variant": variant,
                "median_ms": ms,
                "ratio_to_torch_bn": ms / tbn if tbn else None,
            }
        )
        print_ratio_line(
            f"{norm} {variant}, {devices} dev, {flag_set}", ms, tbn
        )
  sq = [t["sqd_ms"] for t in report.data.get("torch", []) if "sqd_ms" in t]
  if sq:
    print(f"  PyTorch kthvalue-SQD step {statistics.median(sq):.1f} ms")
  return rows


def main(argv: Sequence[str] | None = None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--child"]:
    return child_main(argv[1], json.loads(argv[2]))
  args = parse_args(argv)
  report = Report(args, argv, MODULE)
  t_start = time.perf_counter()
  if args.torch_python:
    torch_first(report, args)

  winner = args.winner
  if "variants" in args.sections:
    fastest = section_variants(report, args)
    winner = winner or fastest
  winner = winner or "base"  # nothing else timed: the later sections time base
  report.data["winner"] = winner
  print(f"winner: {winner}", flush=True)
  if "profile" in args.sections:
    section_profile(report, args, winner)

  best_flags = args.best_flags
  if "flags" in args.sections:
    fastest = section_flags(report, args, winner)
    best_flags = best_flags or fastest
  best_flags = best_flags or "default"
  report.data["best_flags"] = best_flags
  report.save()
  if "final" in args.sections:
    section_final(report, args, winner, best_flags)
  if args.torch_python:
    torch_last(report, args)

  report.data["summary"] = summary_rows(report, args, winner)
  report.data["seconds"] = round(time.perf_counter() - t_start, 1)
  report.data["complete"] = True
  report.save()
  print(f"done in {report.data['seconds']:.0f} s", flush=True)
  return report.data


if __name__ == "__main__":
  main()
