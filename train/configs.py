"""Training configurations as data.

A :class:`Config` holds every hyperparameter of a run; it is what
``config.json`` in a run directory stores and what a resumed run is checked
against. The CLI modules start from :data:`CIFAR` (``python -m train.cifar``)
or :data:`MNIST` (``python -m train.mnist``) and override fields from flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
import dataclasses
import json
import types
from typing import Any

from train.config_fields import FieldSpec as FieldSpec
from train.config_fields import Flag as Flag
from train.config_fields import boolean as _boolean
from train.config_fields import declared as _field
from train.config_fields import integer as _integer
from train.config_fields import is_int as _is_int
from train.config_fields import one_of as _one_of
from train.config_fields import parse_nonnegative_int as parse_nonnegative_int
from train.config_fields import parse_positive_int as parse_positive_int
from train.config_fields import real as _real
from train.data import info as data_info
from train.data import subset as data_subset
from train.model import models

#: Datasets the CLI accepts (loaded by ``train.data.input_pipeline``).
DATASET_NAMES = ("cifar10", "cifar100", "svhn", "mnist", "fashion_mnist")

#: ``--calibration`` values (``train.model.models.CALIBRATIONS``).
CALIBRATIONS = models.CALIBRATIONS

#: Fields that may change between the runs that share a workdir: raising
#: ``epochs`` extends a finished run (the learning rate is constant, so the
#: extended run equals one that asked for more epochs from the start).
RESUMABLE_FIELDS = frozenset({"epochs"})


# --- how a field is declared (train.config_fields) ----------------------------


def _norm(v: Any) -> str | None:
  try:
    models.parse_norm(v)
  except (ValueError, AttributeError, TypeError) as e:
    return f": {e}"
  return None


def _parse_norm(value: str) -> str:
  try:
    models.parse_norm(value)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return value.strip()


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters of one training run.

  Each field's flag, help, check and run-name prefix are declared with it
  (:class:`FieldSpec`, in the field's metadata; :data:`FIELDS`).

  Attributes:
    dataset: One of :data:`DATASET_NAMES`.
    model: One of ``train.model.models.MODELS``.
    norm: ``bn`` (``flax.linen.BatchNorm``) or a GBN measure, ``sqd:<alpha>``;
      ``gn`` (``flax.linen.GroupNorm``) or ``gn:<measure>``
      (``gbn_jax.linen.GGroupNorm``).
    epochs: Number of passes over the training set.
    batch_size: Global batch size (over all devices and hosts).
    steps: Train exactly this many optimizer steps instead of ``epochs``
      epochs: ``ceil(steps / steps per epoch)`` epochs, the last one cut
      short; ``None``: ``epochs``.
    learning_rate: Constant SGD learning rate.
    momentum: SGD momentum; 0 is plain SGD, as in the paper.
    weight_decay: L2 penalty coefficient, applied to all parameters (as
      Caffe's ``weight_decay``) by adding ``weight_decay * w`` to gradients.
    augment: Random crop (pad 4) + horizontal flip; ``None`` means the
      dataset's default (``input_pipeline.dataset_info``).
    seed: Seeds initialization, shuffling and augmentation.
    norm_momentum: Running-average momentum of the norm layers.
    norm_epsilon: Norm epsilon.
    eval_every: Evaluate on the test set every this many epochs (and after
      the last epoch).
    renorm: Batch renormalization (Ioffe, 2017) in every norm layer, with
      ``r`` clipped to ``[1 / renorm_rmax, renorm_rmax]`` and ``d`` to
      ``[-renorm_dmax, renorm_dmax]``. With ``norm='bn'`` the layers are
      ``GBatchNorm(measure='sd')``, BatchNorm's own statistics.
    renorm_rmax: See ``renorm``.
    renorm_dmax: See ``renorm``.
    calibration: ``none`` or ``normal``: every GBN layer's ``D`` divided by
      its value for a standard normal feature (``GBatchNorm``'s
      ``calibration='normal'``). A no-op for ``bn`` and ``sd``.
    norm_bias: Every norm layer's initial bias (``norms.make_norm``).
    norm_groups: A group norm's number of channel groups.
    train_subset: Train on this many images of the training set, as many of
      each class (``train.data.subset``); ``None``: all of them.
    subset_seed: Chooses the ``train_subset`` images, apart from ``seed``.
  """

  dataset: str = _field(
      "cifar10",
      FieldSpec(
          _one_of(DATASET_NAMES),
          "--dataset",
          choices=DATASET_NAMES,
          help="dataset; looked up in --data-dir alone when given, else in "
          "$GBN_DATA_DIR, ~/.cache/gbn_jax, /usr/share/datasets, then "
          "tensorflow-datasets (see train/data/datasets.py)",
      ),
  )
  model: str = _field(
      "resnet20",
      FieldSpec(
          _one_of(tuple(models.MODELS)),
          "--model",
          choices=tuple(models.MODELS),
          help="lenet: Caffe LeNet (VALID 5x5 convs 20/50, dense 500) with a "
          "norm after each conv; resnet20: He et al.'s CIFAR ResNet20 with "
          "parameter-free (option A) shortcuts",
      ),
  )
  norm: str = _field(
      "bn",
      FieldSpec(
          _norm,
          "--norm",
          parse=_parse_norm,
          run_name="",
          help="normalization layer: 'bn' is flax.linen.BatchNorm (the "
          "baseline); the others are gbn_jax.GBatchNorm measures, 'sqd:<alpha>' "
          "with 0 < alpha < 1 (sqd1/2/3 = alpha 0.25/0.5/0.75); 'gn' is "
          "flax.linen.GroupNorm (per-example statistics over --norm-groups "
          "channel groups) and 'gn:<measure>' gbn_jax.linen.GGroupNorm with "
          "that measure, e.g. gn:sqd2, gn:sqd:0.9. One of: "
          + ", ".join(models.norm_names())
          + "; wcd (centered on the max) needs a positive --norm-bias, e.g. 1",
      ),
  )
  epochs: int = _field(
      100,
      FieldSpec(
          _integer(1),
          "--epochs",
          parse=parse_positive_int,
          help="total epochs; raise it and rerun to extend a finished run",
      ),
  )
  batch_size: int = _field(
      256,
      FieldSpec(
          _integer(1),
          "--batch-size",
          parse=parse_positive_int,
          run_name="b",
          help="global batch size, split evenly over the devices (on one host "
          "the most devices that divide it; on several hosts all of them)",
      ),
  )
  steps: int | None = _field(
      None,
      FieldSpec(
          lambda v: None if v is None else _integer(1)(v),
          "--steps",
          parse=parse_positive_int,
          run_name="steps",
          added=True,
          help="train exactly N optimizer steps instead of --epochs epochs "
          "(the same number for every --batch-size): ceil(N / steps per "
          "epoch) epochs, the last one stopped after step N; metrics.jsonl's "
          "'step' counts them",
      ),
  )
  learning_rate: float = _field(
      0.1,
      FieldSpec(
          _real("must be a positive number", lambda v: v > 0),
          "--lr",
          parse=float,
          run_name="lr",
          help="constant SGD learning rate",
      ),
  )
  momentum: float = _field(
      0.0,
      FieldSpec(
          _real("must be in [0, 1)", lambda v: 0 <= v < 1),
          "--momentum",
          parse=float,
          run_name="m",
          help="SGD momentum (0 = plain SGD, as in the paper)",
      ),
  )
  weight_decay: float = _field(
      1e-4,
      FieldSpec(
          _real("must be >= 0", lambda v: v >= 0),
          "--weight-decay",
          parse=float,
          run_name="wd",
          help="L2 penalty on all parameters, added to the gradients",
      ),
  )
  augment: bool | None = _field(
      None,
      FieldSpec(
          lambda v: None
          if v is None or isinstance(v, bool)
          else (f"must be true, false or null, got {v!r}"),
          "--augment",
          kind=Flag.ON_OFF,
          help="random crop (pad 4) + horizontal flip of training images; "
          "default: on for cifar10/cifar100/svhn, off for mnist/fashion_mnist",
      ),
  )
  seed: int = _field(
      0,
      FieldSpec(
          _integer(0, 2**32, "2**32"),
          "--seed",
          parse=int,
          run_name="seed",
          help="seeds initialization, shuffling and augmentation; the same seed "
          "on the same machine gives the same metrics",
      ),
  )
  norm_momentum: float = _field(
      0.9,
      FieldSpec(
          _real("must be in [0, 1)", lambda v: 0 <= v < 1),
          "--norm-momentum",
          parse=float,
          run_name="nm",
          help="momentum of the norms' running averages",
      ),
  )
  norm_epsilon: float = _field(
      1e-5, FieldSpec(_real("must be > 0", lambda v: v > 0), run_name="eps")
  )
  eval_every: int = _field(
      1,
      FieldSpec(
          _integer(1),
          "--eval-every",
          parse=parse_positive_int,
          run_name="ev",
          help="evaluate on the test set every N epochs (and after the last)",
      ),
  )
  renorm: bool = _field(
      False,
      FieldSpec(
          _boolean,
          "--renorm",
          kind=Flag.SWITCH,
          run_name="renorm",
          added=True,
          help="batch renormalization (Ioffe 2017) in every norm layer, for any "
          "measure (bn: GBatchNorm's sd, BatchNorm's statistics)",
      ),
  )
  renorm_rmax: float = _field(
      3.0,
      FieldSpec(
          _real("must be >= 1", lambda v: v >= 1),
          "--renorm-rmax",
          parse=float,
          run_name="rmax",
          added=True,
          help="with --renorm: r is clipped to [1/rmax, rmax]",
      ),
  )
  # Alike train/configs.py::Config.renorm_rmax: one flag's declaration each,
  # alike in the table's form only.
  renorm_dmax: float = _field(
      5.0,
      FieldSpec(
          _real("must be >= 0", lambda v: v >= 0),
          "--renorm-dmax",
          parse=float,
          run_name="dmax",
          added=True,
          help="with --renorm: d is clipped to [-dmax, dmax]",
      ),
  )
  calibration: str = _field(
      "none",
      FieldSpec(
          _one_of(CALIBRATIONS),
          "--calibration",
          choices=CALIBRATIONS,
          run_name="cal_",
          added=True,
          help="normal: divide every GBN layer's deviation D by its value for a "
          "standard normal feature, so that D is the standard deviation for "
          "Gaussian data (BatchNorm's gain at initialization whatever the "
          "measure); a no-op for bn and sd, which stay BatchNorm",
      ),
  )
  norm_bias: float = _field(
      0.0,
      FieldSpec(
          _real("must be a finite number", lambda v: True),
          "--norm-bias",
          parse=float,
          run_name="nb",
          added=True,
          help="initial bias of every norm layer (wcd: 1 passes the values "
          "above the mean to the ReLU, 0 none)",
      ),
  )
  norm_groups: int = _field(
      models.DEFAULT_GROUPS,
      FieldSpec(
          _integer(1),
          "--norm-groups",
          parse=parse_positive_int,
          run_name="groups",
          added=True,
          help="channel groups of gn and gn:<measure> (ignored by batch "
          "norms); it must divide every norm layer's channels: the default "
          "divides LeNet's 20 and 50 (groups of 4 and 10 channels), "
          "ResNet20's 16, 32 and 64 need 2, 4, 8 or 16",
      ),
  )
  train_subset: int | None = _field(
      None,
      FieldSpec(
          # The range depends on the dataset: validate() checks it.
          lambda v: None
          if v is None or _is_int(v)
          else f"must be an integer or null, got {v!r}",
          "--train-subset",
          parse=int,
          run_name="sub",
          added=True,
          help="train on a fixed subset of N training images, N / classes of "
          "each class, chosen by --subset-seed alone (the same images for "
          "every --seed and --norm); N is a multiple of the dataset's "
          "classes, at most its training images. An epoch is one pass over "
          "the subset; the test set stays whole",
      ),
  )
  subset_seed: int = _field(
      0,
      FieldSpec(
          _integer(0, 2**32, "2**32"),
          "--subset-seed",
          parse=int,
          run_name="subseed",
          added=True,
          help="with --train-subset: chooses its images",
      ),
  )

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
    unknown = set(data) - set(FIELDS)
    missing = set(FIELDS) - set(data) - ADDED_FIELDS
    if unknown or missing:
      raise ValueError(
          f"unknown fields {sorted(unknown)}, missing fields "
          f"{sorted(missing)}"
      )
    return cls(**data)


#: Every field's :class:`FieldSpec`, in field order.
FIELDS: Mapping[str, FieldSpec] = types.MappingProxyType(
    {f.name: f.metadata["spec"] for f in dataclasses.fields(Config)}
)

#: Fields newer than the first ``config.json`` files; an older file lacks
#: them and means their defaults.
ADDED_FIELDS = frozenset(name for name, spec in FIELDS.items() if spec.added)


#: ``python -m train.cifar``: the paper's ResNet20 CIFAR setting (batch 256;
#: the learning rate 0.1 and 100 epochs are this project's choice).
CIFAR = Config()

#: ``python -m train.mnist``: the paper's LeNet MNIST setting (batch 1000,
#: learning rate 0.01; 20 epochs and Caffe LeNet's weight decay are ours).
MNIST = Config(
    dataset="mnist",
    model="lenet",
    epochs=20,
    batch_size=1000,
    learning_rate=0.01,
    weight_decay=5e-4,
)


def validate(config: Config) -> Config:
  """Checks every field, with messages that name the offending flag.

  Args:
    config: The config to check.

  Returns:
    ``config`` unchanged, so calls can be chained.

  Raises:
    ValueError: On the first invalid field.
  """
  for name, spec in FIELDS.items():
    problem = spec.check(getattr(config, name))
    if problem is not None:
      label = spec.flag or name
      raise ValueError(
          f"{label}{'' if problem.startswith(':') else ' '}" f"{problem}"
      )
  if config.renorm and models.parse_norm(config.norm).group:
    raise ValueError(f"--norm {config.norm}: {models.RENORM_REFUSAL}")
  if config.train_subset is not None:
    problem = data_subset.subset_problem(
        config.train_subset,
        data_info.dataset_info(config.dataset).num_classes,
        data_info.TRAIN_IMAGES[config.dataset],
    )
    if problem is not None:
      raise ValueError(f"--train-subset {problem} for {config.dataset}")
  elif config.subset_seed:
    raise ValueError("--subset-seed chooses a --train-subset: give one")
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
