"""Says when training is dead: the loss sits at chance level for an epoch.

A classifier that predicts every class with equal probability has the
cross-entropy ``ln(num_classes)`` whatever its input. A training loss that
stays there for a whole epoch means the network learns nothing; with a GBN
measure the usual reason is the measure's gain: a raw deviation ``D`` is not
the standard deviation (``rsd`` is 0.40σ for Gaussian data), so the swap
multiplies every layer's gain σ/D at initialization, which acts like another
learning rate, and a rate tuned for BatchNorm can be too large for it.

`dead_training_note` decides from one epoch's step losses (a pure function);
`DeadTrainingWatch` calls it after each epoch and speaks once per command.
"""

from __future__ import annotations

from collections.abc import Sequence
import math

import numpy as np

from train import configs
from train import datasets

#: Relative distance to ``ln(num_classes)`` that counts as chance level.
TOLERANCE = 0.01

#: Fewer steps are no evidence: any network starts near chance, and tiny
#: test runs take a few steps an epoch.
MIN_STEPS = 20

#: The epoch is judged in this many consecutive parts, each by its mean loss:
#: the whole epoch must sit at chance, not just its average, and one noisy
#: batch does not decide.
PARTS = 10

# Norms whose statistics are BatchNorm's own: their gain is BatchNorm's, so
# only the learning rate (or the network) is left to blame.
_BATCHNORM_NORMS = ("bn", "sd")
# bn_gain:<norm>: BatchNorm's statistics at another measure's gain, chosen on
# purpose (train.models.GAIN_NORM); calibration does not apply to it.
_GAIN_PREFIX = "bn_gain:"


def at_chance(
    losses: Sequence[float] | np.ndarray,
    num_classes: int,
    tolerance: float = TOLERANCE,
) -> bool:
  """Whether an epoch's step losses sat at chance level throughout.

  Args:
    losses: The training loss of each step of the epoch, in order.
    num_classes: Number of classes (chance level is ``ln(num_classes)``).
    tolerance: Relative distance to ``ln(num_classes)`` that still counts.

  Returns:
    True when there are at least `MIN_STEPS` losses and each of `PARTS`
    consecutive parts of the epoch has its mean loss within ``tolerance``
    of ``ln(num_classes)``.

  Raises:
    ValueError: ``num_classes`` below 2, a negative ``tolerance``, or
      ``losses`` not one-dimensional.
  """
  if isinstance(num_classes, bool) or not isinstance(num_classes, int):
    raise ValueError(f"num_classes: must be an integer, got {num_classes!r}")
  if num_classes < 2:
    raise ValueError(f"num_classes: must be >= 2, got {num_classes}")
  if not tolerance >= 0:
    raise ValueError(f"tolerance: must be >= 0, got {tolerance!r}")
  values = np.asarray(losses, np.float64)
  if values.ndim != 1:
    raise ValueError(
        f"losses: expected one loss per step, got shape {values.shape}"
    )
  if len(values) < MIN_STEPS:
    return False
  chance = math.log(num_classes)
  means = [part.mean() for part in np.array_split(values, PARTS)]
  # NaN fails the comparison: a non-finite loss is another error's business.
  return all(abs(m - chance) <= tolerance * chance for m in means)


def dead_training_note(
    losses: Sequence[float] | np.ndarray,
    *,
    epoch: int,
    num_classes: int,
    norm: str,
    learning_rate: float,
    calibration: str = "none",
) -> str | None:
  """What to tell the user about an epoch whose loss sat at chance, if so.

  Args:
    losses: The epoch's step losses, in order.
    epoch: The epoch's number, for the message.
    num_classes: Number of classes of the dataset.
    norm: The run's ``--norm`` (``bn``, a measure, ``bn_gain:<norm>``).
    learning_rate: The run's ``--lr``.
    calibration: The run's ``--calibration``.

  Returns:
    ``None`` unless `at_chance`; else the message: the likely cause (for a
    GBN measure its gain at this learning rate, for BatchNorm the learning
    rate) and the fixes.
  """
  if not at_chance(losses, num_classes):
    return None
  chance = math.log(num_classes)
  mean = float(np.mean(losses))
  head = (
      f"warning: epoch {epoch}'s training loss sat at chance level for the"
      f" whole epoch (mean {mean:.4f}; ln {num_classes} = {chance:.4f}): the"
      " network is not learning."
  )
  smaller = f"a smaller --lr (e.g. {learning_rate / 10:g})"
  if norm in _BATCHNORM_NORMS:
    return (
        f"{head} Likely cause: --lr {learning_rate:g} is too large for this"
        f" network. Fix: {smaller}."
    )
  if norm.startswith(_GAIN_PREFIX):
    return (
        f"{head} Likely cause: the gain that {norm} sets, at --lr"
        f" {learning_rate:g} (an effective step unlike BatchNorm's at the"
        f" same rate). Fix: {smaller}, or --norm bn."
    )
  if calibration == "normal":
    return (
        f"{head} Likely cause: --lr {learning_rate:g} is too large for {norm}"
        " (calibrated: its gain at initialization is already BatchNorm's)."
        f" Fix: {smaller}."
    )
  return (
      f"{head} Likely cause: {norm}'s gain σ/D at --lr {learning_rate:g}: D"
      " is not the standard deviation, so the same rate makes another step"
      " than BatchNorm's (often too large a one). Fixes: --calibration"
      " normal (every measure starts at BatchNorm's gain, so a rate tuned"
      f" for BatchNorm fits), or {smaller}."
  )


class DeadTrainingWatch:
  """Checks each epoch of a run; says it once (see `dead_training_note`)."""

  def __init__(self, config: configs.Config):
    self._config = config
    self._num_classes = datasets.dataset_info(config.dataset).num_classes
    self._said = False

  def after_epoch(
      self, epoch: int, losses: Sequence[float] | np.ndarray
  ) -> str | None:
    """The note for this epoch, the first time one applies; else None."""
    if self._said:
      return None
    note = dead_training_note(
        losses,
        epoch=epoch,
        num_classes=self._num_classes,
        norm=self._config.norm,
        learning_rate=self._config.learning_rate,
        calibration=self._config.calibration,
    )
    self._said = note is not None
    return note
