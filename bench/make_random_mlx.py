#!/usr/bin/env python3
"""Writes a random-weight MLX-quantized Llama directory (mlx-lm's `convert -q` layout) for
benchmarking llmem's MLX path on shapes nobody has a file for.

    /usr/bin/python3 bench/make_random_mlx.py CONFIG_DIR OUT_DIR [--bits 4|8] [--group 32|64|128]

CONFIG_DIR holds a Llama config.json and tokenizer files (a `--load-format dummy` directory);
OUT_DIR gets them with `quantization: {group_size, bits}` added and one model.safetensors: every
projection and the embedding as U32 codes (uniform random) with bf16 scales and biases, norms
bf16 ones. The values mean nothing; the bytes and the work a token takes are a real model's.
"""
import argparse
import json
import os
import shutil
import struct

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--bits", type=int, choices=[4, 8], default=4)
    ap.add_argument("--group", type=int, choices=[32, 64, 128], default=64)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    for f in os.listdir(a.config_dir):
        if f.startswith("tokenizer") or f == "generation_config.json":
            shutil.copy(os.path.join(a.config_dir, f), a.out_dir)
    c = json.load(open(os.path.join(a.config_dir, "config.json")))
    c["quantization"] = {"group_size": a.group, "bits": a.bits}
    json.dump(c, open(os.path.join(a.out_dir, "config.json"), "w"), indent=1)
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    rng = np.random.default_rng(0)
    tensors = {}

    def bf16(x):
        return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def linear(name, rows, cols):
        tensors[name + ".weight"] = ("U32", rng.integers(0, 2**32, (rows, cols * a.bits // 32),
                                                         dtype=np.uint32))
        groups = (rows, cols // a.group)
        tensors[name + ".scales"] = ("BF16", bf16(rng.uniform(0.001, 0.01, groups)))
        tensors[name + ".biases"] = ("BF16", bf16(rng.uniform(-0.05, 0.0, groups)))

    linear("model.embed_tokens", vocab, hidden)
    if not c.get("tie_word_embeddings", False):
        linear("lm_head", vocab, hidden)
    tensors["model.norm.weight"] = ("BF16", bf16(np.ones(hidden)))
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        linear(p + "self_attn.q_proj", heads * head_dim, hidden)
        linear(p + "self_attn.k_proj", kv_heads * head_dim, hidden)
        linear(p + "self_attn.v_proj", kv_heads * head_dim, hidden)
        linear(p + "self_attn.o_proj", hidden, heads * head_dim)
        linear(p + "mlp.gate_proj", inter, hidden)
        linear(p + "mlp.up_proj", inter, hidden)
        linear(p + "mlp.down_proj", hidden, inter)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = ("BF16", bf16(np.ones(hidden)))
    header, offset = {}, 0
    for name, (dtype, x) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(x.shape),
                        "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(a.out_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, x in tensors.values():
            f.write(x.tobytes())
    print(f"wrote {a.out_dir}: {offset / 1e9:.2f} GB of tensors")


if __name__ == "__main__":
    main()
