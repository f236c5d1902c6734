#!/usr/bin/env bash
# lily against llama.cpp (and optionally mlx-lm) on one H200, on random weights of the exact
# Qwen3.6-35B-A3B shape: lily reads the MLX 4-bit checkpoint of `lily synth`, llama.cpp a GGUF in
# its Q4_K_M mix from tools/peers/make_synth_gguf.py.  Run ON the GPU machine, from the repo root:
#
#   MODE=all bash tools/bench_h200.sh
#
# A device call may run 10 minutes and the whole comparison takes longer (the llama.cpp build
# alone ~5 min), so the work is split into phases that skip what is already done.  The state
# lives in /tmp (/tmp/lily-h200: GGUF, llama.cpp build, results; /tmp/synth-35b-a3b: lily's
# checkpoint), which survives between back-to-back calls while the machine stays warm: call
# again until the table is full.
#
# MODE
#   build-llama  build llama-bench (CUDA, sm_90) from .device/peers/llama.cpp-src.tar.gz
#                (tools/peers/fetch_llamacpp.sh makes it) while the GGUF and lily's checkpoint are
#                written in the background; pack the binaries, gguf-py and the vocab into
#                $OUT/llama-bench-cuda-bin.tar.xz (in 15 MiB pieces .0 .1 ... if larger, since a
#                file over 16 MiB does not come back): join them into .device/peers/ to skip
#                the build on a fresh machine
#   lily         lily synth (skipped if present), then one `lily bench` process per context
#   llama        GGUF (skipped if present), then llama-bench: prefill = pp<N> on an empty context,
#                decode = tg<DECODE_STEPS> at depth N (the same work as lily's context N)
#   mlx          mlx-lm on CUDA (tools/peers/bench_mlx_cuda.py) from wheels in MLX_WHEELS
#   stage-mlx    only copy MLX_WHEELS/* to /tmp: the mlx-cuda wheel (90 MB) is more than a call
#                carries beside the repository, so it travels split (`split -b 20M`) over
#                several calls; parts NAME.whl.part-* are joined once the zip is complete
#   all          build-llama if no llama-bench yet, then lily, llama, and mlx if its wheels are
#                staged, as far as the deadline allows
#   table        only the table, from RESULTS_DIR (also here: RESULTS_DIR=<unpacked results.tar.gz>)
# Every mode ends with the table; $OUT gets table.md, h200-compare.json and results.tar.gz (raw
# JSON + logs), since at most 8 files come back from a call.
#
# Knobs (environment; defaults in brackets)
#   CONTEXTS ["256 4096 16384 32768 131072"]  DECODE_STEPS [64]  DEVICE [cuda]  DEADLINE_S [560]
#   LILY_BIN [.device/lily, else the copy from an earlier call]  LILY_TIMEOUT_S [300, per context]
#   LILY_MODEL [/tmp/synth-35b-a3b, shared with tools/gpu_check.sh]
#   LLAMA_SRC [.device/peers/llama.cpp-src.tar.gz]  LLAMA_BIN [.device/peers/llama-bench-cuda-bin.tar.xz]
#   LLAMA_ARGS ["-ub 2048 -b 4096"]  LLAMA_REPS [3]  QTYPE [q4_k_m]  JOBS [nproc]
#   MLX_WHEELS [.device/peers/mlx-whl]  MLX_CONTEXTS ["256 4096 16384"]
#   FORCE=1 rerun what has results   RETRY_FAILED=1 rerun lily contexts that failed
#   WORK_DIR [/tmp/lily-h200]  RESULTS_DIR [$WORK_DIR/results]
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1

MODE=${MODE:-all}
CONTEXTS=${CONTEXTS:-256 4096 16384 32768 131072}
read -r -a CTX <<< "${CONTEXTS//,/ }"
MLX_CONTEXTS=${MLX_CONTEXTS:-256 4096 16384}   # mlx-lm's prefill is ~220 tok/s at 16k: 131k would not fit
read -r -a MLX_CTX <<< "${MLX_CONTEXTS//,/ }"
DECODE_STEPS=${DECODE_STEPS:-64}
DEVICE=${DEVICE:-cuda}
DEADLINE_S=${DEADLINE_S:-560}   # of a call's 600 s: the rest packs results and prints the table
LILY_BIN=${LILY_BIN:-.device/lily}
LILY_TIMEOUT_S=${LILY_TIMEOUT_S:-300}
LLAMA_SRC=${LLAMA_SRC:-.device/peers/llama.cpp-src.tar.gz}
LLAMA_BIN=${LLAMA_BIN:-.device/peers/llama-bench-cuda-bin.tar.xz}
# A 2048-token ubatch (4096 batch) is what the reference notes used for large prompts: pp4096
# went from 5,457 to 8,660 tok/s with it; small prompts are not hurt, so one setting serves all.
LLAMA_ARGS=${LLAMA_ARGS--ub 2048 -b 4096}
LLAMA_REPS=${LLAMA_REPS:-3}
QTYPE=${QTYPE:-q4_k_m}
JOBS=${JOBS:-$(nproc)}
MLX_WHEELS=${MLX_WHEELS:-.device/peers/mlx-whl}
FORCE=${FORCE:-0}
RETRY_FAILED=${RETRY_FAILED:-0}

W=${WORK_DIR:-/tmp/lily-h200}
RES=${RESULTS_DIR:-$W/results}
SRC=$W/llama.cpp
BLD=$W/build
GGUF=$W/qwen36-35b-a3b-synth-$QTYPE.gguf
# The checkpoint and kernel cache are where tools/gpu_check.sh puts them, so that the two scripts
# share one 19.5 GB copy (the disk holds ~64 GB: two copies and the GGUF would nearly fill it).
LILY_MODEL=${LILY_MODEL:-/tmp/synth-35b-a3b}
export LILY_KERNEL_CACHE=${LILY_KERNEL_CACHE:-/tmp/lily-kernels}
LILY=$W/lily
SYNTH_TMP=$(dirname "$LILY_MODEL")/.$(basename "$LILY_MODEL").synth-tmp   # + -PID: lily synth's staging dir
OUT=${OUT:-$W/out}
mkdir -p "$W" "$RES" "$OUT" || exit 1
LOG=$RES/bench_h200.log   # appended by every call
[ "$MODE" = table ] && LOG=/dev/null

T0=$(date +%s)
el()   { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE_S - $(el) )); }
log()  { printf '[%4ss] %s\n' "$(el)" "$*" | tee -a "$LOG"; }

for d in /usr/local/cuda/bin /usr/local/cuda-13*/bin; do
  [ -x "$d/nvcc" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH="$d:$PATH" ;; esac
done
export PATH

# ------------------------------------------------------------------ background jobs
# The models are written in the background while llama.cpp builds (nice'd: the build comes
# first).  Each job is one exec'd process, so its pid is enough to stop it.
declare -A BG_PID BG_T0
bg_start() {   # NAME CMD...
  local name=$1; shift
  ( renice -n 10 -p "$BASHPID" >/dev/null 2>&1; exec "$@" ) > "$RES/$name.log" 2>&1 &
  BG_PID[$name]=$!; BG_T0[$name]=$(date +%s)
  log "$name: started in the background (pid ${BG_PID[$name]}, log $name.log)"
}
bg_wait() {    # NAME: wait while the deadline allows; returns the job's exit status
  local name=$1 pid=${BG_PID[$1]:-} rc
  [ -n "$pid" ] || return 0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(left)" -lt 20 ]; then log "$name: not done before the deadline ($(tail -c 200 "$RES/$name.log" | tail -1))"; return 124; fi
    sleep 2
  done
  wait "$pid"; rc=$?
  unset "BG_PID[$name]"
  log "$name: exit $rc after $(( $(date +%s) - BG_T0[$name] ))s: $(tail -1 "$RES/$name.log")"
  return "$rc"
}
bg_stop_all() {  # at the end of a call: keep what finished, stop the rest, drop partial outputs
  local name
  for name in "${!BG_PID[@]}"; do
    if kill -0 "${BG_PID[$name]}" 2>/dev/null; then
      kill "${BG_PID[$name]}" 2>/dev/null; wait "${BG_PID[$name]}" 2>/dev/null
      log "$name: stopped unfinished (the next call starts it again)"
    elif bg_wait "$name" && [ "$name" = gguf ]; then
      publish_gguf
    fi
  done
  rm -f "$GGUF.part"; rm -rf "$SYNTH_TMP"-*
}

# ------------------------------------------------------------------ inputs
ensure_lily_bin() {
  # The carried binary replaces the copy from an earlier call (later calls need not carry it);
  # results of a different binary are moved aside, so the table never mixes two builds.
  local old
  if [ -f "$LILY_BIN" ] && ! cmp -s "$LILY_BIN" "$LILY"; then
    if [ -x "$LILY" ] && compgen -G "$RES/lily-ctx*" >/dev/null; then
      old=$RES/old-lily-$(date +%s); mkdir -p "$old" && mv "$RES"/lily-ctx* "$old"/
      log "a different lily binary: the earlier lily results moved to $old"
    fi
    cp -f "$LILY_BIN" "$LILY.new" && chmod +x "$LILY.new" && mv -f "$LILY.new" "$LILY"
  fi
  [ -x "$LILY" ] || { log "ERROR: no lily binary: carry a stripped release build as $LILY_BIN"; return 1; }
}

ensure_src() {   # llama.cpp tree under $SRC (gguf-py and the vocab also come with the binary pack)
  local sum
  if [ -f "$LLAMA_SRC" ]; then
    sum=$(sha256sum < "$LLAMA_SRC" | cut -c1-16)
    if [ "$(cat "$SRC/.lily-src-sum" 2>/dev/null)" != "$sum" ]; then
      rm -rf "$SRC" && tar -xzf "$LLAMA_SRC" -C "$W" && echo "$sum" > "$SRC/.lily-src-sum" || return 1
      log "llama.cpp source unpacked from $LLAMA_SRC ($(cat "$SRC/SOURCE-lily.txt" 2>/dev/null))"
    fi
  fi
  [ -f "$SRC/gguf-py/gguf/gguf_writer.py" ]
}

start_gguf() {   # in the background, unless present
  [ -s "$GGUF" ] && return 0
  [ -n "${BG_PID[gguf]:-}" ] && return 0
  ensure_src || { log "ERROR: no llama.cpp tree for the GGUF generator (carry $LLAMA_SRC or $LLAMA_BIN)"; return 1; }
  local need avail
  need=$(python3 tools/peers/make_synth_gguf.py --llama-dir "$SRC" --qtype "$QTYPE" --out "$GGUF" --dry-run \
         | sed -n 's/.*(\([0-9.]*\) GB).*/\1/p' | head -1)
  avail=$(df -BG --output=avail "$W" | tail -1 | tr -dc '0-9')
  log "GGUF: needs ${need:-?} GB, $W has ${avail} GB free"
  if [ -n "$need" ] && [ "${avail:-0}" -le "${need%.*}" ]; then log "ERROR: not enough disk for the GGUF"; return 1; fi
  rm -f "$GGUF.part"
  bg_start gguf python3 tools/peers/make_synth_gguf.py --llama-dir "$SRC" --qtype "$QTYPE" --out "$GGUF.part"
}
publish_gguf() { [ -s "$GGUF.part" ] && mv -f "$GGUF.part" "$GGUF" && log "GGUF: $GGUF ($(du -h "$GGUF" | cut -f1))"; }
ensure_gguf() {   # start (unless started) and wait
  [ -s "$GGUF" ] && return 0
  start_gguf || return 1
  bg_wait gguf || return 1
  publish_gguf
}

start_synth() {  # lily's checkpoint, in the background, unless present (lily synth publishes atomically)
  [ -f "$LILY_MODEL/config.json" ] && return 0
  [ -n "${BG_PID[synth]:-}" ] && return 0
  ensure_lily_bin || return 1
  rm -rf "$SYNTH_TMP"-*
  # the tiny fixture's tokenizer, as tools/gpu_check.sh does (its API tests need one; bench does not)
  local tok=()
  [ -f tests/fixtures/tiny-qwen3_5_moe/tokenizer.json ] && tok=(--tokenizer-from tests/fixtures/tiny-qwen3_5_moe)
  bg_start synth "$LILY" synth --preset 35b-a3b --out "$LILY_MODEL" "${tok[@]}"
}
ensure_synth() {
  [ -f "$LILY_MODEL/config.json" ] && return 0
  start_synth || return 1
  bg_wait synth || return 1
  [ -f "$LILY_MODEL/config.json" ] && log "lily checkpoint: $LILY_MODEL ($(du -sh "$LILY_MODEL" | cut -f1))"
}

# ------------------------------------------------------------------ llama.cpp build
have_bench() { [ -x "$BLD/bin/llama-bench" ]; }

build_llama() {   # RESERVE_S: seconds to keep for what follows in this call
  local reserve=${1:-20} s budget rc t
  have_bench && return 0
  if [ -f "$LLAMA_BIN" ]; then
    tar -xJf "$LLAMA_BIN" -C "$W" && have_bench && { log "llama-bench: unpacked from $LLAMA_BIN"; return 0; }
    log "WARNING: $LLAMA_BIN did not give a llama-bench; building"
  fi
  ensure_src || { log "ERROR: no llama.cpp source: run tools/peers/fetch_llamacpp.sh here and carry $LLAMA_SRC"; return 1; }
  for t in nvcc cmake ninja; do command -v "$t" >/dev/null || { log "ERROR: $t not found"; return 1; }; done
  s=$(date +%s)
  if [ ! -f "$BLD/build.ninja" ]; then
    # Only what llama-bench needs; f16 K/V is all the FA kernels needed (fewer template instances).
    cmake -S "$SRC" -B "$BLD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF > "$RES/llama-cmake.log" 2>&1 \
      || { tail -20 "$RES/llama-cmake.log"; log "ERROR: cmake failed (llama-cmake.log)"; rm -rf "$BLD"; return 1; }
  fi
  budget=$(( $(left) - reserve ))
  [ "$budget" -ge 30 ] || { log "llama-bench: no time left to build (${budget}s)"; return 1; }
  log "llama-bench: building with -j$JOBS (time limit ${budget}s; an unfinished build resumes next call)"
  timeout "$budget" ninja -C "$BLD" -j "$JOBS" llama-bench >> "$RES/llama-build.log" 2>&1
  rc=$?
  if [ $rc -eq 124 ]; then
    log "llama-bench: build stopped at its time limit at $(grep -o '^\[[0-9]*/[0-9]*\]' "$RES/llama-build.log" | tail -1); call again"
    return 1
  elif [ $rc -ne 0 ]; then
    grep -m10 -E 'error' "$RES/llama-build.log"; log "ERROR: build failed (llama-build.log)"
    return 1
  fi
  log "llama-bench: built in $(( $(date +%s) - s ))s"
}

pack_llama() {   # binaries + gguf-py + vocab: enough for MODE=llama on a fresh machine
  local f=$OUT/llama-bench-cuda-bin.tar.xz size
  have_bench || return 1
  ( cd "$W" && tar -cf - build/bin/llama-bench build/bin/*.so* llama.cpp/gguf-py \
        llama.cpp/models/ggml-vocab-qwen35.gguf llama.cpp/SOURCE-lily.txt | xz -T0 -6 > "$f" ) \
    || { log "ERROR: packing llama-bench failed"; rm -f "$f"; return 1; }
  size=$(stat -c %s "$f")
  if [ "$size" -gt $(( 15 << 20 )) ]; then
    split -b 15M -d -a 1 "$f" "$f." && rm -f "$f"
    log "llama-bench pack: $(( size >> 20 )) MiB in pieces $(cd "$OUT" && echo llama-bench-cuda-bin.tar.xz.*)" \
        "(here: cat them > $LLAMA_BIN)"
  else
    log "llama-bench pack: $(( size >> 20 )) MiB -> \$OUT/llama-bench-cuda-bin.tar.xz (here: copy to $LLAMA_BIN)"
  fi
}

# ------------------------------------------------------------------ lily
lily_summary() {   # one line from a report
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["results"]; print("prefill %.1f tok/s, decode %.2f tok/s, digest %s" % (r["prefill"]["tok_s"], r["decode"]["tok_s"], r["decode"]["token_digest"]))' "$1"
}

run_lily() {   # N
  local n=$1 j=$RES/lily-ctx$1.json f=$RES/lily-ctx$1.fail budget cut=0 s rc secs why
  if [ -s "$j" ] && [ "$FORCE" != 1 ]; then log "lily ctx $n: done before: $(lily_summary "$j")"; return 0; fi
  if [ -f "$f" ] && [ "$RETRY_FAILED" != 1 ] && [ "$FORCE" != 1 ]; then
    log "lily ctx $n: failed before ($(cat "$f")); RETRY_FAILED=1 runs it again"; return 0
  fi
  budget=$LILY_TIMEOUT_S
  if [ $(( $(left) - 10 )) -lt "$budget" ]; then budget=$(( $(left) - 10 )); cut=1; fi
  if [ $cut = 1 ] && [ "$budget" -lt 30 ]; then log "lily ctx $n: not run, ${budget}s left (call again)"; return 1; fi
  rm -f "$f" "$j.part"
  s=$(date +%s)
  # stdout repeats the JSON report: the file is enough; stderr (timings line, errors) is the log
  timeout -k 10 "$budget" "$LILY" bench --model "$LILY_MODEL" --device "$DEVICE" --prompt-len "$n" \
      --decode-steps "$DECODE_STEPS" --json-out "$j.part" > /dev/null 2> "$RES/lily-ctx$n.log"
  rc=$?; secs=$(( $(date +%s) - s ))
  if [ $rc -eq 0 ] && [ -s "$j.part" ]; then
    mv -f "$j.part" "$j"; log "lily ctx $n: $(lily_summary "$j") (${secs}s with load)"
    return 0
  fi
  rm -f "$j.part"
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ $cut = 1 ]; then
    log "lily ctx $n: stopped by the call's deadline after ${secs}s (call again)"; return 1
  fi
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then why="timeout after ${budget} s (LILY_TIMEOUT_S)"
  else why="exit $rc: $(grep -v '^\s*$' "$RES/lily-ctx$n.log" | tail -1 | cut -c1-300)"; fi
  echo "$why" > "$f"
  log "lily ctx $n: FAILED, $why"
}

lily_phase() {
  local n
  ensure_lily_bin || return 1
  ensure_synth || { log "ERROR: no lily checkpoint (synth.log)"; return 1; }
  for n in "${CTX[@]}"; do run_lily "$n" || return 1; done
}

# ------------------------------------------------------------------ llama.cpp
llama_done() {   # pp|tg: the contexts that have a result
  python3 -c 'import sys; sys.path.insert(0, "tools/peers"); import table
pp, tg, _ = table.load_llama(sys.argv[1]); print(*sorted(pp if sys.argv[2] == "pp" else tg))' "$RES" "$1"
}

run_llama_bench() {   # pp|tg ARGS...  (appends JSON lines; a line is flushed per finished test)
  local kind=$1 budget rc s; shift
  budget=$(( $(left) - 10 ))
  [ "$budget" -ge 60 ] || { log "llama $kind: not run, ${budget}s left (call again)"; return 1; }
  # shellcheck disable=SC2206  # LLAMA_ARGS is a word list on purpose
  local args=(-m "$GGUF" -ngl 99 -fa 1 -r "$LLAMA_REPS" --repack 0 --progress -o jsonl "$@" $LLAMA_ARGS)
  log "llama $kind: llama-bench ${args[*]}"
  s=$(date +%s)
  LD_LIBRARY_PATH="$BLD/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    timeout -k 10 "$budget" "$BLD/bin/llama-bench" "${args[@]}" >> "$RES/llama-$kind.jsonl" 2>> "$RES/llama-$kind.log"
  rc=$?
  if [ $rc -ne 0 ]; then
    grep -v '^llama-bench: benchmark' "$RES/llama-$kind.log" | tail -5
    log "llama $kind: exit $rc after $(( $(date +%s) - s ))s (finished tests are kept; call again for the rest)"
    return 1
  fi
  log "llama $kind: done in $(( $(date +%s) - s ))s"
}

commas() { local IFS=,; echo "$*"; }

llama_phase() {   # one llama-bench process for all prefills, one for all decodes (one model load each)
  local n done_pp done_tg pp=() tg=()
  build_llama 60 || return 1
  ensure_gguf || { log "ERROR: no GGUF (gguf.log)"; return 1; }
  done_pp=" $(llama_done pp) "; done_tg=" $(llama_done tg) "
  for n in "${CTX[@]}"; do
    if [ "$FORCE" = 1 ] || [[ $done_pp != *" $n "* ]]; then pp+=("$n"); fi
    if [ "$FORCE" = 1 ] || [[ $done_tg != *" $n "* ]]; then tg+=("$n"); fi
  done
  if [ ${#pp[@]} -eq 0 ]; then log "llama pp: all contexts done before"
  else run_llama_bench pp -p "$(commas "${pp[@]}")" -n 0 || return 1; fi
  if [ ${#tg[@]} -eq 0 ]; then log "llama tg: all contexts done before"
  else run_llama_bench tg -p 0 -n "$DECODE_STEPS" -d "$(commas "${tg[@]}")"; fi
}

# ------------------------------------------------------------------ mlx-lm (optional)
stage_mlx() {   # copy carried wheels (or parts) to /tmp and join the parts whose zip is complete
  local p base parts seen=" "
  if [ -d "$MLX_WHEELS" ]; then
    mkdir -p "$W/mlx-whl" && cp -f "$MLX_WHEELS"/* "$W/mlx-whl/" 2>/dev/null \
      && log "mlx: staged $(cd "$MLX_WHEELS" && echo ./*)"
  fi
  for p in "$W"/mlx-whl/*.whl.part-*; do
    [ -e "$p" ] || continue
    base=${p%.part-*}
    [[ $seen == *" $base "* ]] && continue
    seen+="$base "
    cat "$base".part-* > "$base.tmp"
    if python3 -c 'import sys, zipfile; sys.exit(zipfile.ZipFile(sys.argv[1]).testzip() is not None)' "$base.tmp" 2>/dev/null; then
      mv "$base.tmp" "$base" && rm -f "$base".part-* && log "mlx: joined $(basename "$base")"
    else
      parts=("$base".part-*)
      rm -f "$base.tmp"; log "mlx: $(basename "$base") incomplete so far (${#parts[@]} parts)"
    fi
  done
}

mlx_ready() { ls "$W"/mlx-whl/*.whl >/dev/null 2>&1 && ! ls "$W"/mlx-whl/*.part-* >/dev/null 2>&1; }

mlx_phase() {   # after stage_mlx
  local n pend=() done_ctx budget rc
  mlx_ready || { log "mlx: no complete wheels staged in $W/mlx-whl (MLX_WHEELS=$MLX_WHEELS)"; return 1; }
  if [ ! -f "$W/site/.lily-installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
        "$W"/mlx-whl/*.whl > "$RES/mlx-install.log" 2>&1 || { log "ERROR: mlx wheels did not install (mlx-install.log)"; return 1; }
    touch "$W/site/.lily-installed"
  fi
  done_ctx=" $(python3 -c 'import json,sys
try: print(*[json.loads(l)["context"] for l in open(sys.argv[1]) if l.startswith("{")])
except OSError: pass' "$RES/mlx-lm.jsonl") "
  for n in "${MLX_CTX[@]}"; do { [ "$FORCE" = 1 ] || [[ $done_ctx != *" $n "* ]]; } && pend+=("$n"); done
  [ ${#pend[@]} -gt 0 ] || { log "mlx: all contexts done before"; return 0; }
  budget=$(( $(left) - 10 ))
  [ "$budget" -ge 90 ] || { log "mlx: not run, ${budget}s left (call again)"; return 1; }
  # libmlx.so looks for the CUDA libraries (cuBLAS, cuDNN, NCCL, ...) beside a pip install of
  # them, $ORIGIN/../../nvidia/*/lib, which --target "$W/site" does not have: take the lib
  # folders of the machine's own `nvidia` packages (torch's) and the toolkit's instead.
  local cuda_libs
  cuda_libs=$(python3 -c 'import glob, os, nvidia
print(":".join(d for p in nvidia.__path__ for d in sorted(glob.glob(os.path.join(p, "*", "lib")))))' 2>/dev/null)
  cuda_libs="${cuda_libs:+$cuda_libs:}/usr/local/cuda/lib64"
  log "mlx: bench_mlx_cuda.py ${pend[*]} (limit ${budget}s)"
  LD_LIBRARY_PATH="$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout -k 10 "$budget" \
      python3 tools/peers/bench_mlx_cuda.py --jsonl-out "$RES/mlx-lm.jsonl" "${pend[@]}" >> "$RES/mlx-lm.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then tail -5 "$RES/mlx-lm.log"; log "mlx: exit $rc (finished contexts are kept)"; return 1; fi
  log "mlx: done"
}

# ------------------------------------------------------------------ end of every call
machine_info() {   # what the table's JSON records about the machine
  {
    echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)"
    echo "cpu: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB; nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' | cut -d' ' -f2)"
    [ -x "$LILY" ] && echo "lily: $(sha256sum "$LILY" | cut -c1-16) (sha256 of the binary)"
    [ -f "$SRC/SOURCE-lily.txt" ] && echo "llama.cpp: $(cat "$SRC/SOURCE-lily.txt")"
    echo "date: $(date -u +%FT%TZ)"
  } > "$RES/machine.txt"
}

finish() {
  local n missing=""
  bg_stop_all
  [ "$MODE" != table ] && command -v nvidia-smi >/dev/null && machine_info
  python3 tools/peers/table.py "$RES" --json-out "$RES/h200-compare.json" --md-out "$RES/table.md" > /dev/null
  if [ "$MODE" != table ]; then
    cp -f "$RES/table.md" "$RES/h200-compare.json" "$OUT/" 2>/dev/null
    tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RES")" "$(basename "$RES")"
    for n in "${CTX[@]}"; do
      [ -s "$RES/lily-ctx$n.json" ] || [ -f "$RES/lily-ctx$n.fail" ] || missing+=" lily:$n"
    done
    local dp dt; dp=" $(llama_done pp) "; dt=" $(llama_done tg) "
    for n in "${CTX[@]}"; do
      [[ $dp == *" $n "* ]] || missing+=" llama-pp:$n"; [[ $dt == *" $n "* ]] || missing+=" llama-tg:$n"
    done
    echo
    echo "==== $(date -u +%FT%TZ) mode=$MODE, $(el)s; results in $RES and \$OUT/results.tar.gz"
    [ -n "$missing" ] && echo "still missing:$missing  (MODE=all again, while the machine is warm, resumes)"
  fi
  echo
  cat "$RES/table.md"
}

# ------------------------------------------------------------------ main
log "mode=$MODE contexts=${CTX[*]} device=$DEVICE deadline=${DEADLINE_S}s work=$W"
if [ "$MODE" != table ]; then
  apps=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
  [ -n "$apps" ] && log "WARNING: the GPU is busy before the benchmark: $apps"
  log "/tmp: $(df -BG --output=avail "$W" | tail -1 | tr -d ' ') free; $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null)"
fi
case $MODE in
  build-llama)
    start_gguf; start_synth
    build_llama 30 && pack_llama
    ensure_gguf; ensure_synth
    ;;
  lily)      lily_phase ;;
  llama)     llama_phase ;;
  mlx)       stage_mlx; mlx_phase ;;
  stage-mlx) stage_mlx ;;
  all)
    start_gguf; start_synth
    if ! have_bench && [ ! -f "$LLAMA_BIN" ]; then
      build_llama 60 && pack_llama
    fi
    # no benchmark runs while a model is still being written (disk and CPU would skew it)
    ensure_synth; ensure_gguf
    # each phase checks the deadline itself; a phase that fails for want of an input does not
    # stop the next one
    lily_phase; llama_phase
    stage_mlx; if mlx_ready; then mlx_phase; fi
    ;;
  table) ;;
  *) log "ERROR: unknown MODE=$MODE (build-llama lily llama mlx stage-mlx all table)"; exit 2 ;;
esac
finish
