"""What every benchmark shares: its timing, its machine, its JSON.

The timing is same-process and interleaved: the cases run round-robin, run by
run, after warm-up, and each case's figure is the median of its samples
(:func:`interleaved_samples`, :func:`time_interleaved`). :func:`machine_info`
describes the machine in the one shape every benchmark's JSON records, and
:func:`write_result` writes the results so far after every row.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import flax
import jax


def machine_info() -> dict[str, Any]:
  """The date, host, devices, versions and XLA settings of this process.

  One shape for every benchmark (``results/benchmarks/bench_*.json``'s
  ``machine``, the children of ``bench_lenet_step``): ``devices`` lists the
  JAX devices (their count is its length), ``device_kind`` names the first
  one (the GPU model that ``device_check.sh`` names its files after), and
  ``XLA_FLAGS`` and ``PJRT_NPROC`` are the environment's
  (``bench_lenet_step`` varies them). ``cpu_model`` and ``cpu_vector_isa``
  (the widest of AVX-512 and AVX2 the CPU has, or ``None``) tell which
  machine a CPU timing came from: the compiled kernels' speed depends on
  the vector instructions (``GBN_CONV_MAX_ISA`` caps
  them).
  """
  devices = jax.devices()
  return {
      "date": (
          datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="seconds"
          )
      ),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      **_cpu(),
      "GBN_CONV_MAX_ISA": os.environ.get("GBN_CONV_MAX_ISA"),
      "devices": [str(d) for d in devices],
      "device_kind": devices[0].device_kind,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
      "PJRT_NPROC": os.environ.get("PJRT_NPROC"),
  }


def _cpu() -> dict[str, Any]:
  """``cpu_model`` and ``cpu_vector_isa`` from /proc/cpuinfo (Linux)."""
  model, flags = None, set()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
          model = value.strip()
        elif key.strip() == "flags" and not flags:
          flags = set(value.split())
  except OSError:
    pass
  isa = next((i for i in ("avx512f", "avx2") if i in flags), None)
  return {"cpu_model": model, "cpu_vector_isa": isa}


def time_interleaved(
    fns: dict, runs: int, warmup: int = 3, inner: int = 1
) -> dict[str, float]:
  """Median seconds per call of each fn (:func:`interleaved_samples`)."""
  samples = interleaved_samples(fns, runs, warmup, inner)
  return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_samples(
    fns: dict, runs: int, warmup: int = 3, inner: int = 1
) -> dict[str, list[float]]:
  """Seconds per call of each fn, ``runs`` samples each, called round-robin.

  Each fn dispatches one step and returns its (unblocked) result. A sample
  times ``inner`` back-to-back dispatches and blocks on the last: on an
  accelerator, where one step can take less than its dispatch, ``inner > 1``
  keeps the device busy and measures device time rather than Python overhead.
  """
  for fn in fns.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for _ in range(runs):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(inner):
        out = fn()
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - start) / inner)
  return samples


def add_timing_args(parser: argparse.ArgumentParser, runs: int) -> None:
  """``--runs`` (default ``runs``), ``--warmup``, ``--inner`` and ``--out``.

  The timing flags every layer benchmark (``layer.bench_gbn``,
  ``layer.bench_methods``, ``device.device_check_radix``) takes, read by :func:`interleaved_samples`.
  """
  parser.add_argument(
      "--runs", type=int, default=runs, help="timed samples per case (median)"
  )
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument(
      "--inner", type=int, default=1, help="dispatches per sample (~10 on GPU)"
  )
  parser.add_argument("--out", help="write the results as JSON here")


def command_line(module: str, argv: Sequence[str] | None) -> str:
  """``python -m module argv...``, as a result's ``command`` records it."""
  return " ".join([f"python -m {module}", *(argv or sys.argv[1:])])


def write_json(path: str | None, result: dict) -> dict:
  """Writes ``result`` to ``path`` (if any); returns it."""
  if path:
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
  return result


def write_result(path, run: dict, complete: bool = False, **fields) -> dict:
  """The results so far (written after every row, so a cut-off run keeps them).

  The machine, ``run``'s settings, whether the run is ``complete``, then
  ``fields`` (the rows).
  """
  result = {"machine": machine_info(), **run, "complete": complete, **fields}
  return write_json(path, result)
