#!/usr/bin/env python3
"""Writes a random-weight Qwen3-MoE model straight into a GGUF file (qwen3moe, llama.cpp's layout:
router blk.N.ffn_gate_inp F32, experts stacked in blk.N.ffn_{gate,up,down}_exps), streamed tensor
by tensor so that memory holds one tensor at a time — for benchmarking llmem beside llama.cpp on
one file, with no intermediate checkpoint on disk.

The default shape is Qwen3-30B-A3B's layer scaled to a small machine: hidden 2048, 16 layers,
32/4 heads × 128, 64 experts of width 768, top 8, pycoder's 4,096-token vocabulary (about 5.1B
parameters, 0.9B active). Q8_0 blocks are drawn directly (random codes and scales), so that a
15B-parameter file takes seconds, not a quantizer's minutes. The tokenizer keys are pycoder's (gpt2 BPE) so that both engines can
tokenize.

  /usr/bin/python3 bench/make_moe_gguf.py OUT.gguf [--type bf16|q8_0] [--gguf-py DIR]
      [--hidden 2048] [--layers 16] [--heads 32] [--kv-heads 4] [--head-dim 128]
      [--experts 64] [--top-k 8] [--expert-ffn 768] [--tokenizer models/pycoder/tokenizer.json]
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--type", choices=["bf16", "q8_0"], default="bf16")
    ap.add_argument("--gguf-py", default=os.path.join(ROOT, "..", "shared", "tools", "gguf-py"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=768)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "models", "pycoder",
                                                        "tokenizer.json"))
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf
    Q = gguf.GGMLQuantizationType
    qtype = Q.BF16 if a.type == "bf16" else Q.Q8_0

    tok = json.load(open(a.tokenizer))
    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    n_vocab = max(list(vocab.values()) + list(added.values())) + 1
    tokens = [""] * n_vocab
    types = [1] * n_vocab
    for t, i in vocab.items():
        tokens[i] = t
    for t, i in added.items():
        tokens[i] = t
        types[i] = 3
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]

    h, hd, E, fe = a.hidden, a.head_dim, a.experts, a.expert_ffn
    q, kv = a.heads * hd, a.kv_heads * hd
    w = gguf.GGUFWriter(a.out, "qwen3moe")
    w.add_name("random-qwen3moe-%dx%d" % (a.layers, E))
    w.add_block_count(a.layers)
    w.add_embedding_length(h)
    w.add_feed_forward_length(fe)
    w.add_expert_feed_forward_length(fe)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_context_length(40960)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(a.top_k)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if a.type == "bf16"
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)

    # (name, shape outermost first, matrix?) in file order
    plan = [("token_embd.weight", (n_vocab, h), True)]
    for l in range(a.layers):
        p = "blk.%d." % l
        plan += [(p + "attn_norm.weight", (h,), False),
                 (p + "attn_q.weight", (q, h), True), (p + "attn_k.weight", (kv, h), True),
                 (p + "attn_v.weight", (kv, h), True), (p + "attn_output.weight", (h, q), True),
                 (p + "attn_q_norm.weight", (hd,), False), (p + "attn_k_norm.weight", (hd,), False),
                 (p + "ffn_norm.weight", (h,), False),
                 (p + "ffn_gate_inp.weight", (E, h), False),
                 (p + "ffn_gate_exps.weight", (E, fe, h), True),
                 (p + "ffn_up_exps.weight", (E, fe, h), True),
                 (p + "ffn_down_exps.weight", (E, h, fe), True)]
    plan += [("output_norm.weight", (h,), False), ("output.weight", (n_vocab, h), True)]

    def nbytes(shape, matrix):
        n = int(np.prod(shape))
        if not matrix:
            return 4 * n
        return 2 * n if qtype == Q.BF16 else n // 32 * 34

    for name, shape, matrix in plan:
        if matrix:
            byte_shape = list(shape) if qtype == Q.BF16 else list(shape[:-1]) + [shape[-1] // 32 * 34]
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint16 if qtype == Q.BF16 else np.uint8),
                              nbytes(shape, matrix), raw_dtype=qtype)
        else:
            w.add_tensor_info(name, list(shape), np.dtype(np.float32), nbytes(shape, matrix))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    total = sum(nbytes(s, m) for _, s, m in plan)
    done = 0
    for name, shape, matrix in plan:
        if not matrix:
            if "ffn_gate_inp" in name:
                t = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
            else:
                t = np.ones(shape, dtype=np.float32)
        else:
            if qtype == Q.BF16:
                x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
                bits = x.view(np.uint32)
                t = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            else:  # Q8_0 blocks drawn directly: a scale near 0.06 / 127 and 32 random codes
                nb = int(np.prod(shape)) // 32
                blocks = np.empty((nb, 34), dtype=np.uint8)
                d = (rng.random(nb, dtype=np.float32) * 0.2 + 0.9) * np.float32(0.06 / 127)
                blocks[:, :2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
                blocks[:, 2:] = rng.integers(-127, 128, size=(nb, 32), dtype=np.int8).view(np.uint8)
                t = blocks.reshape(list(shape[:-1]) + [shape[-1] // 32 * 34])
        w.write_tensor_data(t)
        done += t.nbytes
        print("\r%s: %5.1f%%" % (a.out, 100.0 * done / total), end="", file=sys.stderr)
    w.close()
    print("\n%s: %d bytes" % (a.out, os.path.getsize(a.out)), file=sys.stderr)


if __name__ == "__main__":
    main()
