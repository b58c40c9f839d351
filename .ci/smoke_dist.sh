#!/usr/bin/env bash
# Builds the sdist and the wheel, checks the wheel's contents, installs the
# wheel (not the checkout) into a fresh venv and runs a sqd2 layer with the C++
# kernel; then reinstalls from the sdist with the C++ compiler disabled, as on
# a machine without one, and checks the pure-JAX fallback. One venv for both
# (pip's cache makes the second install quick). Run from the CI venv.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python -m pip install -q -c .ci/constraints.txt build check-wheel-contents
python -m build -q --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
check-wheel-contents "$wheel"
# Only the library is distributed (train/ runs from a checkout).
if python -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}' | grep -vE '^gbn_jax(/|-)'; then
  echo "error: the wheel has files outside gbn_jax (listed above)" >&2; exit 1
fi
# And the library is normalization only: the training suite's convolutions
# (train/native/convolution.py, train/native/csrc) are in neither distribution.
conv_files='(^|/)(convolution|_conv_cpu|conv_cpu|conv_tiles)[^/]*$'
if python -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}' | grep -E "$conv_files"; then
  echo "error: the wheel has convolution files (listed above)" >&2; exit 1
fi
if tar -tzf "$sdist" | grep -E "$conv_files|^[^/]+/train/"; then
  echo "error: the sdist has training-suite files (listed above)" >&2; exit 1
fi

python3 -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q -c .ci/constraints.txt "$wheel"
# .ci/run sets GBN_EXPECT_NATIVE=1 where a C++ compiler is present.
native=--no-native
if [ "${GBN_EXPECT_NATIVE:-}" = 1 ]; then native=--native; fi
(cd "$work" && env -u GBN_KTH_LIBRARY "$vpy" -I "$repo/.ci/smoke_dist.py" "$native")

# No C++ compiler: setuptools' compile and link steps fail, the optional
# extension is skipped, and the install must still succeed.
CC=/bin/false CXX=/bin/false "$vpy" -m pip install -v --force-reinstall --no-deps --no-cache-dir \
  "$sdist" >"$work/sdist.log" 2>&1 || { cat "$work/sdist.log"; exit 1; }
grep -q 'building extension "gbn_jax._kth_cpu" failed' "$work/sdist.log" \
  || { cat "$work/sdist.log"; echo "error: the compiler was not disabled" >&2; exit 1; }
(cd "$work" && env -u GBN_KTH_LIBRARY "$vpy" -I "$repo/.ci/smoke_dist.py" --no-native)
