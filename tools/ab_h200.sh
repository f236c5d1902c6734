#!/usr/bin/env bash
# An A/B of lily builds or settings on the GPU machine: `lily bench --device cuda` on the
# synthetic 35B (tools/gpu_check.sh's `synth` phase writes it), the variants alternating within
# each round so that a drift of the machine lands on all of them alike. Run from the repo root:
#
#   bash tools/ab_h200.sh A=.device/lily B=.device/lily-b C=.device/lily-b,LILY_CUDA_QX=0
#
# A variant is NAME=BINARY[,VAR=VALUE...]: the binary, and environment for its runs only. The first
# variant is the baseline of the ratios. Each run's JSON and stderr (ab-NAME-CTX-ROUND.json, .log)
# go to $OUT/ab-runs.tar.gz;
# the table (every run, then each variant's mean decode and prefill against the baseline's, and
# whether the greedy tokens' digests agree) is printed last and written to $OUT/ab-table.md.
# Knobs: CONTEXTS ["256 32768"], ROUNDS [2], DECODE_STEPS [128], SYNTH [/tmp/synth-35b-a3b],
# RUN_TIMEOUT_S [240, per run].
set -uo pipefail

OUT=${OUT:-/tmp/lily-ab}
SYNTH=${SYNTH:-/tmp/synth-35b-a3b}
CONTEXTS=${CONTEXTS:-256 32768}
ROUNDS=${ROUNDS:-2}
DECODE_STEPS=${DECODE_STEPS:-128}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}
export LILY_KERNEL_CACHE=${LILY_KERNEL_CACHE:-/tmp/lily-kernels}
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: bash tools/ab_h200.sh NAME=BINARY[,VAR=VALUE...] ..." >&2; exit 2; }
[ -f "$SYNTH/config.json" ] || { echo "no checkpoint at $SYNTH (tools/gpu_check.sh synth)" >&2; exit 2; }

ROWS=()
for ctx in $CONTEXTS; do
  for round in $(seq 1 "$ROUNDS"); do
    for spec in "$@"; do
      name=${spec%%=*}
      rest=${spec#*=}
      IFS=, read -r -a parts <<< "$rest"
      bin=${parts[0]}
      envs=("${parts[@]:1}")
      base="$OUT/ab-$name-$ctx-$round"
      rm -f "$base.json"  # a failed run must not read an earlier call's JSON
      timeout "$RUN_TIMEOUT_S" env "${envs[@]}" "$bin" bench --model "$SYNTH" --device cuda \
        --prompt-len "$ctx" --decode-steps "$DECODE_STEPS" --json-out "$base.json" \
        >/dev/null 2>"$base.log"
      rc=$?
      line=$(python3 - "$base.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"]
    print(f'{r["prefill"]["tok_s"]:.1f} {r["decode"]["tok_s"]:.2f} {r["decode"]["token_digest"]}')
except Exception:
    print("- - -")
EOF
)
      ROWS+=("$name $ctx $round $rc $line")
      echo "$name ctx $ctx round $round: rc $rc, prefill/decode/digest $line"
    done
  done
done

python3 - "$OUT/ab-table.md" "${ROWS[@]}" <<'EOF'
import sys
from collections import defaultdict
path, rows = sys.argv[1], [r.split() for r in sys.argv[2:]]
out = ["| variant | ctx | round | rc | prefill tok/s | decode tok/s | digest |", "|---|---:|---:|---:|---:|---:|---|"]
out += ["| " + " | ".join(r) + " |" for r in rows]
order = list(dict.fromkeys(r[0] for r in rows))
runs = defaultdict(list)
for name, ctx, _, rc, pre, dec, dig in rows:
    if rc == "0" and dec != "-":
        runs[(name, ctx)].append((float(pre), float(dec), dig))
out += ["", "| variant | ctx | runs | decode mean | vs " + order[0] + " | prefill mean | vs " + order[0] + " | digests |",
        "|---|---:|---:|---:|---:|---:|---:|---|"]
for ctx in dict.fromkeys(r[1] for r in rows):
    base = runs.get((order[0], ctx))
    for name in order:
        rs = runs.get((name, ctx))
        if not rs:
            out.append(f"| {name} | {ctx} | 0 | - | - | - | - | - |")
            continue
        dec = sum(r[1] for r in rs) / len(rs)
        pre = sum(r[0] for r in rs) / len(rs)
        digs = {r[2] for r in rs}
        same = "equal" if base and digs == {r[2] for r in base} else ("differ" if base else "-")
        bd = sum(r[1] for r in base) / len(base) if base else float("nan")
        bp = sum(r[0] for r in base) / len(base) if base else float("nan")
        out.append(f"| {name} | {ctx} | {len(rs)} | {dec:.2f} | {dec / bd - 1:+.2%} | {pre:.0f} | {pre / bp - 1:+.2%} | {same} |")
text = "\n".join(out)
open(path, "w").write(text + "\n")
print(text)
EOF
# A device call returns at most 8 files: the runs' JSON and logs travel as one archive.
(cd "$OUT" && tar czf ab-runs.tar.gz ab-*-*.json ab-*-*.log 2>/dev/null && rm -f ab-*-*.json ab-*-*.log)
