"""``train.report`` and its modules need numpy and matplotlib only.

The report reads what training recorded (``norm_layers.json``) instead of
building models, so it runs where the results are without jax or flax; its
copies of training's constants are checked against training's here.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from train import configs
from train.loop import capture
from train.report import cli as report
from train.report import gain as report_gain
from train.report import runs as report_runs

from tests.helpers.process import run_python
from tests.helpers.run_folders import write_run

REPORT_MODULES = (
    "train.report.cli",
    "train.report.runs",
    "train.report.tables",
    "train.report.gain",
    "train.report.curvature",
    "train.report.figures",
    "train.report.plot",
    "train.report.labels",
)
# What the report must not load: the training stack.
FORBIDDEN = (
    "jax",
    "jaxlib",
    "flax",
    "gbn_jax",
    "train.model.models",
    "train.configs",
)

_CHILD = """
import json, sys
from pathlib import Path
for name in json.loads(sys.argv[1]):
  __import__(name)
from train.report import cli as report
run, out = Path(sys.argv[2]), Path(sys.argv[3])
assert report.main([str(run), "--out", str(out), "--gain"]) == 0
print(json.dumps(sorted(sys.modules)))
"""


def _gain_row(text: str, norm: str) -> list[str]:
  section = text.split("## Gain", 1)[1]
  line = next(l for l in section.splitlines() if l.startswith(f"| {norm} |"))
  return [c.strip() for c in line.strip("|").split("|")]


def test_report_imports_neither_jax_nor_flax(tmp_path):
  run = write_run(tmp_path / "runs" / "r", "rsd", 0, 0.01, [0.3, 0.2], [1, 1])
  (run / capture.NORM_LAYERS_FILE).write_text(
      json.dumps(
          {
              **{
                  f: report.find_runs([run])[0].config[f]
                  for f in (
                      "dataset",
                      "model",
                      "batch_size",
                      "norm",
                      "calibration",
                  )
              },
              "layers": {"norm1": {"n": 10, "gaussian": 2.5}},
          }
      )
  )
  out = tmp_path / "out"
  loaded = json.loads(
      run_python(
          _CHILD, args=[json.dumps(REPORT_MODULES), str(run), str(out)]
      ).splitlines()[-1]
  )
  # The child did import and run the report (the check could fail).
  assert set(REPORT_MODULES) <= set(loaded) and "matplotlib" in loaded
  bad = [
      m
      for m in loaded
      if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
  ]
  assert not bad, bad
  # A full report, gain section included, from the recorded gain.
  assert _gain_row((out / "report.md").read_text(), "rsd")[1] == "2.500"


def test_report_constants_equal_trainings():
  assert report_runs.ADDED_FIELD_DEFAULTS == {
      f.name: f.default
      for f in dataclasses.fields(configs.Config)
      if f.name in configs.ADDED_FIELDS
  }
  assert report_gain.NORM_LAYERS_FILE == capture.NORM_LAYERS_FILE
  assert report_runs.ACTIVATIONS_FILE == "activations.jsonl"


@pytest.mark.parametrize(
    "content, warning",
    [
        (None, None),  # an old run without the record: '–', no warning
        ("{not json", "skipped"),
        ('{"layers": {"norm1": {"n": 5}}}', "KeyError"),
    ],
    ids=["absent", "corrupt", "incomplete"],
)
def test_report_without_a_usable_record_shows_a_dash(
    tmp_path, capsys, content, warning
):
  run = write_run(tmp_path / "runs" / "r", "rbd", 0, 0.01, [0.3], [1])
  if content is not None:
    (run / capture.NORM_LAYERS_FILE).write_text(content)
  assert report.main([str(run), "--out", str(tmp_path / "out"), "--gain"]) == 0
  row = _gain_row((tmp_path / "out" / "report.md").read_text(), "rbd")
  assert row[1] == "–", row
  err = capsys.readouterr().err
  if warning is None:
    assert not err
  else:
    assert warning in err and capture.NORM_LAYERS_FILE in err, err


def test_report_cli_says_why_not(tmp_path, capsys):
  with pytest.raises(SystemExit):
    report.main(["--out"])  # argparse: DIR and --out's value missing
  assert "usage: python -m train.report" in capsys.readouterr().err
  assert report.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 1
  assert capsys.readouterr().err.startswith(
      "python -m train.report: error: no run directories"
  )
