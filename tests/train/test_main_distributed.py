"""Multi-host training: two ``train.mnist`` processes through ``jax.distributed``.

Both processes run on 127.0.0.1 with one host device each and share a
workdir, as hosts of a cluster share a file system. Checked against one
process with two host devices: the same metrics; only process 0 writes
``config.json``/``metrics.jsonl`` (an audit hook in each process logs every
rename onto those files, which is how they are written); a killed process
makes the other stop with a clear error in bounded time; rerunning both
resumes from the last checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
import signal
import socket
import time

import numpy as np
import pytest

from train.loop import checkpointing

from tests.helpers.process import run_module
from tests.helpers.process import start_module
from tests.helpers.process import unoptimized_codegen
from tests.helpers.training import tiny_cli_args
from tests.helpers.training import write_tiny_mnist

REPO = Path(__file__).resolve().parents[2]
_AUDIT_HOOK = """
import os, sys
_log = os.environ.get("GBN_TEST_WRITE_LOG")
if _log:
  def _hook(event, args):
    if event == "os.rename" and str(args[1]).endswith(
        ("config.json", "metrics.jsonl")):
      with open(_log, "a") as f:
        f.write(os.path.basename(str(args[1])) + "\\n")
  sys.addaudithook(_hook)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("distributed")
  data = write_tiny_mnist(root / "data", n_train=96)
  hook = root / "hook"
  hook.mkdir()
  (hook / "sitecustomize.py").write_text(_AUDIT_HOOK)
  return root, data, hook


def _args(data: Path, workdir: Path, epochs: int) -> list[str]:
  """``train.mnist``'s arguments."""
  more = ("--epochs", str(epochs), "--norm", "sqd2", "--lr", "0.05")
  return tiny_cli_args(data, workdir, *more)


def _launch_pair(setup, workdir: Path, epochs: int, port: int):
  root, data, hook = setup
  processes = []
  for rank in (0, 1):
    env = unoptimized_codegen(
        {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank),
            "GBN_HOST_DEVICES": "1",
            "GBN_DISTRIBUTED_HEARTBEAT_SECONDS": "10",
            "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]),
            "GBN_TEST_WRITE_LOG": str(root / f"writes{rank}-{workdir.name}"),
        }
    )
    processes.append(
        start_module(
            "train.mnist",
            *_args(data, workdir, epochs),
            env=env,
            keep_output=True,
        )
    )
  return processes


def _single_process(setup, workdir: Path, epochs: int) -> list[dict]:
  _, data, _ = setup
  result = run_module(
      "train.mnist",
      *_args(data, workdir, epochs),
      env=unoptimized_codegen({"GBN_HOST_DEVICES": "2"}),
      timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert "2 device(s)" in result.stderr
  return checkpointing.read_metrics(workdir)


def _assert_same_training(a: list[dict], b: list[dict]) -> None:
  assert [r["epoch"] for r in a] == [r["epoch"] for r in b]
  for x, y in zip(a, b):
    for key in ("train_loss", "test_loss"):
      np.testing.assert_allclose(x[key], y[key], rtol=1e-4, err_msg=key)
    assert abs(x["train_error"] - y["train_error"]) <= 1 / 96 + 1e-9
    assert abs(x["test_error"] - y["test_error"]) <= 1 / 37 + 1e-9


@pytest.mark.slow
def test_killed_process_stops_the_other_then_both_resume(setup, tmp_path):
  root = setup[0]
  workdir = tmp_path / "pair"
  # The pair trains on only until the kill lands: 9 epochs of room.
  epochs = 12
  processes = _launch_pair(setup, workdir, epochs, _free_port())
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline and processes[0].poll() is None:
    if len(checkpointing.read_metrics(workdir)) >= 3:
      break
    time.sleep(0.05)
  processes[1].send_signal(signal.SIGKILL)
  killed_at = time.monotonic()
  _, err = processes[0].communicate(timeout=120)
  stopped_after = time.monotonic() - killed_at
  processes[1].communicate()
  assert processes[0].returncode == 1, err[-3000:]
  assert stopped_after < 60, stopped_after
  print(f"process 0 stopped {stopped_after:.1f}s after process 1 was killed")
  error = [l for l in err.splitlines() if "python -m train.mnist: error:" in l]
  assert error, err[-3000:]
  assert "Rerun every process with the same command" in err
  done = len(checkpointing.read_metrics(workdir))
  assert 3 <= done < epochs

  processes = _launch_pair(setup, workdir, epochs, _free_port())
  outputs = [p.communicate(timeout=300) for p in processes]
  for p, (_, err) in zip(processes, outputs):
    assert p.returncode == 0, err[-3000:]
  assert "resumed from" in outputs[0][1]
  assert "2 device(s)" in outputs[0][1]
  # Gloo prints its connection lines to stdout; the summary is ours.
  summaries = [
      [l for l in out.splitlines() if not l.startswith("[Gloo]")]
      for out, _ in outputs
  ]
  assert len(summaries[0]) == 1
  assert summaries[0][0].startswith(
      f"mnist lenet norm=sqd2 seed=0: {epochs} epochs"
  )
  assert summaries[1] == []  # process 1 reports nothing
  # Only process 0 writes the run's files, before and after the kill.
  writes0 = (root / "writes0-pair").read_text().split()
  assert "config.json" in writes0 and "metrics.jsonl" in writes0
  assert not (root / "writes1-pair").exists()
  rows = checkpointing.read_metrics(workdir)
  assert [r["epoch"] for r in rows] == list(range(1, epochs + 1))
  _assert_same_training(rows, _single_process(setup, tmp_path / "one", epochs))
