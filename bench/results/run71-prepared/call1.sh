#!/usr/bin/env bash
# run71 call 1, prepared in session 67 (no machine came; bench/results/run71-prepared/prepare.sh
# builds what it carries): one token's expert gate/up in three blocks an SM (the WHOLE kernels).
# Correctness (cuda_parity, goldens) on the default, then the A/B of one binary: off
# (LILY_CUDA_GATE_UP_WHOLE=0: the general kernels, two blocks an SM, as main), on (WHOLE, three
# blocks), then phase probes of on and off at 256, then w2 (WHOLE at two blocks: kernel folder
# .device/w2) against off at 256 if time is left.
set -uo pipefail
T0=$(date +%s)
BUDGET=${BUDGET:-570}
before() { [ $(( $(date +%s) - T0 )) -lt $(( BUDGET - $1 )) ]; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
(cd .device && xz -d -f -T4 lily.xz cuda_parity.xz golden.xz)
chmod +x .device/lily .device/cuda_parity .device/golden
R=$OUT; OUT=/tmp/m1; mkdir -p $OUT/logs
export LILY_KERNEL_CACHE=/tmp/lily-kernels
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $OUT/logs/gpu.txt
OUT=$OUT/logs timeout 200 bash tools/gpu_check.sh synth > $OUT/logs/synth.txt 2>&1; note synth done
export LILY_TEST_FIXTURES=$PWD/tests/fixtures LILY_REQUIRE_GPU=1
RES=()
t() { # label bin log env...
  local label=$1 bin=$2 log=$3; shift 3
  local s=$(date +%s)
  if timeout $(( $(left) - 30 < 150 ? $(left) - 30 : 150 )) env "$@" $bin --test-threads=1 --nocapture > $OUT/logs/$log 2>&1; then r="pass $(grep -o '[0-9]* passed' $OUT/logs/$log | tail -1)"; else r="FAIL"; grep -E 'panicked|FAILED' $OUT/logs/$log | head -8; fi
  RES+=("$label|$r|$(( $(date +%s) - s )) s"); note "$label: $r"
}
t "cuda_parity (whole)" .device/cuda_parity parity.log
t "golden (whole)" .device/golden golden.log
tar czf $R/logs.tar.gz -C $OUT logs
CONTEXTS="256 32768" ROUNDS=${ROUNDS:-3} DECODE_STEPS=128 OUT=$OUT/ab timeout $(( $(left) - 60 < 300 ? $(left) - 60 : 300 )) bash tools/ab_h200.sh off=.device/lily,LILY_CUDA_GATE_UP_WHOLE=0 on=.device/lily > $OUT/logs/ab.txt 2>&1; note ab done
cp $OUT/ab/ab-table.md $R/ 2>/dev/null
tar czf $R/logs.tar.gz -C $OUT logs ab
# Phase marks inside the gate/up (kernel folder .device/probe, 8 marks a block), both kernels;
# the first compiles every family with the marks (slow), the second reuses the cache. Marks
# (probe-marks.patch, thread 0 of each block): 3 the router's logits landed, 4 routing known
# (the barrier after it), 5 warp 0's first row landed, 6 that row summed, 7 the block done.
for v in on off; do before 75 || break
  e=; [ $v = off ] && e=LILY_CUDA_GATE_UP_WHOLE=0
  env $e LILY_CUDA_TIMELINE_MARKS=8 LILY_CUDA_KERNEL_DIR=$PWD/.device/probe LILY_CUDA_TIMELINE=$OUT/logs/probe-$v.bin timeout $(( $(left) - 20 < 170 ? $(left) - 20 : 170 )) .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 8 > $OUT/logs/probe-$v.txt 2>&1
  python3 tools/timeline.py $OUT/logs/probe-$v.bin --phases moe_gate_up_stream > $OUT/logs/timeline-$v.md 2>&1; note "timeline $v rc $?"
  rm -f $OUT/logs/probe-$v.bin
  tar czf $R/logs.tar.gz -C $OUT logs ab
done
if before 120; then
  CONTEXTS="256" ROUNDS=2 DECODE_STEPS=128 OUT=$OUT/ab2 timeout $(( $(left) - 20 )) bash tools/ab_h200.sh off=.device/lily,LILY_CUDA_GATE_UP_WHOLE=0 w2=.device/lily,LILY_CUDA_KERNEL_DIR=$PWD/.device/w2 on=.device/lily > $OUT/logs/ab2.txt 2>&1; note ab2 done
fi
grep -E 'nmse|greedy tokens identical' $OUT/logs/parity.log $OUT/logs/golden.log | sed 's|.*/||' > $OUT/logs/parity-summary.txt
tar czf $R/logs.tar.gz -C $OUT logs ab $(ls -d $OUT/ab2 2>/dev/null | xargs -r -n1 basename)
grep -E 'E=256 k=8|1536' $OUT/logs/parity.log | tail -6
for v in off on; do [ -f $OUT/logs/timeline-$v.md ] && sed -n '/^| family/,$p' $OUT/logs/timeline-$v.md | head -6; [ -f $OUT/logs/timeline-$v.md ] && sed -n '/^marks of/,$p' $OUT/logs/timeline-$v.md; done
cat $OUT/logs/gpu.txt
echo; cat $OUT/ab/ab-table.md
[ -f $OUT/ab2/ab-table.md ] && tail -8 $OUT/ab2/ab-table.md
echo "| check | result | time |"; for r in "${RES[@]}"; do echo "| ${r//|/ | } |"; done
