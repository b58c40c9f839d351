"""Configs as data: one declaration per field drives flags, checks and names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from train import cli_flags
from train import configs
from train.loop import trainer as train
from train.sweep import grid as sweep_grid

REPO = Path(__file__).resolve().parents[2]

# A valid value other than the CIFAR default, and an invalid one, per field.
# A new field without an entry here fails these tests on purpose.
SAMPLES = {
    "dataset": ("svhn", "imagenet"),
    "model": ("lenet", "vgg"),
    "norm": ("sqd:0.3", "sqd:1.5"),
    "epochs": (7, 0),
    "batch_size": (64, -2),
    "learning_rate": (0.03, 0.0),
    "momentum": (0.9, 1.0),
    "weight_decay": (5e-4, -1e-4),
    "augment": (False, "yes"),
    "seed": (3, 2**32),
    "norm_momentum": (0.99, 1.5),
    "norm_epsilon": (1e-3, 0.0),
    "eval_every": (2, 0),
    "renorm": (True, 1),
    "renorm_rmax": (2.0, 0.5),
    "renorm_dmax": (1.0, -1.0),
    "calibration": ("normal", "uniform"),
    "norm_bias": (1.0, float("nan")),
    "steps": (1000, 0),
    "norm_groups": (10, 0),
    "train_subset": (5000, 5001),
    "subset_seed": (2, -1),
}
# The other fields a sample needs: a subset seed chooses a subset.
SAMPLE_NEEDS = {"subset_seed": {"train_subset": 5000}}


def _argv(name: str, value) -> list[str]:
  spec = configs.FIELDS[name]
  if spec.kind is configs.Flag.SWITCH:
    return [spec.flag] if value else []
  if spec.kind is configs.Flag.ON_OFF:
    return [spec.flag if value else "--no-" + spec.flag[2:]]
  return [spec.flag, str(value)]


def test_every_field_is_declared_and_sampled():
  assert set(configs.FIELDS) == {
      f.name for f in dataclasses.fields(configs.Config)
  }
  assert set(SAMPLES) == set(configs.FIELDS)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_flag_sets_its_field_and_check_names_it(name):
  good, bad = SAMPLES[name]
  assert good != getattr(configs.CIFAR, name)
  spec = configs.FIELDS[name]
  needs = SAMPLE_NEEDS.get(name, {})
  base = configs.CIFAR.replace(**needs)
  expected = base.replace(**{name: good})
  configs.validate(expected)
  if spec.flag is not None:
    parser = cli_flags.build_parser(configs.CIFAR, "x")
    flags = [f for n, v in needs.items() for f in _argv(n, v)]
    args = parser.parse_args(flags + _argv(name, good))
    assert cli_flags.config_from_args(args, configs.CIFAR) == expected
  with pytest.raises(ValueError) as e:
    configs.validate(base.replace(**{name: bad}))
  assert str(e.value).startswith(spec.flag or name), str(e.value)


def test_no_flags_is_the_defaults():
  for defaults in (configs.CIFAR, configs.MNIST):
    parser = cli_flags.build_parser(defaults, "x")
    assert (
        cli_flags.config_from_args(parser.parse_args([]), defaults) == defaults
    )


def test_flag_takes_value_agrees_with_argparse():
  parser = cli_flags.build_parser(configs.CIFAR, "x")
  seen = 0
  # argparse's own record of its options, as an independent reference.
  for action in parser._actions:  # pylint: disable=protected-access
    for option in action.option_strings:
      if option in ("-h", "--help"):
        continue
      assert cli_flags.flag_takes_value(option) is (
          action.nargs is None
      ), option
      seen += 1
  assert seen >= 25
  assert cli_flags.flag_takes_value("--no-augment") is False
  assert cli_flags.flag_takes_value("--bogus") is None


def test_added_fields_default_in_old_config_files():
  old = {
      f: v
      for f, v in configs.CIFAR.to_json().items()
      if f not in configs.ADDED_FIELDS
  }
  assert configs.ADDED_FIELDS == {
      "renorm",
      "renorm_rmax",
      "renorm_dmax",
      "calibration",
      "norm_bias",
      "steps",
      "norm_groups",
      "train_subset",
      "subset_seed",
  }
  assert configs.Config.from_json(old) == configs.CIFAR
  with pytest.raises(ValueError, match="missing fields"):
    configs.Config.from_json({k: v for k, v in old.items() if k != "seed"})


def test_committed_run_names_reproduce():
  """Every committed sweep run keeps its folder name (a rename would make a
  resumed sweep start the run over)."""
  config_files = sorted((REPO / "results" / "sweeps").rglob("config.json"))
  if not config_files:
    pytest.skip("no committed sweeps in this checkout")
  for path in config_files:
    config = train.resolve(
        configs.Config.from_json(json.loads(path.read_text()))
    )
    defaults = (
        configs.MNIST
        if config.dataset in ("mnist", "fashion_mnist")
        else configs.CIFAR
    )
    defaults = train.resolve(defaults.replace(dataset=config.dataset))
    assert sweep_grid.run_name(config, defaults) == path.parent.name, path
