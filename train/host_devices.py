"""Use every CPU core: one XLA host device per core, set before JAX starts.

XLA:CPU runs most of a small model's step on one thread; splitting the host
into several devices and the batch across them (the training loop is data
parallel over all devices) keeps every core busy. Measured on 2 cores: a LeNet
step at batch 1000 took 618-674 ms on 2 host devices against 796-1023 ms on one
(``README.md``, "Using every core").

``GBN_HOST_DEVICES`` controls it: ``auto`` (default) makes one device per core,
``1`` turns it off, any other number is used as given; the loop then uses the
most devices that divide the batch evenly. Nothing happens if JAX is already
imported or ``XLA_FLAGS`` already sets the host device count. On GPU/TPU
machines the accelerators stay the default devices; this only splits the CPU
backend.
"""

from __future__ import annotations

import os
import sys

ENV_VAR = "GBN_HOST_DEVICES"
_FLAG = "--xla_force_host_platform_device_count"


def choose(cores: int | None = None, setting: str | None = None) -> int:
  """The number of host devices to create."""
  setting = (
      os.environ.get(ENV_VAR, "auto") if setting is None else setting
  ).strip()
  if setting == "auto":
    return cores or os.cpu_count() or 1
  try:
    count = int(setting)
  except ValueError:
    count = 0
  if count < 1:
    raise SystemExit(
        f"{ENV_VAR} must be 'auto' or a positive integer, got {setting!r}"
    )
  return count


def configure() -> None:
  """Sets ``XLA_FLAGS`` for :func:`choose`'s device count, if JAX is not started."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "jax" in sys.modules or _FLAG in flags:
    return
  count = choose()
  if count > 1:
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
