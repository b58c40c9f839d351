"""Tests of ``python -m train.plot`` with many runs: labels, layout, and a
second call into the same folder (fake run folders, no training)."""

from __future__ import annotations

import json
from pathlib import Path
import shutil

import pytest

from train import configs
from train.report import plot
from train.sweep import grid as sweep_grid

from tests.helpers.run_folders import saved_figure_calls
from tests.helpers.run_folders import saved_width_fraction
from tests.helpers.run_folders import write_run

# Twelve runs of mixed settings, as a user's workdir gathers them: (norm,
# learning rate, seed, other settings).
_MIXED = (
    ("bn", 0.1, 0, {"batch_size": 128}),
    ("bn", 0.1, 1, {"batch_size": 128}),
    ("bn", 0.01, 0, {"batch_size": 256, "momentum": 0.9}),
    ("sqd2", 0.1, 0, {"batch_size": 128}),
    ("sqd2", 0.1, 1, {"batch_size": 128}),
    ("sqd2", 0.01, 0, {"batch_size": 256, "momentum": 0.9}),
    ("rsd", 0.1, 0, {"batch_size": 128, "weight_decay": 1e-3}),
    ("rsd", 0.01, 0, {"batch_size": 256, "momentum": 0.9}),
    ("mad", 0.1, 0, {"batch_size": 128}),
    ("mad", 0.01, 1, {"batch_size": 256, "momentum": 0.9}),
    ("sqd:0.3", 0.05, 0, {"batch_size": 512, "momentum": 0.9}),
    ("wcd", 0.1, 2, {"batch_size": 128, "norm_momentum": 0.99}),
)


def _mixed_runs(folder: Path) -> list[Path]:
  return [
      write_run(
          folder / f"run{i:02d}",
          norm,
          seed,
          lr,
          [0.5 - 0.01 * i, 0.4, 0.3 + 0.01 * i],
          [10, 11, 12],
          **settings,
      )
      for i, (norm, lr, seed, settings) in enumerate(_MIXED)
  ]


def test_plot_of_many_runs_keeps_the_plot_area(tmp_path, monkeypatch):
  calls = saved_figure_calls(monkeypatch)
  runs = _mixed_runs(tmp_path / "runs")
  plot.plot_runs(runs, tmp_path / "out")
  assert len(calls) == 4
  for fig, keywords in calls:
    ax = fig.axes[0]
    assert saved_width_fraction(fig, keywords, ax) >= 0.6
    (legend,) = fig.legends or [ax.get_legend()]
    assert len(legend.get_texts()) == len(_MIXED)
    # All of it on the saved figure, none of it on the data.
    box = legend.get_window_extent()
    assert not box.overlaps(ax.get_window_extent())
    if keywords.get("bbox_inches") != "tight":
      assert fig.bbox.contains(box.x0, box.y0)
      assert fig.bbox.contains(box.x1, box.y1)
  # Fewer runs: a shorter figure with a plot of the same size.
  plot.plot_runs(runs[:2], tmp_path / "out_few")
  many, few = calls[0][0], calls[4][0]
  assert many.get_figheight() > few.get_figheight()
  plot_height = [
      f.axes[0].get_position().height * f.get_figheight() for f in (few, many)
  ]
  assert plot_height[1] == pytest.approx(plot_height[0], rel=0.1)


def test_plot_labels_are_the_settings_that_differ(tmp_path):
  runs = _mixed_runs(tmp_path / "runs")
  configs_ = [json.loads((d / "config.json").read_text()) for d in runs]
  # A run written before some fields existed did what their defaults do.
  for field in ("renorm", "renorm_rmax", "renorm_dmax", "calibration"):
    del configs_[0][field]
  labels = plot.run_labels(configs_)
  assert labels[:3] == [
      "bn b128 lr0.1 m0.0 wd0.0005 seed0 nm0.9",
      "bn b128 lr0.1 m0.0 wd0.0005 seed1 nm0.9",
      "bn b256 lr0.01 m0.9 wd0.0005 seed0 nm0.9",
  ]
  assert labels[6] == "rsd b128 lr0.1 m0.0 wd0.001 seed0 nm0.9"
  assert labels[10:] == [
      "sqd:0.3 b512 lr0.05 m0.9 wd0.0005 seed0 nm0.9",
      "wcd b128 lr0.1 m0.0 wd0.0005 seed2 nm0.99",
  ]
  # Spelled as the run names of a sweep: each word is one of the name's.
  base = configs.MNIST.replace(dataset="fashion_mnist", augment=False)
  for config, label in zip(configs_, labels):
    name = sweep_grid.run_name(
        configs.Config.from_json({**config, "norm": "bn"}),
        base,
        always=tuple(configs.FIELDS),
    )
    assert set(label.split()[1:]) <= set(name.split("-")), (label, name)
  # Runs that differ in nothing are told apart by their folders.
  copy = shutil.copytree(runs[0], tmp_path / "copy" / "run00")
  assert plot.run_labels(configs_[:1] * 2, [runs[0], copy]) == [
      "bn (runs/run00)",
      "bn (copy/run00)",
  ]


def test_plot_spells_fields_as_run_names():
  prefixes = {
      name: spec.run_name
      for name, spec in configs.FIELDS.items()
      if spec.run_name is not None
  }
  assert plot.RUN_NAME_PREFIXES == prefixes


def _png_bytes(folder: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def test_plot_again_replaces_its_own_figures_only(tmp_path, capsys):
  a, b, c, d = _mixed_runs(tmp_path / "runs")[:4]
  out = tmp_path / "runs" / "plots"
  names = [
      "train_loss_vs_epoch.png",
      "test_error_vs_epoch.png",
      "train_loss_vs_seconds.png",
      "test_error_vs_seconds.png",
  ]
  assert plot.main([str(a), str(b)]) == 0
  assert capsys.readouterr().out.splitlines() == [
      f"wrote {out / n}" for n in names
  ]
  # The same runs, and then more: replaced, and said so.
  for again in ([a, b], [a, b, c]):
    assert plot.main([str(r) for r in again]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"replaced {out / n}" for n in names
    ]
  # Fewer or other runs: the figures of a, b and c would be lost.
  before = _png_bytes(out)
  for other in ([a], [d]):
    assert plot.main([str(r) for r in other]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        f"python -m train.plot: error: {out} already holds figures of"
    )
    assert "runs/run02" in captured.err and "--force" in captured.err
    assert _png_bytes(out) == before
  # A figure that does not say which runs it shows is kept too.
  (out / names[0]).write_bytes((out / names[0]).read_bytes()[:100])
  assert plot.main([str(a), str(b), str(c)]) == 1
  assert "do not record which runs" in capsys.readouterr().err
  assert plot.main([str(d), "--force"]) == 0
  assert capsys.readouterr().out.splitlines() == [
      f"replaced {out / n}" for n in names
  ]
  assert plot.figure_runs(out / names[0]) == [str(d.resolve())]
