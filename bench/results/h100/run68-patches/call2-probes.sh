#!/usr/bin/env bash
# run68 call 2, prepared and not run (session 64). Build the kernel folders here before the call:
#   git checkout exp/router-sums (or apply router-sums.patch to 211bade), then for d in noatom rep4:
#   mkdir -p .device/rs/$d && cp crates/engine/src/backend/cuda/kernels/quant.cu .device/rs/$d/ &&
#   (cd .device/rs/$d && patch quant.cu < ../../../bench/results/h100/run68-patches/router-sums-$d.patch)
# .device/rs/k2 is the branch's quant.cu (3b99f04). Carry .device with the branch's build (.device/lily.xz).
# Session 64, call 2: where the router summed by the output projection loses (256 only).
# off: the router's own launch; on2: summed (.device/rs/k2); noatom: summed but never added
# (a bound: routing on zeros, digests differ); rep4: four replicas of the sums, a block's by its index.
set -uo pipefail
T0=$(date +%s)
BUDGET=${BUDGET:-300}
before() { [ $(( $(date +%s) - T0 )) -lt $(( BUDGET - $1 )) ]; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
[ -f .device/lily ] || (cd .device && xz -d -f -T4 lily.xz)
chmod +x .device/lily
R=$OUT; OUT=/tmp/rs2; mkdir -p $OUT/logs
export LILY_KERNEL_CACHE=/tmp/lily-kernels
OUT=$OUT/logs timeout 150 bash tools/gpu_check.sh synth > $OUT/logs/synth.txt 2>&1; note synth done
D=$PWD/.device/rs
CONTEXTS="256" ROUNDS=2 DECODE_STEPS=64 OUT=$OUT/ab timeout $(( $(left) - 30 < 220 ? $(left) - 30 : 220 )) bash tools/ab_h200.sh off=.device/lily,LILY_CUDA_ROUTER_SUMS=0 on2=.device/lily,LILY_CUDA_KERNEL_DIR=$D/k2 noatom=.device/lily,LILY_CUDA_KERNEL_DIR=$D/noatom rep4=.device/lily,LILY_CUDA_KERNEL_DIR=$D/rep4 > $OUT/logs/ab.txt 2>&1; note ab done
for v in off on2; do before 60 || break
  e=1; k=$D/k2; [ $v = off ] && e=0
  LILY_CUDA_KERNEL_DIR=$k LILY_CUDA_ROUTER_SUMS=$e LILY_CUDA_TIMELINE=$OUT/logs/timeline-$v.bin timeout $(( $(left) - 15 )) .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 8 > $OUT/logs/timeline-$v.txt 2>&1
  python3 tools/timeline.py $OUT/logs/timeline-$v.bin > $OUT/logs/timeline-$v.md 2>&1; note "timeline $v rc $?"
done
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/logs/gpu.txt
tar czf $R/logs2.tar.gz -C $OUT logs ab; cp $OUT/ab/ab-table.md $R/ 2>/dev/null
cat $OUT/logs/gpu.txt; cat $OUT/ab/ab-table.md | tail -6
for v in off on2; do sed -n '/^| family/,$p' $OUT/logs/timeline-$v.md 2>/dev/null | head -9; done
