#!/usr/bin/env bash
# run70 call 1: where moe_block_one_token's 24.5 us go (run69 call 3: 9.7 + 5.4 us as two launches).
# Ran (session 66, an H100; logs.tar.gz beside it). Build from exp/moe-one-launch with marks.patch
# (marks 3-7 in the kernel, timeline MARKS = 8; branch exp/moe-one-launch-phases):
#   LILY_BENCH_SOURCE_ID=phases-probe cargo build --release -p lily; strip, xz into .device/lily.xz.
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-360}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
(cd .device && xz -d -f -T4 lily.xz) && chmod +x .device/lily
R=$OUT; OUT=/tmp/m1; mkdir -p $OUT/logs
export LILY_KERNEL_CACHE=/tmp/lily-kernels
OUT=$OUT/logs timeout 200 bash tools/gpu_check.sh synth > $OUT/logs/synth.txt 2>&1; note synth done
for v in one two; do
  [ $(left) -gt 100 ] || break
  e=(); [ $v = two ] && e=(LILY_CUDA_MOE_ONE_LAUNCH=0)
  env "${e[@]}" LILY_CUDA_TIMELINE=/tmp/tl-$v.bin timeout 120 .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 8 > $OUT/logs/timeline-$v.txt 2>&1
  python3 tools/timeline.py /tmp/tl-$v.bin > $OUT/logs/timeline-$v.md 2>&1
  [ $v = one ] && python3 bench/results/h100/run70-one-launch-phases/phases.py /tmp/tl-one.bin > $OUT/logs/phases-one.md 2>&1
  note "timeline $v done"; tar czf $R/logs.tar.gz -C $OUT logs
  [ $v = one ] && tail -12 $OUT/logs/phases-one.md
done
for v in one two; do
  [ $(left) -gt 40 ] || break
  e=(); [ $v = two ] && e=(LILY_CUDA_MOE_ONE_LAUNCH=0)
  env "${e[@]}" timeout 60 .device/lily bench --model /tmp/synth-35b-a3b --device cuda --prompt-len 256 --decode-steps 128 > $OUT/logs/bench-$v.txt 2>&1; note "bench $v: $(grep -o 'decode [0-9.]* tok/s' $OUT/logs/bench-$v.txt)"
done
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/logs/gpu.txt
tar czf $R/logs.tar.gz -C $OUT logs
tail -12 $OUT/logs/phases-one.md
grep -E 'moe_' $OUT/logs/timeline-two.md | tail -4
