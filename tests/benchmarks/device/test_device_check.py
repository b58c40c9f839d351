"""The GPU run's script, rehearsed on the CPU (``DRY_RUN=1``).

A GPU is lent only now and then, for minutes: the script must not have
rotted when one is. The rehearsal runs every step with tiny shapes and
2 epochs of synthetic CIFAR-10-format data, and must write the files a real
run writes.

What the script guarantees is checked, never how fast this machine is: every
step ran (or was skipped for want of time) and logged how it ended, and every
file it wrote is whole and says whether its step finished. A step its cap
cut off logs ``NAME: rc=124`` (137: killed) and ``NAME: cut off by its cap``,
and its JSON says ``"complete": false`` (see
benchmarks/device/device_check.sh); what it did write is checked like a finished step's. A second rehearsal with
a tiny budget makes the caps cut, so that those paths are checked too.
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import sys
import tarfile

import pytest

from benchmarks.device import device_check_compile

from tests.helpers.process import REPO
from tests.helpers.process import run_program
from tests.helpers.process import run_shell_script
from tests.helpers.process import unoptimized_codegen

STEPS = ("tests", "radix", "methods", "steps", "compile", "full")
# timeout's exit status when it stopped a step: TERM, or KILL 5 s later.
CUT = (124, 137)
# What the rehearsal's settings (DRY_RUN=1 in the script) ask of each step.
METHOD_ALPHAS = {0.5, 0.99}
STEP_MODELS = {"lenet"}
LENET_RUNS = [
    f"cifar10-lenet-{n}-b256-lr0.1-noaug-seed0" for n in ("bn", "sqd2")
]
# The compile step's CLI runs, in the order it runs them.
COMPILE_NORMS = ["sqd2"]
COMPILE_RUNS = [
    (norm, run) for run in ("first", "cached") for norm in COMPILE_NORMS
]
RESNET_RUNS = {
    "cifar10_resnet20_gain_gpu": "cifar10-resnet20-bn-b256-lr0.1-noaug-seed0",
    "cifar10_resnet20_gain_aug_gpu": "cifar10-resnet20-bn-b256-lr0.1-seed0",
}


def _ending(log: str, step: str) -> int | None:
  """A step's exit status from the log; ``None``: skipped, no time left."""
  codes = re.findall(rf"\] {step}: rc=(\d+)$", log, re.MULTILINE)
  if not codes:
    assert f"] {step}: skipped, no time left" in log, f"{step} left no trace"
    return None
  (code,) = map(int, codes)
  assert code == 0 or code in CUT, f"{step} failed: rc={code}"
  assert (f"] {step}: cut off by its cap of " in log) == (code in CUT), step
  return code


def _result(path: Path, code: int | None) -> dict | None:
  """The JSON a step wrote; whole, and complete if the step finished.

  A step that was cut off, or never started, may have written nothing.
  """
  if code != 0 and not path.exists():
    return None
  result = json.loads(path.read_text())
  assert isinstance(result["complete"], bool), path
  if code == 0:
    assert result["complete"], path
  return result


def _epochs(run: Path) -> list[int]:
  metrics = run / "metrics.jsonl"
  if not metrics.exists():
    return []
  return [
      json.loads(line)["epoch"] for line in metrics.read_text().splitlines()
  ]


def _check_sweep_run(run: Path, finished: bool, augment: bool) -> None:
  """A sweep run: every epoch it logged, in order; all of them if finished."""
  epochs = _epochs(run)
  assert epochs == ([1, 2] if finished else [1, 2][: len(epochs)]), run
  if (run / "config.json").exists() or finished:
    config = json.loads((run / "config.json").read_text())
    assert config["augment"] is augment
  assert not (run / "checkpoints").exists()  # left out of the archive


def _check_compile(compile_: dict, work: Path) -> None:
  """The CLI runs over an empty, then a filled cache, and bench_compile's."""
  runs = [(r["norm"], r["run"]) for r in compile_["runs"]]
  assert runs == COMPILE_RUNS[: len(runs)]
  for run in compile_["runs"]:
    if run.get("returncode") != 0:  # cut: recorded as far as it got
      assert run["cut"] and "returncode" not in run, run
      continue
    assert (work / run["log"]).exists()
    # The CLI logs its compile seconds rounded to 0.1 s.
    assert 0 < run["compile_s"] <= run["to_compiled_s"] + 0.05, run
    assert run["to_compiled_s"] < run["to_first_epoch_s"] < run["wall_s"]
    assert len(run["epoch_s"]) == 2 and min(run["epoch_s"]) > 0, run
    # The first run compiles and writes its programs; the rerun reads every
    # one of them back.
    first = run["run"] == "first"
    assert run["cache_hit"] is not first, run
    listed = run["cache_written"] if first else run["cache_hits"]
    assert {"jit_train_step", "jit_eval_model"} <= set(listed), run
    assert run["cache_entries"] >= 2
  if compile_["complete"]:
    assert len(runs) == len(COMPILE_RUNS)
    assert [b["norm"] for b in compile_["bench_compile"]] == COMPILE_NORMS
    for bench in compile_["bench_compile"]:
      assert "error" not in bench, bench
      for name in ("step", "evaluate"):
        seconds = bench["programs"][name]
        assert seconds["lower_s"] > 0 and seconds["compile_s"] > 0
        assert seconds["cached_compile_s"] > 0


def test_the_tests_step_names_test_files_that_exist():
  # The script skips a listed file that is not there (a checkout without the
  # tests): a moved test file would drop out of a card's run without a word.
  text = (Path(REPO) / "benchmarks" / "device" / "device_check.sh").read_text()
  step = text[text.index("step_tests() {") :]
  step = step[: step.index("\n}\n")]
  listed = re.findall(r"\btests/\S+\.py\b", step)
  assert "tests/gbn_jax/selection/test_pallas.py" in listed, listed
  missing = [name for name in listed if not (Path(REPO) / name).is_file()]
  assert not missing, missing


def _shared_and_checkout(tmp_path: Path) -> tuple[Path, Path]:
  """A stand-in for ``../shared`` (data, converter) and an empty checkout."""
  shared = tmp_path / "shared"
  (shared / "data").mkdir(parents=True)
  (shared / "tools").mkdir()
  (shared / "data" / "cifar10-jpeg.tar.xz").write_bytes(b"images")
  (shared / "tools" / "cifar10_binary.py").write_text("# converter\n")
  checkout = tmp_path / "checkout"
  (checkout / ".git" / "info").mkdir(parents=True)
  return shared, checkout


def _prepare(checkout: Path, shared: Path, tmp_path: Path) -> str:
  """The script's ``prepare`` step run in ``checkout``; its output."""
  done = run_program(
      [
          "bash",
          str(Path(REPO) / "benchmarks/device/device_check.sh"),
          "prepare",
      ],
      env={
          "SHARED": str(shared),
          "OUT": str(tmp_path / "out"),
          "WORK": str(tmp_path / "work"),
      },
      timeout=60,
      cwd=checkout,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  return done.stdout


def test_prepare_lays_out_the_data_and_the_runs_to_go_on_from(tmp_path):
  shared, checkout = _shared_and_checkout(tmp_path)
  (checkout / "results" / "sweeps").mkdir(parents=True)
  run = f"sweeps/cifar10_resnet20_gain_aug_gpu/{RESNET_RUNS['cifar10_resnet20_gain_aug_gpu']}"
  source = tmp_path / "session" / run
  (source / "checkpoints" / "80").mkdir(parents=True)
  (source / "metrics.jsonl").write_text('{"epoch": 1}\n')
  with tarfile.open(checkout / "results/sweeps/gpu_resume.tgz", "w:gz") as tar:
    tar.add(tmp_path / "session" / "sweeps", arcname="sweeps")
  # What an older bundle left there must not come back to life.
  stale = checkout / ".device/resume/sweeps/old/run-seed0"
  stale.mkdir(parents=True)

  out = _prepare(checkout, shared, tmp_path)
  resume = checkout / ".device" / "resume"
  assert (resume / run / "checkpoints" / "80").is_dir()
  assert (resume / run / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
  assert not stale.exists()
  assert "runs to go on from: 1" in out
  assert (
      checkout / ".device/data/cifar10-jpeg.tar.xz"
  ).read_bytes() == b"images"
  assert (checkout / ".device/tools/cifar10_binary.py").is_file()
  # Twice: the same layout, one exclusion line.
  _prepare(checkout, shared, tmp_path)
  assert (resume / run / "checkpoints" / "80").is_dir()
  exclude = (checkout / ".git/info/exclude").read_text().splitlines()
  assert exclude.count("/.device/") == 1


def test_prepare_without_a_bundle_leaves_no_runs(tmp_path):
  shared, checkout = _shared_and_checkout(tmp_path)
  out = _prepare(checkout, shared, tmp_path)
  assert "runs to go on from" not in out
  assert not (checkout / ".device" / "resume").exists()


def test_compile_cache_hit_counts_the_clis_programs_only():
  # JAX's compiler debug lines, as jax 0.10 writes them.
  hit = "DEBUG:jax._src.compiler:Persistent compilation cache hit for '{}'"
  miss = "DEBUG:jax._src.compiler:PERSISTENT COMPILATION CACHE MISS for '{}'"
  small = (
      "DEBUG:jax._src.compiler:Not writing persistent cache entry for '{}'"
      " because it took < 0.10 seconds to compile (0.01s)"
  )
  cached = [hit.format("jit_train_step"), hit.format("jit_eval_model")]
  # A small eager program over the threshold this time is written, and
  # says nothing about whether the CLI's programs came from the cache.
  cached += [miss.format("jit_slice"), miss.format("jit_fold_in")]
  cached.append(small.format("jit_slice"))
  summary = device_check_compile.cache_summary(cached)
  assert summary == {
      "cache_hits": ["jit_eval_model", "jit_train_step"],
      "cache_written": ["jit_fold_in"],
      "cache_hit": True,
  }
  first = [miss.format("jit_train_step"), miss.format("jit_eval_model")]
  assert not device_check_compile.cache_summary(first)["cache_hit"]
  assert device_check_compile.cache_summary(first)["cache_written"] == [
      "jit_eval_model",
      "jit_train_step",
  ]
  # One of the CLI's programs compiled afresh: not a hit.
  partly = cached + [miss.format("jit_prepare_epoch")]
  assert not device_check_compile.cache_summary(partly)["cache_hit"]
  # Nothing of the CLI's compiled at all (a cut run): not a hit either.
  assert not device_check_compile.cache_summary([hit.format("jit_slice")])[
      "cache_hit"
  ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget",
    [
        # Twice what the steps need on two idle cores: on a loaded machine
        # some are cut all the same.
        pytest.param("960", id="full_budget"),
        # Less than the first steps need: cut and skipped steps, a stopped
        # sweep, on any machine.
        pytest.param("40", id="tiny_budget"),
    ],
)
def test_dry_run_writes_every_file_a_device_run_writes(tmp_path, budget):
  out, work = tmp_path / "out", tmp_path / "work"
  env = dict(
      DRY_RUN="1",
      OUT=str(out),
      WORK=str(work),
      PYTHON=sys.executable,
      BUDGET=budget,
      # The rehearsal checks the script, not values or speed, and its
      # programs run a step or two.
      **unoptimized_codegen(),
  )
  proc = run_shell_script(
      "benchmarks/device/device_check.sh", env=env, timeout=1120
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  # What comes back from a device, whatever cut the run short: the log, the
  # results, and the ResNet20 runs to resume from.
  assert sorted(p.name for p in out.iterdir()) == [
      "device_results.tgz",
      "log.txt",
      "resnet_resume.tgz",
  ]
  unpacked = tmp_path / "unpacked"
  with tarfile.open(out / "device_results.tgz") as tar:
    tar.extractall(unpacked, filter="data")
  log = (out / "log.txt").read_text()
  ending = {step: _ending(log, step) for step in STEPS}
  assert log.rstrip().endswith("done")

  methods = _result(unpacked / "methods.json", ending["methods"])
  picked = None
  if methods is not None:
    alphas = {r["alpha"] for r in methods["layers"]}
    assert alphas <= METHOD_ALPHAS
    if methods["complete"]:
      assert alphas == METHOD_ALPHAS
      assert methods["fastest_exact"] in methods["methods"]
    assert all(r["exact"] for r in methods["layers"])
    picked = methods["fastest_exact"]
  # The steps after it say which method they used, whatever methods wrote.
  if picked:
    assert f"selection method: {picked}" in log
  else:
    assert "selection method: the default (methods.json has no pick)" in log

  radix = _result(unpacked / "radix.json", ending["radix"])
  if radix is not None:
    assert all(all(r["exact"].values()) for r in radix["rows"])
    assert radix["rows"] or not radix["complete"]

  steps = _result(unpacked / "steps.json", ending["steps"])
  layers = _result(unpacked / "layers.json", ending["full"])
  # bench_cpu.json merges the two, whichever of them exist.
  bench_path = unpacked / "bench_cpu.json"
  assert bench_path.exists() == (steps is not None or layers is not None)
  if bench_path.exists():
    bench = json.loads(bench_path.read_text())
    assert bench["complete"] == bool(
        steps and steps["complete"] and layers and layers["complete"]
    )
    models = {r["model"] for r in bench["train_steps"]}
    measures = {r["measure"] for r in bench["layers"]}
    assert models <= STEP_MODELS
    assert measures <= {"sd", "sqd2", "sqd:0.99"}
    if steps and steps["complete"]:
      assert models == STEP_MODELS
    if layers and layers["complete"]:
      assert measures == {"sd", "sqd2", "sqd:0.99"}
    assert all(
        r["bn_ms"] > 0 and r["gbn_ms"] > 0
        for r in bench["layers"] + bench["train_steps"]
    )

  compile_ = _result(unpacked / "compile.json", ending["compile"])
  if compile_ is not None:
    _check_compile(compile_, unpacked / "compile")

  # No torch here: the step says so in its file; with torch, it ran capped.
  torch = json.loads((unpacked / "torch_sqd.json").read_text())
  assert ("skipped" in torch) == ("torch: skipped (no torch" in log)

  # The table2 job: the LeNet row, then the gain study's ResNet20 runs with
  # and without augmentation. The budget may stop it; what it finished stays.
  finished = "table2: sweep finished" in log
  assert finished != ("table2: budget spent, stopping the sweep" in log)
  sweep = unpacked / "sweeps" / "cifar10_lenet_gpu"
  runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
  assert runs == LENET_RUNS if finished else set(runs) <= set(LENET_RUNS)
  for run in runs:
    _check_sweep_run(sweep / run, finished, augment=False)
    if (sweep / run / "config.json").exists():
      config = json.loads((sweep / run / "config.json").read_text())
      assert (config["learning_rate"], config["weight_decay"]) == (0.1, 1e-4)
  for folder, name in RESNET_RUNS.items():
    resnet = unpacked / "sweeps" / folder
    runs = sorted(p.name for p in resnet.iterdir() if p.is_dir())
    assert runs == [name] if finished else set(runs) <= {name}
    for run in runs:
      _check_sweep_run(resnet / run, finished, augment="aug" in folder)

  # A later session resumes the ResNet20 runs from their newest checkpoint,
  # which alone travels (epochs 1 and 2 were both saved when finished).
  with tarfile.open(out / "resnet_resume.tgz") as tar:
    names = tar.getnames()
  for folder, name in RESNET_RUNS.items():
    run = f"sweeps/{folder}/{name}"
    if finished:
      assert f"{run}/metrics.jsonl" in names and f"{run}/config.json" in names
    steps_saved = {
        n.split("/")[4] for n in names if n.startswith(f"{run}/checkpoints/")
    }
    assert steps_saved == {"2"} if finished else len(steps_saved) <= 1, names
