#!/usr/bin/env python3
"""The GGUF vocabularies of the reference tokenizers, for test-tok-vocab (tok/vocab.c).

For each tokenizer this writes the tokenizer.ggml.* keys llama.cpp's converters would write into
a GGUF file, reads them back with gguf-py's GGUFReader, and stores them in a small binary file the
C test reads without a GGUF parser (tests/data/tok/vocab/<name>.vocab):

    "LMVOCAB1"
    str model, str pre                      str: u32 length (0xFFFFFFFF: absent) + bytes
    u32 n_tokens, n_tokens × str
    u8 has_scores [n_tokens × f32]
    u8 has_types  [n_tokens × i32]
    u32 n_merges (0xFFFFFFFF: absent), n_merges × str
    i64 bos, eos, unk, pad                  −1: absent
    i32 add_bos, add_eos, add_space_prefix  −1: absent
    str chat_template
    (all little-endian)

How each vocabulary is made:
  * pycoder: the whole GGUF written by ../shared/tools/hf_to_gguf_minimal.py (model "gpt2", pre
    "llama-bpe", CONTROL for special added tokens, UNUSED "[PADi]" up to the config's
    vocab_size, bos/eos from config.json, add_bos/add_eos false).
  * tiny-llama3, tiny-qwen2, tiny-qwen3: the same vocabulary logic (hf_to_gguf_minimal refuses
    their rope scaling or model_type); pre "llama-bpe" because their tokenizer.json carries the
    Llama 3 split regex (a real Qwen2 tokenizer's regex is the one llama.cpp calls "qwen2").
  * tok-gpt2: the same with pre "gpt-2" (GPT-2's ByteLevel regex).
  * tok-nfc: the same with pre "qwen2" (NFC + Qwen2's regex; its cases hold no digits, the one
    place that regex differs from the tokenizer's own Llama 3 regex).
  * tiny-mistral-swa: model "llama", as convert_hf_to_gguf's _set_vocab_llama_hf (gguf-py's
    LlamaHfVocab) types the tokens (BYTE for <0xNN>, CONTROL for the special ids, NORMAL else),
    with gguf.SpecialVocab for the special ids and add flags. The scores are SentencePiece's for
    this vocabulary (−id for NORMAL tokens, 0 for the others: a SentencePiece BPE model lists its
    pieces by descending score, which is the order tokenizers' BPE training gives the ids):
    LlamaHfVocab's flat −1000.0 would make llama.cpp (and llmem) merge leftmost-first and
    differ from tokenizer.json on 2 of the 12 reference strings.

Needs numpy and gguf-py (llama.cpp's, from ../shared/tools/gguf-py or $GGUF_PY).
Usage: /usr/bin/python3 tests/data/tok/make_gguf_vocab.py [--out DIR]
"""
import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.dirname(HERE)
ROOT = os.path.dirname(os.path.dirname(DATA))
TOOLS = os.environ.get("LLMEM_SHARED_TOOLS", os.path.join(os.path.dirname(ROOT), "shared", "tools"))
GGUF_PY = os.environ.get("GGUF_PY", os.path.join(TOOLS, "gguf-py"))
sys.path.insert(0, GGUF_PY)
import gguf  # noqa: E402

MODELS = os.path.join(DATA, "models")


def hf_dir(name):
    if name == "pycoder":
        return os.path.join(ROOT, "models", "pycoder")
    if name.startswith("tok-"):
        return os.path.join(HERE, name)
    return os.path.join(MODELS, name)


def load_json(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---- vocabularies, as the converters write them ----------------------------------------------

def gpt2_vocab(d, w, pre):
    """hf_to_gguf_minimal.py's tokenizer part (tokens by id, CONTROL for special added tokens,
    UNUSED padding up to config.json's vocab_size)."""
    tok = load_json(os.path.join(d, "tokenizer.json"))
    cfg = load_json(os.path.join(d, "config.json")) or {}
    vocab = dict(tok["model"]["vocab"])
    special = set()
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    n = cfg.get("vocab_size", max(vocab.values()) + 1)
    id2tok = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        if i in id2tok:
            tokens.append(id2tok[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        eos = cfg["eos_token_id"]
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


def llama_hf_vocab(d, w):
    """_set_vocab_llama_hf: LlamaHfVocab's tokens and types (without transformers: the special
    ids are tokenizer_config's bos/eos/unk and the special added tokens), SentencePiece scores."""
    tok = load_json(os.path.join(d, "tokenizer.json"))
    cfg = load_json(os.path.join(d, "tokenizer_config.json")) or {}
    model = tok["model"]
    assert model["type"] == "BPE" and model.get("byte_fallback"), "not a Llama-style BPE"
    vocab = dict(model["vocab"])
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    names = [cfg.get(k) for k in ("bos_token", "eos_token", "unk_token")] + [model.get("unk_token")]
    names = [n["content"] if isinstance(n, dict) else n for n in names if n]
    special_ids = {vocab[n] for n in names if n in vocab}
    special_ids |= {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    id2tok = {i: s for s, i in vocab.items()}
    assert sorted(id2tok) == list(range(len(id2tok))), "ids with gaps"
    tokens, scores, types = [], [], []
    for i in range(len(id2tok)):
        text = id2tok[i].encode("utf-8")
        if re.fullmatch(rb"<0x[0-9A-Fa-f]{2}>", text):
            t = gguf.TokenType.BYTE
        elif i in special_ids:
            t = gguf.TokenType.CONTROL
        else:
            t = gguf.TokenType.NORMAL
        tokens.append(text)
        types.append(t)
        scores.append(-float(i) if t == gguf.TokenType.NORMAL else 0.0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(d, n_vocab=len(tokens)).add_to_gguf(w)


def write_vocab_only(name, path):
    d = hf_dir(name)
    w = gguf.GGUFWriter(path, "llama")
    if name == "tiny-mistral-swa":
        llama_hf_vocab(d, w)
    else:
        gpt2_vocab(d, w, {"tok-gpt2": "gpt-2", "tok-nfc": "qwen2"}.get(name, "llama-bpe"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- GGUF → the fixture ------------------------------------------------------------------------

def read_gguf(path):
    r = gguf.GGUFReader(path)
    f = r.fields

    def strs(key):
        if key not in f:
            return None
        fld = f[key]
        return [bytes(fld.parts[i]) for i in fld.data]

    def one(key):
        if key not in f:
            return None
        v = f[key].contents()
        return v.encode("utf-8") if isinstance(v, str) else v

    def arr(key):
        return None if key not in f else list(f[key].contents())

    return {
        "model": one("tokenizer.ggml.model"),
        "pre": one("tokenizer.ggml.pre"),
        "tokens": strs("tokenizer.ggml.tokens"),
        "scores": arr("tokenizer.ggml.scores"),
        "types": arr("tokenizer.ggml.token_type"),
        "merges": strs("tokenizer.ggml.merges"),
        "ids": [one(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")],
        "flags": [one("tokenizer.ggml.add_bos_token"), one("tokenizer.ggml.add_eos_token"),
                  one("tokenizer.ggml.add_space_prefix")],
        "template": one("tokenizer.chat_template"),
    }


def put_str(out, s):
    if s is None:
        out += struct.pack("<I", 0xFFFFFFFF)
    else:
        out += struct.pack("<I", len(s)) + s


def fixture(v):
    out = bytearray(b"LMVOCAB1")
    put_str(out, v["model"])
    put_str(out, v["pre"])
    out += struct.pack("<I", len(v["tokens"]))
    for t in v["tokens"]:
        put_str(out, t)
    for key, fmt in (("scores", "<f"), ("types", "<i")):
        out += struct.pack("<B", v[key] is not None)
        for x in v[key] or []:
            out += struct.pack(fmt, x)
    if v["merges"] is None:
        out += struct.pack("<I", 0xFFFFFFFF)
    else:
        out += struct.pack("<I", len(v["merges"]))
        for m in v["merges"]:
            put_str(out, m)
    out += struct.pack("<4q", *[-1 if x is None else int(x) for x in v["ids"]])
    out += struct.pack("<3i", *[-1 if x is None else int(bool(x)) for x in v["flags"]])
    put_str(out, v["template"])
    return bytes(out)


NAMES = ["pycoder", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral-swa", "tok-gpt2",
         "tok-nfc"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "vocab"))
    ap.add_argument("names", nargs="*", default=NAMES)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.names:
            path = os.path.join(tmp, name + ".gguf")
            if name == "pycoder":
                subprocess.run([sys.executable, os.path.join(TOOLS, "hf_to_gguf_minimal.py"),
                                hf_dir(name), path, "--gguf-py", GGUF_PY, "--outtype", "f32"],
                               check=True, stdout=subprocess.DEVNULL)
            else:
                write_vocab_only(name, path)
            data = fixture(read_gguf(path))
            with open(os.path.join(a.out, name + ".vocab"), "wb") as f:
                f.write(data)
            print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
