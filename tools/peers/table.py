#!/usr/bin/env python3
"""Combine the H200 comparison's raw results into one markdown table and one JSON file.

    python3 tools/peers/table.py RESULTS_DIR [--json-out FILE] [--md-out FILE]

RESULTS_DIR is what tools/bench_h200.sh fills (or an unpacked results.tar.gz):
  lily-ctx<N>.json   `lily bench --prompt-len N --json-out` reports (one process per context)
  lily-ctx<N>.fail   one line: why that run has no report (timeout, exit status)
  llama*.jsonl       `llama-bench -o jsonl` lines: prefill = pp<N> at depth 0, decode = tg<S> at depth N
  mlx-lm.jsonl       tools/peers/bench_mlx_cuda.py lines {"context", "prefill_tok_s", "decode_tok_s"}
  machine.txt        free text about the GPU machine (copied into the JSON)
Standard library only, so it runs on the GPU machine and here alike.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import re
import sys

# Decode's bandwidth limit.  A decode step must read every active weight once: 3B active
# parameters at ~4.5 bits plus the 248k x 2048 lm_head, about 1.67 GB (the MLX 4-bit checkpoint;
# llama.cpp's Q4_K_M mix is a little larger), at the 4.3 TB/s a device-to-device copy measured on
# this H200 (the vendor's 4.8 TB/s is not reachable): 4.3e12 / 1.67e9 = ~2,570 tok/s at an
# empty context.  At context N each step also reads the K and V cache of the 10 full-attention
# layers: 2 KV heads x 256 dims x (K + V) x 2 bytes (f16/bf16) = 2 KiB per layer per token.
# (The Gated DeltaNet state is fixed-size, ~63 MB in f32, and left out: under 4% of the weights.)
WEIGHT_BYTES_PER_STEP = 1.67e9
COPY_BANDWIDTH_B_S = 4.3e12
KV_BYTES_PER_TOKEN = 10 * 2 * 256 * 2 * 2


def decode_limit(context: int) -> float:
    return COPY_BANDWIDTH_B_S / (WEIGHT_BYTES_PER_STEP + context * KV_BYTES_PER_TOKEN)


def load_lily(d: str):
    rows, meta, fails = {}, None, {}
    for p in sorted(glob.glob(os.path.join(d, "lily-ctx*.json"))):
        try:
            with open(p) as f:
                r = json.load(f)
            n = int(r["workload"]["prompt_len"])
            pre, dec = r["results"]["prefill"], r["results"]["decode"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"warning: skipping {p}: {e}", file=sys.stderr)
            continue
        steps = sorted(dec.get("step_wall_secs") or [])
        rows[n] = {
            "prefill_tok_s": pre["tok_s"],
            "prefill_wall_secs": pre.get("wall_secs"),
            "decode_tok_s": dec["tok_s"],
            "decode_wall_secs": dec.get("wall_secs"),
            "decode_steps": r["workload"].get("decode_steps"),
            "decode_median_step_ms": 1e3 * steps[len(steps) // 2] if steps else None,
            "first_token_id": pre.get("first_token_id"),
            "token_digest": dec.get("token_digest"),
            "file": os.path.basename(p),
        }
        meta = meta or r.get("meta")
    for p in glob.glob(os.path.join(d, "lily-ctx*.fail")):
        m = re.search(r"lily-ctx(\d+)\.fail$", p)
        if m and int(m.group(1)) not in rows:
            with open(p) as f:
                fails[int(m.group(1))] = f.read().strip()
    return rows, meta, fails


def load_llama(d: str):
    pp, tg, meta = {}, {}, None
    for p in sorted(glob.glob(os.path.join(d, "llama*.jsonl"))):
        with open(p) as f:
            for ln, line in enumerate(f, 1):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    t = json.loads(line)
                    npr, ngen, depth = int(t["n_prompt"]), int(t["n_gen"]), int(t["n_depth"])
                except (ValueError, KeyError, TypeError) as e:
                    print(f"warning: {p}:{ln}: {e}", file=sys.stderr)
                    continue
                cell = {
                    "tok_s": t["avg_ts"], "stddev_tok_s": t.get("stddev_ts"),
                    "reps": len(t.get("samples_ts") or []),
                    "n_batch": t.get("n_batch"), "n_ubatch": t.get("n_ubatch"),
                    "flash_attn": t.get("flash_attn"), "n_gpu_layers": t.get("n_gpu_layers"),
                    "test": f"pp{npr}" if ngen == 0 else f"tg{ngen} @ d{depth}",
                }
                # later lines (a rerun) replace earlier ones
                if ngen == 0 and npr > 0 and depth == 0:
                    pp[npr] = cell
                elif npr == 0 and ngen > 0:
                    tg[depth] = cell
                else:
                    continue
                meta = {k: t.get(k) for k in ("build_commit", "build_number", "gpu_info", "backends",
                                              "model_type", "model_size", "model_n_params", "type_k", "type_v")}
    return pp, tg, meta


def load_mlx(d: str):
    rows = {}
    p = os.path.join(d, "mlx-lm.jsonl")
    if os.path.exists(p):
        with open(p) as f:
            for line in f:
                if line.strip().startswith("{"):
                    r = json.loads(line)
                    rows[int(r["context"])] = r
    return rows


def fmt(x):
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def build(d: str):
    lily, lily_meta, lily_fail = load_lily(d)
    pp, tg, llama_meta = load_llama(d)
    mlx = load_mlx(d)
    contexts = sorted(set(lily) | set(lily_fail) | set(pp) | set(tg) | set(mlx))
    rows = []
    for n in contexts:
        li, lp, lt, mx = lily.get(n), pp.get(n), tg.get(n), mlx.get(n)
        lim = decode_limit(n)
        rows.append({
            "context": n,
            "lily": li,
            "lily_failure": lily_fail.get(n),
            "llama_cpp": {"prefill": lp, "decode": lt} if (lp or lt) else None,
            "mlx_lm": mx,
            "ratio_lily_over_llama_cpp": {
                "prefill": ratio(li and li["prefill_tok_s"], lp and lp["tok_s"]),
                "decode": ratio(li and li["decode_tok_s"], lt and lt["tok_s"]),
            },
            "ratio_lily_over_mlx_lm": {
                "prefill": ratio(li and li["prefill_tok_s"], mx and mx.get("prefill_tok_s")),
                "decode": ratio(li and li["decode_tok_s"], mx and mx.get("decode_tok_s")),
            },
            "decode_limit_tok_s": lim,
            "decode_fraction_of_limit": {
                "lily": li["decode_tok_s"] / lim if li else None,
                "llama_cpp": lt["tok_s"] / lim if lt else None,
            },
        })
    machine = None
    mp = os.path.join(d, "machine.txt")
    if os.path.exists(mp):
        with open(mp) as f:
            machine = f.read().strip()
    return {
        "schema_version": 1,
        "harness": "tools/bench_h200.sh + tools/peers/table.py",
        "generated_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "workload": {
            "context": "prompt length N: prefill tok/s of an N-token prompt, then decode tok/s after it",
            "lily": "lily bench --prompt-len N: prefill to the first token, then decode steps one token each (on a GPU chained: each step queued before the token of the one before is read)",
            "llama_cpp": "llama-bench: prefill = pp<N> on an empty context, decode = tg<steps> at depth N",
            "mlx_lm": "tools/peers/bench_mlx_cuda.py: lily's prompt formula, 64 decode steps",
        },
        "constants": {
            "weight_bytes_per_step": WEIGHT_BYTES_PER_STEP,
            "copy_bandwidth_b_s": COPY_BANDWIDTH_B_S,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        },
        "meta": {"lily": lily_meta, "llama_cpp": llama_meta},
        "rows": rows,
    }


def llama_source(lmeta, machine):
    """What llama.cpp was: llama-bench's build commit, or, where the tree had no git (the pinned
    sdist's vendored source reports "unknown"), the source line bench_h200.sh wrote into
    machine.txt ("llama.cpp: ...")."""
    commit = lmeta.get("build_commit", "?")
    if commit != "unknown":
        return commit
    for line in (machine or "").splitlines():
        if line.startswith("llama.cpp:"):
            return "from " + line.split(":", 1)[1].strip()
    return commit


def markdown(res) -> str:
    rows = res["rows"]
    has_mlx = any(r["mlx_lm"] for r in rows)
    head = ["context", "lily prefill", "llama.cpp prefill", "ratio",
            "lily decode", "llama.cpp decode", "ratio", "decode limit", "% of limit (lily / llama.cpp)"]
    if has_mlx:
        head += ["mlx-lm prefill", "ratio", "mlx-lm decode", "ratio"]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        li, ll, mx = r["lily"], r["llama_cpp"] or {}, r["mlx_lm"]
        lp, lt = ll.get("prefill"), ll.get("decode")
        fail = "-" if not r["lily_failure"] else "timeout" if r["lily_failure"].startswith("timeout") else "failed"
        rat = r["ratio_lily_over_llama_cpp"]
        frac = r["decode_fraction_of_limit"]
        pct = " / ".join("-" if v is None else f"{100 * v:.1f}%" for v in (frac["lily"], frac["llama_cpp"]))
        cells = [
            f"{r['context']:,}",
            fmt(li["prefill_tok_s"]) if li else fail,
            fmt(lp and lp["tok_s"]),
            "-" if rat["prefill"] is None else f"{rat['prefill']:.2f}x",
            fmt(li["decode_tok_s"]) if li else fail,
            fmt(lt and lt["tok_s"]),
            "-" if rat["decode"] is None else f"{rat['decode']:.2f}x",
            f"{r['decode_limit_tok_s']:,.0f}",
            pct,
        ]
        if has_mlx:
            mrat = r["ratio_lily_over_mlx_lm"]
            cells += [fmt(mx and mx.get("prefill_tok_s")),
                      "-" if mrat["prefill"] is None else f"{mrat['prefill']:.1f}x",
                      fmt(mx and mx.get("decode_tok_s")),
                      "-" if mrat["decode"] is None else f"{mrat['decode']:.1f}x"]
        out.append("| " + " | ".join(cells) + " |")

    notes = ["", "tok/s; ratio = lily / the peer to its left (above 1: lily is faster)."]
    lm = (res["meta"] or {}).get("lily") or {}
    if lm:
        notes.append(f"lily: `lily bench` on {lm.get('device', '?')}, one run per context "
                     f"(source {lm.get('source_id', '?')}).")
    cells = [c for r in rows if r["llama_cpp"] for c in r["llama_cpp"].values() if c]
    if cells:
        c = cells[0]
        tg = sorted({x["test"].split()[0] for x in cells if x["test"].startswith("tg")}) or ["tg64"]
        reps = sorted({x["reps"] for x in cells})
        ub = sorted({(x["n_ubatch"], x["n_batch"]) for x in cells})
        lmeta = res["meta"]["llama_cpp"] or {}
        notes.append(
            f"llama.cpp {llama_source(lmeta, res.get('machine'))} ({lmeta.get('model_type', '?')}, {lmeta.get('backends', '?')}): "
            f"llama-bench -ngl {c['n_gpu_layers']} -fa {c['flash_attn']}, "
            + ", ".join(f"-ub {u} -b {b}" for u, b in ub)
            + f", mean of {'/'.join(map(str, reps))} reps; prefill = pp<N> on an empty context, "
            f"decode = {'/'.join(tg)} at depth N.")
    mlx_rows = [r["mlx_lm"] for r in rows if r["mlx_lm"]]
    if mlx_rows:
        versions = sorted({f"mlx {m['mlx']}, mlx-lm {m['mlx_lm']}" for m in mlx_rows if m.get("mlx")})
        notes.append(
            f"mlx-lm on CUDA ({'; '.join(versions) or 'versions not recorded'}): "
            "tools/peers/bench_mlx_cuda.py on random weights of the same shape built and quantized by "
            "mlx-lm (4-bit g64, 8-bit router and shared-expert gate), one run per context; prefill = "
            "the prompt to the first token, decode = the next 64 steps.")
    k = res["constants"]
    notes.append(f"decode limit = {k['copy_bandwidth_b_s'] / 1e12:.1f} TB/s copy bandwidth / "
                 f"({k['weight_bytes_per_step'] / 1e9:.2f} GB weights + N x {k['kv_bytes_per_token'] // 1024} KiB KV) per step.")
    for r in rows:
        if r["lily_failure"]:
            notes.append(f"lily at {r['context']:,}: {r['lily_failure']}")
    return "\n".join(out + notes) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results_dir")
    ap.add_argument("--json-out", help="write the combined JSON here")
    ap.add_argument("--md-out", help="also write the markdown table here")
    a = ap.parse_args(argv)
    res = build(a.results_dir)
    md = markdown(res)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    if a.md_out:
        with open(a.md_out, "w") as f:
            f.write(md)
    sys.stdout.write(md)
    return 0 if res["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
