"""Run folders as the training suite leaves them, for the plot and report
tests: a ``config.json``, a ``metrics.jsonl`` and ``curvature.jsonl`` lines,
with made-up numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train import configs
from train.loop import checkpointing

from tests.helpers.training import TINY


def write_run(
    folder: Path,
    norm: str,
    seed: int,
    lr: float,
    errors,
    seconds,
    epochs: int | None = None,
    dataset="fashion_mnist",
    precise_errors=None,
    **settings,
):
  """A finished run folder: its config and one metrics row an epoch.

  Args:
    folder: The run folder to create.
    norm: The config's ``norm``.
    seed: The config's seed (it also shifts the training loss).
    lr: The config's learning rate.
    errors: Each epoch's test error.
    seconds: Each epoch's seconds.
    epochs: The config's epochs, if not ``len(errors)`` (an unfinished run).
    dataset: The config's dataset.
    precise_errors: Each epoch's ``test_error_precise``, if any.
    **settings: Other config fields (``batch_size=128``, ``momentum=0.9``).

  Returns:
    ``folder``.
  """
  folder.mkdir(parents=True)
  config = configs.MNIST.replace(
      dataset=dataset,
      norm=norm,
      seed=seed,
      learning_rate=lr,
      augment=False,
      epochs=epochs or len(errors),
      **settings,
  )
  checkpointing.write_config(folder, config)
  rows, elapsed, best = [], 0.0, None
  for epoch, (error, sec) in enumerate(zip(errors, seconds), start=1):
    elapsed += sec
    best = error if best is None else min(best, error)
    rows.append(
        {
            "epoch": epoch,
            "train_loss": 2.0 / epoch + seed * 0.01,
            "train_error": error + 0.01,
            "test_loss": 1.0 / epoch,
            "test_error": error,
            "best_test_error": best,
            "seconds": sec,
            "elapsed_seconds": elapsed,
        }
    )
    if precise_errors is not None:
      rows[-1]["test_error_precise"] = precise_errors[epoch - 1]
  checkpointing.write_metrics(folder, rows)
  return folder


def write_random_run(folder: Path, norm: str, seed: int) -> Path:
  """A run of :data:`tests.helpers.training.TINY` with ``norm``: five epochs of
  random curves (no test error in the first)."""
  rng = np.random.default_rng(seed)
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(
      json.dumps(TINY.replace(norm=norm).to_json())
  )
  rows, elapsed = [], 0.0
  for epoch in range(1, 6):
    elapsed += rng.uniform(1, 2)
    rows.append(
        {
            "epoch": epoch,
            "train_loss": float(2 / epoch),
            "test_error": None if epoch == 1 else float(rng.uniform()),
            "elapsed_seconds": elapsed,
        }
    )
  checkpointing.write_metrics(folder, rows)
  return folder


def curvature_line(
    epoch: int,
    top: float,
    trace: float,
    *,
    parameters: int,
    weight_decay: float,
    noise_scale: float | None = None,
    loss: float = 1.0,
    settings: dict | None = None,
) -> dict:
  """A made-up line of a run's ``curvature.jsonl``, as train.curvature writes.

  Like the tool's, the line holds the training loss's Hessian: the
  cross-entropy's plus the weight decay's penalty, which adds
  ``weight_decay`` to every eigenvalue and ``weight_decay * parameters`` to
  the trace.

  Args:
    epoch: The measured checkpoint's epoch (0: the initial parameters); the
      line's step is ten an epoch.
    top: The cross-entropy's top eigenvalue; the second is half of it.
    trace: The cross-entropy's Hessian trace.
    parameters: The model's parameter count.
    weight_decay: The run's weight decay.
    noise_scale: The gradient noise scale, ``None`` where it had none.
    loss: The training loss on the sample.
    settings: The measurement's settings; by default the tool's fields with
      small values.

  Returns:
    The line, a dict to write as one JSON line.
  """
  if settings is None:
    settings = {
        "batches": 2,
        "batch_size": 8,
        "eigenvalues": 2,
        "iterations": 4,
        "probes": 2,
        "seed": 0,
    }
  return {
      "epoch": epoch,
      "step": epoch * 10,
      "loss": loss,
      "eigenvalues": [top + weight_decay, top / 2 + weight_decay],
      "eigenvalue_residuals": [1e-3, 1e-2],
      "trace": trace + weight_decay * parameters,
      "trace_stderr": 10.0,
      "noise_scale": noise_scale,
      "gradient_norm_sq": 0.02,
      "gradient_variance_trace": 2.0,
      "parameters": parameters,
      "weight_decay": weight_decay,
      "batch_hvps": 20,
      "seconds": 1.0,
      "settings": settings,
  }


def saved_figures(monkeypatch) -> list:
  """The figures matplotlib saves from now on, in order (they are still
  written)."""
  figures = []
  _on_savefig(monkeypatch, lambda fig, keywords: figures.append(fig))
  return figures


def saved_figure_calls(monkeypatch) -> list:
  """``(figure, savefig keywords)`` of each figure matplotlib saves from
  now on, in order (they are still written)."""
  calls = []
  _on_savefig(monkeypatch, lambda fig, keywords: calls.append((fig, keywords)))
  return calls


def _on_savefig(monkeypatch, record) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  original = matplotlib.figure.Figure.savefig
  monkeypatch.setattr(
      matplotlib.figure.Figure,
      "savefig",
      lambda fig, *a, **k: (record(fig, k), original(fig, *a, **k)),
  )


def saved_width_fraction(fig, keywords, artist) -> float:
  """The share of a saved figure's width that ``artist`` (an axes) takes,
  from matplotlib's layout: the saved area is the figure, or with
  ``bbox_inches="tight"`` the box around everything drawn."""
  from matplotlib.backends import backend_agg  # pylint: disable=g-import-not-at-top

  canvas = backend_agg.FigureCanvasAgg(fig)  # a closed figure has none
  canvas.draw()
  renderer = canvas.get_renderer()
  if keywords.get("bbox_inches") == "tight":
    saved = fig.get_tightbbox(renderer).width
  else:
    saved = fig.get_figwidth()
  return artist.get_window_extent(renderer).width / fig.dpi / saved


def report_written_twice(sweep: Path, tmp_path: Path) -> tuple[dict, dict]:
  """The files of ``python -m train.report SWEEP`` written to two folders,
  the first twice (a rerun into the same folder): ``{name: bytes}`` each."""
  # pylint: disable=g-import-not-at-top
  from train.report import cli as report

  first, second = tmp_path / "first", tmp_path / "second"
  report.write_report([sweep], first)
  report.write_report([sweep], second)
  report.write_report([sweep], first)

  def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}

  return files(first), files(second)
