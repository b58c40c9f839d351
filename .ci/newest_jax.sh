#!/usr/bin/env bash
# The library's quick tests a second time, on today's JAX: the newest Python
# on this machine (on PATH or under pyenv) in a venv of its own, with the
# newest jax, jaxlib and flax the registry serves for it (no constraints).
# What is tested is the project's wheel, installed there: tests/gbn_jax (with
# tests/helpers and tests/conftest.py) is copied to a temporary folder and run
# from it, so that no checkout is on sys.path. Where no Python newer than the
# pinned run's is found, says so and exits 0.
#
#   bash .ci/newest_jax.sh [prepare|test]
#
# prepare: the venv, with the wheel built and installed in it (downloads and
# a compile, which .ci/run overlaps with the pinned tests); test: the tests,
# in the prepared venv; no argument: both.
set -euo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
case "$phase" in
  prepare | test | all) ;;
  *) echo "usage: $0 [prepare|test]" >&2; exit 2 ;;
esac
venv="$PWD/.venv-newest"
# What prepare found, for test: "ready PYTHON_VERSION WHEEL", or "none PINNED".
status="$venv/ci-status"

version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

# Every interpreter found, as "VERSION PATH", newest first.
candidates() {
  local py
  {
    compgen -c python3. | grep -E '^python3\.[0-9]+$' | sort -u
    ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/python3 2>/dev/null || true
  } | while read -r py; do
    v=$(version "$py") && echo "$v $(command -v "$py" || echo "$py")"
  done | sort -t. -k1,1nr -k2,2nr -u
}

prepare() {
  local pinned chosen="" v py work wheels
  pinned=$(version python3)
  rm -f "$status"
  while read -r v py; do
    [ "$(printf '%s\n%s\n' "$pinned" "$v" | sort -V | tail -1)" = "$v" ] || continue
    [ "$v" != "$pinned" ] || continue
    rm -rf "$venv"
    if "$py" -m venv "$venv" \
        && "$venv/bin/python" -m pip install -q --upgrade pip \
        && "$venv/bin/python" -m pip install -q --upgrade jax jaxlib flax; then
      chosen="$v"
      break
    fi
    echo "note: Python $v ($py) could not take jax and flax from the registry; trying an older one"
  done < <(candidates)
  if [ -z "$chosen" ]; then
    rm -rf "$venv" && mkdir -p "$venv"
    echo "none $pinned" >"$status"
    return 0
  fi

  # The wheel, as users get it (the C++ kernel compiled for this Python where
  # a compiler is here), then the tests' own tools: nothing of the training
  # suite.
  # Built from a copy of the tracked files: pip builds in the source tree,
  # and the pinned tests may be reading the checkout meanwhile.
  work=$(mktemp -d)
  mkdir "$work/src"
  git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work/src"
  "$venv/bin/python" -m pip wheel -q --no-deps -w "$work/dist" "$work/src" >"$work/wheel.log" 2>&1 \
    || { cat "$work/wheel.log"; rm -rf "$work"; return 1; }
  wheels=("$work"/dist/gbn_jax-*.whl)
  if [ "${#wheels[@]}" -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
    echo "error: expected one gbn_jax wheel in $work/dist" >&2; ls "$work/dist" >&2
    rm -rf "$work"; return 1
  fi
  "$venv/bin/python" -m pip install -q "${wheels[0]}" pytest pytest-xdist chex flatbuffers scipy
  echo "ready $chosen $(basename "${wheels[0]}")" >"$status"
  rm -rf "$work"
}

run_tests() {
  local state chosen wheel run site imported
  [ -f "$status" ] || { echo "error: no prepared venv: run $0 prepare first" >&2; return 1; }
  read -r state chosen wheel <"$status"
  if [ "$state" = none ]; then
    echo "note: no Python newer than the pinned run's $chosen takes today's JAX here; the newest-JAX run is skipped"
    return 0
  fi
  echo "newest-JAX run: Python $chosen, $wheel"
  "$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|flax|numpy) '

  # The library's tests, alone: the tests/ package with its shared code and
  # the library's folder, none of train/, benchmarks/ or notebooks/ (which
  # tests/project/test_tests_layout.py checks they do not need); flax's
  # example ResNet comes through the tool that fetches flax's sources.
  work=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$work"' EXIT
  run="$work/run"
  mkdir -p "$run/tests" "$run/tools"
  cp tests/__init__.py tests/conftest.py "$run/tests/"
  cp -r tests/helpers tests/gbn_jax "$run/tests/"
  cp tools/flax_batchnorm_suite.py "$run/tools/"
  find "$run" -name __pycache__ -prune -exec rm -rf {} +
  # pyproject.toml's pytest settings stay in the checkout: the markers the
  # tests use, the doctests and the scheduling, for a run from that folder,
  # of the library's tests (the helpers of train's tests, there too, are not
  # imported).
  "$venv/bin/python" - "$run/pytest.ini" <<'PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
  options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
markers = "".join(f"\n  {m}" for m in options["markers"])
with open(sys.argv[1], "w") as f:
  f.write(
      "[pytest]\ntestpaths = tests/gbn_jax\n"
      f"addopts = {options['addopts']} -p no:cacheprovider\nmarkers ={markers}\n"
  )
PY

  # The package the tests import must be the installed one.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
  imported=$(cd "$run" && "$venv/bin/python" -c 'import gbn_jax; print(gbn_jax.__file__)')
  case "$imported" in
    "$site"/gbn_jax/*) ;;
    *) echo "error: gbn_jax was imported from $imported, not from the venv's $site" >&2; return 1 ;;
  esac
  echo "gbn_jax from $imported"

  # The quick tests, and the installed package's doctests (--pyargs: by
  # name); test_public_surface checks that the workers import gbn_jax from
  # $site too. XLA's CPU backend compiles unoptimized here: this run asks
  # whether the library works on today's JAX, its tests compile far longer
  # than they run, and the pinned run tests the optimized programs.
  flags="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
  (cd "$run" && XLA_FLAGS="${flags# }" GBN_EXPECT_PACKAGE_IN="$site" "$venv/bin/python" -m pytest -q -n auto \
    -m "not slow" tests/gbn_jax --pyargs gbn_jax)
}

if [ "$phase" != test ]; then prepare; fi
if [ "$phase" != prepare ]; then run_tests; fi
