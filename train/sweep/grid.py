"""The runs of a sweep: a grid of train flags expanded into named configs.

Any train flag that takes a value may be a comma-separated list; the grid is
the cross product (:func:`expand`), each point named after its config
(:func:`run_name`) so that a run keeps its directory whichever grid it is part
of. ``python -m train.sweep`` (:mod:`train.sweep`) runs them.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
import dataclasses
import itertools
from typing import Any

from train import cli_flags
from train import configs
from train.data import info as data_info

#: The CLI module of each ``--defaults`` choice.
DEFAULTS = {
    "cifar": (configs.CIFAR, "train.cifar"),
    "mnist": (configs.MNIST, "train.mnist"),
}
#: Flags the sweep owns: every run gets its own workdir and no progress bar.
_RESERVED = ("--workdir", "--overwrite", "--no-progress")


@dataclasses.dataclass(frozen=True)
class Run:
  """One point of the grid.

  Attributes:
    name: Its directory name under the sweep dir.
    argv: The CLI flags of the run (without ``--workdir``).
    config: The config those flags give, ``augment`` resolved.
  """

  name: str
  argv: tuple[str, ...]
  config: configs.Config


def _format_value(value: Any) -> str:
  return repr(value) if isinstance(value, float) else str(value)


#: The fields a sweep's run names always show: the sweep's axes, so that
#: its folders sort and read alike.
SWEEP_NAMED = ("norm", "batch_size", "learning_rate", "seed")


def run_name(
    config: configs.Config,
    defaults: configs.Config,
    *,
    always: Collection[str] = SWEEP_NAMED,
) -> str:
  """A directory name that says the config.

  Dataset and model lead, the fields in ``always`` appear whatever their
  value, the others only where they differ from ``defaults`` (``epochs``
  never: raising it extends a run), so a run keeps its name whichever grid
  it is part of. ``augment=None`` means the dataset's default, on either
  side. ``train.main.default_workdir`` names a CLI run with ``always``
  ``("norm", "seed")``.

  >>> run_name(configs.MNIST.replace(norm="sqd:0.3", seed=2), configs.MNIST)
  'mnist-lenet-sqd_0.3-b1000-lr0.01-seed2'
  >>> run_name(configs.MNIST.replace(momentum=0.9, augment=True,
  ...                                renorm=True), configs.MNIST)
  'mnist-lenet-bn-b1000-lr0.01-m0.9-renorm-aug-seed0'
  >>> run_name(configs.MNIST.replace(norm="mad", calibration="normal"),
  ...          configs.MNIST)
  'mnist-lenet-mad-b1000-lr0.01-cal_normal-seed0'
  >>> run_name(configs.MNIST.replace(learning_rate=0.1, augment=False),
  ...          configs.MNIST, always=("norm", "seed"))
  'mnist-lenet-bn-lr0.1-seed0'
  """
  config = resolve_augment(config)
  defaults = resolve_augment(defaults.replace(dataset=config.dataset))
  # Dataset and model lead (unprefixed), epochs never shows (raising it
  # extends a run), augment is spelled aug/noaug just before the seed, which
  # comes last; the other fields follow train.configs.FIELDS.
  parts = [config.dataset, config.model]
  named = [
      (name, spec.run_name)
      for name, spec in configs.FIELDS.items()
      if spec.run_name is not None and name != "seed"
  ]
  for field, prefix in named + [("seed", configs.FIELDS["seed"].run_name)]:
    value = getattr(config, field)
    if field == "seed" and config.augment != defaults.augment:
      parts.append("aug" if config.augment else "noaug")
    if field in always or value != getattr(defaults, field):
      text = prefix + ("" if isinstance(value, bool) else _format_value(value))
      parts.append(text.replace(":", "_"))
  return "-".join(parts)


def _split_grid(argv: Sequence[str]) -> list[list[tuple[str, ...]]]:
  """Splits the train flags into axes: one list of flag tuples per flag."""
  axes: list[list[tuple[str, ...]]] = []
  i = 0
  while i < len(argv):
    token = argv[i]
    flag, eq, inline = token.partition("=")
    if flag in _RESERVED:
      raise ValueError(f"{flag} is set by the sweep for each run; leave it out")
    takes_value = cli_flags.flag_takes_value(flag)
    if takes_value is None:
      raise ValueError(f"unrecognized argument {token!r} (see --help)")
    if not takes_value:
      axes.append([(flag,)])
      i += 1
      continue
    if eq:
      values = inline
    elif i + 1 < len(argv):
      values = argv[i + 1]
      i += 1
    else:
      raise ValueError(f"{flag} needs a value")
    items = [v.strip() for v in values.split(",")]
    if any(not v for v in items):
      raise ValueError(f"{flag} {values!r}: empty item in the list")
    axes.append([(flag, v) for v in items])
    i += 1
  return axes


def expand(argv: Sequence[str], defaults_name: str = "cifar") -> list[Run]:
  """The runs of a grid, in order, duplicates removed.

  Args:
    argv: Train flags, each value possibly a comma-separated list.
    defaults_name: A key of :data:`DEFAULTS`.

  Returns:
    One :class:`Run` per point of the cross product. The last flag varies
    fastest, so ``--seed 0,1 --norm bn,sqd1`` runs every norm of seed 0
    before seed 1.

  Raises:
    ValueError: On an unknown or reserved flag, or an invalid value (the
      message is the CLI's own).
  """
  defaults, module = DEFAULTS[defaults_name]
  parser = cli_flags.build_parser(defaults, f"python -m {module}")
  parser.exit_on_error = False
  axes = _split_grid(argv)
  runs, seen = [], set()
  for combo in itertools.product(*axes):
    flags = tuple(part for pair in combo for part in pair)
    try:
      args = parser.parse_args(flags)
    except argparse.ArgumentError as e:
      raise ValueError(str(e)) from None
    config = configs.validate(cli_flags.config_from_args(args, defaults))
    config = resolve_augment(config)
    name = run_name(config, defaults)
    if name in seen:
      continue
    seen.add(name)
    runs.append(Run(name=name, argv=flags, config=config))
  return runs


#: The ``--defaults`` that each dataset implies when the flag is left out.
_DATASET_DEFAULTS = {"mnist": "mnist", "fashion_mnist": "mnist"}


def implied_defaults(argv: Sequence[str]) -> str:
  """The ``--defaults`` that the train flags' ``--dataset`` values imply.

  mnist and fashion_mnist imply ``mnist`` (LeNet, as ``train.mnist``), the
  others and no ``--dataset`` ``cifar``: the CIFAR defaults' ResNet20 on
  28x28 digits is never what a sweep without ``--defaults`` means.

  Raises:
    ValueError: If the datasets imply different defaults (then
      ``--defaults`` must say which).
  """
  datasets = []
  for i, token in enumerate(argv):
    flag, eq, inline = token.partition("=")
    if flag == "--dataset":
      values = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
      datasets += [v.strip() for v in values.split(",") if v.strip()]
  implied = sorted({_DATASET_DEFAULTS.get(d, "cifar") for d in datasets})
  if len(implied) > 1:
    raise ValueError(
        f"--dataset {','.join(datasets)} mixes datasets whose defaults "
        "differ (mnist/fashion_mnist: --defaults mnist, the others: "
        "--defaults cifar); pass --defaults, or sweep them apart"
    )
  return implied[0] if implied else "cifar"


def dataset_defaults(dataset: str) -> configs.Config:
  """The defaults ``dataset`` implies, as :func:`implied_defaults` picks."""
  return DEFAULTS[_DATASET_DEFAULTS.get(dataset, "cifar")][0]


def resolve_augment(config: configs.Config) -> configs.Config:
  """``config`` with ``augment=None`` replaced by its dataset's default."""
  if config.augment is not None:
    return config
  info = data_info.dataset_info(config.dataset)
  return config.replace(augment=bool(info.augment_by_default))
