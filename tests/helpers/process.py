"""Every process the tests start: fresh interpreters, CLIs, scripts, pytest.

Settings fixed when a process or JAX starts (forced host devices, kernel
switches read once, the CLI's own startup) need a fresh process; the tests
start them only through these functions (tests/project/test_structure.py checks that
no other test module imports ``subprocess``).

Each function runs in the repository with this process's environment, less
``drop``, with ``env`` over it. Those that run a command to its end capture
its text output and return the finished process without checking its exit
status: the tests assert the status and the output themselves, which puts
both in the failure message. ``run_python`` alone raises ``ProcessFailed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import os
import subprocess
import sys

REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

# run_python's error on a nonzero exit (and subprocess.run(check=True)'s, as
# raised by the tools the tests call), with the child's stdout and stderr.
ProcessFailed = subprocess.CalledProcessError
# The base of ProcessFailed and of a timeout's error.
ProcessError = subprocess.SubprocessError
Finished = subprocess.CompletedProcess

_ON_CPU = {"JAX_PLATFORMS": "cpu"}


def _environment(
    env: Mapping[str, str] | None, drop: Iterable[str]
) -> dict[str, str]:
  dropped = set(drop)
  full = {k: v for k, v in os.environ.items() if k not in dropped}
  full.update(env or {})
  return full


def forced_host_devices(count: int) -> dict[str, str]:
  """``env`` for a JAX process on the CPU with ``count`` host devices (the
  flags already in ``XLA_FLAGS`` kept)."""
  flags = os.environ.get("XLA_FLAGS", "")
  flag = f"--xla_force_host_platform_device_count={count}"
  return {"XLA_FLAGS": f"{flags} {flag}".strip(), **_ON_CPU}


def unoptimized_codegen(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """``env`` with ``XLA_FLAGS`` (``env``'s, else this process's) that
  compile the CPU programs without LLVM's optimization passes.

  For processes whose programs compile far longer than they run: a few
  steps each, checked against each other or within a tolerance. Such a
  process's float results may differ in the last bits from an optimized
  program's, so a test that compares them bit for bit with this process's,
  or that times them, must not use it.
  """
  env = dict(env or {})
  flags = env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
  return env


def run_program(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    drop: Iterable[str] = (),
    timeout: float | None = 600,
    cwd: str | os.PathLike[str] = REPO,
) -> Finished[str]:
  """``argv`` (any program) run to its end in ``cwd``, its output captured."""
  return subprocess.run(
      list(argv),
      env=_environment(env, drop),
      cwd=cwd,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
  )


def run_python(
    code: str,
    env: Mapping[str, str] | None = None,
    *,
    drop: Sequence[str] = (),
    args: Sequence[str] = (),
) -> str:
  """``python -c code args`` on the CPU; its stdout, or ``ProcessFailed``."""
  finished = run_python_result(code, *args, env=env, drop=drop, timeout=None)
  finished.check_returncode()
  return finished.stdout


def run_python_result(
    code: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    drop: Iterable[str] = (),
    timeout: float | None = 600,
) -> Finished[str]:
  """``python -c code args`` on the CPU, run to its end (``timeout`` None:
  however long it takes)."""
  return run_program(
      [sys.executable, "-c", code, *args],
      env={**(env or {}), **_ON_CPU},
      drop=drop,
      timeout=timeout,
  )


# Alike run_python: one signature per kind of
# process, each a contract its callers use (a -m run picks its backend).
def run_module(
    module: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    drop: Iterable[str] = (),
    timeout: float = 300,
) -> Finished[str]:
  """``python -m module args`` (a CLI of the repository) run to its end."""
  return run_program(
      [sys.executable, "-m", module, *args],
      env=env,
      drop=drop,
      timeout=timeout,
  )


def run_pytest(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 900,
) -> Finished[str]:
  """``python -m pytest -q args`` run to its end, its summary in stdout.

  For tests that need a fresh process's settings (forced host devices, a
  kernel switch read once). No cache folder: parallel runs would share it.
  """
  return run_module(
      "pytest", "-q", "-p", "no:cacheprovider", *args, env=env, timeout=timeout
  )


def run_shell_script(
    path: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> Finished[str]:
  """``bash path`` (relative to the repository) run to its end."""
  return run_program(["bash", path], env=env, timeout=timeout)


def start_module(
    module: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    keep_output: bool = False,
) -> subprocess.Popen[str]:
  """``python -m module args`` started, not waited for: for tests that kill
  it mid-run. Its output is piped (read it with ``communicate``) when
  ``keep_output``, else discarded so that no full pipe can block it."""
  output = subprocess.PIPE if keep_output else subprocess.DEVNULL
  return subprocess.Popen(
      [sys.executable, "-m", module, *args],
      env=_environment(env, ()),
      cwd=REPO,
      stdout=output,
      stderr=output,
      text=True,
  )
