"""The step benchmarks' shared harness: children, the report, the checks.

``benchmarks.step.step_children`` must start a child with exactly the flag set's
environment and read its ``RESULT`` line (or say why there is none);
``step_report`` must save what it is given and read step times back;
``step_setup``'s differences must be the definition's. No JAX in the
children here: they are small scripts, so these tests take seconds.
"""

import argparse
import io
import json
from pathlib import Path
import statistics
import sys
import textwrap

import numpy as np
import pytest

from benchmarks.step import step_children
from benchmarks.step import step_report
from benchmarks.step import step_setup


def test_child_env_sets_the_flag_set_and_drops_the_parents(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  monkeypatch.setenv("PJRT_NPROC", "7")
  env = step_children.child_env(3, "nproc1")
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
  assert env["PJRT_NPROC"] == "1" and env["JAX_PLATFORMS"] == "cpu"
  env = step_children.child_env(2, "ynn_off")
  assert env["XLA_FLAGS"].split() == [
      "--xla_force_host_platform_device_count=2",
      "--xla_cpu_experimental_ynn_fusion_type=",
  ]
  assert "PJRT_NPROC" not in env


def test_child_env_names_a_bad_argument():
  with pytest.raises(ValueError, match="flag_set 'fastest'"):
    step_children.child_env(1, "fastest")
  with pytest.raises(ValueError, match="devices must be at least 1"):
    step_children.child_env(0)


def _script(tmp_path: Path, body: str) -> Path:
  path = tmp_path / "peer.py"
  path.write_text(textwrap.dedent(body))
  return path


def test_run_json_reads_the_result_line_or_says_why_not(tmp_path):
  ok = _script(
      tmp_path,
      """
      import json
      print("noise first")
      print("RESULT " + json.dumps({"bn_ms": 12.5}))
      """,
  )
  got = step_children.run_torch(sys.executable, [str(ok)])
  assert got["bn_ms"] == 12.5 and got["wall_s"] >= 0
  crash = _script(tmp_path, "import sys\nsys.exit('no torch here')\n")
  got = step_children.run_torch(sys.executable, [str(crash)])
  assert got["error"].startswith("torch child exited 1:"), got
  assert "no torch here" in got["error"] and "wall_s" in got
  slow = _script(tmp_path, "import time\ntime.sleep(30)\n")
  got = step_children.run_json([sys.executable, str(slow)], timeout=0.5)
  assert "TimeoutExpired" in got["error"], got
  with pytest.raises(ValueError, match="python"):
    step_children.run_torch("", [str(ok)])


def test_run_child_runs_the_module_with_the_flag_set(tmp_path, monkeypatch):
  # A stand-in benchmark module, importable by the child through PYTHONPATH.
  (tmp_path / "fake_bench.py").write_text(textwrap.dedent("""
          import json, os, sys
          assert sys.argv[1] == "--child"
          env = {k: os.environ.get(k) for k in ("XLA_FLAGS", "PJRT_NPROC")}
          print("RESULT " + json.dumps(
              {"kind": sys.argv[2], "spec": json.loads(sys.argv[3]), **env}))
          """))
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  got = step_children.run_child(
      "fake_bench", "time", {"norms": ["bn"]}, devices=2, flag_set="nproc1"
  )
  assert got["kind"] == "time" and got["spec"] == {"norms": ["bn"]}
  assert got["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
  assert got["PJRT_NPROC"] == "1" and got["flag_set"] == "nproc1"
  missing = step_children.run_child("no_such_bench", "time", {}, devices=1)
  assert missing["error"].startswith("child time (default, 1 devices) exited")
  assert missing["flag_set"] == "default"


def test_child_main_prints_one_result_line(monkeypatch):
  monkeypatch.setattr(step_children.host_memory, "configure", lambda: None)
  out = io.StringIO()
  monkeypatch.setattr(sys, "stdout", out)
  children = {"double": lambda spec: {"n": 2 * spec["n"]}}
  assert step_children.child_main(children, "double", {"n": 4}) == {"n": 8}
  (line,) = out.getvalue().splitlines()
  assert line == "RESULT " + json.dumps({"n": 8})
  with pytest.raises(ValueError, match="kind 'triple'"):
    step_children.child_main(children, "triple", {})


def test_report_saves_after_every_put(tmp_path):
  path = tmp_path / "sub" / "out.json"
  args = argparse.Namespace(out=str(path), peer=Path("/x/peer.py"), runs=3)
  report = step_report.Report(args, ["--runs", "3"], "benchmarks.bench_x")
  report.put("variants", {"norms": {}})
  saved = json.loads(path.read_text())
  assert saved["command"] == "python -m benchmarks.bench_x --runs 3"
  assert saved["args"] == {"out": str(path), "peer": "/x/peer.py", "runs": 3}
  assert saved["complete"] is False and saved["variants"] == {"norms": {}}


def test_median_ms_format_ms_and_measured_runs():
  timed = {"norms": {"bn": {"variants": {"base": {"median_ms": 4.25}}}}}
  assert step_report.median_ms(timed, "bn", "base") == 4.25
  assert step_report.median_ms(timed, "sqd2", "base") is None
  assert step_report.median_ms({"error": "boom"}, "bn", "base") is None
  assert step_report.median_ms(None, "bn", "base") is None
  assert step_report.format_ms(4.25) == "     4.2 ms"
  assert step_report.format_ms(None).strip() == "failed"
  failed = {"error": "boom", "devices": 2, "flag_set": "default"}
  final = dict(timed, devices=2, flag_set="nproc1")
  data = {"variants": timed, "final": [failed, final]}
  assert list(step_report.measured_runs(data)) == [
      (1, "default", timed),
      (2, "nproc1", final),
  ]
  assert not list(step_report.measured_runs({"variants": {"error": "x"}}))


def test_rel_diff_and_summarize_are_their_definitions():
  rng = np.random.default_rng(0)
  a = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
  b = {"w": rng.normal(size=(3, 4)), "b": np.zeros(4)}
  want = max(
      np.sqrt(np.sum((a["w"] - b["w"]) ** 2) / np.sum(b["w"] ** 2)),
      np.sqrt(np.sum(a["b"] ** 2)),  # b is all zeros: the absolute norm
  )
  assert step_setup.rel_diff(a, b) == pytest.approx(want, rel=1e-12)
  assert step_setup.rel_diff(b, b) == 0.0
  samples = [0.003, 0.001, 0.002, 0.010]
  got = step_setup.summarize(samples)
  assert got["median_ms"] == pytest.approx(statistics.median(samples) * 1e3)
  assert got["min_ms"] == pytest.approx(1.0)
  assert got["runs_ms"] == [3.0, 1.0, 2.0, 10.0]
