"""Greedy golden outputs from mlx-lm for the tiny qwen3_5_moe model.

Usage: python gen_golden.py MODEL_DIR OUT.json {bf16|f32} [N_NEW]
bf16 = exactly how mlx-lm runs an mlx-community 4-bit model (activations bf16).
f32  = same quantized weights, but scales/biases/norms upcast to f32 (exact) and
       activations in f32: the better reference for an f32 Rust implementation.

Prompt set (any vocab size V = text_config.vocab_size):
- V >= 248320 (the real vocab): exactly the shared script's six prompts.
- V <  248320: edge_ids = [0, 1, 2, V//2, V-3, V-2, V-1]; random_300 = rng(7).integers(0, V, 300);
  the text/chat prompts (real tokenizer) and single_endoftext (id 248044) are kept only when every
  id < V; single_endoftext is then replaced by single_id = [V//3] so a one-token prompt remains.
- prefill_all_positions_top5 and per_layer_hidden are written for text_pangram and chat_no_think,
  or for edge_ids and random_300 when those two are absent.
"""
import hashlib, json, sys, time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache

model_dir, out_path, prec = sys.argv[1], sys.argv[2], sys.argv[3]
n_new = int(sys.argv[4]) if len(sys.argv) > 4 else 24
TOPK = 10

t0 = time.perf_counter()
model, tok = load(model_dir)
if prec == "f32":
    model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
mx.eval(model.parameters())
t_load = time.perf_counter() - t0

def f(x):  # float -> shortest repr that round-trips float32
    return float(np.float32(x))

def topk(row):
    row = np.asarray(row, dtype=np.float32)
    idx = np.argsort(-row, kind="stable")[:TOPK]
    lse = float(np.log(np.exp(row.astype(np.float64) - row.max()).sum()) + row.max())
    return {"ids": idx.tolist(), "logits": [f(row[i]) for i in idx],
            "margin_top1_top2": f(row[idx[0]] - row[idx[1]]), "logsumexp": lse,
            "sum": float(row.astype(np.float64).sum()), "argmax": int(idx[0])}

chat_user = [{"role": "user", "content": "Give me a short introduction to large language models."}]
prompts = {
    "single_endoftext": [248044],
    "text_pangram": tok.encode("The quick brown fox jumps over the lazy dog."),
    "edge_ids": [0, 1, 2, 151643, 248043, 248044, 248045, 248076, 248077, 248319],
    "random_300": np.random.default_rng(7).integers(0, 248044, 300).tolist(),
    "chat_no_think": tok.apply_chat_template(chat_user, add_generation_prompt=True, enable_thinking=False),
    "chat_think": tok.apply_chat_template(chat_user, add_generation_prompt=True),
}
prompts = {k: [int(t) for t in (v["input_ids"] if isinstance(v, dict) else v)] for k, v in prompts.items()}
FULL_VOCAB = 248320
vocab = json.load(open(f"{model_dir}/config.json"))["text_config"]["vocab_size"]
if vocab < FULL_VOCAB:
    small = {"edge_ids": [0, 1, 2, vocab // 2, vocab - 3, vocab - 2, vocab - 1],
             "random_300": np.random.default_rng(7).integers(0, vocab, 300).tolist()}
    kept = {}
    for k, v in prompts.items():
        if k in small:
            kept[k] = [int(t) for t in small[k]]
        elif all(t < vocab for t in v):
            kept[k] = v
        elif k == "single_endoftext":
            kept["single_id"] = [vocab // 3]
    prompts = kept
DETAIL = [k for k in ("text_pangram", "chat_no_think") if k in prompts] or ["edge_ids", "random_300"]

def greedy(ids):
    cache = make_prompt_cache(model)
    t = time.perf_counter()
    logits = model(mx.array(ids)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(logits)
    t_pre = time.perf_counter() - t
    prefill_rows = np.array(logits)
    steps, out = [], []
    row = prefill_rows[-1]
    t = time.perf_counter()
    for _ in range(n_new):
        nxt = int(np.argmax(row))
        steps.append(topk(row))
        out.append(nxt)
        lg = model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(lg)
        row = np.array(lg)
    t_dec = time.perf_counter() - t
    return prefill_rows, out, steps, t_pre, t_dec

def per_layer(ids):
    """Hidden state after embedding and after each decoder layer (no cache, full prompt)."""
    tm = model.language_model.model
    h = tm.embed_tokens(mx.array(ids)[None])
    fa, ssm = create_attention_mask(h, None), create_ssm_mask(h, None)
    rec = []
    for i, layer in enumerate([None] + list(tm.layers)):
        if layer is not None:
            h = layer(h, mask=ssm if layer.is_linear else fa, cache=None)
        x = np.array(h[0].astype(mx.float32))
        rec.append({"layer": i - 1, "rms": [f(v) for v in np.sqrt((x.astype(np.float64) ** 2).mean(-1))],
                    "first8_last_pos": [f(v) for v in x[-1, :8]]})
    return rec

res = {"model_dir_config": json.load(open(f"{model_dir}/config.json")).get("_tiny_random"),
       "precision": prec, "mlx": mx.__version__, "n_new": n_new, "cases": {}}
import mlx_lm; res["mlx_lm"] = mlx_lm.__version__
tot_pre = tot_dec = 0.0; n_pre = 0
for name, ids in prompts.items():
    prefill_rows, out, steps, t_pre, t_dec = greedy(ids)
    tot_pre += t_pre; tot_dec += t_dec; n_pre += len(ids)
    # cross-check 1: mlx_lm's own generate_step (greedy sampler) gives the same tokens
    ref = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(ids), model, max_tokens=n_new)), range(n_new))]
    # cross-check 2: one no-cache forward over prompt+generated vs prefill+incremental decode
    full = np.array(model(mx.array(ids + out[:-1])[None])[0].astype(mx.float32))
    d_prompt = float(np.abs(full[:len(ids)] - prefill_rows).max())
    case = {"prompt_ids": ids, "generated_ids": out, "generate_step_agrees": ref == out,
            "max_abs_diff_fullforward_vs_prefill": d_prompt,
            "prefill_last": topk(prefill_rows[-1]), "steps": steps}
    case["full_forward_vs_decode_argmax_agree"] = [int(np.argmax(full[len(ids) - 1 + j])) for j in range(n_new)] == out
    case["max_abs_diff_fullforward_vs_decode_top10"] = float(max(
        abs(full[len(ids) - 1 + j][i] - v) for j, st in enumerate(steps) for i, v in zip(st["ids"], st["logits"])))
    if name in DETAIL:
        case["prefill_all_positions_top5"] = [
            {"ids": (ix := np.argsort(-r, kind="stable")[:5]).tolist(), "logits": [f(r[i]) for i in ix]} for r in prefill_rows]
        case["per_layer_hidden"] = per_layer(ids)
    res["cases"][name] = case
    print(f"{name:18s} prompt={len(ids):4d} gen={out[:12]}... step_agree={ref == out} "
          f"fullfwd_vs_prefill={d_prompt:.2e} fullfwd_vs_decode={case['max_abs_diff_fullforward_vs_decode_top10']:.2e} min_margin={min(s['margin_top1_top2'] for s in steps):.4f} "
          f"prefill {t_pre*1e3:.0f} ms, decode {t_dec/n_new*1e3:.1f} ms/tok")
res["timing"] = {"load_s": round(t_load, 3), "prefill_tok_per_s": round(n_pre / tot_pre, 1),
                 "decode_ms_per_tok": round(tot_dec / (n_new * len(prompts)) * 1e3, 2)}
s = json.dumps(res, indent=1)
open(out_path, "w").write(s)
# determinism fingerprint: excludes timings
res.pop("timing")
print("timing", {"load_s": round(t_load, 3), "prefill_tok_per_s": round(n_pre / tot_pre, 1),
      "decode_ms_per_tok": round(tot_dec / (n_new * len(prompts)) * 1e3, 2)})
print("sha256(results without timing) =", hashlib.sha256(json.dumps(res, sort_keys=True).encode()).hexdigest())
