"""Use every CPU core: one XLA host device per core, set before JAX starts.

XLA:CPU runs most of a small model's step on one thread; splitting the host
into several devices and the batch across them (the training loop is data
parallel over all devices) keeps every core busy. ResNet20 keeps one device
(:data:`ONE_DEVICE_MODELS`). Step times on one and on several host devices,
with the commands that measure them: ``docs/performance.md``.

``GBN_HOST_DEVICES`` controls it: ``auto`` (default) makes one device per core,
except for the models in :data:`ONE_DEVICE_MODELS`, ``1`` turns it off, any
other number is used as given; the loop then uses the most devices that divide
the batch evenly. Nothing happens if JAX is already
imported or ``XLA_FLAGS`` already sets the host device count. On GPU/TPU
machines the accelerators stay the default devices; this only splits the CPU
backend.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import os
import sys

ENV_VAR = "GBN_HOST_DEVICES"
_FLAG = "--xla_force_host_platform_device_count"

#: Models that ``auto`` keeps on one host device. ResNet20's convolutions,
#: selections and large elementwise work already run on every core through
#: XLA's intra-op threads, and a split adds the norms' statistics across
#: devices at every layer, so its epochs are faster on one device
#: (``docs/performance.md``, "Host memory").
ONE_DEVICE_MODELS = frozenset({"resnet20"})


def choose(
    cores: int | None = None,
    setting: str | None = None,
    model: str | None = None,
) -> int:
  """The number of host devices to create for ``model`` (None: any)."""
  setting = (
      os.environ.get(ENV_VAR, "auto") if setting is None else setting
  ).strip()
  if setting == "auto":
    if model in ONE_DEVICE_MODELS:
      return 1
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


def model_from_argv(argv: Sequence[str], default: str) -> str:
  """The ``--model`` that a command line asks for, read before JAX starts.

  The CLI's own parser reads the flags only after importing the training
  suite, which imports JAX; this reads ``--model`` alone, as that parser
  would (``--model X``, ``--model=X``), and leaves errors to it.
  """
  parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
  parser.add_argument("--model", default=default)
  try:
    return parser.parse_known_args(list(argv))[0].model
  except argparse.ArgumentError:
    return default


def configure(model: str | None = None) -> None:
  """Sets ``XLA_FLAGS`` for :func:`choose`'s device count, if JAX is not started."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "jax" in sys.modules or _FLAG in flags:
    return
  count = choose(model=model)
  if count > 1:
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
