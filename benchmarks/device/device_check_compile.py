"""The CLI's compile time, first and cached, as a user meets it.

The CLI keeps its compiled programs between runs
(:mod:`train.compile_cache`); what they cost is in docs/performance.md
("Compile time"). For each norm, this runs the real CLI twice, each time in a fresh process::

  python -m train.cifar --norm N --epochs E --data-dir D ...

first over an empty compile cache folder, then again over the same folder.
The CLI finds its cache as a user's run does: its default folder, under
``XDG_CACHE_HOME`` pointed at a folder made for the norm
(``JAX_COMPILATION_CACHE_DIR`` and ``GBN_COMPILE_CACHE`` removed), where
the compiled C++ kernels' cache (:mod:`train.native.build`, CPU only) is the
user's own, so that only JAX's cache starts empty. JAX's compiler logs each
persistent-cache hit and miss (``JAX_DEBUG_LOG_MODULES=jax._src.compiler``).

Each run's record: ``compile_s``, the seconds the CLI logs ("compiled in
Xs": tracing, lowering and XLA of its programs, before epoch 1);
``to_compiled_s`` and ``to_first_epoch_s``, from the launch to that line and
to the end of epoch 1 (the CLI logs no single step: its first step ends
inside epoch 1); ``epoch_s`` (``metrics.jsonl``'s ``seconds``); ``wall_s``;
``cache_hits`` (programs read back), ``cache_written`` (programs compiled and
written); ``cache_hit``: every one of the CLI's programs was read back.
Then, unless ``--no-bench-compile``, ``benchmarks.compile.bench_compile
--cached`` per norm (its own file per norm) splits the compile into
tracing+lowering and XLA seconds, fresh and cached.
``--out`` is rewritten after every run, ``"complete": false`` until all ran;
a run stopped by SIGTERM (the device check's cap) is recorded as far as it
got, with ``"cut": true``.

  python -m benchmarks.device.device_check_compile --data-dir /tmp/cifar10 \\
      --work /tmp/compile --out /tmp/compile.json
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import os
from pathlib import Path
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from benchmarks.timing import command_line
from benchmarks.timing import machine_info
from benchmarks.timing import write_json
from train import run_files
from train.loop import programs
from train.native import build as native_build

# What JAX's compiler logs (jax._src.compiler, at debug level).
_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
_MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")
_NOT_WRITTEN = re.compile(r"Not writing persistent cache entry for '([^']+)'")
# What the CLI logs (train/loop/trainer.py).
_COMPILED = re.compile(r"; compiled in (\d+(?:\.\d+)?)s$")
_EPOCH_ONE = re.compile(r"^epoch 1/\d+: ")
#: The names JAX gives the CLI's programs (``train.loop.programs``' jitted functions).
CLI_PROGRAMS = tuple(f"jit_{name}" for name in programs.PROGRAM_FUNCTIONS)
# Settings of the user's that would bypass or turn off the CLI's own cache.
_CACHE_ENV = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "GBN_COMPILE_CACHE",
)


class Cut(Exception):
  """SIGTERM arrived: the device check's cap ends this step."""


def _on_term(signum: int, frame: Any) -> None:
  del signum, frame
  raise Cut()


def cache_summary(lines: Sequence[str]) -> dict[str, Any]:
  """Which programs a run read from the persistent cache, and which it wrote.

  Args:
    lines: The run's output, with JAX's compiler debug log in it.

  Returns:
    ``cache_hits`` and ``cache_written``: sorted program names (a name once
    however many times); ``cache_hit``: of the CLI's own programs
    (:data:`CLI_PROGRAMS`), some were read back and none missed. Small eager
    programs don't count: whether one is written depends on whether it took
    ``train.compile_cache.MIN_COMPILE_SECONDS`` to compile, which a loaded
    machine decides.
  """
  hits, missed, not_written = set(), set(), set()
  for line in lines:
    if match := _HIT.search(line):
      hits.add(match.group(1))
    elif match := _MISS.search(line):
      missed.add(match.group(1))
    elif match := _NOT_WRITTEN.search(line):
      not_written.add(match.group(1))
  own = set(CLI_PROGRAMS)
  return {
      "cache_hits": sorted(hits),
      "cache_written": sorted(missed - not_written),
      "cache_hit": bool(hits & own) and not missed & own,
  }


def cli_env(cache_home: Path) -> dict[str, str]:
  """This process's environment for a CLI run whose cache is ``cache_home``'s."""
  env = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV}
  env["XDG_CACHE_HOME"] = str(cache_home)
  env["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler"
  return env


def fresh_cache_home(folder: Path) -> Path:
  """An empty ``XDG_CACHE_HOME`` but for the user's compiled C++ kernels."""
  shutil.rmtree(folder, ignore_errors=True)
  native = native_build.cache_dir()  # before XDG_CACHE_HOME changes
  native.mkdir(parents=True, exist_ok=True)
  (folder / "gbn_jax").mkdir(parents=True)
  (folder / "gbn_jax" / "native").symlink_to(native, target_is_directory=True)
  return folder


def run_cli(
    record: dict[str, Any],
    argv: Sequence[str],
    cache_home: Path,
    workdir: Path,
    log_path: Path,
) -> None:
  """One CLI run, timed from its launch, into ``record`` (see the docstring).

  ``record`` is filled in place, so that a run cut off (:class:`Cut`) keeps
  what it got to.
  """
  command = [sys.executable, "-m", "train.cifar", *argv]
  command += ["--workdir", str(workdir), "--overwrite", "--no-progress"]
  record.update(
      command=" ".join(command[1:]),
      log=log_path.name,
      compile_s=None,
      to_compiled_s=None,
      to_first_epoch_s=None,
  )
  lines: list[str] = []
  start = time.perf_counter()
  proc = subprocess.Popen(
      command,
      env=cli_env(cache_home),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )
  try:
    with log_path.open("w") as log:
      for line in proc.stdout:
        seconds = time.perf_counter() - start
        log.write(line)
        lines.append(line)
        if match := _COMPILED.search(line.rstrip()):
          record["compile_s"] = float(match.group(1))
          record["to_compiled_s"] = round(seconds, 3)
        elif _EPOCH_ONE.match(line) and record["to_first_epoch_s"] is None:
          record["to_first_epoch_s"] = round(seconds, 3)
    record["returncode"] = proc.wait()
  except Cut:
    record["cut"] = True
    proc.kill()
    raise
  finally:
    record["wall_s"] = round(time.perf_counter() - start, 3)
    record["epoch_s"] = _epoch_seconds(workdir)
    record.update(cache_summary(lines))
    record["cache_entries"] = _cache_entries(cache_home)


def _epoch_seconds(workdir: Path) -> list[float]:
  try:
    rows = run_files.read_metrics(workdir)
  except OSError:
    return []
  return [round(row["seconds"], 3) for row in rows]


def _cache_entries(cache_home: Path) -> int:
  folder = cache_home / "gbn_jax" / "jax_cache"
  return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def run_bench_compile(
    args: argparse.Namespace, norm: str, out: Path
) -> dict[str, Any]:
  """``benchmarks.compile.bench_compile --cached`` for one norm: its seconds."""
  command = [
      sys.executable,
      "-m",
      "benchmarks.compile.bench_compile",
      "--cached",
  ]
  command += ["--models", args.model, "--norms", norm, "--out", str(out)]
  if args.batch_size is not None:
    command += ["--batch", str(args.batch_size)]
  if args.bench_images is not None:
    images = str(args.bench_images)
    command += ["--train-images", images, "--test-images", images]
  out.unlink(missing_ok=True)  # an earlier session's, in the same --work
  returncode = subprocess.run(command, check=False).returncode
  summary: dict[str, Any] = {"norm": norm, "file": out.name}
  summary["returncode"] = returncode
  try:
    (row,) = json.loads(out.read_text())["rows"]
  except (OSError, ValueError) as e:
    return {**summary, "error": f"no result: {e}"}
  if "error" in row:
    return {**summary, "error": row["error"][:500]}
  keys = (
      "trace_s",
      "lower_s",
      "compile_s",
      "cached_lower_s",
      "cached_compile_s",
  )
  summary["compile_program_s"] = row["compile_program_s"]
  summary["programs"] = {
      name: {k: program.get(k) for k in keys}
      for name, program in row["programs"].items()
  }
  return summary


def _line(norm: str, label: str, run: dict[str, Any]) -> str:
  epochs = " ".join(f"{s:.1f}" for s in run["epoch_s"])
  return (
      f"{norm} {label}: compiled in {run['compile_s']}s (launch to compiled"
      f" {run['to_compiled_s']}s, to epoch 1's end {run['to_first_epoch_s']}s),"
      f" epochs [{epochs}] s, cache hits {len(run['cache_hits'])}, written"
      f" {len(run['cache_written'])}, cache_hit={run['cache_hit']}"
  )


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the CLI runs and bench_compile; 1 if any of them failed."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--norms", default="bn,sqd2")
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=None)
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--work", required=True, help="cache and run folders")
  parser.add_argument("--out", required=True)
  parser.add_argument(
      "--bench-images",
      type=int,
      default=None,
      help="bench_compile's synthetic set sizes (default: the real ones)",
  )
  parser.add_argument("--no-bench-compile", action="store_true")
  args = parser.parse_args(argv)
  norms = [n for n in args.norms.split(",") if n]
  work = Path(args.work).resolve()
  work.mkdir(parents=True, exist_ok=True)
  cli = ["--model", args.model, "--epochs", str(args.epochs)]
  cli += ["--data-dir", str(Path(args.data_dir).resolve())]
  if args.batch_size is not None:
    cli += ["--batch-size", str(args.batch_size)]
  result = {
      "command": command_line("benchmarks.device.device_check_compile", argv),
      "model": args.model,
      "epochs": args.epochs,
      "norms": norms,
      "runs": [],
      "bench_compile": [],
      "complete": False,
  }
  signal.signal(signal.SIGTERM, _on_term)
  try:
    # Both first compiles before the cached reruns: a cap that cuts the
    # step keeps the comparison the issue asks for first.
    for label in ("first", "cached"):
      for norm in norms:
        cache_home = work / f"xdg_cache_{norm}"
        if label == "first":
          fresh_cache_home(cache_home)
        name = f"{norm}-{label}"
        run = {"norm": norm, "run": label}
        result["runs"].append(run)
        run_cli(
            run,
            [*cli, "--norm", norm],
            cache_home,
            work / name,
            work / f"{name}.log",
        )
        write_json(args.out, {"machine": machine_info(), **result})
        print(_line(norm, label, run), flush=True)
    if not args.no_bench_compile:
      for norm in norms:
        out = work / f"bench_compile_{norm}.json"
        result["bench_compile"].append(run_bench_compile(args, norm, out))
        write_json(args.out, {"machine": machine_info(), **result})
  except Cut:
    write_json(args.out, {"machine": machine_info(), **result})
    print("cut off (SIGTERM): what ran is in --out", flush=True)
    sys.exit(128 + signal.SIGTERM)
  result["complete"] = True
  write_json(args.out, {"machine": machine_info(), **result})
  failed = [r for r in result["runs"] if r["returncode"]]
  failed += [r for r in result["bench_compile"] if "error" in r]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
