#!/usr/bin/env bash
# Accelerator check in one call, from the repository root:
#   bash benchmarks/device_check.sh [radix] [methods] [full] [tests]
# radix: the fixed-pass radix select against the other methods and a
# mean+var pass, exactness checked (radix.json);
# methods: sqd layers with each k-th smallest method (methods_*.json);
# full: the whole benchmark (bench_device.json), run with the method that
# was fastest in `methods` if that step ran; tests: the exactness tests on the
# device. Results go to $OUT (default /tmp/gbn_device).
set -u
OUT=${OUT:-/tmp/gbn_device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
best=()
for step in "${@:-full}"; do
  case "$step" in
    methods)
      for method in accelerator adaptive sort; do
        timeout 70 python3 -m benchmarks.bench_gbn --inner 10 --runs 15 --measures sqd2 sqd:0.99 \
          --shapes 256x32x32x16 1024x32x32x16 1000x8x8x50 --train-steps \
          --select-method "$method" --out "$OUT/methods_$method.json" 2>&1 | tee -a "$OUT/log.txt"
      done
      pick=$(python3 - "$OUT" <<'PY'
import json, pathlib, sys
totals = {}
for path in pathlib.Path(sys.argv[1]).glob("methods_*.json"):
  rows = json.loads(path.read_text())["layers"]
  if len(rows) == 6:
    totals[path.stem.split("_", 1)[1]] = sum(r["gbn_ms"] for r in rows)
print(min(totals, key=totals.get) if totals else "")
PY
)
      echo "fastest method on the large shapes: ${pick:-none}" | tee -a "$OUT/log.txt"
      [ -n "$pick" ] && best=(--select-method "$pick") ;;
    radix)
      timeout 150 python3 -m benchmarks.device_check_radix --runs 20 --inner 10 \
        --out "$OUT/radix.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    full)
      timeout 200 python3 -m benchmarks.bench_gbn --inner 10 --runs 20 "${best[@]}" \
        --out "$OUT/bench_device.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    tests)
      timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -x -p no:cacheprovider -o addopts= \
        tests/test_radix_select.py tests/test_select.py tests/test_quantiles.py 2>&1 | tail -8 | tee -a "$OUT/log.txt" ;;
  esac
done
