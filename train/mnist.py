"""``python -m train.mnist``: LeNet on MNIST (the paper's setting) by default.

Defaults: LeNet, MNIST, batch 1000, constant learning rate 0.01, plain SGD
(momentum 0), weight decay 5e-4, 20 epochs, no augmentation, ``--norm bn``.
Same flags as ``python -m train.cifar`` (e.g. ``--dataset fashion_mnist``).
"""

from __future__ import annotations

from collections.abc import Sequence
import sys

from train.loop import host_devices
from train.loop import host_memory

# Alike train/cifar.py (the whole module): each dataset's own entry point,
# whose pre-JAX setup must run in it before its imports.
# configs.MNIST.model (a test checks), known before JAX starts.
DEFAULT_MODEL = "lenet"

if __name__ == "__main__":  # before JAX starts: host devices for the model,
  host_devices.configure(  # and the step's memory reused from step to step
      host_devices.model_from_argv(sys.argv[1:], DEFAULT_MODEL)
  )
  host_memory.configure()

# pylint: disable=g-import-not-at-top
from train import configs  # noqa: E402 (after the pre-JAX setup)
from train import main as train_main  # noqa: E402

_ABOUT = (
    "Defaults: the GBN paper's LeNet MNIST setting (batch 1000, learning "
    "rate 0.01, plain SGD); 20 epochs and weight decay 5e-4 (Caffe's LeNet "
    "solver) are this project's choice."
)


def main(argv: Sequence[str] | None = None) -> int:
  return train_main.run(
      argv, configs.MNIST, prog="python -m train.mnist", about=_ABOUT
  )


if __name__ == "__main__":
  sys.exit(main())
