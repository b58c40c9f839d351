"""The subprocesses of ``bench_lenet_step``: XLA flag sets, timing, torch.

XLA flags and the host device count are fixed when JAX starts, so every
measurement runs in a fresh interpreter (``python -m
benchmarks.bench_lenet_step --child KIND SPEC``, :func:`run_child`), which
prints one ``RESULT`` line of JSON; :func:`run_torch` times the PyTorch peer
in its own interpreter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np

from benchmarks.lenet_profile import layer_costs
from benchmarks.lenet_profile import profile_compiled
from benchmarks.lenet_setup import Setup
from benchmarks.lenet_setup import compare_outputs
from benchmarks.lenet_setup import summarize
from benchmarks.lenet_setup import time_interleaved
from benchmarks.machine import machine_info
from train import host_memory

REPO = Path(__file__).resolve().parents[1]
RESULT = "RESULT "


#: Flag set name -> (extra XLA_FLAGS, extra environment). All flags exist in
#: jaxlib 0.10.2 (an unknown flag aborts the process).
FLAG_SETS: dict[str, tuple[str, dict[str, str]]] = {
    "default": ("", {}),
    # YNNPACK fusions (on by default for convs, dots, reductions) off / fewer
    # / more.
    "ynn_off": ("--xla_cpu_experimental_ynn_fusion_type=", {}),
    "ynn_no_conv": (
        "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",
        {},
    ),
    "ynn_no_dot": (
        "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
        {},
    ),
    "ynn_plus_eltwise": ("--xla_cpu_experimental_ynn_fusion_type=+eltwise", {}),
    "onednn_dot": (
        "--xla_cpu_use_onednn=true "
        "--xla_cpu_experimental_onednn_fusion_type=dot,eltwise",
        {},
    ),
    "eigen_1thread": ("--xla_cpu_multi_thread_eigen=false", {}),
    "no_concurrency_sched": (
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
        {},
    ),
    "vector_512": ("--xla_cpu_prefer_vector_width=512", {}),
    "fast_runtime": ("--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_RUNTIME", {}),
    "fast_math": ("--xla_cpu_enable_fast_math=true", {}),  # not exact
    "nproc1": ("", {"PJRT_NPROC": "1"}),  # intra-op thread pool size
    "nproc4": ("", {"PJRT_NPROC": "4"}),
    # glibc's malloc defaults instead of the CLI's heap reuse
    # (train/host_memory.py): each step's temporaries in fresh pages.
    "glibc_malloc": ("", {"GBN_HOST_MALLOC": "default"}),
}
DEFAULT_FLAG_SETS = (
    "ynn_off",
    "ynn_no_conv",
    "ynn_no_dot",
    "ynn_plus_eltwise",
    "onednn_dot",
    "eigen_1thread",
    "no_concurrency_sched",
    "vector_512",
    "fast_math",
    "nproc1",
    "nproc4",
)
#: Flag sets that may change results (never picked as "best" automatically).
INEXACT_FLAG_SETS = frozenset({"fast_math"})


def child_time(spec: dict[str, Any]) -> dict[str, Any]:
  """Times ``spec['variants']`` for each norm in one process.

  ``spec``: norms, variants, batch, runs, warmup, and optionally
  ``adaptive``: time all variants for the first norm, then only base and the
  ``adaptive`` fastest ones for the others.
  """
  out = {"machine": machine_info(), "norms": {}}
  variants = list(spec["variants"])
  for k, norm in enumerate(spec["norms"]):
    setup = Setup(norm, spec["batch"])
    names = variants
    if k and spec.get("adaptive"):
      first = out["norms"][spec["norms"][0]]["variants"]
      ranked = sorted(
          (v for v in first if v != "base" and "median_ms" in first[v]),
          key=lambda v: first[v]["median_ms"],
      )
      names = ["base"] + ranked[: spec["adaptive"]]
    row = {"devices": setup.mesh.size, "variants": {}}
    fns, outs = {}, {}
    for name in names:
      try:
        compiled, state, seconds = setup.compile(name)
        outs[name] = jax.device_get(
            compiled(state, setup.images, setup.labels, np.int32(0))
        )
        fns[name] = setup.runner(compiled, state)
        row["variants"][name] = {
            "compile_s": round(seconds, 2),
            "loss": float(outs[name][1]["loss"]),
        }
      except Exception as e:  # pylint: disable=broad-except
        row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    if "base" in outs:
      for name in outs:
        if name != "base":
          row["variants"][name].update(
              compare_outputs(setup.state, outs["base"], outs[name])
          )
    samples = time_interleaved(fns, spec["runs"], spec["warmup"])
    for name, s in samples.items():
      row["variants"][name].update(summarize(s))
    if "base" in samples:
      base = statistics.median(samples["base"])
      for name, s in samples.items():
        row["variants"][name]["ratio_to_base"] = statistics.median(s) / base
    out["norms"][norm] = row
  return out


def child_profile(spec: dict[str, Any]) -> dict[str, Any]:
  """Profiles ``spec['variants']`` for each norm, and times the layers alone.

  ``spec``: norms, variants, batch, warmup, steps (traced), and ``layers``
  (time each layer alone: every one for the first norm, the norm layers for
  the others) with ``layer_runs``.
  """
  out = {"machine": machine_info(), "profiles": {}}
  for norm in spec["norms"]:
    setup = Setup(norm, spec["batch"])
    for variant in spec["variants"]:
      try:
        compiled, state, _ = setup.compile(variant)
        run = setup.runner(compiled, state)
        for _ in range(spec["warmup"]):
          jax.block_until_ready(run())
        out["profiles"][f"{norm}/{variant}"] = profile_compiled(
            compiled, run, spec["steps"]
        )
      except Exception as e:  # pylint: disable=broad-except
        out["profiles"][f"{norm}/{variant}"] = {
            "error": f"{type(e).__name__}: {e}"[:500]
        }
    if spec.get("layers"):  # the other norms: only their norm layers
      out.setdefault("layers", {})[norm] = layer_costs(
          norm,
          spec["batch"],
          spec["layer_runs"],
          spec["warmup"],
          names=None if norm == spec["norms"][0] else ("norm1", "norm2"),
      )
  return out


def child_main(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
  """A child's run (``--child KIND SPEC``): the result, printed as JSON.

  Host memory is set up as the CLI sets it (:mod:`train.host_memory`; the
  ``glibc_malloc`` flag set keeps glibc's defaults instead).
  """
  host_memory.configure()
  result = {"time": child_time, "profile": child_profile}[kind](spec)
  print(RESULT + json.dumps(result), flush=True)
  return result


_TORCH_CHILD = r"""
import json, os, sys, time, statistics
import torch, torch.nn as nn, torch.nn.functional as F
peer_path, runs, warm, threads, norms, alpha, batch = sys.argv[1:8]
sys.path.insert(0, os.path.dirname(peer_path))
peer = __import__(os.path.splitext(os.path.basename(peer_path))[0])
if int(threads):
  torch.set_num_threads(int(threads))
dev = torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(int(batch), 1, 28, 28, device=dev)
y = torch.randint(0, 10, (int(batch),), device=dev)
res = {"torch": torch.__version__, "threads": torch.get_num_threads(),
       "batch": int(batch)}
for name in norms.split(","):
  norm = nn.BatchNorm2d if name == "bn" else (lambda c: peer.SQD(c, float(alpha)))
  model = peer.lenet(norm).to(dev)
  opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=5e-4)
  def f():
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
  res[name + "_ms"] = peer.timed(f, dev, int(runs), int(warm))
print("RESULT " + json.dumps(res))
"""


def run_child(
    kind: str,
    spec: dict[str, Any],
    *,
    devices: int,
    flag_set: str = "default",
    timeout: float = 900,
) -> dict:
  """Runs ``kind`` (time/profile) in a fresh interpreter with the flag set."""
  flags, env_extra = FLAG_SETS[flag_set]
  env = {
      k: v
      for k, v in os.environ.items()
      if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")
  }
  env.update(
      env_extra,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=(
          f"--xla_force_host_platform_device_count={devices} {flags}"
      ).strip(),
  )
  t = time.perf_counter()
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "benchmarks.bench_lenet_step",
          "--child",
          kind,
          json.dumps(spec),
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  wall = time.perf_counter() - t
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT):
      result = json.loads(line[len(RESULT) :])
      result["wall_s"] = round(wall, 1)
      result["flag_set"] = flag_set
      return result
  return {
      "error": (
          f"child {kind} ({flag_set}, {devices} devices) exited "
          f"{proc.returncode}: {proc.stderr[-2000:]}"
      ),
      "flag_set": flag_set,
      "wall_s": round(wall, 1),
  }


def run_torch(args) -> dict[str, Any]:
  """The peer's LeNet step ms (``bn_ms``, ``sqd_ms``) in ``--torch-python``."""
  norms = "bn,sqd" if args.torch_sqd else "bn"
  cmd = [
      args.torch_python,
      "-c",
      _TORCH_CHILD,
      str(args.torch_peer),
      str(args.torch_runs),
      str(max(args.warmup, 3)),
      str(args.torch_threads),
      norms,
      "0.5",
      str(args.batch),
  ]
  t = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT):
      result = json.loads(line[len(RESULT) :])
      result["wall_s"] = round(time.perf_counter() - t, 1)
      return result
  return {
      "error": (
          f"torch child exited {proc.returncode}: " f"{proc.stderr[-2000:]}"
      )
  }
