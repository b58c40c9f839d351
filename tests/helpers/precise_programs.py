"""A training program compiled with ``--precise-stats`` and its evaluation.

tests/gbn_jax/test_precise.py checks :func:`precise_evaluation` against numpy
statistics on one device; tests/gbn_jax/test_linen_multidevice.py checks
that four devices give what one does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from train import configs
from train.data import input_pipeline
from train.loop import programs
from train.loop import sharding
from train.loop import train_steps


@dataclasses.dataclass
class PreciseRun:
  """A compiled program, its state and the first epoch's batches.

  Attributes:
    program: Compiled with ``precise_stats=2``.
    state: The training state, advanced by :meth:`step`.
    images: The first epoch's training images, batched as ``program``
      prepares them.
    labels: Their labels.
    test_data: The placed test set.
  """

  program: programs.Program
  state: Any
  images: jax.Array
  labels: jax.Array
  test_data: sharding.Placed

  def step(self, index: int) -> None:
    """One training step on batch ``index`` of the epoch."""
    self.state, _ = self.program.step(
        self.state, self.images, self.labels, np.int32(index)
    )


def compile_precise_run(
    config: configs.Config,
    dataset: input_pipeline.Dataset,
    mesh: jax.sharding.Mesh,
) -> PreciseRun:
  """Compiles ``config``'s program on ``mesh`` with 2 precise-stats batches,
  initializes it (seed 0) and prepares epoch 1's batches."""
  train_data = sharding.place_train(dataset, mesh)
  test_data = sharding.place_test(dataset, mesh, config.batch_size)
  program, _ = programs.compile_program(
      config, mesh, train_data, test_data, dataset.num_classes, precise_stats=2
  )
  images, labels = program.prepare(
      train_data.images,
      train_data.labels,
      train_steps.epoch_key(config.seed, 1),
  )
  return PreciseRun(
      program, program.init(jax.random.key(0)), images, labels, test_data
  )


def precise_evaluation(run: PreciseRun) -> dict[str, np.ndarray]:
  """``Program.precise`` of the run's state on the test set, on the host."""
  test = run.test_data
  return jax.device_get(
      run.program.precise(
          run.state, run.images, test.images, test.labels, test.mask
      )
  )
