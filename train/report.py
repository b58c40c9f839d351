"""``python -m train.report DIR... --out OUT``: tables and curves of many runs.

Each DIR is a run directory or any folder above run directories (a sweep
dir, ``results/``); run directories (folders with ``config.json``) are
found recursively. ``OUT/report.md`` then holds:

* **Test error**, in the layout of the paper's Tables 2/3: one row per
  setting (dataset, model, learning rate, batch, augmentation, and any other
  field that differs between settings), one column per norm. A cell is the
  best test error of a run (its lowest over the evaluated epochs), mean ±
  sample standard deviation over seeds, with n; the row's lowest mean is in
  bold.
* **Convergence**: per norm, the epochs and seconds (cumulative training
  wall-clock, ``elapsed_seconds``) a run takes to first reach the target
  error, BatchNorm's mean final test error in the same setting.
* **Best learning rate**: per norm, its lowest mean over the learning-rate
  grid of a setting, and at which rate.
* **Gain**, where a run has ``gain.json`` (``python -m train.gain``) or
  with ``--gain``: per setting and norm, the gain ``sigma/D`` a Gaussian
  feature meets (from ``gbn_jax``'s normal-consistency constants, see
  :func:`gaussian_gain`), the gain measured on real activations, the best
  error; and Spearman's rank correlation of gain with best error across
  the norms of each setting.
* **Calibrated against raw measures and BatchNorm**, where runs with
  ``calibration='normal'`` exist: per measure, raw, calibrated, BatchNorm
  with its Gaussian gain (``bn_gain:<measure>``), and the differences
  calibrated − BatchNorm, raw − calibrated, ``bn_gain`` − BatchNorm with
  their standard errors over independent seeds.
* **Precise statistics**, for runs trained with ``--precise-stats``: per
  norm, the final test error with the running averages (EMA) and with the
  statistics recomputed over training batches (PreciseBN), and their paired
  difference.
* **Curves** (``curves_*.png``): training loss and test error against epoch
  and seconds, the mean over seeds with a ±std band, one line per norm.
* **Activations** (``activations_*.png``), for runs trained with
  ``--record-activations``: percentile bands of one feature before and
  after one norm layer over training iterations.

Only finished runs (every epoch of their config) enter the means; an
unfinished or failed run is listed as such in its cell and in the run list,
never dropped silently.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
import dataclasses
import functools
import json
import math
import os
from pathlib import Path
import re
import sys
from typing import Any

import numpy as np

from train import plot

_PROG = "python -m train.report"
#: Fields that tell settings (table rows) apart, always shown.
ROW_FIELDS = ("dataset", "model", "learning_rate", "batch_size", "augment")
#: The paper's Table 2 (original CIFAR-10, LeNet, batch 1024, lr 0.1,
#: 200 epochs; best test error %, mean ± std over runs). Its SD is BatchNorm.
PAPER_TABLE2_CIFAR10_LENET = {
    "bn": (28.74, 0.36),
    "mad": (29.03, 0.37),
    "rsd": (29.19, 0.45),
    "rbd": (31.16, 0.30),
    "sqd1": (46.64, 4.05),
    "sqd2": (27.23, 0.19),
    "sqd3": (27.17, 0.27),
}
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
  def finished(self) -> bool:
    return self.epochs_done >= self.config["epochs"]

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


@functools.cache
def _added_field_defaults() -> dict[str, Any]:
  """Defaults of config fields added after some runs were written.

  A run written before a field existed did what its default does, so it is
  the same setting as a newer run with the default (else the two would
  differ in, and be labelled by, a field one of them lacks). Empty where the
  training package cannot be imported (it needs jax).
  """
  try:
    from train import configs  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  return {
      f.name: f.default
      for f in dataclasses.fields(configs.Config)
      if f.name in configs.ADDED_FIELDS
  }


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
        lines = (
            (run_dir / "metrics.jsonl").read_text().splitlines()
            if (run_dir / "metrics.jsonl").exists()
            else []
        )
        rows = [json.loads(line) for line in lines if line.strip()]
      except (OSError, ValueError) as e:
        print(f"{_PROG}: warning: skipped {run_dir}: {e}", file=sys.stderr)
        continue
      if not isinstance(config, dict) or "norm" not in config:
        continue
      config = {**_added_field_defaults(), **config}
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


def _setting_key(config: dict[str, Any], drop: Sequence[str]) -> str:
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
    key = _setting_key(run.config, drop)
    groups.setdefault(key, {}).setdefault(run.config["norm"], []).append(run)
  return groups


def norm_order(norms: Iterable[str]) -> list[str]:
  rank = {n: i for i, n in enumerate(NORM_ORDER)}
  return sorted(set(norms), key=lambda n: (rank.get(n, len(rank)), n))


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
  """Mean and sample standard deviation (``None`` for one value)."""
  array = np.asarray(values, np.float64)
  std = float(array.std(ddof=1)) if len(array) > 1 else None
  return float(array.mean()), std


def _pm(mean: float, std: float | None, digits: int = 2) -> str:
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
        epochs = ", ".join(
            f"{r.epochs_done}/{r.config['epochs']}" for r in runs
        )
        parts.append(f"{len(runs)} {state} ({epochs} epochs)")
    return "; ".join(parts)


def _setting_label(config: dict[str, Any], extra: Sequence[str]) -> str:
  shown = [f for f in ROW_FIELDS] + [f for f in extra if f not in ROW_FIELDS]
  return ", ".join(
      f"{plot.FIELD_LABELS.get(f, f)}={config.get(f)}" for f in shown
  )


def _row_extra(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  configs = [
      next(iter(by_norm.values()))[0].config for by_norm in groups.values()
  ]
  return plot.varying_fields(configs, exclude=("norm", "seed"))


def _first_config(by_norm: dict[str, list[Run]]) -> dict[str, Any]:
  return next(iter(by_norm.values()))[0].config


def error_table(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Markdown lines of the test-error table (paper layout)."""
  norms = norm_order(n for g in groups.values() for n in g)
  extra = _row_extra(groups)
  lines = [
      "| setting | " + " | ".join(norms) + " |",
      "|---|" + "---|" * len(norms),
  ]
  for by_norm in groups.values():
    config = _first_config(by_norm)
    cells = {n: Cell.of(by_norm.get(n, [])) for n in norms}
    means = {
        n: mean_std(c.best_errors())[0]
        for n, c in cells.items()
        if c.best_errors()
    }
    best = min(means.values()) if means else None
    texts = []
    for n in norms:
      cell = cells[n]
      text = ""
      if cell.best_errors():
        mean, std = mean_std(cell.best_errors())
        text = _pm(mean, std)
        if mean == best:
          text = f"**{text}**"
        text += f" (n={len(cell.best_errors())})"
      if cell.others:
        text = (text + "; " if text else "") + cell.others_text()
      texts.append(text or "–")
    lines.append(
        f"| {_setting_label(config, extra)} | " + " | ".join(texts) + " |"
    )
    if _is_paper_table2(config):
      paper = [
          (
              _pm(*PAPER_TABLE2_CIFAR10_LENET[n])
              if n in PAPER_TABLE2_CIFAR10_LENET
              else ""
          )
          for n in norms
      ]
      lines.append(
          "| *paper, Table 2 (original CIFAR-10, 200 epochs)* | "
          + " | ".join(paper)
          + " |"
      )
  return lines


def _is_paper_table2(config: dict[str, Any]) -> bool:
  return (
      config.get("dataset") == "cifar10"
      and config.get("model") == "lenet"
      and config.get("batch_size") == 1024
      and config.get("learning_rate") == 0.1
  )


@dataclasses.dataclass
class Reach:
  """When each run of a cell first reached a target error."""

  epochs: list[int]
  seconds: list[float]
  total: int

  @classmethod
  def of(cls, runs: Sequence[Run], target: float) -> Reach:
    epochs, seconds = [], []
    for run in runs:
      for row in run.rows:
        error = row.get("test_error")
        if error is not None and 100 * error <= target:
          epochs.append(row["epoch"])
          seconds.append(row["elapsed_seconds"])
          break
    return cls(epochs, seconds, len(runs))

  def text(self, own_target: bool = False) -> tuple[str, str]:
    """``(epochs, seconds)`` cells; ``own_target``: the target is the mean
    final error of these very runs (BatchNorm's row), which those above
    their mean never reach."""
    if not self.epochs:
      return f"not reached (0 of {self.total} runs)", "not reached"
    note = (
        ""
        if len(self.epochs) == self.total
        else (
            f", {len(self.epochs)} of {self.total} runs reached it"
            + (" (the target is their own mean)" if own_target else "")
        )
    )
    epochs = _pm(*mean_std(self.epochs), digits=1) + note
    seconds = _pm(*mean_std(self.seconds), digits=0) + note
    return epochs, seconds


def _speed_key(config: dict[str, Any]) -> str:
  return _setting_key(config, ("epochs", "eval_every")) + config["norm"]


def epoch_seconds(timing_runs: Sequence[Run]) -> dict[str, float]:
  """Median seconds per epoch of each (setting, norm) among ``timing_runs``.

  Timing runs are separate runs on an otherwise idle machine; their epochs
  give each norm's speed where the runs of a sweep shared the machine.
  """
  by_key: dict[str, list[float]] = {}
  for run in timing_runs:
    by_key.setdefault(_speed_key(run.config), []).extend(
        row["seconds"] for row in run.rows
    )
  return {k: float(np.median(v)) for k, v in by_key.items() if v}


def convergence_table(
    groups: dict[str, dict[str, list[Run]]],
    quiet: dict[str, float] | None = None,
) -> list[str]:
  """Markdown lines: epochs and seconds to reach BatchNorm's final error.

  With ``quiet`` (:func:`epoch_seconds`), also the seconds to target at the
  timing runs' speed: the epochs to target times their seconds per epoch
  (columns left out without timing runs; empty for a norm without one).
  """
  extra = _row_extra(groups)
  quiet = quiet or {}
  lines = []
  for by_norm in groups.values():
    config = _first_config(by_norm)
    baseline = Cell.of(by_norm.get("bn", []))
    lines.append(f"**{_setting_label(config, extra)}**")
    lines.append("")
    if not baseline.final_errors():
      lines += ["No finished BatchNorm (`bn`) run here, so no target.", ""]
      continue
    target = mean_std(baseline.final_errors())[0]
    quiet_header = (
        "quiet seconds per epoch | seconds to target at quiet " "speed | "
        if quiet
        else ""
    )
    lines += [
        f"Target: {target:.2f} % (BatchNorm's mean final test error, "
        f"n={len(baseline.final_errors())}).",
        "",
        "| norm | epochs to target | seconds to target | "
        f"seconds per epoch | {quiet_header}final test error (%) |",
        "|---|---|---|---|" + ("---|---|" if quiet else "") + "---|",
    ]
    for norm in norm_order(by_norm):
      cell = Cell.of(by_norm[norm])
      if not cell.finished:
        lines.append(
            f"| {norm} | {cell.others_text()} | | |"
            + (" | |" if quiet else "")
            + " |"
        )
        continue
      reach = Reach.of(cell.finished, target)
      epochs, seconds = reach.text(own_target=norm == "bn")
      per_epoch = [r["seconds"] for run in cell.finished for r in run.rows]
      final = _pm(*mean_std(cell.final_errors()))
      speed = quiet.get(_speed_key(cell.finished[0].config))
      quiet_text = quiet_reach = ""
      if speed is not None:
        quiet_text = f"{speed:.1f}"
        quiet_reach = (
            _pm(*mean_std([e * speed for e in reach.epochs]), digits=0)
            if reach.epochs
            else "not reached"
        )
      quiet_cells = f"{quiet_text} | {quiet_reach} | " if quiet else ""
      lines.append(
          f"| {norm} | {epochs} | {seconds} | "
          f"{_pm(*mean_std(per_epoch), digits=1)} | {quiet_cells}"
          f"{final} |"
      )
    lines.append("")
  return lines


def best_lr_table(runs: Sequence[Run]) -> list[str]:
  """Markdown lines: each norm's best mean over the learning-rate grid."""
  groups = group_runs(runs, drop=("learning_rate",))
  lines = []
  for by_norm in groups.values():
    rates = sorted(
        {r.config["learning_rate"] for rs in by_norm.values() for r in rs}
    )
    if len(rates) < 2:
      continue
    config = dict(_first_config(by_norm), learning_rate="grid")
    lines += [
        f"**{_setting_label(config, [])}**, learning rates "
        + ", ".join(map(str, rates)),
        "",
        "| norm | best mean test error (%) | at lr | mean per lr |",
        "|---|---|---|---|",
    ]
    for norm in norm_order(by_norm):
      per_lr = {}
      for rate in rates:
        cell = Cell.of(
            [r for r in by_norm[norm] if r.config["learning_rate"] == rate]
        )
        if cell.best_errors():
          per_lr[rate] = mean_std(cell.best_errors())
      if not per_lr:
        lines.append(f"| {norm} | no finished run | | |")
        continue
      rate = min(per_lr, key=lambda k: per_lr[k][0])
      listing = ", ".join(f"{k}: {v[0]:.2f}" for k, v in per_lr.items())
      lines.append(f"| {norm} | {_pm(*per_lr[rate])} | {rate} | {listing} |")
    lines.append("")
  return lines


def precise_table(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Markdown lines: final test error with running averages vs precise stats.

  Only finished runs whose last evaluation has ``test_error_precise`` (runs
  trained with ``--precise-stats``) enter; the difference is paired per run
  (precise minus EMA, percentage points), negative when precise statistics
  help.
  """
  extra = _row_extra(groups)
  lines = []
  for by_norm in groups.values():
    rows = []
    for norm in norm_order(by_norm):
      pairs = [
          (100 * run.final_error(), 100 * run.final_error("test_error_precise"))
          for run in Cell.of(by_norm[norm]).finished
          if run.rows[-1].get("test_error_precise") is not None
      ]
      if not pairs:
        continue
      ema, precise = (list(v) for v in zip(*pairs))
      rows.append(
          f"| {norm} | {_pm(*mean_std(ema))} | "
          f"{_pm(*mean_std(precise))} | "
          f"{_pm(*mean_std([p - e for e, p in pairs]))} | "
          f"{len(pairs)} |"
      )
    if rows:
      lines += [
          f"**{_setting_label(_first_config(by_norm), extra)}**",
          "",
          "| norm | final test error, running averages (%) | "
          "final test error, precise statistics (%) | precise − "
          "running (points, paired) | n |",
          "|---|---|---|---|---|",
          *rows,
          "",
      ]
  return lines


# ----------------------------------------------------------------- the gain

GAIN_FILE = "gain.json"
#: Stages of ``gain.json`` (``python -m train.gain``), in table order.
GAIN_STAGES = ("init", "final")


def read_gain(run: Run) -> dict[str, Any] | None:
  """The run's ``gain.json`` (``python -m train.gain``), or ``None``."""
  path = run.path / GAIN_FILE
  if not path.exists():
    return None
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    print(f"{_PROG}: warning: skipped {path}: {e}", file=sys.stderr)
    return None
  return data if isinstance(data, dict) else None


def measured_gains(runs: Sequence[Run], stage: str) -> list[float]:
  """``overall`` gain of ``stage`` of each run that has it in ``gain.json``."""
  gains = []
  for run in runs:
    entry = (read_gain(run) or {}).get(stage)
    if isinstance(entry, dict) and entry.get("overall") is not None:
      gains.append(float(entry["overall"]))
  return gains


@functools.lru_cache(maxsize=None)
def _norm_layer_sizes(
    dataset: str, model_name: str, batch_size: int
) -> tuple[tuple[str, int], ...] | None:
  """``((layer, n), ...)``: values per statistic of each norm layer.

  ``n`` is batch x spatial positions of the layer's input, from the model's
  shapes (``jax.eval_shape``: nothing is computed; the norm does not change
  them). ``None`` where the training package (jax) cannot be imported or
  the fields are no valid config.
  """
  try:
    # pylint: disable=g-import-not-at-top
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import gbn_jax
    from train import configs
    from train import input_pipeline
    from train import train as train_lib
  except ImportError:
    return None
  try:
    config = configs.validate(
        configs.Config(dataset=dataset, model=model_name, batch_size=batch_size)
    )
    info = input_pipeline.dataset_info(config.dataset)
    model = train_lib.create_model(config, info.num_classes)
  except (ValueError, TypeError, KeyError) as e:
    print(
        f"{_PROG}: warning: no layer sizes for {dataset}, {model_name}, "
        f"batch {batch_size}: {e}",
        file=sys.stderr,
    )
    return None
  sizes: dict[str, int] = {}

  def capture(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(
        module, (nn.BatchNorm, gbn_jax.GBatchNorm)
    ):
      x = args[0]
      axis = module.axis if isinstance(module.axis, int) else -1
      sizes["/".join(module.scope.path)] = math.prod(x.shape) // x.shape[axis]
    return next_fun(*args, **kwargs)

  images = jax.ShapeDtypeStruct(
      (config.batch_size, *info.image_shape), jnp.float32
  )
  with nn.intercept_methods(capture):
    jax.eval_shape(
        lambda x: model.init(jax.random.key(0), x, train=True), images
    )
  return tuple(sizes.items())


def gaussian_gain(norm: str, calibration: str | None, n: int) -> float:
  """The gain ``sigma/D`` a norm layer gives a Gaussian feature of ``n`` values.

  1 for BatchNorm (``bn``, ``sd``) and for a calibrated measure (its ``D``
  is divided by exactly its Gaussian value); ``1 / normal_constant(n)`` of
  the measure (``gbn_jax``'s, what ``calibration='normal'`` divides by) for
  a raw one and for ``bn_gain:<measure>`` (BatchNorm's sigma times that
  constant).

  Raises:
    ValueError: ``norm`` is no ``--norm`` value.
    ImportError: jax is not installed.
  """
  # pylint: disable=g-import-not-at-top
  import gbn_jax
  from train import models

  spec = models.parse_norm(norm)
  target = spec.gain_of
  if target is None:
    if spec.measure in (None, "sd") or calibration == "normal":
      return 1.0
    target = spec
  measure = gbn_jax.get_measure(
      target.measure,
      **({} if target.alpha is None else {"alpha": target.alpha}),
  )
  return 1.0 / float(measure.normal_constant(n))


def gaussian_layer_gains(config: dict[str, Any]) -> dict[str, float] | None:
  """``{norm layer: Gaussian gain}`` of a run's config (``None``: no jax)."""
  sizes = _norm_layer_sizes(
      config["dataset"], config["model"], config["batch_size"]
  )
  if sizes is None:
    return None
  return {
      layer: gaussian_gain(config["norm"], config.get("calibration"), n)
      for layer, n in sizes
  }


def _gain_range(gains: dict[str, float] | None) -> str:
  if not gains:
    return "–"
  low, high = min(gains.values()), max(gains.values())
  return (
      f"{low:.3f}"
      if f"{low:.3f}" == f"{high:.3f}"
      else (f"{low:.3f}–{high:.3f}")
  )


def rank_correlation(
    gains: Sequence[float], errors: Sequence[float]
) -> tuple[float, float] | None:
  """Spearman's rho and its p-value; ``None`` below 3 points or for a
  constant input (rho is undefined there)."""
  if len(gains) < 3 or len(set(gains)) < 2 or len(set(errors)) < 2:
    return None
  from scipy import stats  # pylint: disable=g-import-not-at-top

  result = stats.spearmanr(gains, errors)
  return float(result.statistic), float(result.pvalue)


def _rho_text(pairs: Sequence[tuple[float, float]]) -> str:
  rho = rank_correlation([g for g, _ in pairs], [e for _, e in pairs])
  if rho is None:
    return f"– ({len(pairs)} norms" + (
        ", gain constant)" if len(pairs) >= 3 else ")"
    )
  return f"{rho[0]:+.2f} (p={rho[1]:.2g}, {len(pairs)} norms)"


def gain_tables(groups: dict[str, dict[str, list[Run]]]) -> list[str]:
  """Markdown lines: per setting, each norm's gain and best error, and the
  rank correlation of gain with best error across norms.

  The Gaussian gain of a norm is the median over its layers (each layer's
  ``n`` from the model, see :func:`gaussian_layer_gains`), as ``gain.json``'s
  ``overall`` is of the measured ones; a measured gain is the mean over the
  runs (seeds) that have a ``gain.json``.
  """
  extra = _row_extra(groups)
  lines, rho_rows = [], []
  for by_norm in groups.values():
    config = _first_config(by_norm)
    label = _setting_label(config, extra)
    rows, pairs = [], {"gaussian": [], **{s: [] for s in GAIN_STAGES}}
    for norm in norm_order(by_norm):
      cell = Cell.of(by_norm[norm])
      errors = cell.best_errors()
      try:
        layer_gains = gaussian_layer_gains(
            cell.finished[0].config
            if cell.finished
            else by_norm[norm][0].config
        )
      except ValueError:
        layer_gains = None
      texts = []
      if errors:
        error = mean_std(errors)[0]
        if layer_gains:
          pairs["gaussian"].append(
              (float(np.median(list(layer_gains.values()))), error)
          )
      for stage in GAIN_STAGES:
        measured = measured_gains(cell.finished, stage)
        if measured:
          texts.append(
              f"{_pm(*mean_std(measured), digits=3)} " f"(n={len(measured)})"
          )
          if errors:
            pairs[stage].append((float(np.mean(measured)), error))
        else:
          texts.append("–")
      best = (
          f"{_pm(*mean_std(errors))} (n={len(errors)})"
          if errors
          else cell.others_text() or "–"
      )
      rows.append(
          f"| {norm} | {_gain_range(layer_gains)} | "
          + " | ".join(texts)
          + f" | {best} |"
      )
    lines += [
        f"**{label}**",
        "",
        "| norm | Gaussian gain σ/D (per layer) | measured gain at "
        "init | measured gain after training | best test error (%) |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    rho_rows.append(
        f"| {label} | {_rho_text(pairs['gaussian'])} | "
        f"{_rho_text(pairs['init'])} | "
        f"{_rho_text(pairs['final'])} |"
    )
  return lines + [
      "Spearman's rank correlation of gain with mean best test error, "
      "across the norms of a setting (`scipy.stats.spearmanr`; p: its "
      "two-sided p-value, small n). Negative: the larger the gain, the "
      "lower the error. A measured gain enters for the norms where a "
      "finished run has one (its mean over those runs, as in the table "
      "above); '–' where fewer than 3 norms or a constant "
      "gain (calibrated norms all have Gaussian gain 1) leave it undefined.",
      "",
      "| setting | ρ, Gaussian gain | ρ, measured gain at init | "
      "ρ, measured gain after training |",
      "|---|---|---|---|",
      *rho_rows,
      "",
  ]


def _difference(a: Sequence[float], b: Sequence[float]) -> str:
  """``mean(a) - mean(b) ± sqrt(var_a/n_a + var_b/n_b)`` (sample variances)."""
  if not a or not b:
    return ""
  diff = float(np.mean(a) - np.mean(b))
  if len(a) < 2 or len(b) < 2:
    return f"{diff:+.2f} (n={len(a)}, {len(b)})"
  se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
  return f"{diff:+.2f} ± {se:.2f} (n={len(a)}, {len(b)})"


def _is_calibrated(config: dict[str, Any]) -> bool:
  # "none" (the CLI's spelling and the added field's default) or None: raw.
  return config.get("calibration") == "normal"


def calibration_table(runs: Sequence[Run]) -> list[str]:
  """Markdown lines: raw vs calibrated measures vs BatchNorm, per setting.

  A setting here is a config less norm, seed and calibration, so that a
  measure's raw and calibrated runs and BatchNorm's share a row group; only
  settings with a calibrated run are shown. Cells are best test errors
  (mean ± std over seeds); differences are of means, ± their standard error
  over independent seeds.
  """
  groups = group_runs(runs, drop=("calibration",))
  extra = _row_extra(groups)
  lines = []
  for by_norm in groups.values():

    def errors(
        norm: str, calibrated: bool | None = None, by_norm=by_norm
    ) -> list[float]:
      chosen = [
          r
          for r in by_norm.get(norm, [])
          if calibrated is None or _is_calibrated(r.config) == calibrated
      ]
      return Cell.of(chosen).best_errors()

    calibrated = [
        n for n in by_norm if errors(n, True) and n not in ("bn", "sd")
    ]
    if not calibrated:
      continue
    bn = errors("bn")  # bn ignores calibration: all its runs are BatchNorm
    config = dict(_first_config(by_norm), calibration="none|normal")
    lines += [
        f"**{_setting_label(config, extra)}**",
        "",
        "| norm | raw | calibrated | BatchNorm with its Gaussian gain "
        "(`bn_gain:`) | calibrated − BatchNorm | raw − calibrated | "
        "`bn_gain:` − BatchNorm |",
        "|---|---|---|---|---|---|---|",
    ]
    if bn:
      lines.append(f"| bn | {_pm(*mean_std(bn))} (n={len(bn)}) | | | | | |")
    for norm in norm_order(n for n in by_norm if not n.startswith("bn_gain:")):
      if norm == "bn":
        continue
      raw, cal = errors(norm, False), errors(norm, True)
      gain = errors(f"bn_gain:{norm}")
      if not raw and not cal:
        continue
      cells = [
          f"{_pm(*mean_std(v))} (n={len(v)})" if v else "–"
          for v in (raw, cal, gain)
      ]
      lines.append(
          f"| {norm} | " + " | ".join(cells) + " | "
          f"{_difference(cal, bn)} | {_difference(raw, cal)} | "
          f"{_difference(gain, bn)} |"
      )
    lines.append("")
  return lines


def _slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def curves_figure(
    by_norm: dict[str, list[Run]], title: str, path: Path
) -> Path:
  """Writes the 2x2 curves of one setting: mean over seeds, ±std band."""
  fig, axes = plot.plt.subplots(2, 2, figsize=(12, 7.5))
  for ax, (metric, ylabel, xkey, xlabel) in zip(axes.T.flat, plot.CURVES):
    for norm in norm_order(by_norm):
      runs = [r for r in by_norm[norm] if r.rows]
      epochs = sorted({row["epoch"] for r in runs for row in r.rows})
      xs, means, stds = [], [], []
      for epoch in epochs:
        at = [
            row
            for r in runs
            for row in r.rows
            if row["epoch"] == epoch and row.get(metric) is not None
        ]
        if not at:
          continue
        ys = [
            row[metric] * (100 if metric == "test_error" else 1) for row in at
        ]
        xs.append(float(np.mean([row[xkey] for row in at])))
        means.append(float(np.mean(ys)))
        stds.append(float(np.std(ys, ddof=1)) if len(ys) > 1 else 0.0)
      if not xs:
        continue
      done = sum(r.finished for r in runs)
      label = f"{norm} (n={done}" + (
          f", +{len(runs) - done} unfinished)" if done < len(runs) else ")"
      )
      (line,) = ax.plot(xs, means, marker="o", markersize=3, label=label)
      ax.fill_between(
          xs,
          np.subtract(means, stds),
          np.add(means, stds),
          color=line.get_color(),
          alpha=0.2,
          linewidth=0,
      )
    plot.style_axes(ax, metric, xkey, xlabel, ylabel)
    ax.set_title(f"{ylabel} vs {xlabel}")
  axes[0, 1].legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      fontsize="small",
      title="mean ± std over seeds",
  )
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plot.plt.close(fig)
  return path


def read_activations(run: Run) -> list[dict[str, Any]]:
  path = run.path / ACTIVATIONS_FILE
  if not path.exists():
    return []
  return [
      json.loads(line) for line in path.read_text().splitlines() if line.strip()
  ]


def activations_figure(runs: Sequence[Run], path: Path) -> Path | None:
  """Percentile bands of the recorded feature, before and after the norm.

  One column per run (BatchNorm first), rows: before / after the layer; the
  panels of a row share their y-scale, so that spreads compare.
  """
  recorded = [(r, read_activations(r)) for r in runs]
  recorded = [(r, rows) for r, rows in recorded if rows]
  if not recorded:
    return None
  recorded.sort(
      key=lambda item: norm_order([item[0].config["norm"], *NORM_ORDER]).index(
          item[0].config["norm"]
      )
  )
  # One y-scale per row: the spread of the feature under each norm is what
  # the panels of a row compare.
  fig, axes = plot.plt.subplots(
      2,
      len(recorded),
      squeeze=False,
      figsize=(4.5 * len(recorded), 6.5),
      sharex="col",
      sharey="row",
  )
  for column, (run, rows) in enumerate(recorded):
    percentiles = rows[0]["percentiles"]
    steps = np.array([row["step"] for row in rows])
    for row_index, key in enumerate(("before", "after")):
      ax = axes[row_index, column]
      values = np.array([row[key] for row in rows])  # (records, percentiles)
      middle = len(percentiles) // 2
      # Outer bands light, inner dark, opaque and drawn outside in, so that
      # each band has its own clearly different colour.
      shades = plot.plt.cm.Blues(np.linspace(0.3, 0.75, max(middle, 1)))
      for i in range(middle):
        ax.fill_between(
            steps,
            values[:, i],
            values[:, -1 - i],
            color=shades[i],
            linewidth=0,
            label=f"{percentiles[i]:g}-{percentiles[-1 - i]:g}th",
        )
      ax.plot(
          steps,
          values[:, middle],
          color="C3",
          label=f"{percentiles[middle]:g}th (median)",
      )
      ax.axhline(0, color="k", linewidth=0.6)
      ax.set_title(f"{run.config['norm']}: {key} {rows[0]['layer']}")
      ax.set_xlabel("training iteration")
      ax.set_ylabel(f"feature {rows[0]['feature']} value")
      ax.grid(True, alpha=0.3)
  axes[0, -1].legend(
      loc="upper left",
      bbox_to_anchor=(1.02, 1.0),
      fontsize="small",
      title="percentiles over the batch",
  )
  fig.suptitle(
      "Distribution of one feature over training (cf. the paper's " "Figure 1)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plot.plt.close(fig)
  return path


def run_names(runs: Sequence[Run], out: Path) -> list[str]:
  """Each run's name: its path below the deepest folder holding every run
  and the report (``results/`` for the README's reports).

  Only resolved paths enter, so the names do not depend on how a DIR was
  written (relative, ``./``-prefixed, absolute, through a symlink). Where
  that folder is the filesystem's root (runs and report far apart), the
  names are below the deepest folder holding the runs' folders.
  """
  paths = [run.path.resolve() for run in runs]
  if not paths:
    return []
  base = Path(os.path.commonpath([*paths, out.resolve()]))
  if base == Path(base.anchor):
    base = Path(os.path.commonpath([p.parent for p in paths]))
  return [str(p.relative_to(base)) if p != base else p.name for p in paths]


def run_list(runs: Sequence[Run], out: Path) -> list[str]:
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
        f"{run.epochs_done}/{run.config['epochs']} | "
        f"{'' if best is None else f'{100 * best:.2f}'} | {state} |"
    )
  return lines


def write_report(
    dirs: Sequence[str | Path],
    out: str | Path,
    command: str | None = None,
    timing: Sequence[str | Path] = (),
    gain: bool = False,
) -> Path:
  """Writes ``out/report.md`` and its PNGs; returns the report's path.

  ``timing`` folders hold runs timed on an idle machine (see
  :func:`epoch_seconds`); they are not part of the tables otherwise. The
  gain section is written where a run has ``gain.json``, or always with
  ``gain``.

  Raises:
    FileNotFoundError: If a DIR is missing.
    ValueError: If no run directory is found.
  """
  runs = find_runs(dirs)
  if not runs:
    raise ValueError(
        "no run directories (folders with config.json) found "
        f"in {', '.join(map(str, dirs))}"
    )
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  all_runs, runs = runs, distinct_runs(runs)
  groups = group_runs(runs)
  extra = _row_extra(groups)
  finished = sum(r.finished for r in runs)
  lines = ["# Report", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  lines += [
      f"{len(runs)} runs: {finished} finished, "
      f"{sum(r.state == 'unfinished' for r in runs)} unfinished, "
      f"{sum(r.state == 'failed' for r in runs)} failed"
      + (
          f" (and {len(all_runs) - len(runs)} repeated configs, counted once)"
          if len(all_runs) > len(runs)
          else ""
      )
      + ". Means and standard "
      "deviations (sample, ddof=1) are over the finished runs (seeds) of a "
      "cell; errors in %.",
      "",
      "## Best test error (the paper's table layout)",
      "",
      "Each cell: the lowest test error a run reached over its evaluated "
      "epochs, mean ± std over seeds (n); the lowest mean of a row in bold.",
      "",
      *error_table(groups),
      "",
      "## Convergence",
      "",
      "Epochs and seconds (cumulative training wall-clock, compilation "
      "excluded) until a run's test error first falls to the target; mean ± "
      "std over the runs that reached it. BatchNorm's own row has its own "
      "mean as target, so its runs that end above their mean never reach "
      "it."
      + (
          " Quiet seconds per epoch: the median epoch of the timing runs "
          f"({', '.join(map(str, timing))}), run one at a time on an idle "
          "machine; seconds to target at quiet speed = epochs to target x "
          "that; both empty for a setting or norm with no timing run."
          if timing
          else ""
      ),
      "",
      *convergence_table(
          groups, epoch_seconds(find_runs(timing)) if timing else None
      ),
  ]
  if any((r.path / GAIN_FILE).exists() for r in runs) or gain:
    lines += [
        "## Gain",
        "",
        "The gain σ/D: what a norm layer multiplies a feature by, "
        "relative to BatchNorm (σ: the feature's standard deviation "
        "over the batch, D: the layer's deviation measure). Gaussian "
        "gain: for a Gaussian feature, 1 / `Measure.normal_constant(n)`"
        " of `gbn_jax` (the divisor of `calibration='normal'`: 1 for "
        "`bn`, `sd` and every calibrated measure; for `bn_gain:<m>`, "
        "`m`'s), with n = batch × spatial positions of each norm layer "
        "from the model's shapes (it matters for `rbd` and `wcd` only); "
        "the range over the layers is shown, their median enters the "
        "correlation. Measured gain: `overall` of the runs' `gain.json` "
        "(`python -m train.gain`: the median over layers of each "
        "layer's median over features of σ/D, on real "
        "pre-normalization activations), mean ± std over the runs that "
        "have one (n); '–' where none has.",
        "",
        *gain_tables(groups),
    ]
  calibration_lines = calibration_table(runs)
  if calibration_lines:
    lines += [
        "## Calibrated against raw measures and BatchNorm",
        "",
        "Best test error (%), mean ± std over seeds (n). Calibrated: "
        "`calibration='normal'`, each D divided by its value for a "
        "standard normal feature, so that every measure has "
        "BatchNorm's gain 1 on Gaussian data; raw: without. The "
        "differences are of means over seeds, in points; seeds are "
        "independent runs (not paired), so ± is the standard error of "
        "the difference, sqrt(s_a²/n_a + s_b²/n_b) with the sample "
        "variances (ddof=1) of the two cells, shown where both have at "
        "least 2 runs.",
        "",
        *calibration_lines,
    ]
  lr_lines = best_lr_table(runs)
  if lr_lines:
    lines += [
        "## Best learning rate",
        "",
        "Per norm, the learning rate with the lowest mean best test " "error.",
        "",
        *lr_lines,
    ]
  precise_lines = precise_table(groups)
  if precise_lines:
    lines += [
        "## Precise statistics",
        "",
        "Runs trained with `--precise-stats N`: before each evaluation "
        "the norms' statistics were also recomputed as equal-weight "
        "averages over N training batches (PreciseBN) and the test set "
        "evaluated with them; the model trained the same either way.",
        "",
        *precise_lines,
    ]
  lines += ["## Curves", ""]
  written = set()
  for index, by_norm in enumerate(groups.values()):
    label = _setting_label(_first_config(by_norm), extra)
    name = f"curves_{index + 1:02d}_{_slug(label)[:80]}.png"
    curves_figure(by_norm, label, out / name)
    written.add(name)
    lines += [f"![{label}]({name})", ""]
  activation_runs = [
      r for r in all_runs if (r.path / ACTIVATIONS_FILE).exists()
  ]
  if activation_runs:
    lines += ["## Activations", ""]
    by_setting = group_runs(activation_runs)
    for index, by_norm in enumerate(by_setting.values()):
      chosen = [runs_[0] for runs_ in by_norm.values()]
      name = f"activations_{index + 1:02d}.png"
      if activations_figure(chosen, out / name):
        written.add(name)
        label = _setting_label(_first_config(by_norm), extra)
        lines += [
            f"{label}: "
            + ", ".join(
                f"{r.config['norm']} seed {r.config['seed']}" for r in chosen
            ),
            "",
            f"![activations]({name})",
            "",
        ]
  lines += ["## Runs", "", *run_list(all_runs, out), ""]
  path = out / "report.md"
  path.write_text("\n".join(lines))
  _remove_stale_figures(out, written)
  return path


def _remove_stale_figures(out: Path, written: set[str]) -> None:
  """Deletes figures of an earlier report in ``out`` that this one lacks.

  Only the report's own names (``curves_*.png``, ``activations_*.png``), so
  that a rerun into the same folder leaves no figure of settings or labels
  that are gone.
  """
  for pattern in ("curves_*.png", "activations_*.png"):
    for figure in out.glob(pattern):
      if figure.name not in written:
        figure.unlink()


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog=_PROG,
      description=__doc__.split("\n\n")[0].split(": ", 1)[1]
      + " Writes OUT/report.md plus PNGs; see train/report.py.",
  )
  parser.add_argument(
      "dirs",
      nargs="+",
      metavar="DIR",
      help="run directories or folders above them",
  )
  parser.add_argument(
      "--timing",
      nargs="+",
      default=(),
      metavar="DIR",
      help="runs timed on an idle machine: their seconds per "
      "epoch give each norm's speed in the convergence table",
  )
  parser.add_argument(
      "--gain",
      action="store_true",
      help="write the gain section even where no run has a "
      "gain.json (python -m train.gain); it is written "
      "anyway where one has",
  )
  parser.add_argument(
      "--out", required=True, help="folder for report.md and the PNGs"
  )
  args = parser.parse_args(argv)
  command = " ".join([_PROG, *(argv if argv is not None else sys.argv[1:])])
  try:
    path = write_report(
        args.dirs, args.out, command=command, timing=args.timing, gain=args.gain
    )
  except (FileNotFoundError, ValueError) as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 1
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
