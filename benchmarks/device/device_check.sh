#!/usr/bin/env bash
# The accelerator check as one budgeted run, from the repository root:
#
#   BUDGET=575 OUT=/tmp/out bash benchmarks/device/device_check.sh [STEP...]
#   DRY_RUN=1 OUT=/tmp/out bash benchmarks/device/device_check.sh      # the CPU rehearsal
#
# Steps, in this order by default (name some to run only those):
#   env      versions and the card (env.txt); starts the CIFAR-10 conversion
#   tests    the exactness tests of the selections on the device (tests.log)
#   library  (named only, not a default step) the library's quick tests,
#            tests/gbn_jax -m "not slow", on the card's own JAX, every test's
#            outcome in library.log (pytest -v, several workers)
#   radix    each selection kernel alone against a mean+var pass, and one
#            histogram pass and one sums pass alone: which pass costs what
#            (radix.json)
#   methods  sqd layers at alpha .25/.5/.75/.99 on the four layer shapes, per
#            selection method; picks the fastest exact one (methods.json).
#            METHODS="bracket pallas_experimental" and METHOD_ALPHAS="0.5 0.99"
#            narrow it to those methods and levels
#   steps    LeNet b1000 and ResNet20 b256 sqd2 train steps against BatchNorm,
#            with the picked method (steps.json)
#   compile  the CLI's compile time as a user meets it
#            (benchmarks/device/device_check_compile.py): for bn, then sqd2,
#            `python -m train.cifar --norm N --epochs 2 --data-dir` (the env
#            step's CIFAR-10) in a fresh process over an empty compile cache;
#            then both again over their caches. Per run: the "compiled in"
#            seconds the CLI logs, launch to that line and to epoch 1's end,
#            the epochs' seconds, which programs the cache gave back
#            (cache_hit) (compile.json; output in compile/). Then
#            benchmarks.compile.bench_compile --cached per norm: tracing+lowering
#            and XLA seconds, fresh and cached (compile/bench_compile_N.json,
#            summed up in compile.json). Four CLI runs and their compiles,
#            then four bench_compile children (their cost on a card:
#            docs/performance.md, "Compile time"); the cap cuts
#            bench_compile first. `env compile` alone fits any session.
#   full     the whole layer table with the picked method (layers.json);
#            with steps.json it becomes bench_<card>.json
#   torch    the PyTorch peer (peers/torch_sqd.py, part of the working tree)
#            on the same card, if torch imports (torch_sqd.json)
#   table2   the paper's Table 2 CIFAR-10 LeNet row: batch 1024, plain SGD lr
#            0.1, no augmentation, weight decay 1e-4 (as the committed
#            5-epoch sweep), 200 epochs, norms bn mad rsd rbd sqd1 sqd2 sqd3,
#            every norm's seed 0 first, then seeds 1 and 2, 7 runs sharing the
#            card; metrics every epoch (sweeps/cifar10_lenet_gpu/). It runs in
#            its own session (setsid), so it outlives this call until the
#            budget of a later `collect` call ends it.
#            When the row is done, the same detached job goes on with the
#            gain study's ResNet20 runs: CIFAR-10 without
#            augmentation, batch 256, lr 0.1, 200 epochs, bn, rbd,
#            bn_gain:rbd and calibrated rbd, seeds 0 and 1
#            (sweeps/cifar10_resnet20_gain_gpu/), as many as the budget allows,
#            with a checkpoint every 10 epochs; at the same time, the same four
#            conditions with augmentation (crop + flip, the paper's protocol;
#            sweeps/cifar10_resnet20_gain_aug_gpu/): does RBD's shape still
#            help where augmentation already regularizes? Runs that a
#            committed sweep holds as finished are skipped; runs an earlier session left
#            unfinished go on from their checkpoint if RESUME (default
#            .device/resume/) holds them: after a session, its
#            OUT/resnet_resume.tgz is committed as RESUME_BUNDLE
#            (results/sweeps/gpu_resume.tgz), which `prepare` unpacks there.
#   collect  (a later call) waits for table2 until BUDGET ends or the sweep
#            finishes, then stops it (KEEP_RUNNING=1: leave it running)
#
# The torch step runs before table2, which takes whatever time is left.
# Every step is capped by the time left (BUDGET seconds from the start, less a
# margin to pack); a step cut off keeps what it wrote, since the benchmarks
# rewrite their JSON after every row and the sweep writes every epoch. How a
# step ended is in the log: "NAME: rc=0" finished; "NAME: rc=124" (or 137,
# killed) followed by "NAME: cut off by its cap of Ns" was stopped by its cap,
# and its JSON, if it got as far as its first row, says "complete": false;
# "NAME: skipped, no time left" never started. table2 logs "sweep finished"
# or "budget spent"; a run it stopped has the epochs it finished.
# Everything lands in WORK (default /tmp/gbn_device), and after every step it
# is packed into OUT/device_results.tgz (checkpoints left out), with the log
# in OUT/log.txt, and the ResNet20 runs with their newest checkpoint into
# OUT/resnet_resume.tgz: three files, whatever cut the run short.
#
# DRY_RUN=1 runs every step on whatever backend there is (the CPU here) with
# tiny shapes, tiny batches, 2 epochs of synthetic CIFAR-10-format data and a
# few seconds per step, writing the same files (a few minutes; caps and budget
# leave about twice what it needs); tests/benchmarks/device/test_device_check.py runs
# it. Data: the JPEG CIFAR-10 (../shared/data/cifar10-jpeg.tar.xz) and its
# converter (../shared/tools/cifar10_binary.py) travel to the device as
# .device/data/ and .device/tools/, the runs to go on from as .device/resume/:
# `bash benchmarks/device/device_check.sh prepare` lays them out here (ignored
# by git), and the device call carries them:
# run(command="bash benchmarks/device/device_check.sh", carry=[".device"]).
set -u
OUT=${OUT:-/tmp/gbn_device_out}
WORK=${WORK:-/tmp/gbn_device}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
MARGIN=${MARGIN:-8}
if [ "$DRY_RUN" = 1 ]; then BUDGET=${BUDGET:-960}; else BUDGET=${BUDGET:-575}; fi
deadline=$((SECONDS + BUDGET))
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# One run at a time on the card for timing; table2 sets its own fractions.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SWEEP=$WORK/sweeps/cifar10_lenet_gpu
RESNET_SWEEP=$WORK/sweeps/cifar10_resnet20_gain_gpu
RESNET_AUG_SWEEP=$WORK/sweeps/cifar10_resnet20_gain_aug_gpu
if [ "$DRY_RUN" = 1 ]; then RESUME=${RESUME:-$WORK/no_resume}; else RESUME=${RESUME:-.device/resume}; fi
RESUME_BUNDLE=${RESUME_BUNDLE:-results/sweeps/gpu_resume.tgz}
DATA=$WORK/cifar10
LOG=$WORK/log.txt

log() { echo "[device_check $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((deadline - SECONDS - MARGIN)); }
# cap N: the seconds a step may take, at most N and what is left.
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
pack() {
  tar -czf "$OUT/device_results.tgz.tmp" -C "$WORK" --exclude=checkpoints --exclude=jax_cache \
    --exclude=cifar10 --exclude='*.lock' --exclude='xdg_cache_*' . 2>/dev/null && mv "$OUT/device_results.tgz.tmp" "$OUT/device_results.tgz"
  cp "$LOG" "$OUT/log.txt" 2>/dev/null
  pack_resume
}
# The ResNet20 runs with their newest checkpoint each (about 1.2 MB a run), in
# OUT/resnet_resume.tgz: unpacked into RESUME (.device/resume/ here), the next
# device session's table2 step goes on from there instead of from epoch 1.
pack_resume() {
  local sweeps=() dir ckpts step older=()
  for dir in "$RESNET_SWEEP" "$RESNET_AUG_SWEEP"; do
    [ -d "$dir" ] && sweeps+=("${dir#"$WORK"/}")
  done
  [ ${#sweeps[@]} -gt 0 ] || return 0
  for ckpts in "$RESNET_SWEEP"/*/checkpoints "$RESNET_AUG_SWEEP"/*/checkpoints; do
    [ -d "$ckpts" ] || continue
    for step in $(ls "$ckpts" | grep -E '^[0-9]+$' | sort -n | head -n -1); do
      older+=("--exclude=${ckpts#"$WORK"/}/$step")
    done
  done
  tar -czf "$OUT/resnet_resume.tgz.tmp" -C "$WORK" --exclude='*.lock' --exclude='*tmp*' \
    "${older[@]}" "${sweeps[@]}" 2>/dev/null \
    && mv "$OUT/resnet_resume.tgz.tmp" "$OUT/resnet_resume.tgz"
}
# run_capped NAME SECONDS CMD...: runs CMD under timeout, logs its output.
run_capped() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -le 3 ]; then log "$name: skipped, no time left"; return 1; fi
  log "$name: start (at most ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  log "$name: rc=$rc"
  # timeout's status when it stopped the step (TERM, or KILL 5 s later).
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then log "$name: cut off by its cap of ${limit}s"; fi
  pack
  return "$rc"
}
picked_method() {
  "$PYTHON" - "$WORK/methods.json" <<'PY'
import json, sys
try:
  print(json.load(open(sys.argv[1])).get("fastest_exact") or "")
except (OSError, ValueError):
  print("")
PY
}

if [ "$DRY_RUN" = 1 ]; then
  # One shape: the rehearsal checks each step's plumbing, which one shape runs
  # as fully as several.
  # One middle and one extreme rank, one model, one norm, one seed: each path
  # of the script runs, none twice.
  SHAPES=(64x8x8x16); RUNS=(--runs 3 --warmup 1 --inner 1); ALPHAS=(0.5 0.99)
  STEP_BATCH=(--train-batch 16); STEP_MODELS=(lenet); MEASURES=(sd sqd2 sqd:0.99)
  COMPILE_NORMS=sqd2
  EPOCHS=2; SEEDS=0; NORMS=bn,sqd2; JOBS=2; BATCH=256; CKPT_EVERY=1
  RESNET_EPOCHS=2; RESNET_SEEDS=0; RESNET_NORMS=bn; RESNET_CALIBRATED=; RESNET_JOBS=1
  RESNET_CKPT_EVERY=1; TEST_WORKERS=2
  # About twice what an idle core pair needs: the rehearsal checks the
  # script, not the CPU's speed (a slower pair, loaded by CI's other pytest
  # worker, needs the margin).
  # The tests step is cut off at 4 s, as a device's may be: the suite runs
  # those tests itself, the rehearsal only checks that the step runs and logs.
  # The compile step's CLI runs: LeNet on the synthetic CIFAR-10.
  COMPILE_ARGS=(--model lenet --batch-size 256 --bench-images 256)
  CAPS=(tests=4 library=60 radix=80 methods=200 steps=120 compile=120 full=120 torch=40)
else
  SHAPES=(256x32x32x16 1024x32x32x16 1000x8x8x50 512x256); RUNS=(--runs 12 --warmup 3 --inner 10)
  ALPHAS=(0.25 0.5 0.75 0.99); STEP_BATCH=(); STEP_MODELS=(lenet resnet20); COMPILE_NORMS=bn,sqd2
  MEASURES=(sd mad rsd bpoe rbd wcd sqd1 sqd2 sqd3 sqd:0.05 sqd:0.99)
  EPOCHS=200; SEEDS=0,1,2; NORMS=bn,mad,rsd,rbd,sqd1,sqd2,sqd3; JOBS=7; BATCH=1024; CKPT_EVERY=50
  RESNET_EPOCHS=200; RESNET_SEEDS=0,1; RESNET_NORMS=bn,rbd,bn_gain:rbd; RESNET_CALIBRATED=rbd; RESNET_JOBS=8
  # An orbax save every 10 ResNet20 epochs costs little next to the epochs
  # (docs/performance.md), and a later session resumes from it.
  RESNET_CKPT_EVERY=10; TEST_WORKERS=8
  COMPILE_ARGS=(--model resnet20)
  CAPS=(tests=60 library=150 radix=50 methods=120 steps=70 compile=180 full=90 torch=30)
fi
cap_of() { local c; for c in "${CAPS[@]}"; do [ "${c%%=*}" = "$1" ] && echo "${c#*=}"; done; }

step_env() {
  {
    date -u; echo "DRY_RUN=$DRY_RUN BUDGET=$BUDGET"; git rev-parse HEAD 2>/dev/null
    git status --short 2>/dev/null | head -20
    nvidia-smi -L 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
    "$PYTHON" -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); print(jax.devices())"
    "$PYTHON" -c "import gbn_jax, train.sweep.cli; print('gbn_jax and train import')"
    "$PYTHON" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tail -1
  } 2>&1 | tee "$WORK/env.txt" | tee -a "$LOG"
  # The data for table2, converted while the other steps run (CPU only).
  if [ "$DRY_RUN" = 1 ]; then
    "$PYTHON" - "$DATA" <<'PY' >>"$LOG" 2>&1 &
import pathlib, sys
import numpy as np
out = pathlib.Path(sys.argv[1]) / "cifar-10-batches-bin"
out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
def records(n):  # CIFAR-10 binary records: a label byte, 3072 pixel bytes
  labels = rng.integers(0, 10, (n, 1), dtype=np.uint8)
  pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
  pixels[:, :1024] //= (1 + labels)  # a learnable signal in the red plane
  return np.concatenate([labels, pixels], axis=1).tobytes()
# One batch of 256 an epoch: each run's 2 epochs are 2 steps.
for i in range(1, 6):
  (out / f"data_batch_{i}.bin").write_bytes(records(52))
(out / "test_batch.bin").write_bytes(records(100))
print("synthetic CIFAR-10 (260 train, 100 test) in", out)
PY
    echo $! > "$WORK/convert.pid"
  elif [ -f .device/tools/cifar10_binary.py ] && [ -f .device/data/cifar10-jpeg.tar.xz ]; then
    "$PYTHON" .device/tools/cifar10_binary.py "$DATA" >>"$LOG" 2>&1 &
    echo $! > "$WORK/convert.pid"
  else
    log "no .device/data/cifar10-jpeg.tar.xz: table2 fails unless $DATA holds cifar-10-batches-bin/"
  fi
  pack
}

step_tests() {
  # Most specific first: a step cut off by its cap has run these. -v names
  # every test in the log as it runs: a cut-off run writes no summary.
  local tests=() t
  for t in tests/gbn_jax/selection/test_pallas.py tests/gbn_jax/selection/test_bracket.py \
      tests/gbn_jax/selection/test_radix.py tests/gbn_jax/selection/test_radix_sums.py \
      tests/gbn_jax/test_quantiles.py tests/gbn_jax/selection/test_dispatch.py; do
    [ -f "$t" ] && tests+=("$t")
  done
  # Several workers: one process gets through too few of them in the cap.
  local workers=()
  "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n "$TEST_WORKERS")
  run_capped tests "$(cap "$(cap_of tests)")" "$PYTHON" -m pytest -v -p no:cacheprovider \
    -o addopts= --maxfail=25 "${workers[@]}" "${tests[@]}"
}

step_library() {
  local tests=(tests/gbn_jax) workers=()
  # The rehearsal runs one small module: the suite runs the rest itself.
  [ "$DRY_RUN" = 1 ] && tests=(tests/gbn_jax/test_measures.py)
  "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n "$((TEST_WORKERS + TEST_WORKERS * 3 / 4))")
  run_capped library "$(cap "$(cap_of library)")" "$PYTHON" -m pytest -v -p no:cacheprovider \
    -o addopts= -m "not slow" --tb=short "${workers[@]}" "${tests[@]}"
}

step_radix() {
  run_capped radix "$(cap "$(cap_of radix)")" "$PYTHON" -m benchmarks.device.device_check_radix \
    --shapes "${SHAPES[@]}" "${RUNS[@]}" --out "$WORK/radix.json"
}

step_methods() {
  run_capped methods "$(cap "$(cap_of methods)")" "$PYTHON" -m benchmarks.layer.bench_methods \
    --shapes "${SHAPES[@]}" --alphas ${METHOD_ALPHAS:-${ALPHAS[*]}} \
    ${METHODS:+--methods $METHODS} "${RUNS[@]}" --out "$WORK/methods.json"
}

method_flag() {
  local m; m=$(picked_method)
  # The flag is this function's output: the log line goes to stderr.
  if [ -n "$m" ]; then log "selection method: $m (fastest exact in methods.json)" >&2; echo "--select-method $m"
  else log "selection method: the default (methods.json has no pick)" >&2; fi
}

step_steps() {
  # shellcheck disable=SC2046
  run_capped steps "$(cap "$(cap_of steps)")" "$PYTHON" -m benchmarks.layer.bench_gbn --measures --family \
    --train-steps "${STEP_MODELS[@]}" "${STEP_BATCH[@]}" "${RUNS[@]}" $(method_flag) --out "$WORK/steps.json"
}

# Waits while the env step's CIFAR-10 conversion runs (or the budget ends).
wait_for_data() {
  local p; p=$(cat "$WORK/convert.pid" 2>/dev/null)
  [ -n "$p" ] && while kill -0 "$p" 2>/dev/null && [ "$(left)" -gt 0 ]; do sleep 1; done
}

step_compile() {
  wait_for_data
  if [ ! -d "$DATA/cifar-10-batches-bin" ]; then
    log "compile: skipped, no $DATA/cifar-10-batches-bin (the env step converts it)"; return 1
  fi
  run_capped compile "$(cap "$(cap_of compile)")" "$PYTHON" -m benchmarks.device.device_check_compile \
    --norms "$COMPILE_NORMS" --epochs 2 --data-dir "$DATA" "${COMPILE_ARGS[@]}" --work "$WORK/compile" \
    --out "$WORK/compile.json"
}

step_full() {
  # shellcheck disable=SC2046
  run_capped full "$(cap "$(cap_of full)")" "$PYTHON" -m benchmarks.layer.bench_gbn --train-steps --family \
    --shapes "${SHAPES[@]}" --measures "${MEASURES[@]}" "${RUNS[@]}" $(method_flag) \
    --out "$WORK/layers.json"
  "$PYTHON" - "$WORK" <<'PY' 2>&1 | tee -a "$LOG"
# bench_<card>.json: the layer table and the train steps, as bench_gbn writes one file.
import json, pathlib, re, sys
work = pathlib.Path(sys.argv[1])
def read(name):
  try:
    return json.loads((work / name).read_text())
  except (OSError, ValueError):
    return None
layers, steps = read("layers.json"), read("steps.json")
base = layers or steps
if base is None:
  sys.exit("bench: neither layers.json nor steps.json")
kind = base["machine"].get("device_kind", "").lower()  # e.g. "nvidia h100 80gb hbm3"
card = (re.search(r"\b(h100|h200|a100|l4|v100|tpu ?v\d\w*)\b", kind) or [None])[0]
card = re.sub(r"\W", "", card) if card else base["machine"]["backend"]
merged = {**base, "layers": (layers or {}).get("layers", []),
          "train_steps": (steps or {}).get("train_steps", []),
          "commands": {"layers": (layers or {}).get("command"), "steps": (steps or {}).get("command")},
          "complete": bool(layers and layers["complete"] and steps and steps["complete"])}
(work / f"bench_{card}.json").write_text(json.dumps(merged, indent=2))
print(f"bench_{card}.json: {len(merged['layers'])} layers, {len(merged['train_steps'])} train steps")
PY
  pack
}

step_torch() {
  local peer=peers/torch_sqd.py
  if ! "$PYTHON" -c "import torch" 2>/dev/null || [ ! -f "$peer" ]; then
    log "torch: skipped (no torch here, or no $peer)"; echo '{"skipped": "no torch or no peer script"}' > "$WORK/torch_sqd.json"
    pack; return 0
  fi
  local runs=21; [ "$DRY_RUN" = 1 ] && runs=2
  run_capped torch "$(cap "$(cap_of torch)")" "$PYTHON" "$peer" --runs "$runs" --out "$WORK/torch_sqd.json"
}

sweep_pid() { cat "$WORK/table2.pid" 2>/dev/null; }
# copy_finished FROM TO EPOCHS: runs an earlier device session finished (and
# the repository committed) are not run again; unfinished ones start over.
copy_finished() {
  local done_run
  for done_run in "$1"/*/; do
    [ -f "$done_run/metrics.jsonl" ] || continue
    if [ "$(wc -l < "$done_run/metrics.jsonl")" -ge "$3" ]; then
      cp -r "$done_run" "$2/" && log "table2: $(basename "$done_run") is finished (committed)"
    fi
  done
}
# resume_unfinished FROM TO: runs an earlier device session left unfinished,
# with their newest checkpoint (pack_resume), go on from it.
resume_unfinished() {
  local run
  for run in "$1"/*/; do
    [ -f "$run/metrics.jsonl" ] && [ ! -e "$2/$(basename "$run")" ] || continue
    cp -r "$run" "$2/" && log "table2: $(basename "$run") goes on from an earlier session" \
      "($(ls "$run/checkpoints" 2>/dev/null | tr '\n' ' ')checkpointed, $(wc -l < "$run/metrics.jsonl") epochs logged)"
  done
}
sweep_alive() { local p; p=$(sweep_pid); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

step_table2() {
  if sweep_alive; then log "table2: already running (pid $(sweep_pid))"; else
    wait_for_data
    mkdir -p "$SWEEP" "$RESNET_SWEEP" "$RESNET_AUG_SWEEP"
    local dir
    if [ "$DRY_RUN" != 1 ]; then
      copy_finished results/sweeps/cifar10_lenet_gpu "$SWEEP" "$EPOCHS"
      for dir in "$RESNET_SWEEP" "$RESNET_AUG_SWEEP"; do
        copy_finished "results/sweeps/$(basename "$dir")" "$dir" "$RESNET_EPOCHS"
      done
    fi
    for dir in "$RESNET_SWEEP" "$RESNET_AUG_SWEEP"; do
      resume_unfinished "$RESUME/sweeps/$(basename "$dir")" "$dir"
    done
    log "table2: start, ${EPOCHS} epochs, seeds $SEEDS, norms $NORMS, $JOBS at a time;" \
      "then ResNet20 ${RESNET_EPOCHS} epochs, seeds $RESNET_SEEDS, norms $RESNET_NORMS" \
      "${RESNET_CALIBRATED:+and calibrated $RESNET_CALIBRATED}, without and with augmentation"
    local sweep=("$PYTHON" -m train.sweep --defaults cifar --dataset cifar10 --lr 0.1 --data-dir "$DATA")
    local resnet=("${sweep[@]}" --model resnet20 --batch-size 256 --epochs "$RESNET_EPOCHS"
                  --checkpoint-every "$RESNET_CKPT_EVERY" --seed "$RESNET_SEEDS" --jobs "$RESNET_JOBS")
    # One job, in its own session (setsid), so that it outlives this call:
    # the LeNet row, then the ResNet20 runs, every sweep of them at once so
    # that all their runs share the card.
    {
      printf '%q ' "${sweep[@]}" --no-augment --sweep-dir "$SWEEP" --model lenet --batch-size "$BATCH" \
        --weight-decay 1e-4 --epochs "$EPOCHS" --checkpoint-every "$CKPT_EVERY" --seed "$SEEDS" \
        --norm "$NORMS" --jobs "$JOBS"; echo
      local augment
      for augment in --no-augment --augment; do
        dir=$RESNET_SWEEP; [ "$augment" = --augment ] && dir=$RESNET_AUG_SWEEP
        printf '%q ' "${resnet[@]}" "$augment" --sweep-dir "$dir" --norm "$RESNET_NORMS"; echo '&'
        if [ -n "$RESNET_CALIBRATED" ]; then
          printf '%q ' "${resnet[@]}" "$augment" --sweep-dir "$dir" --norm "$RESNET_CALIBRATED" \
            --calibration normal; echo '&'
        fi
      done
      echo wait
    } > "$WORK/table2_job.sh"
    # Several runs of one norm compile the same programs: share them.
    JAX_COMPILATION_CACHE_DIR=$WORK/jax_cache setsid nohup bash "$WORK/table2_job.sh" \
      >>"$WORK/table2.log" 2>&1 < /dev/null &
    echo $! > "$WORK/table2.pid"
  fi
  wait_table2
}

# Waits for the sweep until it ends or the budget does, packing every 20 s.
wait_table2() {
  local last=$SECONDS
  while sweep_alive && [ "$(left)" -gt 0 ]; do
    sleep 2
    if [ $((SECONDS - last)) -ge 20 ]; then pack; last=$SECONDS; fi
  done
  if sweep_alive; then
    if [ "${KEEP_RUNNING:-1}" = 1 ] && [ "$DRY_RUN" != 1 ]; then
      log "table2: budget spent, sweep left running for a later 'collect' call"
    else
      log "table2: budget spent, stopping the sweep"; kill -TERM -- "-$(sweep_pid)" 2>/dev/null; sleep 3
    fi
  else
    log "table2: sweep finished"
  fi
  tail -3 "$WORK/table2.log" 2>/dev/null | tee -a "$LOG"
  pack
}

step_collect() {
  KEEP_RUNNING=${KEEP_RUNNING:-0} wait_table2
}

step_prepare() {
  local shared=${SHARED:-../shared}
  mkdir -p .device/data .device/tools
  cp "$shared/data/cifar10-jpeg.tar.xz" .device/data/ && cp "$shared/tools/cifar10_binary.py" .device/tools/ \
    || { log "prepare: $shared is incomplete"; return 1; }
  if [ -f "$RESUME_BUNDLE" ]; then
    rm -rf .device/resume && mkdir -p .device/resume && tar -xzf "$RESUME_BUNDLE" -C .device/resume \
      || { log "prepare: $RESUME_BUNDLE does not unpack"; return 1; }
    log "prepare: runs to go on from: $(ls .device/resume/sweeps/*/ 2>/dev/null | grep -c seed)"
  fi
  grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
  log "prepare: .device/ holds $(du -sh .device | cut -f1) to carry"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests radix methods steps compile full torch table2)
log "steps: ${steps[*]} (budget ${BUDGET}s, WORK=$WORK, OUT=$OUT)"
for step in "${steps[@]}"; do
  case "$step" in
    prepare|env|tests|library|radix|methods|steps|compile|full|torch|table2|collect) "step_$step" ;;
    *) log "unknown step '$step'"; exit 2 ;;
  esac
done
log "done"
pack
