"""The GPU run's script, rehearsed on the CPU (``DRY_RUN=1``).

A GPU is lent only now and then, for minutes: the script must not have
rotted when one is. The rehearsal runs every step with tiny shapes and
2 epochs of synthetic CIFAR-10-format data, and must write the files a real
run writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import tarfile

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dry_run_writes_every_file_a_device_run_writes(tmp_path):
  out, work = tmp_path / "out", tmp_path / "work"
  env = dict(
      os.environ,
      DRY_RUN="1",
      OUT=str(out),
      WORK=str(work),
      PYTHON=sys.executable,
      BUDGET="840",
  )
  proc = subprocess.run(
      ["bash", "benchmarks/device_check.sh"],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=1000,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  # What comes back from a device: the log, the results, and the ResNet20
  # runs to resume from.
  assert sorted(p.name for p in out.iterdir()) == [
      "device_results.tgz",
      "log.txt",
      "resnet_resume.tgz",
  ]
  unpacked = tmp_path / "unpacked"
  with tarfile.open(out / "device_results.tgz") as tar:
    tar.extractall(unpacked, filter="data")
  log = (out / "log.txt").read_text()
  for step in ("tests", "radix", "methods", "steps", "full"):
    assert f"{step}: rc=" in log, step

  methods = json.loads((unpacked / "methods.json").read_text())
  assert methods["complete"] and methods["fastest_exact"] in methods["methods"]
  assert {r["alpha"] for r in methods["layers"]} == {0.25, 0.5, 0.75, 0.99}
  assert all(r["exact"] for r in methods["layers"])
  assert f"selection method: {methods['fastest_exact']}" in log

  radix = json.loads((unpacked / "radix.json").read_text())
  assert radix["rows"] and all(all(r["exact"].values()) for r in radix["rows"])

  bench = json.loads((unpacked / "bench_cpu.json").read_text())
  assert bench["complete"]
  assert {r["model"] for r in bench["train_steps"]} == {"lenet", "resnet20"}
  assert {r["measure"] for r in bench["layers"]} == {"sd", "sqd2", "sqd:0.99"}
  assert all(
      r["bn_ms"] > 0 and r["gbn_ms"] > 0
      for r in bench["layers"] + bench["train_steps"]
  )

  sweep = unpacked / "sweeps" / "cifar10_lenet_gpu"
  runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
  assert runs == [
      f"cifar10-lenet-{n}-b256-lr0.1-noaug-seed{s}"
      for n in ("bn", "sqd2")
      for s in (0, 1)
  ]
  for run in runs:
    rows = [
        json.loads(line)
        for line in (sweep / run / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["epoch"] for r in rows] == [1, 2]
    config = json.loads((sweep / run / "config.json").read_text())
    assert (
        config["learning_rate"],
        config["weight_decay"],
        config["augment"],
    ) == (0.1, 1e-4, False)
    assert not (sweep / run / "checkpoints").exists()  # left out of the archive
  # Then, in the same detached job, the gain study's ResNet20 runs.
  resnet = unpacked / "sweeps" / "cifar10_resnet20_gain_gpu"
  assert sorted(p.name for p in resnet.iterdir() if p.is_dir()) == [
      "cifar10-resnet20-bn-b256-lr0.1-noaug-seed0"
  ]
  rows = (
      resnet / "cifar10-resnet20-bn-b256-lr0.1-noaug-seed0" / "metrics.jsonl"
  ).read_text()
  assert [json.loads(line)["epoch"] for line in rows.splitlines()] == [1, 2]
  # And, at the same time, the same runs with augmentation.
  aug = unpacked / "sweeps" / "cifar10_resnet20_gain_aug_gpu"
  aug_run = aug / "cifar10-resnet20-bn-b256-lr0.1-seed0"
  assert sorted(p.name for p in aug.iterdir() if p.is_dir()) == [aug_run.name]
  rows = (aug_run / "metrics.jsonl").read_text()
  assert [json.loads(line)["epoch"] for line in rows.splitlines()] == [1, 2]
  assert json.loads((aug_run / "config.json").read_text())["augment"] is True
  assert "table2: sweep finished" in log

  # A later session resumes the ResNet20 runs from their newest checkpoint,
  # which alone travels (epochs 1 and 2 were both saved).
  with tarfile.open(out / "resnet_resume.tgz") as tar:
    names = tar.getnames()
  for run in (
      "sweeps/cifar10_resnet20_gain_gpu/cifar10-resnet20-bn-b256-lr0.1-noaug-seed0",
      "sweeps/cifar10_resnet20_gain_aug_gpu/cifar10-resnet20-bn-b256-lr0.1-seed0",
  ):
    assert f"{run}/metrics.jsonl" in names and f"{run}/config.json" in names
    steps = {
        n.split("/")[4] for n in names if n.startswith(f"{run}/checkpoints/")
    }
    assert steps == {"2"}, names
