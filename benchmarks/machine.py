"""The machine a benchmark ran on, as every benchmark's JSON records it."""

from __future__ import annotations

import datetime
import os
import platform
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
  machine a CPU timing came from: the development machine has been an AMD
  Zen 4 and an Intel Xeon on different days, and the compiled kernels'
  speed depends on the vector instructions (``GBN_CONV_MAX_ISA`` caps
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
