#!/usr/bin/env python3
# Makes the two mixture-of-experts reference models of tests/data/models (numpy only):
#
#   tiny-qwen3-moe  Qwen3-MoE: q/k norms, GQA 4/2, 8 experts of which a token runs 4, the top 4's
#                   probabilities not renormalized (norm_topk_prob false), layer 2 dense
#                   (mlp_only_layers), tied embeddings; tiny-qwen3's tokenizer
#   tiny-mixtral    Mixtral: 4 experts, top 2 (always renormalized), GQA 2/1, a sliding window of
#                   32 under tiny-mistral-swa's 120-token prompt, untied; tiny-mistral-swa's
#                   tokenizer
#
# Weights are seeded normal values rounded to bf16 (the experts one tensor each, named as the
# Hub's checkpoints name them), written as one model.safetensors with config.json,
# generation_config.json and the tokenizer files of the model named above. The prompts and
# tokenizer cases are that model's (same tokenizer, same ids).
#
# It also writes first references (reference.json, ref_logits_<i>.npy: greedy continuation and
# teacher-forced logits in f32) from a numpy port of transformers' Qwen3MoeForCausalLM and
# MixtralForCausalLM in f32 (eager attention, f32 rotary frequencies, softmax routing in f32), for
# a machine without torch. The references in the tree are transformers' own:
# `make_references.py --model tiny-qwen3-moe --model tiny-mixtral models` (transformers 5.17; the
# port's logits were within 2.2e-6 of them, the greedy tokens the same).
#
#   /usr/bin/python3 tests/data/make_moe_models.py
import json
import os
import shutil
import struct

import numpy as np

DATA = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(DATA, "models")
N_NEW = 40

SPECS = {
    "tiny-qwen3-moe": dict(
        source="tiny-qwen3",
        config={
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 96, "intermediate_size": 192, "moe_intermediate_size": 64,
            "num_experts": 8, "num_experts_per_tok": 4, "norm_topk_prob": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [2], "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 4096,
            "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16"}),
    "tiny-mixtral": dict(
        source="tiny-mistral-swa",
        config={
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "hidden_size": 64, "intermediate_size": 128, "num_local_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "sliding_window": 32, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}),
}


def bf16_round(a):
    """f32 → bf16 (round to nearest even) → f32, and the bf16 bits."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    half = bits.astype(np.uint16)
    return (half.astype(np.uint32) << 16).view(np.float32), half


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name in sorted(tensors):
        half = tensors[name]
        raw = half.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(half.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def make_weights(name, cfg, vocab, rng):
    """The checkpoint's tensors (f32 values, bf16 bits) with the Hub's names."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qwen = cfg["model_type"] == "qwen3_moe"
    E = cfg["num_experts"] if qwen else cfg["num_local_experts"]
    inter_e = cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"]
    w = {}

    def param(key, shape, norm=False):
        v = rng.normal(0.0, 0.2 if len(shape) == 1 else 0.08, shape).astype(np.float32)
        if norm:
            v += 1.0
        w[key] = bf16_round(v)

    param("model.embed_tokens.weight", (vocab, h))
    param("model.norm.weight", (h,), norm=True)
    if not cfg["tie_word_embeddings"]:
        param("lm_head.weight", (vocab, h))
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        param(p + "input_layernorm.weight", (h,), norm=True)
        param(p + "post_attention_layernorm.weight", (h,), norm=True)
        param(p + "self_attn.q_proj.weight", (nh * hd, h))
        param(p + "self_attn.k_proj.weight", (nkv * hd, h))
        param(p + "self_attn.v_proj.weight", (nkv * hd, h))
        param(p + "self_attn.o_proj.weight", (h, nh * hd))
        if qwen:
            param(p + "self_attn.q_norm.weight", (hd,), norm=True)
            param(p + "self_attn.k_norm.weight", (hd,), norm=True)
        if qwen and l in cfg["mlp_only_layers"]:
            param(p + "mlp.gate_proj.weight", (cfg["intermediate_size"], h))
            param(p + "mlp.up_proj.weight", (cfg["intermediate_size"], h))
            param(p + "mlp.down_proj.weight", (h, cfg["intermediate_size"]))
            continue
        block = p + ("mlp." if qwen else "block_sparse_moe.")
        param(block + "gate.weight", (E, h))
        names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        for e in range(E):
            param(block + "experts.%d.%s.weight" % (e, names[0]), (inter_e, h))
            param(block + "experts.%d.%s.weight" % (e, names[1]), (inter_e, h))
            param(block + "experts.%d.%s.weight" % (e, names[2]), (h, inter_e))
    return w


# ---- the numpy port of the forward pass (f32) ---------------------------------------------------

def rmsnorm(x, weight, eps):
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return weight * (x / np.sqrt(var + np.float32(eps))).astype(np.float32)


def silu(x):
    return x / (np.float32(1) + np.exp(-x))


def forward(cfg, W, ids):
    """Teacher-forced logits [len(ids), vocab] of the whole sequence."""
    f32 = np.float32
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps = cfg["rms_norm_eps"]
    qwen = cfg["model_type"] == "qwen3_moe"
    E = cfg["num_experts"] if qwen else cfg["num_local_experts"]
    k = cfg["num_experts_per_tok"]
    norm_topk = cfg["norm_topk_prob"] if qwen else True
    window = cfg.get("sliding_window") if not qwen else None
    T = len(ids)
    g = lambda key: W[key][0]

    inv_freq = (1.0 / (f32(cfg["rope_theta"]) ** (np.arange(0, hd, 2, dtype=np.int64)
                                                  .astype(f32) / f32(hd)))).astype(f32)
    freqs = np.arange(T, dtype=f32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(f32), np.sin(emb).astype(f32)

    def rope(x):  # x [T, heads, hd], the halves rotated
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        rot = np.concatenate([-x2, x1], axis=-1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    pos = np.arange(T)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed &= (pos[:, None] - pos[None, :]) < window

    x = g("model.embed_tokens.weight")[np.asarray(ids)].astype(f32)
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        xn = rmsnorm(x, g(p + "input_layernorm.weight"), eps)
        q = (xn @ g(p + "self_attn.q_proj.weight").T).reshape(T, nh, hd)
        kk = (xn @ g(p + "self_attn.k_proj.weight").T).reshape(T, nkv, hd)
        v = (xn @ g(p + "self_attn.v_proj.weight").T).reshape(T, nkv, hd)
        if qwen:
            q = rmsnorm(q, g(p + "self_attn.q_norm.weight"), eps)
            kk = rmsnorm(kk, g(p + "self_attn.k_norm.weight"), eps)
        q, kk = rope(q), rope(kk)
        out = np.zeros((T, nh, hd), dtype=f32)
        for head in range(nh):
            kvh = head // (nh // nkv)
            s = (q[:, head, :] @ kk[:, kvh, :].T) * f32(hd ** -0.5)
            s = np.where(allowed, s, -np.inf).astype(f32)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s = s / s.sum(axis=-1, keepdims=True)
            out[:, head, :] = s @ v[:, kvh, :]
        x = x + out.reshape(T, nh * hd) @ g(p + "self_attn.o_proj.weight").T
        xn = rmsnorm(x, g(p + "post_attention_layernorm.weight"), eps)
        if qwen and l in cfg["mlp_only_layers"]:
            y = (silu(xn @ g(p + "mlp.gate_proj.weight").T) * (xn @ g(p + "mlp.up_proj.weight").T)
                 ) @ g(p + "mlp.down_proj.weight").T
        else:
            block = p + ("mlp." if qwen else "block_sparse_moe.")
            names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
            logits = xn @ g(block + "gate.weight").T
            probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs = (probs / probs.sum(axis=-1, keepdims=True)).astype(f32)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            weights = np.take_along_axis(probs, top, axis=-1)
            if norm_topk:
                weights = weights / weights.sum(axis=-1, keepdims=True)
            y = np.zeros_like(xn)
            for e in range(E):
                rows, slot = np.nonzero(top == e)
                if len(rows) == 0:
                    continue
                xe = xn[rows]
                ye = (silu(xe @ g(block + "experts.%d.%s.weight" % (e, names[0])).T)
                      * (xe @ g(block + "experts.%d.%s.weight" % (e, names[1])).T)
                      ) @ g(block + "experts.%d.%s.weight" % (e, names[2])).T
                y[rows] += ye * weights[rows, slot][:, None]
        x = x + y
    x = rmsnorm(x, g("model.norm.weight"), eps)
    head = g("model.embed_tokens.weight") if cfg["tie_word_embeddings"] else g("lm_head.weight")
    return (x @ head.T).astype(f32)


def make(name, spec, seed):
    src = os.path.join(MODELS, spec["source"])
    dest = os.path.join(MODELS, name)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        src_cfg = json.load(f)
    with open(os.path.join(src, "reference.json")) as f:
        src_ref = json.load(f)
    cfg = dict(spec["config"])
    vocab = src_cfg["vocab_size"]
    cfg.update(vocab_size=vocab, bos_token_id=src_cfg["bos_token_id"],
               eos_token_id=src_cfg["eos_token_id"])
    for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, fname), os.path.join(dest, fname))
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    W = make_weights(name, cfg, vocab, np.random.default_rng(seed))
    write_safetensors(os.path.join(dest, "model.safetensors"), {k: v[1] for k, v in W.items()})

    ref = {"model": name, "dtype": "torch.bfloat16",
           "math": "float32 (numpy port of transformers, tests/data/make_moe_models.py)",
           "tokenizer_cases": src_ref["tokenizer_cases"], "generations": []}
    for i, gen in enumerate(src_ref["generations"]):
        ids = list(gen["prompt_ids"])
        for _ in range(N_NEW):
            ids.append(int(np.argmax(forward(cfg, W, ids)[-1])))
        logits = forward(cfg, W, ids)
        np.save(os.path.join(dest, "ref_logits_%d.npy" % i), logits)
        ref["generations"].append({"prompt_ids": gen["prompt_ids"],
                                   "greedy_ids": ids[len(gen["prompt_ids"]):],
                                   "logits_file": "ref_logits_%d.npy" % i})
        print("%s ref_logits_%d.npy: %d + %d tokens" % (name, i, len(gen["prompt_ids"]), N_NEW))
    ref["load"] = "bf16 weights as f32"
    with open(os.path.join(dest, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


if __name__ == "__main__":
    for i, (name, spec) in enumerate(SPECS.items()):
        make(name, spec, 1234 + i)
