#!/usr/bin/env python3
"""Write a random-weight GGUF with the exact tensor shapes of Qwen3.6-35B-A3B.

llama.cpp architecture: qwen35moe (src/models/qwen35moe.cpp).  No HF checkpoint,
no torch: the metadata and tensors are written directly with llama.cpp's own
gguf-py, and the tensor data is streamed to disk one tensor at a time (peak RAM
is about 2x the largest tensor, i.e. < 1 GB).

Quantisation presets (--qtype):
  q4_k_m  (default) the tensor-type mix that `llama-quantize ... Q4_K_M` picks for
          this model: Q4_K everywhere, Q6_K for output.weight and for
          attn_v/attn_qkv + ffn_down(_exps/_shexp) on the use_more_bits layers;
          F32 for norms, 1-D tensors, ffn_gate_inp and ssm_conv1d.
  q4_k    Q4_K everywhere (output.weight Q6_K)
  q4_0    Q4_0 everywhere (output.weight Q6_K, as llama-quantize Q4_0 does)
  q8_0    Q8_0 everywhere
Quantised blocks hold random bits with finite fp16 scales chosen so that each
matrix has a weight std of about 1/sqrt(fan_in).

Usage (tools/bench_h200.sh runs it on the GPU machine; --llama-dir is the unpacked
.device/peers/llama.cpp-src.tar.gz made by tools/peers/fetch_llamacpp.sh):
  python3 tools/peers/make_synth_gguf.py --llama-dir /tmp/lily-h200/llama.cpp --out /tmp/x.gguf   # 40 layers
  python3 tools/peers/make_synth_gguf.py --layers 4 --out /tmp/small.gguf --seed 1

Copied from the reference generator (shared/tools/peers/make_synth_gguf.py, 2026-11-29) so
that the comparison is reproducible from this repository; only the search path for llama.cpp
differs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------
# locate llama.cpp (for gguf-py and models/ggml-vocab-qwen35.gguf)
# --------------------------------------------------------------------------------------


def find_llama_dir(explicit: str | None) -> Path:
    # explicit > environment > where tools/bench_h200.sh unpacks it > the working directory
    cands = [explicit, os.environ.get("LLAMA_CPP_DIR"),
             Path("/tmp/lily-h200/llama.cpp"), Path.cwd() / "llama.cpp", Path.cwd()]
    for c in cands:
        if c and (Path(c) / "gguf-py" / "gguf" / "gguf_writer.py").is_file():
            return Path(c)
    sys.exit("error: llama.cpp source tree with gguf-py not found; pass --llama-dir or set LLAMA_CPP_DIR")


def import_gguf(llama_dir: Path):
    sys.path.insert(0, str(llama_dir / "gguf-py"))
    try:
        import yaml  # noqa: F401  (only gguf.metadata needs it, and we never call it)
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    import gguf  # type: ignore
    return gguf


# --------------------------------------------------------------------------------------
# model shape: Qwen3.6-35B-A3B text_config
# --------------------------------------------------------------------------------------

HP = dict(
    n_embd=2048,
    n_vocab=248320,
    n_ctx_train=262144,
    n_head=16,
    n_head_kv=2,
    head_dim=256,
    rope_theta=1.0e7,
    partial_rotary_factor=0.25,
    mrope_section=[11, 11, 10, 0],
    rms_eps=1e-6,
    n_expert=256,
    n_expert_used=8,
    n_ff_exp=512,
    n_ff_shexp=512,
    full_attention_interval=4,
    lin_k_heads=16,   # ssm.group_count
    lin_v_heads=32,   # ssm.time_step_rank
    lin_k_dim=128,    # ssm.state_size
    lin_v_dim=128,
    conv_kernel=4,
)

# block layout: (elements per block, bytes per block, [(byte offset of an fp16 scale, role)])
# role 'd' = main scale, 'dmin' = min scale (K-quants with mins)
QLAYOUT = {
    "Q4_0": (32, 18, [(0, "d")]),
    "Q8_0": (32, 34, [(0, "d")]),
    "Q4_K": (256, 144, [(0, "d"), (2, "dmin")]),   # d, dmin, scales[12], qs[128]
    "Q5_K": (256, 176, [(0, "d"), (2, "dmin")]),   # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (256, 210, [(208, "d")]),              # ql[128], qh[64], scales[16] (int8), d
}
# std of a dequantised weight in units of d, for uniformly random bits (see report):
#   Q4_0: d*(q-8)             q in 0..15            -> ~4.64 d
#   Q8_0: d*q                 q int8                -> ~73.9 d
#   Q4_K: d*sc*q - dmin*m     sc,m 6-bit, q 4-bit   -> ~257 d   with dmin = 7.5 d
#   Q5_K: d*sc*q - dmin*m     sc,m 6-bit, q 5-bit   -> ~525 d   with dmin = 15.5 d
#   Q6_K: d*sc*(q-32)         sc int8, q 6-bit      -> ~1366 d
QSTD = {"Q4_0": 4.64, "Q8_0": 73.9, "Q4_K": 257.0, "Q5_K": 525.0, "Q6_K": 1366.0}
QDMIN = {"Q4_K": 7.5, "Q5_K": 15.5}


def use_more_bits(i: int, n: int) -> bool:
    # llama-quant.cpp: i_layer < n/8 || i_layer >= 7*n/8 || (i_layer - n/8)%3 == 2
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class Spec:
    __slots__ = ("name", "ne", "qtype", "init", "std", "fan_in")

    def __init__(self, name, ne, qtype, init, std=None):
        self.name = name
        self.ne = tuple(int(x) for x in ne)   # ggml order: ne[0] is the contiguous dim
        self.qtype = qtype                      # 'F32', 'F16' or a key of QLAYOUT
        self.init = init                        # 'mat', 'ones', 'normal', 'ssm_a', 'ssm_dt'
        self.std = std


def build_plan(n_layers: int, qpreset: str, mtp: bool, fuse_qkv: bool, fuse_gate_up: bool):
    E = HP["n_embd"]
    V = HP["n_vocab"]
    hd = HP["head_dim"]
    nh, nkv = HP["n_head"], HP["n_head_kv"]
    nexp, ffe, ffs = HP["n_expert"], HP["n_ff_exp"], HP["n_ff_shexp"]
    key_dim = HP["lin_k_dim"] * HP["lin_k_heads"]          # 2048
    value_dim = HP["lin_v_dim"] * HP["lin_v_heads"]        # 4096
    conv_dim = 2 * key_dim + value_dim                     # 8192
    n_all = n_layers + (1 if mtp else 0)
    fai = HP["full_attention_interval"]

    def is_recr(il):
        return il < n_layers and (il + 1) % fai != 0

    base = {"q4_k_m": "Q4_K", "q4_k": "Q4_K", "q4_0": "Q4_0", "q8_0": "Q8_0"}[qpreset]
    out_type = "Q8_0" if base == "Q8_0" else "Q6_K"

    # llama-quantize's running index over attn_v-like tensors (attn_v and attn_qkv)
    n_attn_wv = n_all                       # exactly one attn_v-like tensor per block
    counters = {"wv": 0}

    def q(name, il=None):
        if qpreset != "q4_k_m":
            return base
        if name.endswith("attn_v.weight") or name.endswith("attn_qkv.weight"):
            i = counters["wv"]
            counters["wv"] += 1
            return "Q6_K" if use_more_bits(i, n_attn_wv) else "Q4_K"
        if "ffn_down" in name:
            return "Q6_K" if use_more_bits(il, n_all) else "Q4_K"
        return "Q4_K"

    P = []

    def mat(name, ne, il=None, qt=None):
        P.append(Spec(name, ne, qt or q(name, il), "mat", 1.0 / math.sqrt(ne[0])))

    def vec(name, ne, init="ones", std=None):
        P.append(Spec(name, ne, "F32", init, std))

    mat("token_embd.weight", (E, V))

    def attn_full(il):
        b = f"blk.{il}."
        if fuse_qkv:
            mat(b + "attn_qkv.weight", (E, hd * nh * 2 + 2 * hd * nkv), il)
        else:
            mat(b + "attn_q.weight", (E, hd * nh * 2), il)     # query + output gate
            mat(b + "attn_k.weight", (E, hd * nkv), il)
            mat(b + "attn_v.weight", (E, hd * nkv), il)
        mat(b + "attn_output.weight", (hd * nh, E), il)
        vec(b + "attn_q_norm.weight", (hd,))
        vec(b + "attn_k_norm.weight", (hd,))

    def moe(il):
        b = f"blk.{il}."
        P.append(Spec(b + "ffn_gate_inp.weight", (E, nexp), "F32", "normal", 1.0 / math.sqrt(E)))
        if fuse_gate_up:
            mat(b + "ffn_gate_up_exps.weight", (E, 2 * ffe, nexp), il)
        else:
            mat(b + "ffn_gate_exps.weight", (E, ffe, nexp), il)
            mat(b + "ffn_up_exps.weight", (E, ffe, nexp), il)
        mat(b + "ffn_down_exps.weight", (ffe, E, nexp), il)
        vec(b + "ffn_gate_inp_shexp.weight", (E,), "normal", 1.0 / math.sqrt(E))
        mat(b + "ffn_gate_shexp.weight", (E, ffs), il)
        mat(b + "ffn_up_shexp.weight", (E, ffs), il)
        mat(b + "ffn_down_shexp.weight", (ffs, E), il)

    for il in range(n_layers):
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", (E,))
        if is_recr(il):
            # Gated DeltaNet ("linear_attention") block
            mat(b + "attn_qkv.weight", (E, conv_dim), il)
            mat(b + "attn_gate.weight", (E, value_dim), il)
            P.append(Spec(b + "ssm_conv1d.weight", (HP["conv_kernel"], conv_dim), "F32", "normal", 0.5))
            P.append(Spec(b + "ssm_dt.bias", (HP["lin_v_heads"],), "F32", "ssm_dt"))
            P.append(Spec(b + "ssm_a", (HP["lin_v_heads"],), "F32", "ssm_a"))
            mat(b + "ssm_beta.weight", (E, HP["lin_v_heads"]), il)
            mat(b + "ssm_alpha.weight", (E, HP["lin_v_heads"]), il)
            vec(b + "ssm_norm.weight", (HP["lin_v_dim"],))
            mat(b + "ssm_out.weight", (value_dim, E), il)
        else:
            attn_full(il)
        vec(b + "post_attention_norm.weight", (E,))
        moe(il)

    if mtp:  # one MTP/NextN block, exported by convert_hf_to_gguf.py unless --no-mtp
        il = n_layers
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", (E,))
        attn_full(il)
        vec(b + "post_attention_norm.weight", (E,))
        moe(il)
        mat(b + "nextn.eh_proj.weight", (2 * E, E), il)
        vec(b + "nextn.enorm.weight", (E,))
        vec(b + "nextn.hnorm.weight", (E,))
        vec(b + "nextn.shared_head_norm.weight", (E,))

    vec("output_norm.weight", (E,))
    mat("output.weight", (E, V), qt=out_type)
    return P, n_all, [is_recr(i) for i in range(n_all)]


# --------------------------------------------------------------------------------------
# data generation
# --------------------------------------------------------------------------------------

class Gen:
    def __init__(self, seed: int):
        self.bitgen = np.random.SFC64(seed)
        self.rng = np.random.Generator(self.bitgen)

    def rand_bytes(self, nbytes: int) -> np.ndarray:
        nw = (nbytes + 7) // 8
        buf = self.bitgen.random_raw(nw).view(np.uint8)
        return buf[:nbytes] if buf.size != nbytes else buf

    def quant(self, s: Spec, gguf) -> np.ndarray:
        blk, bsz, fields = QLAYOUT[s.qtype]
        n = math.prod(s.ne)
        assert s.ne[0] % blk == 0, (s.name, s.ne, s.qtype)
        nb = n // blk
        raw = self.rand_bytes(nb * bsz).reshape(nb, bsz)
        d0 = s.std / QSTD[s.qtype]
        # 256-entry table of per-block scales (d0 * U[0.75, 1.25)), indexed by a random byte
        jit = 0.75 + 0.5 * self.rng.random(256)
        scale_bytes = {o + k for o, _ in fields for k in (0, 1)}
        col = bsz - 1 if (bsz - 1) not in scale_bytes else 0   # a quant byte, never a scale byte
        idx = raw[:, col].copy()
        for off, role in fields:
            val = d0 * jit
            if role == "dmin":
                val = val * QDMIN[s.qtype]
            tab = val.astype(np.float16).view(np.uint8).reshape(256, 2)
            raw[:, off:off + 2] = tab[idx]
        return raw.reshape(-1)

    def f32(self, s: Spec) -> np.ndarray:
        n = math.prod(s.ne)
        if s.init == "ones":
            return (1.0 + 0.02 * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        if s.init == "normal":
            return (s.std * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        if s.init == "ssm_a":      # -exp(A_log), A ~ U(1, 16)
            return (-self.rng.uniform(1.0, 16.0, n)).astype(np.float32)
        if s.init == "ssm_dt":     # dt_bias
            return self.rng.uniform(-2.0, 0.5, n).astype(np.float32)
        raise ValueError(s.init)


def nbytes_of(s: Spec) -> int:
    n = math.prod(s.ne)
    if s.qtype == "F32":
        return 4 * n
    if s.qtype == "F16":
        return 2 * n
    blk, bsz, _ = QLAYOUT[s.qtype]
    return n // blk * bsz


# --------------------------------------------------------------------------------------
# vocabulary
# --------------------------------------------------------------------------------------

def load_vocab(gguf, path: Path, n_vocab: int):
    r = gguf.GGUFReader(str(path))

    def get(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    tokens = list(get("tokenizer.ggml.tokens"))
    ttypes = [int(x) for x in get("tokenizer.ggml.token_type")]
    merges = get("tokenizer.ggml.merges")
    if len(tokens) > n_vocab:
        sys.exit(f"error: vocab file has {len(tokens)} tokens > n_vocab {n_vocab}")
    n_pad = n_vocab - len(tokens)
    # pad exactly like convert_hf_to_gguf.py does when config.vocab_size > tokenizer size
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        ttypes.append(int(gguf.TokenType.UNUSED))
    meta = dict(
        model=get("tokenizer.ggml.model") or "gpt2",
        pre=get("tokenizer.ggml.pre") or "qwen35",
        tokens=tokens, ttypes=ttypes, merges=list(merges) if merges is not None else None,
        ids={k: get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")},
        chat_template=get("tokenizer.chat_template"),
        n_pad=n_pad,
    )
    return meta


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40, help="number of decoder layers (layer i is full attention iff i%%4==3)")
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qtype", default="q4_k_m", choices=["q4_k_m", "q4_k", "q4_0", "q8_0"])
    ap.add_argument("--mtp", action="store_true", help="also write the MTP/NextN block (blk.N, nextn_predict_layers=1) "
                    "as convert_hf_to_gguf.py does by default; llama-bench does not load it")
    ap.add_argument("--fuse-qkv", action="store_true", help="fused attn_qkv for full-attention layers (converter --fuse-qkv)")
    ap.add_argument("--fuse-gate-up", action="store_true", help="fused ffn_gate_up_exps (converter --fuse-gate-up-exps)")
    ap.add_argument("--llama-dir", default=None, help="llama.cpp source tree (for gguf-py and the vocab)")
    ap.add_argument("--vocab", default=None, help="GGUF to copy the tokenizer from (default <llama-dir>/models/ggml-vocab-qwen35.gguf)")
    ap.add_argument("--dry-run", action="store_true", help="print the tensor plan and size, write nothing")
    args = ap.parse_args()

    if args.layers < 1:
        sys.exit("error: --layers must be >= 1")

    llama_dir = find_llama_dir(args.llama_dir)
    gguf = import_gguf(llama_dir)
    T = gguf.GGMLQuantizationType

    plan, n_all, recr = build_plan(args.layers, args.qtype, args.mtp, args.fuse_qkv, args.fuse_gate_up)
    total = sum(nbytes_of(s) for s in plan)
    n_params = sum(math.prod(s.ne) for s in plan)
    by_type: dict[str, int] = {}
    for s in plan:
        by_type[s.qtype] = by_type.get(s.qtype, 0) + nbytes_of(s)
    print(f"[synth] layers={args.layers} (+mtp={int(args.mtp)}) qtype={args.qtype} tensors={len(plan)} "
          f"params={n_params/1e9:.3f} B data={total/2**30:.2f} GiB ({total/1e9:.2f} GB)", flush=True)
    print("[synth] bytes by type: " + ", ".join(f"{k} {v/2**30:.2f} GiB" for k, v in sorted(by_type.items())), flush=True)
    if args.dry_run:
        for s in plan:
            print(f"  {s.name:40s} {str(list(s.ne)):22s} {s.qtype}")
        return

    vocab_path = Path(args.vocab) if args.vocab else llama_dir / "models" / "ggml-vocab-qwen35.gguf"
    t0 = time.time()
    vocab = load_vocab(gguf, vocab_path, HP["n_vocab"])
    print(f"[synth] vocab: {len(vocab['tokens'])} tokens ({vocab['n_pad']} [PAD] added), "
          f"{len(vocab['merges'] or [])} merges, pre={vocab['pre']} ({time.time()-t0:.1f}s)", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "qwen35moe")

    ftype = {"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[args.qtype]

    # ---- metadata: what convert_hf_to_gguf.py (Qwen3_5MoeTextModel) writes for this config ----
    w.add_name(f"Qwen3.6-35B-A3B synthetic random weights ({args.layers} layers, {args.qtype})")
    w.add_block_count(n_all)
    w.add_context_length(HP["n_ctx_train"])
    w.add_embedding_length(HP["n_embd"])
    w.add_head_count(HP["n_head"])
    w.add_head_count_kv(HP["n_head_kv"])
    w.add_rope_dimension_sections(HP["mrope_section"])
    w.add_rope_freq_base(HP["rope_theta"])
    w.add_layer_norm_rms_eps(HP["rms_eps"])
    w.add_expert_count(HP["n_expert"])
    w.add_expert_used_count(HP["n_expert_used"])
    w.add_key_length(HP["head_dim"])
    w.add_value_length(HP["head_dim"])
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_expert_feed_forward_length(HP["n_ff_exp"])
    w.add_expert_shared_feed_forward_length(HP["n_ff_shexp"])
    if args.mtp:
        w.add_nextn_predict_layers(1)
    w.add_ssm_conv_kernel(HP["conv_kernel"])
    w.add_ssm_state_size(HP["lin_k_dim"])
    w.add_ssm_group_count(HP["lin_k_heads"])
    w.add_ssm_time_step_rank(HP["lin_v_heads"])
    w.add_ssm_inner_size(HP["lin_v_dim"] * HP["lin_v_heads"])
    w.add_recurrent_layers([bool(x) for x in recr])
    w.add_full_attention_interval(HP["full_attention_interval"])
    w.add_rope_dimension_count(int(HP["head_dim"] * HP["partial_rotary_factor"]))

    # ---- tokenizer ----
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["ttypes"])
    if vocab["merges"]:
        w.add_token_merges(vocab["merges"])
    for k, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                  ("padding", w.add_pad_token_id), ("unknown", w.add_unk_token_id)):
        if vocab["ids"].get(k) is not None:
            fn(int(vocab["ids"][k]))
    w.add_add_bos_token(False)
    if vocab["chat_template"]:
        w.add_chat_template(vocab["chat_template"])

    # ---- tensor infos, then stream the data tensor by tensor ----
    for s in plan:
        shape = tuple(reversed(s.ne))                      # numpy order
        w.add_tensor_info(s.name, shape, np.dtype(np.float32), nbytes_of(s), raw_dtype=T[s.qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    g = Gen(args.seed)
    t1 = time.time()
    done = 0
    last = t1
    for i, s in enumerate(plan):
        arr = g.f32(s) if s.qtype == "F32" else g.quant(s, gguf)
        assert arr.nbytes == nbytes_of(s), (s.name, arr.nbytes, nbytes_of(s))
        w.write_tensor_data(arr)
        done += arr.nbytes
        del arr
        now = time.time()
        if now - last > 5 or i == len(plan) - 1:
            last = now
            print(f"[synth] {i+1}/{len(plan)} tensors, {done/2**30:.1f}/{total/2**30:.1f} GiB, "
                  f"{done/2**20/max(now-t1,1e-6):.0f} MiB/s", flush=True)
    w.close()
    sz = out.stat().st_size
    print(f"[synth] wrote {out} : {sz/2**30:.2f} GiB ({sz} bytes) in {time.time()-t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
