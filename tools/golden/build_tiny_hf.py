"""Write a tiny random-weight qwen3_5_moe checkpoint in the *Hugging Face* layout
(the layout Qwen/Qwen3.6-35B-A3B ships), so that `mlx_lm.convert -q` runs the same
sanitize + quantize path that produced mlx-community's 4-bit conversions.

Parameterised copy of shared/tools/golden/build_tiny_hf.py. The defaults are that script's
shapes (hidden 128, moe/shared intermediate 128, seed 0), and the random draws happen in the same
order, so `build_tiny_hf.py OUT TOK TMPL` rebuilds the shared fixture byte for byte.
Fixed as in the real model: head_dim 256, GDN key/value head dim 128, conv kernel 4,
partial_rotary_factor 0.25 (mrope_section [11, 11, 10], interleaved), rope_theta 1e7.

Usage: python build_tiny_hf.py OUT_DIR TOKENIZER_JSON CHAT_TEMPLATE [--hidden N] [--layers N]
       [--full-attention-interval N] [--vocab N] [--heads N] [--kv-heads N]
       [--linear-key-heads N] [--linear-value-heads N] [--experts N] [--top-k N]
       [--moe-inter N] [--shared-inter N] [--seed N]
Layer i is full attention iff (i + 1) % interval == 0, otherwise linear attention (GDN).
With --vocab < 248320 the config still carries the real bos/eos/vision token ids (they are only
numbers there) and the real tokenizer is still copied (mlx-lm needs one to load the model).
"""
import argparse, json, shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("out_dir")
ap.add_argument("tokenizer_json")
ap.add_argument("chat_template")
ap.add_argument("--hidden", type=int, default=128)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--full-attention-interval", type=int, default=4)
ap.add_argument("--vocab", type=int, default=248320)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--kv-heads", type=int, default=2)
ap.add_argument("--linear-key-heads", type=int, default=2)
ap.add_argument("--linear-value-heads", type=int, default=4)
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=8)
ap.add_argument("--moe-inter", type=int, default=128)
ap.add_argument("--shared-inter", type=int, default=128)
ap.add_argument("--seed", type=int, default=0)
a_ = ap.parse_args()
assert a_.heads % a_.kv_heads == 0, "heads must be a multiple of kv-heads"
assert a_.linear_value_heads % a_.linear_key_heads == 0, "linear value heads must be a multiple of key heads"
assert a_.top_k <= a_.experts

out, tok_json, tmpl, seed = Path(a_.out_dir), a_.tokenizer_json, a_.chat_template, a_.seed
out.mkdir(parents=True, exist_ok=True)

L, interval = a_.layers, a_.full_attention_interval
text_config = {
    "model_type": "qwen3_5_moe_text",
    "architectures": None,
    "hidden_size": a_.hidden, "num_hidden_layers": L, "vocab_size": a_.vocab,
    "num_attention_heads": a_.heads, "num_key_value_heads": a_.kv_heads, "head_dim": 256,
    "attn_output_gate": True, "attention_bias": False, "attention_dropout": 0.0,
    "linear_num_key_heads": a_.linear_key_heads, "linear_num_value_heads": a_.linear_value_heads,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": a_.experts, "num_experts_per_tok": a_.top_k, "moe_intermediate_size": a_.moe_inter,
    "shared_expert_intermediate_size": a_.shared_inter, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "full_attention_interval": interval,
    "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)],
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "max_position_embeddings": 262144, "partial_rotary_factor": 0.25,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                        "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "use_cache": True, "dtype": "bfloat16",
    "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 0,
    "bos_token_id": 248044, "eos_token_id": 248046, "pad_token_id": None,
}
text_config.pop("architectures")
config = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": text_config,
    "tie_word_embeddings": False,
    "image_token_id": 248056, "video_token_id": 248057,
    "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "transformers_version": "5.24.0",
    "_tiny_random": f"random weights, seed={seed}; structure of Qwen3.6-35B-A3B, not a trained model",
}

rng = np.random.default_rng(seed)
H, V = text_config["hidden_size"], text_config["vocab_size"]
nh, nkv, hd = a_.heads, a_.kv_heads, 256
hk, hv, dk, dv, K = a_.linear_key_heads, a_.linear_value_heads, 128, 128, 4
E, I, SI = a_.experts, a_.moe_inter, a_.shared_inter
key_dim, value_dim = hk * dk, hv * dv
conv_dim = 2 * key_dim + value_dim

def lin(o, i, gain=1.0):
    return rng.standard_normal((o, i), dtype=np.float32) * (gain / np.sqrt(i))

def offs(n):  # HF stores (1+w) RMSNorm weights as the offset w
    return rng.standard_normal(n, dtype=np.float32) * 0.1

W = {}
p = "model.language_model."
W[p + "embed_tokens.weight"] = rng.standard_normal((V, H), dtype=np.float32)
W["lm_head.weight"] = lin(V, H, gain=2.0)
W[p + "norm.weight"] = offs(H)
for l in range(L):
    q = f"{p}layers.{l}."
    W[q + "input_layernorm.weight"] = offs(H)
    W[q + "post_attention_layernorm.weight"] = offs(H)
    if text_config["layer_types"][l] == "linear_attention":
        a = q + "linear_attn."
        W[a + "in_proj_qkv.weight"] = lin(conv_dim, H)
        W[a + "in_proj_z.weight"] = lin(value_dim, H)
        W[a + "in_proj_b.weight"] = lin(hv, H)
        W[a + "in_proj_a.weight"] = lin(hv, H)
        W[a + "conv1d.weight"] = rng.standard_normal((conv_dim, 1, K), dtype=np.float32) * 0.5
        W[a + "dt_bias"] = 1.0 + 0.5 * rng.standard_normal(hv, dtype=np.float32)
        W[a + "A_log"] = np.log(rng.uniform(1, 16, hv)).astype(np.float32)  # kept fp32
        W[a + "norm.weight"] = 1.0 + offs(dv)  # gated RMSNorm multiplies by w (no +1)
        W[a + "out_proj.weight"] = lin(H, value_dim)
    else:
        a = q + "self_attn."
        W[a + "q_proj.weight"] = lin(nh * hd * 2, H)  # per head: [query(hd) | gate(hd)]
        W[a + "k_proj.weight"] = lin(nkv * hd, H)
        W[a + "v_proj.weight"] = lin(nkv * hd, H)
        W[a + "o_proj.weight"] = lin(H, nh * hd)
        W[a + "q_norm.weight"] = offs(hd)
        W[a + "k_norm.weight"] = offs(hd)
    m = q + "mlp."
    W[m + "gate.weight"] = lin(E, H, gain=3.0)  # decisive routing: fewer top-k near-ties
    W[m + "experts.gate_up_proj"] = rng.standard_normal((E, 2 * I, H), dtype=np.float32) / np.sqrt(H)
    W[m + "experts.down_proj"] = rng.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I)
    W[m + "shared_expert.gate_proj.weight"] = lin(SI, H)
    W[m + "shared_expert.up_proj.weight"] = lin(SI, H)
    W[m + "shared_expert.down_proj.weight"] = lin(H, SI)
    W[m + "shared_expert_gate.weight"] = lin(1, H)

arrs = {k: mx.array(v) if k.endswith("A_log") else mx.array(v).astype(mx.bfloat16) for k, v in W.items()}
mx.save_safetensors(str(out / "model.safetensors"), arrs, metadata={"format": "pt"})
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
(out / "generation_config.json").write_text(json.dumps(
    {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
     "do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}, indent=2) + "\n")
shutil.copy(tok_json, out / "tokenizer.json")
shutil.copy(tmpl, out / "chat_template.jinja")
(out / "tokenizer_config.json").write_text(json.dumps({
    "add_prefix_space": False, "backend": "tokenizers", "bos_token": None,
    "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
    "model_max_length": 262144, "pad_token": "<|endoftext|>", "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>", "audio_token": "<|audio_pad|>",
}, indent=2) + "\n")
n = sum(v.size for v in W.values())
print(f"wrote {out}: {len(W)} tensors, {n/1e6:.2f}M params, layer_types "
      f"{''.join('L' if t == 'linear_attention' else 'F' for t in text_config['layer_types'])}")
