"""Independent float64 NumPy forward pass of an MLX 4-bit qwen3_5_moe checkpoint.

Reads model.safetensors by hand (header + raw bytes: U32 packed weights, BF16 scales/biases,
F32 A_log), dequantizes (w = scale*q + bias per 64-column group), and runs the text model with
no KV/SSM cache (every step recomputes the whole sequence). It is a readable spec for a Rust
port and a cross-check of mlx-lm.
Usage: python ref_numpy.py MODEL_DIR GOLDEN.json [CASE ...] [--steps N] [--tol X]
No CASE: every case in the golden file. --steps: greedy steps compared (default 8; 0 = all the
golden has). Exits 1 if any case differs in top-10 ids or greedy tokens, or max|dlogit| > tol
(default 1e-3).
"""
import json, struct, sys, time
import numpy as np

args = sys.argv[1:]
def _opt(name, default, typ):
    if name in args:
        i = args.index(name); v = typ(args[i + 1]); del args[i:i + 2]; return v
    return default
n_steps, tol = _opt("--steps", 8, int), _opt("--tol", 1e-3, float)
d, golden = args[0], json.load(open(args[1]))
cases = args[2:] or list(golden["cases"])
cfg = json.load(open(f"{d}/config.json"))
tc, qc = cfg["text_config"], cfg["quantization"]

with open(f"{d}/model.safetensors", "rb") as fh:
    n = struct.unpack("<Q", fh.read(8))[0]
    hdr = json.loads(fh.read(n))
raw = np.memmap(f"{d}/model.safetensors", dtype=np.uint8, mode="r", offset=8 + n)
def T(name):
    v = hdr[name]; b = raw[v["data_offsets"][0]:v["data_offsets"][1]]
    if v["dtype"] == "BF16":
        a = (np.frombuffer(b, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        a = np.frombuffer(b, {"F32": "<f4", "U32": "<u4"}[v["dtype"]])
    return a.reshape(v["shape"]).astype(np.float64 if v["dtype"] != "U32" else np.uint32)

_cache = {}
def W(path):
    """Dequantized float64 weight of module `path` (MLX names, 'language_model.' prefix)."""
    if path in _cache: return _cache[path]
    if path + ".scales" not in hdr:
        w = T(path + ".weight")
    else:
        spec = qc.get(path, {}); bits = spec.get("bits", qc["bits"]); gs = spec.get("group_size", qc["group_size"])
        q = T(path + ".weight"); per = 32 // bits
        q = (q[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & ((1 << bits) - 1)  # little-end nibbles
        q = q.reshape(*q.shape[:-2], -1).astype(np.float64)
        s, b = T(path + ".scales"), T(path + ".biases")
        qg = q.reshape(*q.shape[:-1], -1, gs)
        w = (qg * s[..., None] + b[..., None]).reshape(q.shape)
    _cache[path] = w
    return w

eps = tc["rms_norm_eps"]
def rms(x, w, e=eps): return x / np.sqrt((x * x).mean(-1, keepdims=True) + e) * w
def silu(x): return x / (1 + np.exp(-x))
def sigmoid(x): return 1 / (1 + np.exp(-x))
def softplus(x): return np.logaddexp(0, x)

H, hd, nh, nkv = tc["hidden_size"], tc["head_dim"], tc["num_attention_heads"], tc["num_key_value_heads"]
Hk, Hv, Dk, Dv = tc["linear_num_key_heads"], tc["linear_num_value_heads"], tc["linear_key_head_dim"], tc["linear_value_head_dim"]
rd = int(hd * tc["rope_parameters"]["partial_rotary_factor"]); theta = tc["rope_parameters"]["rope_theta"]
E, topk = tc["num_experts"], tc["num_experts_per_tok"]

def gdn(p, x):
    Tn = x.shape[0]; kd = Hk * Dk
    qkv = x @ W(p + "in_proj_qkv").T
    z = (x @ W(p + "in_proj_z").T).reshape(Tn, Hv, Dv)
    b, a = x @ W(p + "in_proj_b").T, x @ W(p + "in_proj_a").T
    cw = T(p + "conv1d.weight")[:, :, 0]                    # MLX layout [C, K, 1]
    K = cw.shape[1]
    ci = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
    co = silu(sum(cw[:, k] * ci[k:k + Tn] for k in range(K)))  # causal depthwise conv
    q = co[:, :kd].reshape(Tn, Hk, Dk); k = co[:, kd:2 * kd].reshape(Tn, Hk, Dk); v = co[:, 2 * kd:].reshape(Tn, Hv, Dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * Dk ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, Hv // Hk, axis=1), np.repeat(k, Hv // Hk, axis=1)  # v-head h uses k-head h//(Hv/Hk)
    beta = sigmoid(b)
    g = np.exp(-np.exp(T(p + "A_log")) * softplus(a + T(p + "dt_bias")))
    S = np.zeros((Hv, Dv, Dk)); y = np.zeros((Tn, Hv, Dv))
    for t in range(Tn):
        S = S * g[t][:, None, None]
        delta = (v[t] - np.einsum("hvk,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + delta[:, :, None] * k[t][:, None, :]
        y[t] = np.einsum("hvk,hk->hv", S, q[t])
    y = rms(y, T(p + "norm.weight")) * silu(z)                 # gated RMSNorm, weight used as-is
    return y.reshape(Tn, -1) @ W(p + "out_proj").T

def rope(x, pos):
    inv = theta ** (-np.arange(0, rd, 2) / rd); ang = pos[:, None] * inv[None]   # [T, rd/2]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rd:]], -1)

def attn(p, x):
    Tn = x.shape[0]
    qg = (x @ W(p + "q_proj").T).reshape(Tn, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(Tn, nh * hd)
    k = (x @ W(p + "k_proj").T).reshape(Tn, nkv, hd); v = (x @ W(p + "v_proj").T).reshape(Tn, nkv, hd)
    pos = np.arange(Tn, dtype=np.float64)
    q, k = rope(rms(q, T(p + "q_norm.weight")), pos), rope(rms(k, T(p + "k_norm.weight")), pos)
    kh = np.repeat(k, nh // nkv, axis=1); vh = np.repeat(v, nh // nkv, axis=1)
    sc = np.einsum("qhd,khd->hqk", q, kh) * hd ** -0.5
    sc = sc + np.triu(np.full((Tn, Tn), -np.inf), 1)
    pr = np.exp(sc - sc.max(-1, keepdims=True)); pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", pr, vh).reshape(Tn, nh * hd)
    return (o * sigmoid(gate)) @ W(p + "o_proj").T

def mlp(p, x):
    return (silu(x @ W(p + "gate_proj").T) * (x @ W(p + "up_proj").T)) @ W(p + "down_proj").T

def moe(p, x):
    lg = x @ W(p + "gate").T
    pr = np.exp(lg - lg.max(-1, keepdims=True)); pr /= pr.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    Wg, Wu, Wd = W(p + "switch_mlp.gate_proj"), W(p + "switch_mlp.up_proj"), W(p + "switch_mlp.down_proj")
    for t in range(x.shape[0]):
        idx = np.argsort(-pr[t], kind="stable")[:topk]; sc = pr[t, idx] / pr[t, idx].sum()
        for e, s in zip(idx, sc):
            out[t] += s * ((silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])) @ Wd[e].T)
    return out + sigmoid(x @ W(p + "shared_expert_gate").T) * mlp(p + "shared_expert.", x)

def forward(ids, last_only=False):
    pre = "language_model.model."
    x = W(pre + "embed_tokens")[np.array(ids)]
    for l in range(tc["num_hidden_layers"]):
        p = f"{pre}layers.{l}."
        h = rms(x, T(p + "input_layernorm.weight"))
        x = x + (gdn(p + "linear_attn.", h) if (l + 1) % tc["full_attention_interval"] else attn(p + "self_attn.", h))
        x = x + moe(p + "mlp.", rms(x, T(p + "post_attention_layernorm.weight")))
    x = rms(x, T(pre + "norm.weight"))
    if last_only: x = x[-1:]
    return x @ W("language_model.lm_head").T

worst = 0.0; failed = []
for name in cases:
    c = golden["cases"][name]; ids = c["prompt_ids"]; t0 = time.time()
    lg = forward(ids)
    g = c["prefill_last"]; row = lg[-1]
    d_top = max(abs(row[i] - v) for i, v in zip(g["ids"], g["logits"]))
    same_top = list(np.argsort(-row, kind="stable")[:10]) == g["ids"]
    if "prefill_all_positions_top5" in c:
        for r, gp in zip(lg, c["prefill_all_positions_top5"]):
            d_top = max(d_top, max(abs(r[i] - v) for i, v in zip(gp["ids"], gp["logits"])))
    d_prefill = d_top
    gen, seq = [], list(ids)
    n_cmp = len(c["generated_ids"]) if n_steps <= 0 else min(n_steps, len(c["generated_ids"]))
    for j in range(n_cmp):      # greedy, recomputing the whole sequence
        row = forward(seq, last_only=True)[0] if j else lg[-1]
        tok = int(np.argmax(row)); gen.append(tok); seq.append(tok)
        if gen != c["generated_ids"][:j + 1]:
            break                                          # contexts differ from here on
        gs = c["steps"][j]; d_top = max(d_top, max(abs(row[i] - v) for i, v in zip(gs["ids"], gs["logits"])))
    worst = max(worst, d_top)
    ok = same_top and gen == c["generated_ids"][:n_cmp] and d_top <= tol
    if not ok: failed.append(name)
    print(f"{name:18s} T={len(ids):3d} top10_same={same_top} greedy{n_cmp}_same={gen == c['generated_ids'][:n_cmp]} "
          f"max|dlogit| vs golden({golden['precision']}): prefill {d_prefill:.2e}, all compared {d_top:.2e}  ({time.time()-t0:.1f}s)")
print(f"worst max|dlogit| = {worst:.3e}" + (f"  FAILED: {failed}" if failed else "  all cases agree"))
sys.exit(1 if failed else 0)
