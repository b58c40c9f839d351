"""The CLI's flags: one per config field, and the run flags.

:func:`build_parser` makes the argument parser of ``python -m train.cifar``
and ``train.mnist``: a flag for each field of :data:`train.configs.FIELDS`
that has one, then :data:`RUN_FLAGS` (where a run lives and how it is
watched). :func:`config_from_args` is the config the parsed flags describe,
and :func:`flag_takes_value` says whether a flag reads a value. A flag error
takes three lines, not the whole usage. :mod:`train.main` runs what the flags
describe.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from train import configs

_positive_int = configs.parse_positive_int
_nonnegative_int = configs.parse_nonnegative_int


class _ArgumentParser(argparse.ArgumentParser):
  """An argument parser whose errors take three lines, not the usage block.

  The full usage lists every flag (20 lines and more), which buries the one
  line that says what was wrong; ``--help`` still shows it all.
  """

  def error(self, message: str) -> NoReturn:
    self.exit(
        2,
        f"usage: {self.prog} [-h] [--FLAG VALUE ...]\n"
        f"{self.prog}: error: {message}\n"
        f"Run '{self.prog} --help' for every flag and its default.\n",
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except the uninformative None/False ones."""

  def _get_help_string(self, action: argparse.Action) -> str:
    if action.default is None or action.default is False:
      return action.help or ""
    return super()._get_help_string(action)


#: The flags that are not config fields (those are ``train.configs.FIELDS``):
#: where a run lives and how it is watched, never what it computes.
RUN_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--data-dir",
        dict(
            default=None,
            help="folder with the dataset's canonical files (e.g. the four MNIST "
            "IDX files, or cifar-10-batches-bin/), directly or in a subfolder "
            "named after the dataset; if it lacks them, that is an error (no "
            "other copy is used)",
        ),
    ),
    (
        "--workdir",
        dict(
            default=None,
            help="run directory (default: workdir/DATASET-MODEL-NORM-seedSEED, "
            "with each setting but --epochs that differs from the defaults "
            "named before the seed, as a sweep names its runs: -lr0.05, "
            "-cal_normal, -nb1.0)",
        ),
    ),
    (
        "--overwrite",
        dict(
            action="store_true",
            help="delete an existing run in --workdir (config.json, "
            "metrics.jsonl, checkpoints/) instead of refusing a different "
            "config",
        ),
    ),
    (
        "--no-progress",
        dict(action="store_true", help="no progress bar on stderr"),
    ),
    (
        "--checkpoint-every",
        dict(
            type=_positive_int,
            default=1,
            help="save a checkpoint every N epochs (and after the last); "
            "metrics.jsonl still gets every epoch, and a resume retrains the "
            "epochs after the last checkpoint with the same results",
        ),
    ),
    (
        "--keep-checkpoints-every",
        dict(
            type=_positive_int,
            default=None,
            metavar="K",
            help="also save a checkpoint at every epoch that is a multiple of "
            "K, whatever --checkpoint-every, and keep those for good beside "
            "the latest ones (for `python -m train.curvature RUN_DIR`, which "
            "measures every checkpoint kept); pass it again when resuming: a "
            "save without it deletes them",
        ),
    ),
    (
        "--precise-stats",
        dict(
            type=_nonnegative_int,
            default=0,
            metavar="N",
            help="before each evaluation, also recompute the norms' statistics "
            "as equal-weight averages over the epoch's first N training batches "
            "(PreciseBN; the running averages are kept) and evaluate with them: "
            "test_loss_precise/test_error_precise in metrics.jsonl; 0 = off",
        ),
    ),
    (
        "--record-activations",
        dict(
            type=_positive_int,
            default=None,
            metavar="K",
            help="every K steps, record percentiles (5/15/50/85/95) of one "
            "feature before and after one norm layer to activations.jsonl "
            "(plotted by `python -m train.report`, as the paper's Figure 1)",
        ),
    ),
    (
        "--record-layer",
        dict(
            default="norm2",
            help="the norm layer to record, as its module path (LeNet: norm1, "
            "norm2; ResNet20: norm1, stage2_block1/norm1, ...)",
        ),
    ),
    (
        "--record-feature",
        dict(type=int, default=0, help="the channel of that layer to record"),
    ),
    (
        "--no-compile-cache",
        dict(
            action="store_true",
            help="don't keep compiled programs between runs (by default they "
            "are kept in $XDG_CACHE_HOME/gbn_jax/jax_cache, else "
            "~/.cache/gbn_jax/jax_cache, unless GBN_COMPILE_CACHE=0; a "
            "JAX_COMPILATION_CACHE_DIR you set is used instead)",
        ),
    ),
)


def build_parser(
    defaults: configs.Config, prog: str, about: str = ""
) -> argparse.ArgumentParser:
  """The argument parser; ``defaults`` supplies every default value.

  Args:
    defaults: Default config.
    prog: Program name for usage lines.
    about: Extra description (what the defaults reproduce).
  """
  parser = _ArgumentParser(
      prog=prog,
      description=(
          "Train a classifier with BatchNorm or a Generalized Batch "
          "Normalization (Yuan et al., AAAI 2019) in every norm layer. "
          "Data-parallel over all local devices (and all hosts, see "
          "train/main.py). Rerunning the same command in the same --workdir "
          "resumes from the last per-epoch checkpoint. " + about
      ),
      epilog=(
          "Outputs in --workdir: config.json, metrics.jsonl (one row per "
          "epoch: optimizer steps so far, train/test loss and error, best "
          "test error, seconds, "
          "data seconds, images/s), data_source.txt (where each command's "
          "data came from) and checkpoints/. Plot runs with "
          "`python -m train.plot RUN_DIR...`. Training uses a constant "
          "learning rate and drops the last partial batch of each epoch; "
          "the test error is over the whole test set, with the norms' "
          "running averages."
      ),
      formatter_class=_HelpFormatter,
  )
  for name, spec in configs.FIELDS.items():
    if spec.flag is not None:
      _add_field_flag(parser, spec, getattr(defaults, name))
  for flag, options in RUN_FLAGS:
    parser.add_argument(flag, **options)
  return parser


def _add_field_flag(
    parser: argparse.ArgumentParser, spec: configs.FieldSpec, default: Any
) -> None:
  """Adds the flag of one config field (:class:`train.configs.FieldSpec`)."""
  if spec.kind is configs.Flag.SWITCH:
    parser.add_argument(
        spec.flag, action="store_true", default=default, help=spec.help
    )
  elif spec.kind is configs.Flag.ON_OFF:
    parser.add_argument(
        spec.flag,
        action=argparse.BooleanOptionalAction,
        default=default,
        help=spec.help,
    )
  else:
    parser.add_argument(
        spec.flag,
        type=spec.parse,
        choices=spec.choices,
        default=default,
        help=spec.help,
    )


def config_from_args(
    args: argparse.Namespace, defaults: configs.Config
) -> configs.Config:
  """The config that the parsed flags describe."""
  return defaults.replace(
      **{
          name: getattr(args, spec.dest)
          for name, spec in configs.FIELDS.items()
          if spec.flag is not None
      }
  )


def flag_takes_value(flag: str) -> bool | None:
  """Whether the CLI's ``flag`` reads a value (``None``: no such flag)."""
  for spec in configs.FIELDS.values():
    if spec.flag is None:
      continue
    if flag == spec.flag:
      return spec.kind is configs.Flag.VALUE
    if spec.kind is configs.Flag.ON_OFF and flag == "--no-" + spec.flag[2:]:
      return False
  for run_flag, options in RUN_FLAGS:
    if flag == run_flag:
      return "action" not in options
  return None
