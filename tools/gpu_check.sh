#!/usr/bin/env bash
# The GPU machine's checks, in one device call, from the repository root:
#   parity  - the CUDA op-parity tests (on Hopper also with each product tile shape alone, with
#             the products on five blocks that take tiles in turn, with LILY_CUDA_WGMMA=0, the
#             sm_80 product kernels, and with LILY_CUDA_FA=mma, the sm_80 flash attention) and
#             the CUDA end-to-end golden tests
#             (test binaries)
#   api     - the API test suite against `lily serve --device cuda` on the tiny fixture
#   synth   - `lily synth --preset 35b-a3b` into /tmp (kept while the machine stays warm)
#   api35   - the API test suite against `lily serve --device cuda` on the synthetic 35B
#   bench   - `lily bench --device cuda` on the synthetic 35B at $CONTEXTS
# Usage: bash tools/gpu_check.sh [phase ...]   (default: parity api synth bench)
# Needs (built on the development machine, git-ignored, carried with the call):
#   .device/lily                  stripped release binary
#   .device/cuda_parity, .device/golden   stripped test binaries
#     (cargo test -p lily-engine --test cuda_parity --test golden --no-run)
#   .device/wheels/               tests/api/requirements.txt as cp312 wheels
#     (pip download --python-version 3.12 --only-binary=:all: -r tests/api/requirements.txt)
# Logs and bench JSON go to $OUT (or /tmp/lily-gpu-check); a summary table is printed last.
set -uo pipefail

ROOT=$(pwd)
OUT=${OUT:-/tmp/lily-gpu-check}
SYNTH=${SYNTH:-/tmp/synth-35b-a3b}
CONTEXTS=${CONTEXTS:-"256 4096"}
DECODE_STEPS=${DECODE_STEPS:-64}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-240}
export LILY_KERNEL_CACHE=${LILY_KERNEL_CACHE:-/tmp/lily-kernels}
export LILY_TEST_FIXTURES=$ROOT/tests/fixtures
# This is the GPU machine: a GPU test that cannot open the GPU (a kernel that does not compile
# with its NVRTC, say) fails instead of printing SKIPPED.
export LILY_REQUIRE_GPU=${LILY_REQUIRE_GPU:-1}
mkdir -p "$OUT"
SUMMARY=()
T0=$(date +%s)
note() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
record() { SUMMARY+=("$1|$2"); note "$1: $2"; }

run_test_bin() { # label log binary [VAR=value ...]
  local label=$1 log=$2 bin=$3
  shift 3
  note "test binary $label"
  if env "$@" ./.device/$bin --test-threads=1 --nocapture >"$OUT/$log" 2>&1; then
    record "$label" "pass ($(grep -o '[0-9]* passed' "$OUT/$log" | tail -1); $(grep -c SKIPPED "$OUT/$log") skipped)"
  else
    record "$label" "FAIL (see $log)"
    grep -E 'panicked|FAILED|failed' "$OUT/$log" | head -20
  fi
}

phase_parity() {
  for t in cuda_parity golden; do run_test_bin "$t" "$t.log" "$t"; done
  # On Hopper the prefill products run on the warpgroup kernels, each launch on 64- or 16-slot
  # tiles (the tests' small shapes mostly take 16): check each tile shape alone, and the sm_80
  # kernels; likewise the flash attention's sm_80 kernel.
  run_test_bin "cuda_parity (64-slot tiles)" cuda_parity-n64.log cuda_parity LILY_CUDA_TILE_SLOTS=64
  run_test_bin "cuda_parity (16-slot tiles)" cuda_parity-n16.log cuda_parity LILY_CUDA_TILE_SLOTS=16
  # The products' blocks take tiles in turn once there are more tiles than the GPU holds, which
  # the tests' small products rarely reach: capped at five blocks, every block takes many.
  run_test_bin "cuda_parity (5 product blocks)" cuda_parity-b5.log cuda_parity LILY_CUDA_PRODUCT_BLOCKS=5
  run_test_bin "cuda_parity (mma core)" cuda_parity-mma.log cuda_parity LILY_CUDA_WGMMA=0
  run_test_bin "cuda_parity (mma attention)" cuda_parity-fa-mma.log cuda_parity LILY_CUDA_FA=mma
  grep -E 'nmse|greedy tokens identical|GB/s' "$OUT"/cuda_parity.log "$OUT"/golden.log | sed 's|.*/||' >"$OUT/parity-summary.txt"
}

python_deps() {
  [ -d /tmp/pyapi ] && return 0
  python3 -m pip install --quiet --no-index --find-links .device/wheels --target /tmp/pyapi \
    -r tests/api/requirements.txt >"$OUT/pip.log" 2>&1
}

run_api() { # name model-dir extra-env...
  local name=$1 model=$2
  shift 2
  python_deps || { record "$name" "FAIL (pip, see pip.log)"; return; }
  note "API tests ($name, $model)"
  if env PYTHONPATH=/tmp/pyapi LILY_BIN="$ROOT/.device/lily" LILY_TEST_DEVICE=cuda \
      LILY_TEST_MODEL="$model" "$@" python3 -m pytest tests/api -q -rs -p no:cacheprovider \
      --basetemp=/tmp/pytest-$name >"$OUT/$name.log" 2>&1; then
    record "$name" "pass ($(tail -1 "$OUT/$name.log"))"
  else
    record "$name" "FAIL ($(tail -1 "$OUT/$name.log"))"
    grep -E '^(FAILED|ERROR)' "$OUT/$name.log" | head -20
  fi
}

phase_api() { run_api api-tiny "$ROOT/tests/fixtures/tiny-qwen3_5_moe"; }
phase_api35() { run_api api-35b "$SYNTH" LILY_TEST_STARTUP_S=300; }

phase_synth() {
  if [ -f "$SYNTH/config.json" ]; then note "synth: $SYNTH exists"; return; fi
  note "lily synth --preset 35b-a3b"
  local t=$(date +%s)
  ./.device/lily synth --preset 35b-a3b --out "$SYNTH" \
    --tokenizer-from tests/fixtures/tiny-qwen3_5_moe >"$OUT/synth.log" 2>&1 \
    && record synth "$(du -sh "$SYNTH" | cut -f1) in $(($(date +%s) - t)) s" \
    || record synth "FAIL (see synth.log)"
}

phase_bench() {
  for n in $CONTEXTS; do
    note "lily bench --prompt-len $n"
    if timeout "$BENCH_TIMEOUT_S" ./.device/lily bench --model "$SYNTH" --device cuda --prompt-len "$n" \
        --decode-steps "$DECODE_STEPS" --json-out "$OUT/lily-ctx$n.json" >/dev/null 2>"$OUT/bench-ctx$n.log"; then
      record "bench ctx $n" "$(tail -1 "$OUT/bench-ctx$n.log")"
    else
      record "bench ctx $n" "FAIL or timeout (see bench-ctx$n.log)"
    fi
  done
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for p in "${@:-parity api synth bench}"; do
  for q in $p; do "phase_$q"; done
done
echo
echo "| check | result |"
echo "|---|---|"
for s in "${SUMMARY[@]}"; do echo "| ${s%%|*} | ${s#*|} |"; done
