"""Time mlx-lm on a random-weight model with the exact Qwen3.6-35B-A3B shape,
quantized as mlx-community does (affine 4-bit g64, router and shared-expert gate 8-bit).
Contract follows lily's bench: synthetic prompt tok(i) = (i*2654435761 mod 2^32) mod vocab,
prefill = time to first yield of generate_step, decode = next 64 inter-yield intervals.

    python3 tools/peers/bench_mlx_cuda.py [--jsonl-out FILE] [CONTEXT ...]   (default 256 4096)

Copied from the reference (shared/tools/peers/bench_mlx_cuda.py, 2026-11-29); only the
--jsonl-out option is new (one line per context, written as each finishes, for
tools/peers/table.py, with the mlx and mlx-lm versions).  Needs mlx with its CUDA backend and mlx-lm (tools/bench_h200.sh MODE=mlx)."""
import sys, time, json
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5_moe
from mlx_lm.generate import generate_step
from importlib import metadata

try:
    mlx_lm_version = metadata.version("mlx-lm")
except metadata.PackageNotFoundError:  # imported from a tree without its dist-info
    mlx_lm_version = "unknown"

L = 40
tc = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": L,
    "vocab_size": 248320, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "attn_output_gate": True, "attention_bias": False,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "full_attention_interval": 4,
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(L)],
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "eos_token_id": 248046,
}
args = qwen3_5_moe.ModelArgs.from_dict({"model_type": "qwen3_5_moe", "text_config": tc})
mx.random.seed(0)
t0 = time.time()
model = qwen3_5_moe.Model(args)
model.set_dtype(mx.bfloat16)
pred = model.quant_predicate
nn.quantize(model, group_size=64, bits=4,
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and pred(p, m))
mx.eval(model.parameters())
nbytes = sum(v.nbytes for _, v in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters()))
print(f"model built+quantized in {time.time()-t0:.1f}s, {nbytes/1e9:.2f} GB, peak {mx.get_peak_memory()/1e9:.1f} GB", flush=True)

V = tc["vocab_size"]
def prompt(n):
    return mx.array([((i * 2654435761) % (1 << 32)) % V for i in range(n)], dtype=mx.uint32)

def run(n, steps):
    p = prompt(n)
    t = time.perf_counter(); stamps = []; toks = []
    for tok, _ in generate_step(p, model, max_tokens=steps + 1):
        stamps.append(time.perf_counter()); toks.append(int(tok))
    pre = stamps[0] - t
    dec = stamps[-1] - stamps[0]
    return n / pre, steps / dec, toks

argv = sys.argv[1:]
jsonl_out = None
if len(argv) >= 2 and argv[0] == "--jsonl-out":
    jsonl_out, argv = argv[1], argv[2:]

res = []
for n in [int(x) for x in (argv or ["256", "4096"])]:
    run(min(n, 512), 4)  # warm-up
    mx.clear_cache()
    pre, dec, toks = run(n, 64)
    res.append({"context": n, "prefill_tok_s": round(pre, 1), "decode_tok_s": round(dec, 1),
                "mlx": mx.__version__, "mlx_lm": mlx_lm_version})
    print(json.dumps(res[-1]), flush=True)
    if jsonl_out:
        with open(jsonl_out, "a") as f:
            f.write(json.dumps(res[-1]) + "\n")
print("RESULT", json.dumps(res))
