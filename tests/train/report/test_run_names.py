"""``train.report``'s run names: the same however a DIR was written.

The README's report command, run from the repository root, must reproduce
the committed ``results/reports/convergence/report.md``; its run names once
gained a ``results/`` prefix, and an absolute DIR gave absolute names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from train.report import cli as report

from tests.helpers.run_folders import write_run

REPO = Path(__file__).resolve().parents[3]
README_DIRS = (
    "results/sweeps/fashion_mnist_lenet",
    "results/sweeps/cifar10_lenet",
    "results/activations",
)
README_TIMING = "results/benchmarks/timing/fashion_mnist_lenet"
README_OUT = "results/reports/convergence"


def _runs_section(path: Path) -> list[str]:
  text = path.read_text()
  return text.split("## Runs\n", 1)[1].strip().splitlines()


def _names(path: Path) -> list[str]:
  return [
      line.split(" | ")[0].removeprefix("| ")
      for line in _runs_section(path)[2:]
  ]


@pytest.fixture()
def two_sweeps(tmp_path, monkeypatch):
  """``results/{sweeps/a,activations}`` under a project folder, cwd there."""
  project = tmp_path / "project"
  for folder, norm, seed in (
      ("results/sweeps/a/bn-seed0", "bn", 0),
      ("results/sweeps/a/sqd1-seed0", "sqd1", 0),
      ("results/activations/bn-seed1", "bn", 1),
  ):
    write_run(project / folder, norm, seed, 0.01, [0.3, 0.2], [1, 1])
  monkeypatch.chdir(project)
  return project


def test_names_do_not_depend_on_how_dirs_are_written(two_sweeps):
  spellings = {
      "relative": ["results/sweeps/a", "results/activations"],
      "dot": ["./results/sweeps/a", "./results//activations/"],
      "absolute": [
          str(two_sweeps / "results/sweeps/a"),
          str(two_sweeps / "results/activations"),
      ],
      "roundabout": ["results/sweeps/../sweeps/a", "results/activations/."],
  }
  sections = {}
  for name, dirs in spellings.items():
    out = Path("results/reports") / name
    report.write_report(dirs, out)
    sections[name] = _runs_section(out / "report.md")
  assert all(s == sections["relative"] for s in sections.values()), sections
  # Below results/, the deepest folder holding the runs' folders.
  assert _names(Path("results/reports/relative/report.md")) == [
      "activations/bn-seed1",
      "sweeps/a/bn-seed0",
      "sweeps/a/sqd1-seed0",
  ]


def test_names_do_not_depend_on_where_the_report_goes():
  # Below the deepest folder holding the runs' folders, wherever the report
  # is written; runs that share one folder keep its name.
  runs = [
      report.Run(Path(f"/data/x/sweeps/{s}/{r}"), {}, [])
      for s, r in (("a", "bn-seed0"), ("a", "sqd1-seed0"), ("b", "bn-seed1"))
  ]
  for out in ("/elsewhere/out", "/data/x/reports/r", "/data/x/sweeps/a/r"):
    assert report.run_names(runs, Path(out)) == [
        "a/bn-seed0",
        "a/sqd1-seed0",
        "b/bn-seed1",
    ]
  assert report.run_names(runs[:2], Path("/tmp/r")) == [
      "a/bn-seed0",
      "a/sqd1-seed0",
  ]
  assert report.run_names(runs[:1], runs[0].path / "report") == ["a/bn-seed0"]


@pytest.mark.slow
def test_readme_report_command_reproduces_the_committed_report(
    tmp_path, monkeypatch
):
  committed = REPO / README_OUT / "report.md"
  if not all((REPO / d).is_dir() for d in (*README_DIRS, README_TIMING)):
    pytest.skip("the committed sweeps are not in this checkout")
  monkeypatch.chdir(REPO)
  command = " ".join(
      [
          "python -m train.report",
          *README_DIRS,
          "--timing",
          README_TIMING,
          "--out",
          README_OUT,
      ]
  )
  # Into a copy elsewhere: the names must not depend on where the report goes.
  out = tmp_path / "convergence"
  report.write_report(
      list(README_DIRS), out, command=command, timing=[README_TIMING]
  )
  assert (out / "report.md").read_text() == committed.read_text()
