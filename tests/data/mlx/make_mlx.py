#!/usr/bin/python3
"""tests/data/mlx/make_mlx.py — MLX quantized model directories, as mlx-lm's `convert -q` writes
them, made from the reference models of tests/data/models without MLX (which does not install
here): its quantize routine is ported below with numpy.

Usage: /usr/bin/python3 tests/data/mlx/make_mlx.py   (writes tests/data/mlx/<name>/)

The format (ml-explore/mlx; the files as the search index stores them, functions named since it
gives no line numbers):
  * mlx/backend/cpu/quantized.cpp at commit 0e18bb05ac13a17a986f51bf172681c188136a0f,
    `template <typename T, typename U> void quantize(...)` (the CPU routine of
    fast::Quantize::eval_cpu, same file): per group of `group_size` values of a row, in float:
    w_max, w_min; mask = |w_min| > |w_max|; scale = max((w_max - w_min) / n_bins, 1e-7) with
    n_bins = 2^bits - 1, negated unless mask; edge = mask ? w_min : w_max;
    q0 = rint(edge / scale); when q0 != 0: scale = edge / q0 and bias = edge, else bias = 0; each
    value rint((w - bias) / scale) clamped to [0, n_bins] and packed into uint32 words,
    `out_el |= q << (k * bits)` (value k of a word in bits k·bits up, little end first);
    scales[i] = T(scale), biases[i] = T(bias) (T the weight's dtype: the codes are computed with
    the float scale, the stored one is rounded to T). Ported by `quantize` below. (Older
    releases computed the same steps in T, with the stored scale; the reader does not care.)
    The same file's quantized matmuls compute `scale * q + bias` per value too: _qmm_t in T,
    _qmm_t_simd (4 and 8 bits) in float without rounding to T.
  * mlx/fast.cpp at commit 3b259a8a9420bbcdd7ad76208440a136274af229 (the releases where
    quantization was in mlx::core::fast): pack_and_quantize, affine_quantize (the algorithm
    above, computed there in the weight's dtype) and affine_dequantize, whose fallback — what
    mx.dequantize computes on the CPU — unpacks each word (value k = (w << (32 - (k+1)·bits)) >>
    (32 - bits)) and then does `multiply(w_full, scales)` and `add(w_full, biases)`: two
    element-wise operations of the scales' dtype T, each computed in float and rounded to T.
    Ported by `dequantize` below (quant/dequant.c's llmem_quant_dequantize_mlx_row computes the
    same).
  * mlx-lm, mlx_lm/utils.py load_model: config.json's `quantization` {group_size, bits[, mode]}
    plus per-module entries (`"model.layers.0.mlp.down_proj": {"group_size": .., "bits": ..}` or
    false) read by the class_predicate of nn.quantize: `if p in config["quantization"]: return
    config["quantization"][p]`, else a module with to_quantized (Linear, Embedding: norms are not)
    is quantized when `f"{p}.scales" in weights`. convert writes the same object as
    `quantization_config` too. A quantized module's tensors: `weight` uint32 [out, in·bits/32],
    `scales` and `biases` [out, in/group_size] in the model's dtype.

The fixtures (small: tests/data stays a few MB):
  tiny-mistral-swa-4bit      bits 4, group 64, bf16 (embed_tokens and the untied lm_head too)
  tiny-mistral-swa-8bit-f16  bits 8, group 64, converted to float16 first (--dtype float16)
  tiny-mistral-swa-mixed     float32, default bits 4 group 32, with per-module entries:
                             layers.0.mlp.down_proj 8/128, lm_head 8/64, embed_tokens 4/128,
                             layers.1.self_attn.k_proj false (kept float32)
  tiny-qwen2-4bit            bits 4, group 64, bf16, tied embeddings (the quantized table is
                             lm_head too), q/k/v biases kept as vectors
  tiny-qwen3-moe-4bit        bits 4, group 32, bf16, the experts stacked as mlx-lm's SwitchGLU
                             (switch_mlp) and quantized along their last axis, the routers at 8
                             bits (per-module entries), the dense layer 2 as a plain MLP
"""
import json
import os
import shutil
import struct

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "models")


# ---- safetensors ---------------------------------------------------------------------------------

def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[b:e]
        shape = info["shape"]
        if info["dtype"] == "BF16":
            v = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] == "F16":
            v = np.frombuffer(raw, "<f2").astype(np.float32)
        elif info["dtype"] == "F32":
            v = np.frombuffer(raw, "<f4").astype(np.float32)
        else:
            raise SystemExit(f"{path}: {name} is {info['dtype']}")
        out[name] = v.reshape(shape)
    return out


def to_bf16_bits(x):
    """f32 → bf16, to nearest even (finite values)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def round_to(x, dtype):
    """x (f32) rounded to dtype and back to f32: what an MLX array of that dtype holds."""
    x = np.asarray(x, np.float32)
    if dtype == "BF16":
        return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return x.astype(np.float16).astype(np.float32)
    return x


def encode(x, dtype):
    if dtype == "BF16":
        return to_bf16_bits(x).tobytes()
    if dtype == "F16":
        return np.asarray(x, np.float32).astype("<f2").tobytes()
    if dtype == "U32":
        return np.asarray(x, "<u4").tobytes()
    return np.asarray(x, "<f4").tobytes()


def write_safetensors(path, tensors):
    """tensors: name → (dtype, array). Sorted by name, as mlx.core.save_safetensors writes."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        raw = encode(arr, dtype)
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "mlx"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


# ---- MLX's affine quantization (ported; see the top of the file) ---------------------------------

def quantize(w, group_size, bits, dtype):
    """w [rows, cols] holding values of `dtype` → (uint32 codes [rows, cols·bits/32], scales and
    biases [rows, cols/group_size] as f32 values of dtype): mlx/backend/cpu/quantized.cpp's
    quantize<T, U>, every step in float32 as it computes them."""
    rows, cols = w.shape
    assert cols % group_size == 0 and bits in (4, 8)
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    g = w.astype(np.float32).reshape(rows, cols // group_size, group_size)
    w_max = g.max(axis=-1)
    w_min = g.min(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, eps).astype(np.float32)
    scale = np.where(mask, scale, -scale).astype(np.float32)
    edge = np.where(mask, w_min, w_max).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q0 = np.rint(edge / scale).astype(np.float32)
        nz = q0 != 0
        scale = np.where(nz, edge / np.where(nz, q0, 1), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
    q = np.rint((g - bias[..., None]) / scale[..., None]).astype(np.float32)
    q = np.minimum(np.maximum(q, np.float32(0)), n_bins).astype(np.uint64)
    per = 32 // bits
    q = q.reshape(rows, cols // per, per)
    words = np.zeros((rows, cols // per), np.uint64)
    for k in range(per):
        words |= q[..., k] << np.uint64(k * bits)
    return words.astype(np.uint32), round_to(scale, dtype), round_to(bias, dtype)


def dequantize(words, scales, biases, group_size, bits, dtype):
    """mx.dequantize on the CPU (mlx/fast.cpp affine_dequantize's fallback): codes unpacked,
    multiply by the scales then add the biases, each rounded to the scales' dtype."""
    per = 32 // bits
    rows = words.shape[0]
    w = words.astype(np.uint64)
    q = np.stack([(w >> np.uint64(k * bits)) & np.uint64((1 << bits) - 1) for k in range(per)],
                 axis=-1).reshape(rows, -1, group_size).astype(np.float32)
    t = round_to(q * scales[..., None], dtype)
    return round_to(t + biases[..., None], dtype).reshape(rows, -1)


# ---- conversion (mlx-lm's convert -q, for these models) ------------------------------------------

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_quantizable(module):
    """Modules with to_quantized: nn.Linear (the projections, lm_head) and nn.Embedding."""
    last = module.rsplit(".", 1)[-1]
    return last in LINEAR or module in ("lm_head", "model.embed_tokens")


def quantize_checked(key, v, params, dtype):
    """quantize, checked: each value within a step of the original (a step at most: the top code
    clamps when the edge's rounding moved the grid, as MLX's does), plus the rounding of the
    stored scale to dtype (the codes were chosen with the f32 scale) times the largest code."""
    words, s, b = quantize(v, params["group_size"], params["bits"], dtype)
    rel = {"BF16": 2.0 ** -8, "F16": 2.0 ** -11, "F32": 0.0}[dtype]
    step = np.repeat(np.abs(s), params["group_size"], axis=-1)
    deq = dequantize(words, s, b, params["group_size"], params["bits"], dtype)
    tol = step * (1.01 + ((1 << params["bits"]) - 1) * rel) + 1e-2 * np.abs(v) + 1e-6
    assert np.all(np.abs(deq - v) <= tol), key
    return words, s, b


def write_dir(src, out, name, tensors, config, dtype, group_size, bits, overrides):
    """The directory as convert writes it: model.safetensors, config.json with `quantization`
    (and `quantization_config`), and the source's tokenizer and generation config."""
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    q.update(overrides)
    config["dtype"] = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[dtype]
    config["quantization"] = q
    config["quantization_config"] = q
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), os.path.join(out, extra))
    print(f"{name}: {sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))} bytes")


def convert(src, name, dtype, group_size, bits, overrides=None):
    overrides = overrides or {}
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    weights = read_safetensors(os.path.join(src, "model.safetensors"))
    tensors = {}
    for key, v in weights.items():
        v = round_to(v, dtype)  # the model cast to dtype first, as convert --dtype does
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        params = None
        if module is not None and v.ndim == 2 and is_quantizable(module):
            params = overrides.get(module, {"group_size": group_size, "bits": bits})
            if params is not False and v.shape[1] % params["group_size"] != 0:
                params = False
        if not params:
            tensors[key] = (dtype, v)
            continue
        words, s, b = quantize_checked(key, v, params, dtype)
        tensors[module + ".weight"] = ("U32", words)
        tensors[module + ".scales"] = (dtype, s)
        tensors[module + ".biases"] = (dtype, b)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    write_dir(src, out, name, tensors, config, dtype, group_size, bits, overrides)


def convert_moe(src, name, dtype, group_size, bits):
    """A Qwen3-MoE as mlx-lm loads and saves it: each layer's experts stacked into SwitchGLU's
    `mlp.switch_mlp.{gate,up,down}_proj.weight` [experts, rows, cols] (its sanitize), every Linear
    quantized — the stacked experts along their last axis, as SwitchLinear.to_quantized does — and
    the routers `mlp.gate` at 8 bits (mlx-lm's qwen3_moe quant_predicate), as per-module entries."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    weights = read_safetensors(os.path.join(src, "model.safetensors"))
    E = config["num_experts"]
    stacked = {}
    for key in list(weights):
        parts = key.split(".")
        if "experts" in parts:  # model.layers.N.mlp.experts.E.P.weight
            i = parts.index("experts")
            dst = ".".join(parts[:i] + ["switch_mlp"] + parts[i + 2:])
            stacked.setdefault(dst, [None] * E)[int(parts[i + 1])] = weights.pop(key)
    for dst, mats in stacked.items():
        weights[dst] = np.stack(mats)
    overrides = {}
    for l in range(config["num_hidden_layers"]):
        if "model.layers.%d.mlp.gate.weight" % l in weights:
            overrides["model.layers.%d.mlp.gate" % l] = {"group_size": group_size, "bits": 8}
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for key, v in sorted(weights.items()):
        v = round_to(v, dtype)
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        quantizable = module is not None and v.ndim >= 2 and (
            is_quantizable(module) or module in overrides)
        params = overrides.get(module, {"group_size": group_size, "bits": bits})
        if not quantizable or v.shape[-1] % params["group_size"] != 0:
            tensors[key] = (dtype, v)
            continue
        words, s, b = quantize_checked(key, v.reshape(-1, v.shape[-1]), params, dtype)
        lead = v.shape[:-1]
        tensors[module + ".weight"] = ("U32", words.reshape(*lead, -1))
        tensors[module + ".scales"] = (dtype, s.reshape(*lead, -1))
        tensors[module + ".biases"] = (dtype, b.reshape(*lead, -1))
    write_dir(src, out, name, tensors, config, dtype, group_size, bits, overrides)


def main():
    swa = os.path.join(MODELS, "tiny-mistral-swa")
    convert(swa, "tiny-mistral-swa-4bit", "BF16", 64, 4)
    convert(swa, "tiny-mistral-swa-8bit-f16", "F16", 64, 8)
    convert(swa, "tiny-mistral-swa-mixed", "F32", 32, 4, {
        "model.layers.0.mlp.down_proj": {"group_size": 128, "bits": 8},
        "lm_head": {"group_size": 64, "bits": 8},
        "model.embed_tokens": {"group_size": 128, "bits": 4},
        "model.layers.1.self_attn.k_proj": False,
    })
    convert(os.path.join(MODELS, "tiny-qwen2"), "tiny-qwen2-4bit", "BF16", 64, 4)
    convert_moe(os.path.join(MODELS, "tiny-qwen3-moe"), "tiny-qwen3-moe-4bit", "BF16", 32, 4)


if __name__ == "__main__":
    main()
