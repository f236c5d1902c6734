# What a prepared device call (bench/results/*-prepared/call*.sh) begins with, sourced from the
# repo root on the GPU machine:  source tools/device_call.sh WORK BIN...
# It unpacks .device/BIN.xz for each BIN (unless unpacked), keeps the folder that comes back in
# R (the tool's $OUT) and works in OUT=/tmp/WORK (logs in $OUT/logs), records the GPU and writes
# the synthetic 35B (tools/gpu_check.sh synth). Then:
#   before N    true while more than N s of the call's BUDGET (default 570) are left
#   left        the seconds left
#   limit M [C] a step's timeout: what is left less M s, at most C s, at least 1 (timeout 0
#               would be none)
#   note MSG    MSG after the seconds spent
#   run_test LABEL "BIN [TEST FILTER]" LOG [VAR=VALUE...]
#               a test binary, one thread, into $OUT/logs/LOG; "LABEL|result|time" into RESULTS
#   results     RESULTS as a table
T0=$(date +%s)
BUDGET=${BUDGET:-570}
before() { [ $(( $(date +%s) - T0 )) -lt $(( BUDGET - $1 )) ]; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
limit() {
  local t=$(( $(left) - $1 ))
  [ -n "${2:-}" ] && [ $t -gt $2 ] && t=$2
  [ $t -lt 1 ] && t=1
  echo $t
}
note() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
_work=$1; shift
for _bin in "$@"; do
  [ -f .device/$_bin ] || (cd .device && xz -d -f -T4 $_bin.xz)
  chmod +x .device/$_bin
done
R=$OUT; OUT=/tmp/$_work; mkdir -p $OUT/logs
export LILY_KERNEL_CACHE=/tmp/lily-kernels
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > $OUT/logs/gpu.txt
OUT=$OUT/logs timeout 200 bash tools/gpu_check.sh synth > $OUT/logs/synth.txt 2>&1; note synth done
RESULTS=()
run_test() {
  local label=$1 bin=$2 log=$3 r; shift 3
  local s=$(date +%s)
  if timeout $(limit 30 150) env LILY_TEST_FIXTURES=$PWD/tests/fixtures LILY_REQUIRE_GPU=1 "$@" $bin --test-threads=1 --nocapture > $OUT/logs/$log 2>&1; then
    r="pass $(grep -o '[0-9]* passed' $OUT/logs/$log | tail -1)"
  else
    r="FAIL"; grep -E 'panicked|FAILED' $OUT/logs/$log | head -8
  fi
  RESULTS+=("$label|$r|$(( $(date +%s) - s )) s"); note "$label: $r"
}
results() { echo "| check | result | time |"; for r in "${RESULTS[@]}"; do echo "| ${r//|/ | } |"; done; }
