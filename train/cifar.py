"""``python -m train.cifar``: ResNet20 on CIFAR-10 (the paper's setting) by default.

Defaults: ResNet20, CIFAR-10, batch 256, constant learning rate 0.1, plain
SGD (momentum 0), weight decay 1e-4, 100 epochs, crop + flip augmentation,
``--norm bn``. See ``--help`` and :mod:`train.main`.
"""

from __future__ import annotations

from collections.abc import Sequence
import sys

from train.loop import host_devices
from train.loop import host_memory

# configs.CIFAR.model (a test checks), known before JAX starts.
DEFAULT_MODEL = "resnet20"

if __name__ == "__main__":  # before JAX starts: host devices for the model,
  host_devices.configure(  # and the step's memory reused from step to step
      host_devices.model_from_argv(sys.argv[1:], DEFAULT_MODEL)
  )
  host_memory.configure()

# pylint: disable=g-import-not-at-top
from train import configs  # noqa: E402 (after the pre-JAX setup)
from train import main as train_main  # noqa: E402

_ABOUT = (
    "Defaults: the GBN paper's ResNet20 CIFAR-10 setting (batch 256, plain "
    "SGD); the constant learning rate 0.1, weight decay 1e-4 and 100 epochs "
    "are this project's choice (He et al.'s starting rate)."
)


def main(argv: Sequence[str] | None = None) -> int:
  return train_main.run(
      argv, configs.CIFAR, prog="python -m train.cifar", about=_ABOUT
  )


if __name__ == "__main__":
  sys.exit(main())
