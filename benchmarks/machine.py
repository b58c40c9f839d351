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
  (``bench_lenet_step`` varies them).
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
      "devices": [str(d) for d in devices],
      "device_kind": devices[0].device_kind,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
      "PJRT_NPROC": os.environ.get("PJRT_NPROC"),
  }
