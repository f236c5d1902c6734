#!/usr/bin/env bash
# run71 call 2, prepared in session 67: what call 1 leaves. The phase probes of off and bal (on's
# is in call 1), then w2 (WHOLE at two blocks an SM: the single round without the third block)
# and balo (the general kernels with the rows spread) against off and on at 256, 2 rounds.
# Same carry as call 1 (prepare.sh); run after it on the same machine or a fresh one.
set -uo pipefail
source tools/device_call.sh m2 lily
# The probe folder with the rows spread too, for bal's phases.
P=$PWD/bench/results/run71-prepared
mkdir -p /tmp/probe-bal && cp .device/probe/* /tmp/probe-bal/ && (cd /tmp/probe-bal && patch -s -p1 < $P/balanced-rows.patch) || note "probe-bal: patch failed"
for v in off bal; do before 200 || break
  dir=$PWD/.device/probe e=LILY_CUDA_GATE_UP_WHOLE=0
  [ $v = bal ] && dir=/tmp/probe-bal e=
  env $e LILY_CUDA_TIMELINE_MARKS=8 LILY_CUDA_KERNEL_DIR=$dir LILY_CUDA_TIMELINE=$OUT/logs/probe-$v.bin timeout 170 .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 8 > $OUT/logs/probe-$v.txt 2>&1
  python3 tools/timeline.py $OUT/logs/probe-$v.bin --phases moe_gate_up_stream > $OUT/logs/timeline-$v.md 2>&1; note "timeline $v rc $?"
  rm -f $OUT/logs/probe-$v.bin
  tar czf $R/logs.tar.gz -C $OUT logs
done
if before 120; then
  CONTEXTS="256" ROUNDS=2 DECODE_STEPS=128 OUT=$OUT/ab timeout $(limit 20) bash tools/ab_h200.sh off=.device/lily,LILY_CUDA_GATE_UP_WHOLE=0 w2=.device/lily,LILY_CUDA_KERNEL_DIR=$PWD/.device/w2 balo=.device/lily,LILY_CUDA_GATE_UP_WHOLE=0,LILY_CUDA_KERNEL_DIR=$PWD/.device/bal on=.device/lily > $OUT/logs/ab.txt 2>&1; note ab done
  cp $OUT/ab/ab-table.md $R/ 2>/dev/null
fi
tar czf $R/logs.tar.gz -C $OUT logs $(ls -d $OUT/ab 2>/dev/null | xargs -r -n1 basename)
for v in off bal; do [ -f $OUT/logs/timeline-$v.md ] && sed -n '/^| family/,$p' $OUT/logs/timeline-$v.md; done
cat $OUT/logs/gpu.txt
[ -f $OUT/ab/ab-table.md ] && cat $OUT/ab/ab-table.md
