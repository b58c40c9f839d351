"""Training configurations as data.

A :class:`Config` holds every hyperparameter of a run; it is what
``config.json`` in a run directory stores and what a resumed run is checked
against. The CLI modules start from :data:`CIFAR` (``python -m train.cifar``)
or :data:`MNIST` (``python -m train.mnist``) and override fields from flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from train import models

#: Datasets the CLI accepts (loaded by ``train.input_pipeline``).
DATASET_NAMES = ("cifar10", "cifar100", "svhn", "mnist", "fashion_mnist")

#: ``--calibration`` values (``train.models.CALIBRATIONS``).
CALIBRATIONS = models.CALIBRATIONS

#: Fields that may change between the runs that share a workdir: raising
#: ``epochs`` extends a finished run (the learning rate is constant, so the
#: extended run equals one that asked for more epochs from the start).
RESUMABLE_FIELDS = frozenset({"epochs"})

#: Fields newer than the first ``config.json`` files; an older file lacks
#: them and means their defaults.
ADDED_FIELDS = frozenset({"renorm", "renorm_rmax", "renorm_dmax",
                          "calibration"})


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters of one training run.

  Attributes:
    dataset: One of :data:`DATASET_NAMES`.
    model: One of ``train.models.MODELS``.
    norm: ``bn`` (``flax.linen.BatchNorm``) or a GBN measure, ``sqd:<alpha>``.
    epochs: Number of passes over the training set.
    batch_size: Global batch size (over all devices and hosts).
    learning_rate: Constant SGD learning rate.
    momentum: SGD momentum; 0 is plain SGD, as in the paper.
    weight_decay: L2 penalty coefficient, applied to all parameters (as
      Caffe's ``weight_decay``) by adding ``weight_decay * w`` to gradients.
    augment: Random crop (pad 4) + horizontal flip; ``None`` means the
      dataset's default (``input_pipeline.dataset_info``).
    seed: Seeds initialization, shuffling and augmentation.
    eval_every: Evaluate on the test set every this many epochs (and after
      the last epoch).
    norm_momentum: Running-average momentum of the norm layers.
    norm_epsilon: Norm epsilon.
    renorm: Batch renormalization (Ioffe, 2017) in every norm layer, with
      ``r`` clipped to ``[1 / renorm_rmax, renorm_rmax]`` and ``d`` to
      ``[-renorm_dmax, renorm_dmax]``. With ``norm='bn'`` the layers are
      ``GBatchNorm(measure='sd')``, BatchNorm's own statistics.
    renorm_rmax: See ``renorm``.
    renorm_dmax: See ``renorm``.
    calibration: ``none`` or ``normal``: every GBN layer's ``D`` divided by
      its value for a standard normal feature (``GBatchNorm``'s
      ``calibration='normal'``). A no-op for ``bn`` and ``sd``.
  """

  dataset: str = "cifar10"
  model: str = "resnet20"
  norm: str = "bn"
  epochs: int = 100
  batch_size: int = 256
  learning_rate: float = 0.1
  momentum: float = 0.0
  weight_decay: float = 1e-4
  augment: bool | None = None
  seed: int = 0
  eval_every: int = 1
  norm_momentum: float = 0.9
  norm_epsilon: float = 1e-5
  renorm: bool = False
  renorm_rmax: float = 3.0
  renorm_dmax: float = 5.0
  calibration: str = "none"

  def replace(self, **changes: Any) -> Config:
    """Returns a copy with ``changes`` applied."""
    return dataclasses.replace(self, **changes)

  def to_json(self) -> dict[str, Any]:
    """Returns the fields as a JSON-serializable dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, data: Any) -> Config:
    """Builds a config from :meth:`to_json` output.

    Fields added after a run was written (those in :data:`ADDED_FIELDS`)
    take their defaults, which reproduce what that run did.

    Raises:
      ValueError: If ``data`` is not a dict of the known fields.
    """
    if not isinstance(data, dict):
      raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    missing = names - set(data) - ADDED_FIELDS
    if unknown or missing:
      raise ValueError(f"unknown fields {sorted(unknown)}, missing fields "
                       f"{sorted(missing)}")
    return cls(**data)


#: ``python -m train.cifar``: the paper's ResNet20 CIFAR setting (batch 256;
#: the learning rate 0.1 and 100 epochs are this project's choice).
CIFAR = Config()

#: ``python -m train.mnist``: the paper's LeNet MNIST setting (batch 1000,
#: learning rate 0.01; 20 epochs and Caffe LeNet's weight decay are ours).
MNIST = Config(dataset="mnist", model="lenet", epochs=20, batch_size=1000,
               learning_rate=0.01, weight_decay=5e-4)


def _check(condition: bool, message: str) -> None:
  if not condition:
    raise ValueError(message)


def validate(config: Config) -> Config:
  """Checks every field, with messages that name the offending flag.

  Args:
    config: The config to check.

  Returns:
    ``config`` unchanged, so calls can be chained.

  Raises:
    ValueError: On the first invalid field.
  """
  _check(config.dataset in DATASET_NAMES,
         f"--dataset {config.dataset!r} is not one of: "
         f"{', '.join(DATASET_NAMES)}")
  _check(config.model in models.MODELS,
         f"--model {config.model!r} is not one of: {', '.join(models.MODELS)}")
  try:
    models.parse_norm(config.norm)
  except ValueError as e:
    raise ValueError(f"--norm: {e}") from None

  def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

  def is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))

  _check(is_int(config.epochs) and config.epochs >= 1,
         f"--epochs must be a positive integer, got {config.epochs!r}")
  _check(is_int(config.batch_size) and config.batch_size >= 1,
         f"--batch-size must be a positive integer, got {config.batch_size!r}")
  _check(is_real(config.learning_rate) and config.learning_rate > 0,
         f"--lr must be a positive number, got {config.learning_rate!r}")
  _check(is_real(config.momentum) and 0 <= config.momentum < 1,
         f"--momentum must be in [0, 1), got {config.momentum!r}")
  _check(is_real(config.weight_decay) and config.weight_decay >= 0,
         f"--weight-decay must be >= 0, got {config.weight_decay!r}")
  _check(config.augment is None or isinstance(config.augment, bool),
         f"augment must be true, false or null, got {config.augment!r}")
  _check(is_int(config.seed) and 0 <= config.seed < 2**32,
         f"--seed must be an integer in [0, 2**32), got {config.seed!r}")
  _check(is_int(config.eval_every) and config.eval_every >= 1,
         f"--eval-every must be a positive integer, got {config.eval_every!r}")
  _check(is_real(config.norm_momentum) and 0 <= config.norm_momentum < 1,
         f"--norm-momentum must be in [0, 1), got {config.norm_momentum!r}")
  _check(is_real(config.norm_epsilon) and config.norm_epsilon > 0,
         f"norm_epsilon must be > 0, got {config.norm_epsilon!r}")
  _check(isinstance(config.renorm, bool),
         f"renorm must be true or false, got {config.renorm!r}")
  _check(is_real(config.renorm_rmax) and config.renorm_rmax >= 1,
         f"--renorm-rmax must be >= 1, got {config.renorm_rmax!r}")
  _check(is_real(config.renorm_dmax) and config.renorm_dmax >= 0,
         f"--renorm-dmax must be >= 0, got {config.renorm_dmax!r}")
  _check(config.calibration in CALIBRATIONS,
         f"--calibration {config.calibration!r} is not one of: "
         f"{', '.join(CALIBRATIONS)}")
  return config


def differences(stored: Config, requested: Config) -> list[str]:
  """Lists the fields, other than :data:`RESUMABLE_FIELDS`, that differ.

  Args:
    stored: The config of an existing run.
    requested: The config asked for now.

  Returns:
    Human-readable ``field: stored -> requested`` lines (empty if the run
    can be resumed).
  """
  lines = []
  for field in dataclasses.fields(Config):
    if field.name in RESUMABLE_FIELDS:
      continue
    old, new = getattr(stored, field.name), getattr(requested, field.name)
    if old != new:
      lines.append(f"{field.name}: {json.dumps(old)} -> {json.dumps(new)}")
  return lines
