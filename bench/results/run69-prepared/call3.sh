#!/usr/bin/env bash
# run69 call 3, prepared in session 65 and run in session 66 on an H100 (raw results:
# bench/results/h100/run69-call3-one-launch-ab-and-timeline.tar.gz; docs/performance.md, "One token's MoE
# block in one launch"). Calls 1 and 2 had found two bugs, since fixed. Before the call,
# build here from branch exp/moe-one-launch (665d887), or from 423ec76 with moe-one-launch.patch:
#   LILY_BENCH_SOURCE_ID=665d887 cargo build --release -p lily
#   cargo test --release -p lily-engine --test cuda_parity --test golden --no-run
#   strip each and xz it into .device/{lily,cuda_parity,golden}.xz; carry .device.
# Run from the repo root on the GPU machine: bash bench/results/run69-prepared/call3.sh
# One token's MoE block in one launch (moe_block_one_token).
# Correctness first (goldens, cuda_parity with the one launch), then the A/B of the same binary
# with LILY_CUDA_MOE_ONE_LAUNCH=0 (the gate/up and down-mix launches) against the default, then
# a timeline of the one-launch step, then parity of the two-launch path.
set -uo pipefail
T0=$(date +%s)
BUDGET=${BUDGET:-560}
before() { [ $(( $(date +%s) - T0 )) -lt $(( BUDGET - $1 )) ]; }  # more than $1 s left
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
(cd .device && xz -d -f -T4 lily.xz cuda_parity.xz golden.xz)
chmod +x .device/lily .device/cuda_parity .device/golden
R=$OUT; OUT=/tmp/m1; mkdir -p $OUT/logs
export LILY_KERNEL_CACHE=/tmp/lily-kernels
OUT=$OUT/logs timeout 200 bash tools/gpu_check.sh synth > $OUT/logs/synth.txt 2>&1; note synth done
export LILY_TEST_FIXTURES=$PWD/tests/fixtures LILY_REQUIRE_GPU=1
RES=()
t() { # label bin log env...
  local label=$1 bin=$2 log=$3; shift 3
  local s=$(date +%s)
  if timeout $(( $(left) - 30 < 150 ? $(left) - 30 : 150 )) env "$@" $bin --test-threads=1 --nocapture > $OUT/logs/$log 2>&1; then r="pass $(grep -o '[0-9]* passed' $OUT/logs/$log | tail -1)"; else r="FAIL"; grep -E 'panicked|FAILED' $OUT/logs/$log | head -8; fi
  RES+=("$label|$r|$(( $(date +%s) - s )) s"); note "$label: $r"
}
# The MoE block's own parity test first (it hung in call 2): stop here if it fails, so that a
# hang costs 90 s and not the call.
if ! timeout 90 .device/cuda_parity moe_block_with_the_shared_expert_matches --test-threads=1 --nocapture > $OUT/logs/moe-first.log 2>&1; then
  note "moe_block_with_the_shared_expert_matches failed or hung: stopping"; tail -20 $OUT/logs/moe-first.log
  tar czf $R/logs.tar.gz -C $OUT logs; exit 0
fi
note "moe_block_with_the_shared_expert_matches passed"
t "cuda_parity (one launch)" .device/cuda_parity parity.log
t "golden (one launch)" .device/golden golden.log
CONTEXTS="256 32768" ROUNDS=${ROUNDS:-3} DECODE_STEPS=${STEPS:-128} OUT=$OUT/ab timeout $(( $(left) - 60 < 300 ? $(left) - 60 : 300 )) bash tools/ab_h200.sh two=.device/lily,LILY_CUDA_MOE_ONE_LAUNCH=0 one=.device/lily > $OUT/logs/ab.txt 2>&1; note ab done
cp $OUT/ab/ab-table.md $R/ 2>/dev/null
if before 110; then
  LILY_CUDA_TIMELINE=$OUT/logs/timeline-one.bin timeout 90 .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 8 > $OUT/logs/timeline-one.txt 2>&1
  python3 tools/timeline.py $OUT/logs/timeline-one.bin > $OUT/logs/timeline-one.md 2>&1; note "timeline rc $?"
fi
if before 80; then t "cuda_parity (two launches)" .device/cuda_parity parity-two.log LILY_CUDA_MOE_ONE_LAUNCH=0; fi
# The five contexts with the one launch (the default), one run each, if time is left.
if before 200; then
  CONTEXTS="256 4096 16384 32768 131072" OUT=$OUT/contexts timeout $(( $(left) - 40 )) bash tools/gpu_check.sh bench > $OUT/logs/contexts.txt 2>&1; note "contexts rc $?"
fi
grep -E 'nmse|greedy tokens identical' $OUT/logs/parity.log $OUT/logs/golden.log | sed 's|.*/||' > $OUT/logs/parity-summary.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/logs/gpu.txt
tar czf $R/logs.tar.gz -C $OUT logs ab $(ls -d $OUT/contexts 2>/dev/null | xargs -r -n1 basename)
grep -E 'moe_block|E=256 k=8' $OUT/logs/parity.log | tail -8
[ -f $OUT/logs/timeline-one.md ] && grep -E 'moe_block_one_token|gemv_qx.batch|gemv_batch' $OUT/logs/timeline-one.md | head -8
cat $OUT/logs/gpu.txt
echo; cat $OUT/ab/ab-table.md
[ -f $OUT/logs/contexts.txt ] && tail -12 $OUT/logs/contexts.txt
echo "| check | result | time |"; for r in "${RES[@]}"; do echo "| ${r//|/ | } |"; done
