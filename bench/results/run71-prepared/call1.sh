#!/usr/bin/env bash
# run71 call 1, prepared in session 67 (no machine came; bench/results/run71-prepared/prepare.sh
# builds what it carries): one token's expert gate/up in three blocks an SM (the WHOLE kernels),
# and its rows spread over the blocks (kernel folder .device/bal, balanced-rows.patch).
# Correctness first: cuda_parity and the goldens on the default (WHOLE), the MoE parity tests
# with bal, both kernels. Then the A/B of one binary: off (LILY_CUDA_GATE_UP_WHOLE=0: the
# general kernels, two blocks an SM, as main), on (WHOLE, three blocks), bal (WHOLE, rows
# spread), at 256 and 32,768, 3 rounds. Then, if time is left, the phase probe of on.
# Run from the repo root on the GPU machine, carry [".device"]: bash bench/results/run71-prepared/call1.sh
set -uo pipefail
source tools/device_call.sh m1 lily cuda_parity golden
run_test "cuda_parity (whole)" .device/cuda_parity parity.log
run_test "golden (whole)" .device/golden golden.log
BAL=LILY_CUDA_KERNEL_DIR=$PWD/.device/bal
for f in rout experts moe_block lazily; do
  run_test "cuda_parity $f (bal)" ".device/cuda_parity $f" parity-bal-$f.log $BAL
  run_test "cuda_parity $f (bal, general)" ".device/cuda_parity $f" parity-balo-$f.log $BAL LILY_CUDA_GATE_UP_WHOLE=0
done
tar czf $R/logs.tar.gz -C $OUT logs
CONTEXTS="256 32768" ROUNDS=${ROUNDS:-3} DECODE_STEPS=128 OUT=$OUT/ab timeout $(limit 30 330) bash tools/ab_h200.sh off=.device/lily,LILY_CUDA_GATE_UP_WHOLE=0 on=.device/lily bal=.device/lily,$BAL > $OUT/logs/ab.txt 2>&1; note ab done
cp $OUT/ab/ab-table.md $R/ 2>/dev/null
tar czf $R/logs.tar.gz -C $OUT logs ab
# The phase probe of on (call2.sh has the rest); marks in probe-marks.patch.
if before 110; then
  LILY_CUDA_TIMELINE_MARKS=8 LILY_CUDA_KERNEL_DIR=$PWD/.device/probe LILY_CUDA_TIMELINE=$OUT/logs/probe-on.bin timeout $(limit 15) .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 8 > $OUT/logs/probe-on.txt 2>&1
  python3 tools/timeline.py $OUT/logs/probe-on.bin --phases moe_gate_up_stream > $OUT/logs/timeline-on.md 2>&1; note "timeline on rc $?"
  rm -f $OUT/logs/probe-on.bin
fi
grep -hE 'nmse|greedy tokens identical' $OUT/logs/parity*.log $OUT/logs/golden.log > $OUT/logs/parity-summary.txt
tar czf $R/logs.tar.gz -C $OUT logs ab
grep -E 'E=256 k=8|1536' $OUT/logs/parity.log | tail -6
[ -f $OUT/logs/timeline-on.md ] && sed -n '/^| family/,$p' $OUT/logs/timeline-on.md
cat $OUT/logs/gpu.txt
echo; cat $OUT/ab/ab-table.md
results
