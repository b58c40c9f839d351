"""Labels of runs: the settings that tell the plotted or tabled runs apart.

A run's config as read from its ``config.json`` becomes a setting
(`as_setting`: what the run did, whichever version wrote it); the fields
whose values differ between the runs (`varying_fields`) label them, spelled
as the run folders' names spell them (`setting_text`, `run_labels`), and
runs alike in every setting by their folders (`run_dir_names`). Shared by
:mod:`train.report.plot` and the report (:mod:`train.report.runs`), and free
of jax as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
from pathlib import Path
from typing import Any

from train.data import info as data_info

#: How a config field is named in labels (the CLI flag, without dashes).
FIELD_LABELS = {
    "learning_rate": "lr",
    "batch_size": "batch",
    "weight_decay": "wd",
    "norm_momentum": "norm-momentum",
    "norm_epsilon": "norm-eps",
    "eval_every": "eval-every",
}


#: Defaults of config fields added after some runs were written
#: (``train.configs.ADDED_FIELDS``; a test keeps the two equal). A run
#: written before a field existed did what its default does, so it is the
#: same setting as a newer run with the default (else the two would differ
#: in, and be labelled by, a field one of them lacks). Spelled out here
#: because ``train.configs`` imports the models (jax).
ADDED_FIELD_DEFAULTS = {
    "renorm": False,
    "renorm_rmax": 3.0,
    "renorm_dmax": 5.0,
    "calibration": "none",
    "norm_bias": 0.0,
    "steps": None,
    "norm_groups": 5,
    "train_subset": None,
    "subset_seed": 0,
}
#: A field's prefix in the run names of ``train.sweep.grid.run_name``
#: (``train.configs.FIELDS``' ``run_name``; a test keeps the two equal), so
#: that a label reads as the part of a run folder's name that tells the run
#: apart. Spelled out here for the same reason.
RUN_NAME_PREFIXES = {
    "norm": "",
    "batch_size": "b",
    "learning_rate": "lr",
    "momentum": "m",
    "weight_decay": "wd",
    "seed": "seed",
    "norm_momentum": "nm",
    "norm_epsilon": "eps",
    "eval_every": "ev",
    "renorm": "renorm",
    "renorm_rmax": "rmax",
    "renorm_dmax": "dmax",
    "calibration": "cal_",
    "norm_bias": "nb",
    "steps": "steps",
    "norm_groups": "groups",
    "train_subset": "sub",
    "subset_seed": "subseed",
}


def varying_fields(
    configs: Sequence[dict[str, Any]], exclude: Sequence[str] = ("norm",)
) -> list[str]:
  """Config fields whose values differ between ``configs``, in field order."""
  fields: list[str] = []
  for config in configs:
    fields += [k for k in config if k not in fields]
  return [
      k
      for k in fields
      if k not in exclude and len({json.dumps(c.get(k)) for c in configs}) > 1
  ]


def describe(config: dict[str, Any], fields: Sequence[str]) -> str:
  """``lr=0.1, seed=2``-style text of ``fields`` of ``config``."""
  return ", ".join(f"{FIELD_LABELS.get(k, k)}={config.get(k)}" for k in fields)


def condition_text(config: dict[str, Any], fields: Sequence[str]) -> str:
  """``sqd2, renorm, calibration=normal``: the norm and ``fields``.

  A switch shows by its name where it is on; a field at the default of a
  field added later (``calibration=none``) is left out, as the run names
  leave it out.
  """
  parts = [config["norm"]]
  for field in fields:
    value = config.get(field)
    if isinstance(value, bool):
      if value:
        parts.append(field)
    elif field not in ADDED_FIELD_DEFAULTS or value != (
        ADDED_FIELD_DEFAULTS[field]
    ):
      parts.append(f"{FIELD_LABELS.get(field, field)}={value}")
  return ", ".join(parts)


def as_setting(config: dict[str, Any]) -> dict[str, Any]:
  """``config`` with what a run did filled in: the defaults of fields added
  since it was written, and ``augment=None`` as its dataset's default."""
  config = {**ADDED_FIELD_DEFAULTS, **config}
  if config.get("augment") is None and "augment" in config:
    try:
      info = data_info.dataset_info(config.get("dataset"))
    except ValueError:  # a dataset of another version: left as it is
      return config
    config["augment"] = bool(info.augment_by_default)
  return config


def setting_text(field: str, value: Any) -> str:
  """One setting as the run names spell it (``b128``, ``lr0.1``, ``aug``).

  >>> [setting_text(f, v) for f, v in (("learning_rate", 0.1),
  ...  ("model", "lenet"), ("augment", False), ("epochs", 3))]
  ['lr0.1', 'lenet', 'noaug', 'epochs=3']
  """
  prefix = RUN_NAME_PREFIXES.get(field)
  if field in ("dataset", "model"):
    return str(value)
  if field == "augment" and isinstance(value, bool):
    return "aug" if value else "noaug"
  if prefix is None or value is None:
    return f"{FIELD_LABELS.get(field, field)}={value}"
  if isinstance(value, bool):  # a switch shows where it is on, as in names
    return prefix if value else ""
  return prefix + (repr(value) if isinstance(value, float) else str(value))


def run_labels(
    configs: Sequence[dict[str, Any]],
    run_dirs: Sequence[str | Path] | None = None,
) -> list[str]:
  """Labels runs by norm and the settings that tell them apart.

  Runs whose settings are the same (a rerun, a copy) are told apart by
  their folders' names below the folder that holds them all, where
  ``run_dirs`` gives them.

  >>> run_labels([{"norm": "bn", "seed": 0, "learning_rate": 0.1},
  ...             {"norm": "sqd2", "seed": 1, "learning_rate": 0.1}])
  ['bn seed0', 'sqd2 seed1']
  """
  settings = [as_setting(c) for c in configs]
  fields = varying_fields(settings)
  labels = [
      " ".join(
          t
          for t in [
              str(setting.get("norm", "?")),
              *(setting_text(k, setting.get(k)) for k in fields),
          ]
          if t
      )
      for setting in settings
  ]
  if run_dirs is not None:
    names = run_dir_names(run_dirs)
    labels = [
        f"{label} ({name})" if labels.count(label) > 1 else label
        for label, name in zip(labels, names)
    ]
  return labels


def run_dir_names(run_dirs: Sequence[str | Path]) -> list[str]:
  """Each run folder's path below the deepest folder holding the runs'
  folders, or, where they all share one folder, below that folder's parent
  (so that a sweep's name stays).

  Only resolved paths enter, so the names do not depend on how a folder
  was written (relative, ``./``-prefixed, absolute, through a symlink).
  """
  paths = [Path(d).resolve() for d in run_dirs]
  if not paths:
    return []
  parents = {p.parent for p in paths}
  base = Path(os.path.commonpath(list(parents)))
  if len(parents) == 1:
    base = base.parent
  return [str(p.relative_to(base)) if p != base else p.name for p in paths]
