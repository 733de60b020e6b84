#!/usr/bin/env python3
"""Writes the mixture-of-experts GGUF fixtures from tests/data/models (as llama.cpp's converter
lays such models out: the router as blk.N.ffn_gate_inp, each layer's experts stacked in
blk.N.ffn_{gate,up,down}_exps, ne {row length, rows, experts}):

  tiny-qwen3-moe-q8_0.gguf  tiny-qwen3-moe as qwen3moe: matrices Q8_0 (experts included), router,
                            norms F32; its dense layer 2 keeps ffn_{gate,up,down};
                            expert_weights_norm false as its norm_topk_prob
  tiny-mixtral-bf16.gguf    tiny-mixtral as llama with 4 experts: the safetensors' bf16 bits
                            unchanged (q/k rows permuted for interleaved RoPE, as for llama);
                            GGUF has no sliding window for llama

Usage (from the repository root; numpy and ../shared/tools/gguf-py):
  /usr/bin/python3 tests/data/gguf/make_moe_gguf.py [--shared /work/shared]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "models")


def load_safetensors(path):
    """name -> (dtype, array of the stored bits/values)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            f.seek(base + a)
            raw = f.read(b - a)
            dt = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[info["dtype"]]
            out[name] = (info["dtype"], np.frombuffer(raw, dtype=dt).reshape(info["shape"]))
        return out


def f32(entry):
    dtype, a = entry
    if dtype == "BF16":
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(np.float32)


def permute(w, n_heads):
    return np.ascontiguousarray(
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
        .reshape(w.shape))


def write(gguf, name, arch, out_path, qtype):
    d = os.path.join(MODELS, name)
    cfg = json.load(open(os.path.join(d, "config.json")))
    st = load_safetensors(os.path.join(d, "model.safetensors"))
    Q = gguf.GGMLQuantizationType
    qwen = cfg["model_type"] == "qwen3_moe"
    E = cfg["num_experts"] if qwen else cfg["num_local_experts"]
    fe = cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if qwen:
        w.add_expert_feed_forward_length(fe)
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))

    def mat(gname, entry, rows_permute=0):
        dtype, bits = entry
        if rows_permute:
            bits = permute(bits, rows_permute)
        if qtype == Q.BF16:
            assert dtype == "BF16"
            w.add_tensor(gname, np.ascontiguousarray(bits), raw_dtype=Q.BF16)
        else:
            x = f32((dtype, bits))
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(x), qtype),
                         raw_dtype=qtype)

    def vec(gname, entry):
        w.add_tensor(gname, np.ascontiguousarray(f32(entry)))

    mat("token_embd.weight", st["model.embed_tokens.weight"])
    for l in range(cfg["num_hidden_layers"]):
        p, h = "blk.%d." % l, "model.layers.%d." % l
        vec(p + "attn_norm.weight", st[h + "input_layernorm.weight"])
        mat(p + "attn_q.weight", st[h + "self_attn.q_proj.weight"], 0 if qwen else nh)
        mat(p + "attn_k.weight", st[h + "self_attn.k_proj.weight"], 0 if qwen else nkv)
        mat(p + "attn_v.weight", st[h + "self_attn.v_proj.weight"])
        mat(p + "attn_output.weight", st[h + "self_attn.o_proj.weight"])
        if qwen:
            vec(p + "attn_q_norm.weight", st[h + "self_attn.q_norm.weight"])
            vec(p + "attn_k_norm.weight", st[h + "self_attn.k_norm.weight"])
        vec(p + "ffn_norm.weight", st[h + "post_attention_layernorm.weight"])
        if qwen and l in cfg["mlp_only_layers"]:
            for g_, hf in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"),
                           ("ffn_down", "down_proj")):
                mat(p + g_ + ".weight", st[h + "mlp.%s.weight" % hf])
            continue
        block = h + ("mlp." if qwen else "block_sparse_moe.")
        vec_router = f32(st[block + "gate.weight"])
        w.add_tensor(p + "ffn_gate_inp.weight", np.ascontiguousarray(vec_router))
        names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        for g_, hf in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
            stacked = [st[block + "experts.%d.%s.weight" % (e, hf)] for e in range(E)]
            mat(p + g_ + ".weight", (stacked[0][0], np.stack([s[1] for s in stacked])))
    vec("output_norm.weight", st["model.norm.weight"])
    if not cfg["tie_word_embeddings"]:
        mat("output.weight", st["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(out_path, os.path.getsize(out_path), "bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(HERE, "..", "..", "..", "..", "shared"))
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(a.shared, "tools", "gguf-py"))
    import gguf
    Q = gguf.GGMLQuantizationType
    write(gguf, "tiny-qwen3-moe", "qwen3moe", os.path.join(HERE, "tiny-qwen3-moe-q8_0.gguf"),
          Q.Q8_0)
    write(gguf, "tiny-mixtral", "llama", os.path.join(HERE, "tiny-mixtral-bf16.gguf"), Q.BF16)


if __name__ == "__main__":
    main()
