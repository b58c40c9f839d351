"""Run directories as the report reads them: discovery, settings, cells.

numpy only (no jax, flax or ``train.model.models``), as every ``train.report_*``
module: a report is written wherever the results are, without the training
stack.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import dataclasses
import json
from pathlib import Path
import sys
from typing import Any

import numpy as np

from train import run_files
from train.report import labels as plot_labels

PROG = "python -m train.report"
#: Fields that tell settings (table rows) apart, always shown.
ROW_FIELDS = ("dataset", "model", "learning_rate", "batch_size", "augment")
#: Columns in this order first (the paper's), then any other norm.
NORM_ORDER = (
    "bn",
    "sd",
    "mad",
    "rsd",
    "rbd",
    "sqd1",
    "sqd2",
    "sqd3",
    "wcd",
    "bpoe",
)
ACTIVATIONS_FILE = "activations.jsonl"


@dataclasses.dataclass
class Run:
  """One run directory as read from disk.

  Attributes:
    path: The directory.
    config: Its ``config.json``.
    rows: Its ``metrics.jsonl`` rows.
    failure: The error of a failed sweep run (``sweep_status.json``).
  """

  path: Path
  config: dict[str, Any]
  rows: list[dict[str, Any]]
  failure: str | None = None

  @property
  def epochs_done(self) -> int:
    return max((r["epoch"] for r in self.rows), default=0)

  @property
  def steps_done(self) -> int:
    return max((r.get("step", 0) for r in self.rows), default=0)

  @property
  def finished(self) -> bool:
    # A ``--steps`` run ends at its step, usually before its ``epochs``.
    if self.config.get("steps") is not None:
      return self.steps_done >= self.config["steps"]
    return self.epochs_done >= self.config["epochs"]

  @property
  def progress(self) -> str:
    """Epochs done of the config's (``3/5``), or steps done of a ``--steps``
    run's (``30/60 steps``)."""
    if self.config.get("steps") is not None:
      return f"{self.steps_done}/{self.config['steps']} steps"
    return f"{self.epochs_done}/{self.config['epochs']}"

  @property
  def state(self) -> str:
    if self.finished:
      return "finished"
    return "failed" if self.failure else "unfinished"

  def best_error(self) -> float | None:
    errors = [
        r["test_error"] for r in self.rows if r.get("test_error") is not None
    ]
    return min(errors) if errors else None

  def final_error(self, key: str = "test_error") -> float | None:
    errors = [r[key] for r in self.rows if r.get(key) is not None]
    return errors[-1] if errors else None


#: Defaults of config fields added after some runs were written: a run
#: written before a field existed is the same setting as a newer run with
#: the default. Shared with the plots' labels.
ADDED_FIELD_DEFAULTS = plot_labels.ADDED_FIELD_DEFAULTS


def warn(message: str) -> None:
  """A warning line on stderr, prefixed with the command."""
  print(f"{PROG}: warning: {message}", file=sys.stderr)


def find_runs(dirs: Iterable[str | Path]) -> list[Run]:
  """Every run directory in or under ``dirs``, sorted by path.

  Raises:
    FileNotFoundError: If a DIR does not exist.
  """
  found: dict[Path, Run] = {}
  for top in dirs:
    top = Path(top)
    if not top.is_dir():
      raise FileNotFoundError(f"{top} is not a folder")
    for config_path in sorted([top / "config.json", *top.rglob("config.json")]):
      run_dir = config_path.parent
      if (
          not config_path.is_file()
          or "checkpoints" in run_dir.parts
          or run_dir.resolve() in found
      ):
        continue
      try:
        config = json.loads(config_path.read_text())
        rows = run_files.read_metrics(run_dir)
      except (OSError, ValueError) as e:
        warn(f"skipped {run_dir}: {e}")
        continue
      if not isinstance(config, dict) or "norm" not in config:
        continue
      config = {**ADDED_FIELD_DEFAULTS, **config}
      failure = None
      status_path = run_dir / "sweep_status.json"
      if status_path.exists():
        try:
          failure = json.loads(status_path.read_text()).get("error") or "failed"
        except (OSError, ValueError):
          failure = "failed"
      found[run_dir.resolve()] = Run(run_dir, config, rows, failure)
  # By resolved path: the order must not depend on how a DIR was written.
  return sorted(found.values(), key=lambda r: str(r.path.resolve()))


def distinct_runs(runs: Sequence[Run]) -> list[Run]:
  """One run per config (seed included): a rerun is the same experiment.

  Keeps the first of equal configs that has the most epochs, so that n
  counts seeds, not copies (e.g. a run repeated with
  ``--record-activations``, which trains identically).
  """
  best: dict[str, Run] = {}
  for run in runs:
    key = json.dumps(run.config, sort_keys=True)
    if key not in best or run.epochs_done > best[key].epochs_done:
      best[key] = run
  return [
      run for run in runs if best[json.dumps(run.config, sort_keys=True)] is run
  ]


def setting_key(config: dict[str, Any], drop: Sequence[str]) -> str:
  """The setting of ``config``: its fields less norm, seed and ``drop``."""
  return json.dumps(
      {
          k: v
          for k, v in sorted(config.items())
          if k not in ("norm", "seed", *drop)
      }
  )


def group_runs(
    runs: Sequence[Run], drop: Sequence[str] = ()
) -> dict[str, dict[str, list[Run]]]:
  """``{setting key: {norm: runs}}``; a setting is a config less norm, seed."""
  groups: dict[str, dict[str, list[Run]]] = {}
  for run in runs:
    key = setting_key(run.config, drop)
    groups.setdefault(key, {}).setdefault(run.config["norm"], []).append(run)
  return groups


def norm_order(norms: Iterable[str]) -> list[str]:
  """``norms`` in column order: :data:`NORM_ORDER`, then by name."""
  rank = {n: i for i, n in enumerate(NORM_ORDER)}
  return sorted(set(norms), key=lambda n: (rank.get(n, len(rank)), n))


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
  """Mean and sample standard deviation (``None`` for one value)."""
  array = np.asarray(values, np.float64)
  std = float(array.std(ddof=1)) if len(array) > 1 else None
  return float(array.mean()), std


def pm(mean: float, std: float | None, digits: int = 2) -> str:
  """``mean ± std`` (just the mean where ``std`` is ``None``)."""
  return (
      f"{mean:.{digits}f} ± {std:.{digits}f}"
      if std is not None
      else f"{mean:.{digits}f}"
  )


@dataclasses.dataclass
class Cell:
  """The runs of one norm in one setting, summarized."""

  finished: list[Run]
  others: list[Run]

  @classmethod
  def of(cls, runs: Sequence[Run]) -> Cell:
    return cls(
        [r for r in runs if r.finished], [r for r in runs if not r.finished]
    )

  def best_errors(self) -> list[float]:
    return [
        100 * e
        for e in (r.best_error() for r in self.finished)
        if e is not None
    ]

  def final_errors(self) -> list[float]:
    return [
        100 * e
        for e in (r.final_error() for r in self.finished)
        if e is not None
    ]

  def others_text(self) -> str:
    parts = []
    for state in ("unfinished", "failed"):
      runs = [r for r in self.others if r.state == state]
      if runs:
        by_epoch = [r.progress for r in runs if r.config.get("steps") is None]
        done = [r.progress for r in runs if r.config.get("steps") is not None]
        if by_epoch:
          done.append(", ".join(by_epoch) + " epochs")
        parts.append(f"{len(runs)} {state} ({', '.join(done)})")
    return "; ".join(parts)


def setting_label(config: dict[str, Any], extra: Sequence[str]) -> str:
  """A table row's label: :data:`ROW_FIELDS` and ``extra`` fields."""
  shown = [f for f in ROW_FIELDS] + [f for f in extra if f not in ROW_FIELDS]
  return ", ".join(
      f"{plot_labels.FIELD_LABELS.get(f, f)}={config.get(f)}" for f in shown
  )


def row_extra(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Fields beyond :data:`ROW_FIELDS` that differ between the settings."""
  configs = [
      next(iter(by_norm.values()))[0].config for by_norm in groups.values()
  ]
  return plot_labels.varying_fields(configs, exclude=("norm", "seed"))


def first_config(by_norm: dict[str, list[Run]]) -> dict[str, Any]:
  """The config of a setting's first run (all share the setting)."""
  return next(iter(by_norm.values()))[0].config


def run_names(runs: Sequence[Run], out: Path) -> list[str]:
  """Each run's name: its path below the deepest folder holding the runs'
  folders (``results/`` for the README's report), or, where they all share
  one folder, below that folder's parent (so the sweep's name stays).

  Only resolved paths enter, so the names depend neither on how a DIR was
  written (relative, ``./``-prefixed, absolute, through a symlink) nor on
  where the report goes (``out`` is unused, kept for the callers).
  """
  del out
  return plot_labels.run_dir_names([run.path for run in runs])


def run_list(runs: Sequence[Run], out: Path) -> list[str]:
  """Markdown lines: every run, its norm, seed, epochs, error, state."""
  lines = [
      "| run | norm | seed | epochs | best test error (%) | state |",
      "|---|---|---|---|---|---|",
  ]
  for run, where in zip(runs, run_names(runs, out)):
    best = run.best_error()
    state = run.state + (
        f": {run.failure}" if run.failure and not run.finished else ""
    )
    lines.append(
        f"| {where} | {run.config['norm']} | {run.config['seed']} | "
        f"{run.progress} | "
        f"{'' if best is None else f'{100 * best:.2f}'} | {state} |"
    )
  return lines
