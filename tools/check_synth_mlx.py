#!/usr/bin/env python3
"""Check that mlx-lm accepts a `lily synth` checkpoint (the mlx-community layout).

    .venv/bin/python tools/check_synth_mlx.py /tmp/synth-tiny --ids 1,2,3 --tokens 4
    .venv/bin/python tools/check_synth_mlx.py /tmp/synth35b --ids 1,2,3 --stream

Loads with `mlx_lm.utils.load_model(path, lazy=True)`, which builds the qwen3_5_moe model from
config.json, applies the `quantization` block (4-bit affine, 8-bit router and shared-expert
gate) and loads every tensor with strict=True: a missing, extra or mis-shaped tensor fails here.

Then either
  * (default) greedy generation of --tokens tokens after --ids with mlx-lm's `generate_step`,
    which needs every weight in memory (fine for small shapes), or
  * --stream: one forward of --ids without a cache, layer by layer, evaluating each layer and
    then dropping its weights, so peak memory is about one layer (the 35B-A3B shape on a 24 GB
    machine). Prints the last position's top-5 and argmax.
--f32 upcasts the bf16 parameters (scales, biases, norms) to f32, mlx-lm's exact-math mode,
which is what lily's CPU backend computes. Exits non-zero if any logit is not finite.

Tested with mlx 0.32.4 (mlx[cpu]) and mlx-lm 0.32.2.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.utils import load_model


def to_f32(module):
    module.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p, module.parameters()))


def drop_weights(module):
    module.update(tree_map(lambda _: mx.array([]), module.parameters()))
    mx.clear_cache()


def check_finite(logits, what):
    ok = bool(mx.all(mx.isfinite(logits)).item())
    if not ok:
        print(f"FAIL: non-finite logits in {what}")
        sys.exit(1)


def stream_forward(model, ids, f32):
    """model(ids) without a cache, one layer resident at a time."""
    lm = model.language_model
    tm = lm.model
    if f32:
        to_f32(tm.embed_tokens)
    h = tm.embed_tokens(mx.array(ids)[None])
    if f32:
        h = h.astype(mx.float32)
    mx.eval(h)
    drop_weights(tm.embed_tokens)
    fa_mask = create_attention_mask(h, None)
    ssm_mask = create_ssm_mask(h, None)
    for i, layer in enumerate(tm.layers):
        t = time.time()
        if f32:
            to_f32(layer)
        h = layer(h, mask=ssm_mask if layer.is_linear else fa_mask, cache=None)
        mx.eval(h)
        drop_weights(layer)
        kind = "gdn " if layer.is_linear else "attn"
        print(f"  layer {i:2d} {kind} rms={mx.sqrt(mx.mean(h.astype(mx.float32) ** 2)).item():8.3f}  {time.time() - t:5.1f}s", flush=True)
    if f32:
        to_f32(tm.norm)
        to_f32(lm.lm_head)
    logits = lm.lm_head(tm.norm(h))
    mx.eval(logits)
    return logits[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--ids", default="1,2,3", help="prompt token ids, comma-separated")
    ap.add_argument("--tokens", type=int, default=4, help="greedy tokens to generate (default mode)")
    ap.add_argument("--stream", action="store_true", help="layer-by-layer single forward, bounded memory")
    ap.add_argument("--f32", action="store_true", help="upcast bf16 parameters to f32")
    args = ap.parse_args()
    ids = [int(x) for x in args.ids.split(",") if x.strip()]

    t = time.time()
    model, config = load_model(args.model, lazy=True)
    params = tree_flatten(model.parameters())
    nbytes = sum(v.nbytes for _, v in params)
    q = config.get("quantization", {})
    eight = sorted(k for k, v in q.items() if isinstance(v, dict) and v.get("bits") == 8)
    print(
        f"load_model(lazy=True): OK in {time.time() - t:.1f}s: {type(model).__module__}.{type(model).__name__}, "
        f"{len(params)} tensors, {nbytes / 1e9:.3f} GB, quantization bits={q.get('bits')} "
        f"group_size={q.get('group_size')} mode={q.get('mode')}, {len(eight)} 8-bit overrides"
    )
    del params

    if args.stream:
        t = time.time()
        logits = stream_forward(model, ids, args.f32)
        last = logits[-1].astype(mx.float32)
        check_finite(last, "stream forward")
        top = mx.argsort(-last)[:5].tolist()
        print(f"stream forward of {ids}: {time.time() - t:.1f}s, last-position argmax {top[0]}, "
              f"top-5 {[(i, round(last[i].item(), 4)) for i in top]}, "
              f"logit std {mx.std(last).item():.3f}, peak mem {mx.get_peak_memory() / 1e9:.2f} GB")
        print(json.dumps({"mode": "stream", "prompt_ids": ids, "argmax": top[0], "top5": top}))
        return

    from mlx_lm.generate import generate_step

    if args.f32:
        to_f32(model)
    full = model(mx.array(ids)[None])
    check_finite(full, "full forward")
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=args.tokens, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    print(f"generate_step greedy: prompt {ids} -> {out} (first token = full-forward argmax "
          f"{int(mx.argmax(full[0, -1]).item())}), peak mem {mx.get_peak_memory() / 1e9:.2f} GB")
    print(json.dumps({"mode": "generate", "prompt_ids": ids, "tokens": out}))


if __name__ == "__main__":
    main()
