#!/usr/bin/env bash
# The library's quick tests a second time, on today's JAX: the newest Python
# on this machine (on PATH or under pyenv) in a venv of its own, with the
# newest jax, jaxlib and flax the registry serves for it (no constraints).
# Where no Python newer than the pinned run's is found, says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
pinned=$(version python3)

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

venv=.venv-newest
chosen=""
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
  echo "note: no Python newer than the pinned run's $pinned takes today's JAX here; the newest-JAX run is skipped"
  exit 0
fi

# The library and the tests' own tools, nothing of the training suite.
"$venv/bin/python" -m pip install -q -e . pytest pytest-xdist chex flatbuffers
echo "newest-JAX run: Python $chosen"
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|flax|numpy) '

# The library's tests: the modules that import nothing of the training suite,
# the benchmarks or the notebooks (by statement or by module name), and start
# none of their commands.
mapfile -t library_tests < <(grep -LE \
  '(from|import) (train|benchmarks|notebooks)\b|"(train|benchmarks)\.|training_helpers|run_folder_helpers|run_module\(|jupytext|nbformat' \
  tests/test_*.py)
"$venv/bin/python" -m pytest -q -n auto -m "not slow" -p no:cacheprovider \
  gbn_jax "${library_tests[@]}"
