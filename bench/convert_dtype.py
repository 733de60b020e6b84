#!/usr/bin/env python3
"""Copy a Hugging Face model directory with its floating-point weights converted to another dtype.

Usage: python3 bench/convert_dtype.py SRC_DIR DST_DIR [--dtype f16|bf16|f32]

Reads every *.safetensors file of SRC_DIR (8-byte little-endian header length, JSON header, raw
data), converts each F32/F16/BF16 tensor through float32 (round to nearest even), and writes the
result under the same names; every other file is copied. Used to benchmark the same model with
bf16 and f16 weights (docs/BENCHMARKS.md). Needs numpy (Debian: python3-numpy).
"""
import argparse
import json
import os
import shutil
import struct

import numpy as np

NP = {"F32": np.float32, "F16": np.float16}


def to_f32(raw, dtype):
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype=NP[dtype]).astype(np.float32)


def from_f32(x, dtype):
    if dtype == "BF16":
        b = x.view(np.uint32)
        b = b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
        return (b >> np.uint32(16)).astype("<u2").tobytes()
    return x.astype(NP[dtype]).tobytes()


def convert(src, dst, dtype):
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out, off = {}, 0
        for name, t in header.items():
            if name == "__metadata__":
                out[name] = t
                continue
            count = int(np.prod(t["shape"])) if t["shape"] else 1
            size = count * {"F32": 4, "F16": 2, "BF16": 2}.get(dtype if t["dtype"] in ("F32", "F16", "BF16") else t["dtype"], 0)
            if size == 0:
                raise SystemExit(f"{src}: tensor {name} has dtype {t['dtype']}, which this script does not convert")
            out[name] = {"dtype": dtype, "shape": t["shape"], "data_offsets": [off, off + size]}
            off += size
        hj = json.dumps(out, separators=(",", ":")).encode()
        hj += b" " * ((8 - len(hj) % 8) % 8)
        with open(dst, "wb") as g:
            g.write(struct.pack("<Q", len(hj)))
            g.write(hj)
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                a, b = t["data_offsets"]
                f.seek(base + a)
                g.write(from_f32(to_f32(f.read(b - a), t["dtype"]), dtype))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    a = ap.parse_args()
    dtype = a.dtype.upper()
    os.makedirs(a.dst, exist_ok=True)
    for fn in sorted(os.listdir(a.src)):
        s, d = os.path.join(a.src, fn), os.path.join(a.dst, fn)
        if fn.endswith(".safetensors"):
            convert(s, d, dtype)
        elif os.path.isfile(s):
            shutil.copyfile(s, d)
    cfg = os.path.join(a.dst, "config.json")
    if os.path.exists(cfg):
        c = json.load(open(cfg))
        name = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[dtype]
        for k in ("dtype", "torch_dtype"):
            if k in c:
                c[k] = name
        json.dump(c, open(cfg, "w"), indent=2)
    print(f"wrote {a.dst} ({dtype})")


if __name__ == "__main__":
    main()
