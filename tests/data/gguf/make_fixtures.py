#!/usr/bin/env python3
"""Writes the GGUF fixtures of tests/test-gguf.c and what gguf-py reads in them (facts.json).

  pycoder-q4_k_m.gguf  models/pycoder (llama) through ../shared/tools/hf_to_gguf_minimal.py (bf16)
                       and llama.cpp's llama-quantize at Q4_K_M (Q4_K and Q6_K tensors, F32 norms)
  tiny-qwen3.gguf      a random 2-layer qwen3 written by gguf-py: Q8_0, F16 and F32 tensors, q/k
                       norms, an untied output, key_length ≠ hidden / heads, context_length as u64,
                       and one key of every metadata value type (test.*)
  tiny-qwen2.gguf      a random 1-layer qwen2: q/k/v biases, tied embeddings, no key_length,
                       general.alignment 64
  facts.json           per file, as gguf-py's GGUFReader reads it: version, alignment, the data
                       section's offset, every key's type and value (arrays: length, element type,
                       first elements), every tensor's name, ggml type, dims, bytes and offset;
                       and the geometry the C reader must derive

Usage (from the repository root; llama.cpp's CPU build unpacked in /tmp, see
../shared/models/README.md):
  tar -xJf /work/shared/peers/llama.cpp-cpu.tar.xz -C /tmp
  /usr/bin/python3 tests/data/gguf/make_fixtures.py [--shared /work/shared] [--quantize BIN]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def tiny_model(gguf, path, arch, n_layers, hidden, heads, kv_heads, head_dim, ffn, vocab, seed,
               qk_norm, bias, tied, key_length, alignment, extra_keys):
    rng = np.random.default_rng(seed)
    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if key_length:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    extra_keys(w)

    def mat(name, rows, cols, qtype):
        x = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        if qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qtype == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.01 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, hidden, Q.Q8_0)
    for i in range(n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", hidden)
        mat(p + "attn_q.weight", heads * head_dim, hidden, Q.Q8_0)
        mat(p + "attn_k.weight", kv_heads * head_dim, hidden, Q.Q8_0)
        mat(p + "attn_v.weight", kv_heads * head_dim, hidden, Q.Q8_0)
        if bias:
            vec(p + "attn_q.bias", heads * head_dim)
            vec(p + "attn_k.bias", kv_heads * head_dim)
            vec(p + "attn_v.bias", kv_heads * head_dim)
        if qk_norm:
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        mat(p + "attn_output.weight", hidden, heads * head_dim, Q.Q8_0)
        vec(p + "ffn_norm.weight", hidden)
        mat(p + "ffn_gate.weight", ffn, hidden, Q.F16)
        mat(p + "ffn_up.weight", ffn, hidden, Q.F16)
        mat(p + "ffn_down.weight", hidden, ffn, Q.Q8_0)
    vec("output_norm.weight", hidden)
    if not tied:
        mat("output.weight", vocab, hidden, Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def qwen3_keys(gguf):
    V = gguf.GGUFValueType

    def add(w):
        # context_length as u64: writers differ in the integer width they use
        w.add_key_value("qwen3.context_length", 4096, V.UINT64)
        w.add_uint8("test.u8", 200)
        w.add_int8("test.i8", -100)
        w.add_uint16("test.u16", 60000)
        w.add_int16("test.i16", -30000)
        w.add_uint32("test.u32", 4000000000)
        w.add_int32("test.i32", -2000000000)
        w.add_float32("test.f32", 0.25)
        w.add_bool("test.bool", True)
        w.add_string("test.string", "héllo")
        w.add_uint64("test.u64", 2**63 + 5)
        w.add_int64("test.i64", -(2**40))
        w.add_float64("test.f64", -1.5e300)
        w.add_array("test.array_i32", [1, -2, 3])
        w.add_array("test.array_f32", [0.5, -0.25])
        w.add_array("test.array_string", ["a", "", "ccc"])
        w.add_key_value("test.array_bool", [True, False], V.ARRAY, V.BOOL)
        w.add_key_value("test.array_u8", [7], V.ARRAY, V.UINT8)
    return add


def qwen2_keys(gguf):
    def add(w):
        w.add_context_length(32768)
    return add


def value_json(gguf, field):
    V = gguf.GGUFValueType
    t = field.types[0]
    out = {"type": int(t)}
    if t == V.ARRAY:
        out["elem_type"] = int(field.types[-1])
        out["n"] = len(field.data)
        out["first"] = [field.contents(i) for i in range(min(4, len(field.data)))]
    else:
        v = field.contents()
        out["value"] = v if not isinstance(v, float) else repr(v)
    return out


def facts(gguf, path, geometry):
    r = gguf.GGUFReader(path)
    kv = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        kv[name] = value_json(gguf, field)
    tensors = []
    for t in r.tensors:
        tensors.append({
            "name": t.name,
            "type": int(t.tensor_type),
            "dims": [int(d) for d in t.shape],
            "n_elements": int(t.n_elements),
            "n_bytes": int(t.n_bytes),
            "offset": int(t.data_offset - r.data_offset),
        })
    return {
        "file": os.path.basename(path),
        "bytes": os.path.getsize(path),
        "version": int(r.fields["GGUF.version"].contents()),
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "kv": kv,
        "tensors": tensors,
        "geometry": geometry,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared"))
    ap.add_argument("--quantize", default="/tmp/llama.cpp-cpu/bin/llama-quantize")
    a = ap.parse_args()
    shared = os.path.abspath(a.shared)
    sys.path.insert(0, os.path.join(shared, "tools", "gguf-py"))
    import gguf

    out = {}
    pycoder = os.path.join(HERE, "pycoder-q4_k_m.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = os.path.join(tmp, "pycoder-bf16.gguf")
        subprocess.run([sys.executable, os.path.join(shared, "tools", "hf_to_gguf_minimal.py"),
                        os.path.join(ROOT, "models", "pycoder"), bf16, "--gguf-py",
                        os.path.join(shared, "tools", "gguf-py")], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.path.dirname(a.quantize), "..",
                                                            "lib"))
        subprocess.run([a.quantize, bf16, pycoder, "Q4_K_M"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(ROOT, "models", "pycoder", "config.json")))
    out["pycoder"] = facts(gguf, pycoder, {
        "arch": "llama", "n_layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
        "n_heads": cfg["num_attention_heads"], "n_kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"], "max_context": cfg["max_position_embeddings"],
        "tied_embeddings": 1, "attention_bias": 0, "qk_norm": 0})

    q3 = os.path.join(HERE, "tiny-qwen3.gguf")
    tiny_model(gguf, q3, "qwen3", n_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32,
               ffn=128, vocab=96, seed=3, qk_norm=True, bias=False, tied=False, key_length=True,
               alignment=None, extra_keys=qwen3_keys(gguf))
    out["tiny-qwen3"] = facts(gguf, q3, {
        "arch": "qwen3", "n_layers": 2, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 2,
        "head_dim": 32, "intermediate_size": 128, "vocab_size": 96, "max_context": 4096,
        "tied_embeddings": 0, "attention_bias": 0, "qk_norm": 1})

    q2 = os.path.join(HERE, "tiny-qwen2.gguf")
    tiny_model(gguf, q2, "qwen2", n_layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32,
               ffn=96, vocab=64, seed=2, qk_norm=False, bias=True, tied=True, key_length=False,
               alignment=64, extra_keys=qwen2_keys(gguf))
    out["tiny-qwen2"] = facts(gguf, q2, {
        "arch": "qwen2", "n_layers": 1, "hidden_size": 64, "n_heads": 2, "n_kv_heads": 1,
        "head_dim": 32, "intermediate_size": 96, "vocab_size": 64, "max_context": 32768,
        "tied_embeddings": 1, "attention_bias": 1, "qk_norm": 0})

    with open(os.path.join(HERE, "facts.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
