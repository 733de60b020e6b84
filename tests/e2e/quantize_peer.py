#!/usr/bin/env python3
"""GGUF files of `llmem quantize` against llama.cpp's gguf-py and llama-quantize (e2e-quantize).

  rewrite IN OUT      read IN with gguf-py's GGUFReader and write every key/value and tensor
                      again with its GGUFWriter: OUT equals IN byte for byte when our writer
                      lays the file out as gguf-py does
  compare OURS THEIRS per tensor: name, type, shape and bytes of OURS against THEIRS (a file of
                      llama-quantize); prints one line per tensor, exit 1 when any differs

Needs numpy and gguf-py (--gguf-py DIR, default ../shared/tools/gguf-py).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def rewrite(gguf, src, dst):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(key, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(f.parts[f.data[0]]), vtype)
        else:
            w.add_key_value(key, f.parts[f.data[0]].tolist()[0], vtype)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def compare(gguf, ours, theirs):
    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'ours' if name in a else 'llama-quantize'}")
            bad += 1
            continue
        x, y = a[name], b[name]
        tx, ty = x.tensor_type.name, y.tensor_type.name
        if tx != ty or list(x.shape) != list(y.shape):
            print(f"{name}: {tx} {list(x.shape)} vs llama-quantize {ty} {list(y.shape)}")
            bad += 1
        elif x.data.tobytes() != y.data.tobytes():
            xb, yb = x.data.tobytes(), y.data.tobytes()
            n = sum(1 for i in range(len(xb)) if xb[i] != yb[i])
            print(f"{name}: {tx} bytes differ ({n} of {len(xb)})")
            bad += 1
        else:
            print(f"{name}: {tx} equal")
    print(f"{len(a)} tensors, {bad} differ")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-py", default=os.path.join(os.path.dirname(ROOT), "shared", "tools",
                                                      "gguf-py"))
    ap.add_argument("mode", choices=["rewrite", "compare"])
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf  # noqa: E402  (llama.cpp's gguf-py)
    if args.mode == "rewrite":
        rewrite(gguf, args.a, args.b)
        return 0
    return compare(gguf, args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
