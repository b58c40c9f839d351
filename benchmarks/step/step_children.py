"""The step benchmarks' subprocesses: XLA flag sets, children, the torch peer.

XLA flags and the host device count are fixed when JAX starts, so every
measurement of ``bench_lenet_step`` and ``bench_resnet_step`` runs in a fresh
interpreter (``python -m MODULE --child KIND SPEC``, :func:`run_child`), which
prints one ``RESULT`` line of JSON (:func:`child_main`); :func:`run_torch`
runs a PyTorch peer in its own interpreter the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import json
import os
from pathlib import Path
import subprocess
import sys
import time
from typing import Any

from train.loop import host_memory

REPO = Path(__file__).resolve().parents[2]
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
    # (train/loop/host_memory.py): each step's temporaries in fresh pages.
    "glibc_malloc": ("", {"GBN_HOST_MALLOC": "default"}),
}
#: Flag sets that may change results (never picked as "best" automatically).
INEXACT_FLAG_SETS = frozenset({"fast_math"})


def child_env(devices: int, flag_set: str = "default") -> dict[str, str]:
  """This process's environment with ``devices`` CPU devices and the flags.

  The parent's own XLA flags and thread-pool size are dropped: a child runs
  exactly the flag set it is named for.
  """
  if flag_set not in FLAG_SETS:
    raise ValueError(f"flag_set {flag_set!r} is not one of {sorted(FLAG_SETS)}")
  if devices < 1:
    raise ValueError(f"devices must be at least 1, got {devices}")
  flags, env_extra = FLAG_SETS[flag_set]
  drop = ("XLA_FLAGS", "PJRT_NPROC", "NPROC")
  env = {k: v for k, v in os.environ.items() if k not in drop}
  count = f"--xla_force_host_platform_device_count={devices}"
  env.update(
      env_extra, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{count} {flags}".strip()
  )
  return env


def run_json(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
    what: str = "",
) -> dict[str, Any]:
  """Runs ``cmd`` in the repository root; its ``RESULT`` line's JSON.

  Always with ``wall_s``; where no ``RESULT`` line came (a crash, a
  timeout), ``error`` says why, prefixed by ``what``.
  """
  prefix = f"{what} " if what else ""
  t = time.perf_counter()
  try:
    proc = subprocess.run(
        list(cmd),
        cwd=REPO,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    return {
        "error": f"{prefix}{type(e).__name__}: {e}",
        "wall_s": round(time.perf_counter() - t, 1),
    }
  wall = round(time.perf_counter() - t, 1)
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT):
      return dict(json.loads(line[len(RESULT) :]), wall_s=wall)
  return {
      "error": f"{prefix}exited {proc.returncode}: {proc.stderr[-2000:]}",
      "wall_s": wall,
  }


def run_child(
    module: str,
    kind: str,
    spec: dict[str, Any],
    *,
    devices: int,
    flag_set: str = "default",
    timeout: float = 1800,
) -> dict[str, Any]:
  """``python -m module --child kind spec`` with ``devices`` and the flags.

  Returns the child's result with ``wall_s`` and ``flag_set``, or an
  ``error`` naming the child.
  """
  cmd = [sys.executable, "-m", module, "--child", kind, json.dumps(spec)]
  what = f"child {kind} ({flag_set}, {devices} devices)"
  result = run_json(
      cmd, env=child_env(devices, flag_set), timeout=timeout, what=what
  )
  return dict(result, flag_set=flag_set)


def run_torch(
    python: str, argv: Sequence[str], *, timeout: float = 1800
) -> dict[str, Any]:
  """Runs ``python argv...`` (a PyTorch peer that prints a ``RESULT`` line)."""
  if not python:
    raise ValueError("python (the torch interpreter) must be given")
  return run_json([python, *argv], timeout=timeout, what="torch child")


def child_main(
    children: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]],
    kind: str,
    spec: dict[str, Any],
) -> dict[str, Any]:
  """A child's run (``--child KIND SPEC``): the result, printed as JSON.

  Host memory is set up as the CLI sets it (:mod:`train.loop.host_memory`; the
  ``glibc_malloc`` flag set keeps glibc's defaults instead), so the step is
  timed as training runs it.
  """
  if kind not in children:
    raise ValueError(f"kind {kind!r} is not one of {sorted(children)}")
  host_memory.configure()
  result = children[kind](spec)
  print(RESULT + json.dumps(result), flush=True)
  return result
