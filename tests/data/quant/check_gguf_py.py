"""tests/data/quant/check_gguf_py.py — ggml's references (make_reference.c) against gguf-py's numpy
reference, gguf/quants.py: its dequantization of ggml's blocks, float for float as bits, and its
quantization of the input rows, byte for byte, for the types it quantizes. Prints one line a check
and every difference; the references themselves stay ggml's. Run by make_reference.sh.
"""
import os
import sys

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

N = 256
TYPES = {
    "f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0,
    "q5_1": T.Q5_1, "q8_0": T.Q8_0, "q2_K": T.Q2_K, "q3_K": T.Q3_K, "q4_K": T.Q4_K,
    "q5_K": T.Q5_K, "q6_K": T.Q6_K,
}


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).ravel()


def is_nan(u):
    return ((u & 0x7f800000) == 0x7f800000) & ((u & 0x007fffff) != 0)


def compare(what, got, want, floats=False):
    diff = np.nonzero(got != want)[0]
    if len(diff) == 0:
        print(f"{what}: equal ({len(want)})")
        return 0
    print(f"{what}: {len(diff)} of {len(want)} differ, first at {diff[0]}: "
          f"{got[diff[0]]:#x} vs ggml {want[diff[0]]:#x}")
    if floats and np.all(is_nan(got[diff]) & is_nan(want[diff])):
        # numpy's f16 → f32 keeps a signalling NaN signalling; ggml's makes it quiet
        print(f"{what}: only NaN payloads differ (not counted)")
        return 0
    return len(diff)


def main(d):
    x = np.fromfile(os.path.join(d, "input.f32"), dtype=np.float32).reshape(-1, N)
    differ = 0
    for name, qt in TYPES.items():
        for suffix in ("", ".rand"):
            stem = "input" if name == "f32" and suffix == "" else f"{name}{suffix}"
            q = np.fromfile(os.path.join(d, f"{stem}.q" if stem != "input" else "input.f32"),
                            dtype=np.uint8)
            want = bits(np.fromfile(os.path.join(d, f"{stem}.f32"), dtype=np.float32))
            rows = len(want) // N
            with np.errstate(all="ignore"):
                got = bits(quants.dequantize(q.reshape(rows, -1), qt))
            differ += compare(f"dequantize {name}{suffix}", got, want, floats=True)
        try:
            with np.errstate(all="ignore"):
                got = quants.quantize(x, qt).view(np.uint8).ravel()
        except (NotImplementedError, quants.QuantError):
            print(f"quantize {name}: not in gguf-py")
            continue
        want = np.fromfile(os.path.join(d, "input.f32" if name == "f32" else f"{name}.q"),
                           dtype=np.uint8)
        compare(f"quantize {name} (reported, not counted)", got, want)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
