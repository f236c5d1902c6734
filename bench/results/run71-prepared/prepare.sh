#!/usr/bin/env bash
# Builds what run71's call 1 carries (session 67 prepared it; no machine came). Run here, from
# the repo root, on a checkout of branch exp/gate-up-three-blocks (9f5e24a), or of main with
# gate-up-whole.patch applied (git apply bench/results/run71-prepared/gate-up-whole.patch):
#   bash bench/results/run71-prepared/prepare.sh
# then call the device with carry [".device"]: bash bench/results/run71-prepared/call1.sh
set -euo pipefail
P=bench/results/run71-prepared
K=crates/engine/src/backend/cuda/kernels
grep -q "moe_gate_up_stream_whole" $K/quant.cu || { echo "not the branch's kernels (apply $P/gate-up-whole.patch)" >&2; exit 2; }
LILY_BENCH_SOURCE_ID=$(git rev-parse --short HEAD)-whole cargo build --release -p lily
cargo test --release -p lily-engine --test cuda_parity --test golden --no-run 2>&1 | tee /tmp/r71-tests.txt
rm -rf .device && mkdir -p .device/w2 .device/probe .device/bal
cp target/release/lily .device/lily
cp "$(grep -o 'target/release/deps/cuda_parity-[0-9a-f]*' /tmp/r71-tests.txt | head -1)" .device/cuda_parity
cp "$(grep -o 'target/release/deps/golden-[0-9a-f]*' /tmp/r71-tests.txt | head -1)" .device/golden
(cd .device && strip lily cuda_parity golden && xz -T2 -6 lily cuda_parity golden)
# w2: the WHOLE kernels at two blocks an SM (95 registers), to part the one round from the third block.
cp $K/quant.cu .device/w2/
sed -i 's/\(MOE_GATE_UP_STREAM(q[48]_moe_gate_up_stream_whole, [48], 8, true,\) 3)/\1 2)/' .device/w2/quant.cu
[ "$(grep -c 'stream_whole, [48], 8, true, 2)' .device/w2/quant.cu)" = 2 ] || { echo "w2: sed missed" >&2; exit 2; }
# probe: marks 3-7 inside the gate/up (8 marks a block).
cp $K/common.cuh $K/quant.cu .device/probe/
(cd .device/probe && patch -s -p1 < ../../$P/probe-marks.patch)
# bal: the gate/up's warps numbered warp-major over the blocks (the last round spread over all).
cp $K/quant.cu .device/bal/
(cd .device/bal && patch -s -p1 < ../../$P/balanced-rows.patch)
ls -la .device .device/w2 .device/probe .device/bal
