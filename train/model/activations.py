"""Activation recording (``--record-activations K``, the paper's Figure 1).

:class:`ActivationRecording` says which norm layer, feature and percentiles
the train step records (:func:`train.loop.train_steps.train_step`, every ``K``
steps); the rows go to ``activations.jsonl`` (:data:`ACTIVATIONS_FILE`):
:func:`append_activations` adds an epoch's, and
:func:`keep_activations` drops those after the checkpoint a run resumes
from.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import json
from pathlib import Path

import jax


@dataclasses.dataclass(frozen=True)
class ActivationRecording:
  """What to record of one norm layer's activations during training.

  Attributes:
    every: Record at global steps 0, K, 2K, ...
    layer: The norm layer's module path, ``/``-separated (``norm2``: LeNet's
      second; ``stage2_block1/norm1`` in ResNet20).
    feature: Which channel (last axis) of the layer's input and output.
    percentiles: Percentiles (0-100) taken over the batch and any spatial
      axes; each is the ``ceil(p/100 * N)``-th smallest value
      (:func:`gbn_jax.quantile`).
  """

  every: int
  layer: str = "norm2"
  feature: int = 0
  percentiles: tuple[float, ...] = (5.0, 15.0, 50.0, 85.0, 95.0)


ACTIVATIONS_FILE = "activations.jsonl"


def keep_activations(workdir: Path, last_epoch: int) -> None:
  """Drops recorded rows of epochs after the checkpoint resumed from."""
  path = workdir / ACTIVATIONS_FILE
  if path.exists():
    rows = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["epoch"] <= last_epoch
    ]
    path.write_text("".join(line + "\n" for line in rows))


def append_activations(
    workdir: Path,
    record: ActivationRecording,
    epoch: int,
    recorded: Sequence[tuple[int, jax.Array, jax.Array]],
) -> None:
  """Appends an epoch's ``recorded`` ``(step, before, after)`` rows."""
  values = jax.device_get([(before, after) for _, before, after in recorded])
  with open(workdir / ACTIVATIONS_FILE, "a") as f:
    for (step, _, _), (before, after) in zip(recorded, values):
      f.write(
          json.dumps(
              {
                  "step": step,
                  "epoch": epoch,
                  "layer": record.layer,
                  "feature": record.feature,
                  "percentiles": list(record.percentiles),
                  "before": [float(v) for v in before],
                  "after": [float(v) for v in after],
              }
          )
          + "\n"
      )
