#!/usr/bin/env python3
"""tests/fuzz/make_corpus.py — writes the seed corpora of tests/fuzz/corpus/fuzz-<name> from
tests/data and the unit tests' own inputs (tests/test-server.c's request bodies, tests/test-model.c's
config values): valid inputs and near-valid ones, a few hundred bytes to a few kB each. Run from
the repository root; it replaces the corpus directories it writes. New inputs that libFuzzer finds
worth keeping (a crash's reproducer above all) may be added by hand beside these."""
import json
import os
import re
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")


def corpus(name):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    n = [0]

    def put(label, data):
        if isinstance(data, str):
            data = data.encode()
        with open(os.path.join(d, "%02d-%s" % (n[0], label)), "wb") as f:
            f.write(data)
        n[0] += 1

    return put


def read(path):
    with open(os.path.join(DATA, path), "rb") as f:
        return f.read()


MODELS = ["tiny-llama3", "tiny-mistral-swa", "tiny-qwen2", "tiny-qwen3"]


def with_value(config, key, raw):
    """config.json text (bytes) with key set to raw JSON text."""
    obj = json.loads(config)
    obj[key] = "@@VALUE@@"
    return json.dumps(obj, indent=2).replace('"@@VALUE@@"', raw).encode()


def config_seeds():
    put = corpus("fuzz-config")
    for m in MODELS:
        put(m, read("models/%s/config.json" % m))
    base = read("models/tiny-llama3/config.json")
    cases = [
        ("hidden_size", '"256"'), ("num_hidden_layers", "0"), ("num_hidden_layers", "1e30"),
        ("num_key_value_heads", "3"), ("head_dim", "65537"), ("model_type", '"gemma2"'),
        ("architectures", '"LlamaForCausalLM"'), ("text_config", "[]"),
        ("rope_scaling", '{"rope_type": "llama3", "factor": 0}'), ("rope_scaling", '{"type": 3}'),
        ("rope_scaling", '{"type": "linear", "factor": 2.0}'),
        ("rope_scaling", '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}'),
        ("rope_scaling", '{"rope_type": "llama3", "original_max_position_embeddings": 2.9e31}'),
        ("rope_parameters", '{"full_attention": {"rope_theta": 0}}'),
        ("rope_parameters", '{"full_attention": {"rope_theta": 10000}, "sliding_attention": {"rope_theta": 10000}}'),
        ("sliding_window", "0"), ("sliding_window", "64"),
        ("layer_types", '["full_attention", "sliding_attention", "full_attention", "sliding_attention"]'),
        ("layer_types", '["full_attention", 1]'),
    ]
    for key, raw in cases:
        put("%s" % key, with_value(base, key, raw))
    obj = json.loads(base)
    put("text_config", json.dumps({"model_type": "llava", "text_config": obj}))
    put("truncated", base[: len(base) // 2])
    put("not-object", "[1, 2, 3]")
    put("empty", "")
    # the mixtures of experts, and their keys out of range
    moe = read("models/tiny-qwen3-moe/config.json")
    put("tiny-qwen3-moe", moe)
    put("tiny-mixtral", read("models/tiny-mixtral/config.json"))
    for key, raw in [("num_experts_per_tok", "9"), ("mlp_only_layers", "[-1, 2]"),
                     ("decoder_sparse_step", "0"), ("num_experts", "0")]:
        put(key, with_value(moe, key, raw))


def request_seeds():
    put = corpus("fuzz-request")
    with open(os.path.join(ROOT, "tests", "test-server.c"), encoding="utf-8") as f:
        src = f.read()
    lit = r'"(?:[^"\\\n]|\\.)*"'
    seen = set()
    for m in re.finditer(r"(SRV_COMPLETIONS|SRV_CHAT),\s*((?:%s\s*)+)" % lit, src):
        kind = b"\x01" if m.group(1) == "SRV_CHAT" else b"\x00"
        body = b"".join(c_string(s) for s in re.findall(lit, m.group(2)))
        if (kind, body) not in seen:
            seen.add((kind, body))
            put("chat" if kind == b"\x01" else "completions", kind + body)
    put("chat-parts", b"\x01" + json.dumps({
        "model": "pycoder", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None}, {"role": "user", "content": "again"}],
        "max_completion_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"],
        "logprobs": True, "top_logprobs": 3, "stream": True,
        "stream_options": {"include_usage": True}}).encode())
    put("completions-all", b"\x00" + json.dumps({
        "model": "pycoder", "prompt": [[1, 2, 3]], "max_tokens": 4, "temperature": 0, "top_k": 5,
        "min_p": 0.05, "seed": 7, "stop": "x", "logprobs": 2, "ignore_eos": True, "n": 1,
        "stream": False}).encode())


def c_string(s):
    """The bytes of a C string literal (the escapes the tests use)."""
    out, i, s = bytearray(), 0, s[1:-1]
    while i < len(s):
        c = s[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        e = s[i + 1]
        if e == "x":
            j = i + 2
            while j < len(s) and s[j] in "0123456789abcdefABCDEF":
                j += 1
            out.append(int(s[i + 2:j], 16) & 0xFF)
            i = j
            continue
        out += {"n": b"\n", "t": b"\t", "r": b"\r", "0": b"\0", "\\": b"\\", '"': b'"'}.get(e, e.encode())
        i += 2
    return bytes(out)


def safetensors(tensors):
    header, off, blob = {}, 0, b""
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
        blob += bytes(nbytes)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + blob


def safetensors_seeds():
    put = corpus("fuzz-safetensors")
    put("one", b"\x00" + safetensors([("x", "F32", [2], 8)]))
    put("several", b"\x00" + safetensors([("a.weight", "BF16", [2, 3], 12), ("b", "F16", [4], 8),
                                          ("c", "I32", [], 4)]))
    st = safetensors([("x", "F32", [2], 8)])
    put("truncated", b"\x00" + st[:-4])
    put("overlap", b"\x00" + struct.pack("<Q", 74) +
        b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {}}'[:74] + bytes(8))
    big = read("models/tiny-llama3/model.safetensors")
    n = struct.unpack("<Q", big[:8])[0]
    put("llama3-header", b"\x00" + big[: 8 + n])  # the data cut off: refused for its size
    for m in MODELS[:2]:
        put("config-" + m, b"\x01" + read("models/%s/config.json" % m))
    put("index", b"\x02" + json.dumps({"metadata": {"total_size": 16},
                                        "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}).encode())
    put("index-missing", b"\x02" + json.dumps({"weight_map": {"x": "c.safetensors"}}).encode())
    put("index-escape", b"\x02" + json.dumps({"weight_map": {"x": "../a.safetensors"}}).encode())


def tok_seeds():
    put = corpus("fuzz-tok")
    texts = ["Hello, world!", "def main():\n    return 0\n", "  spaces\tand\ttabs  ",
             "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m", "\u65e5\u672c\u8a9e\u306e\u6587",
             "emoji \U0001F600\U0001F680", "<|endoftext|>x<s>", "\u2581leading", "e\u0301 A\u030a"]
    for which in range(5):
        for i, t in enumerate(texts[:5] if which else texts):
            put("encode-%d-%d" % (which, i), bytes([which]) + t.encode())
        put("decode-%d" % which, bytes([which + 5]) + struct.pack("<12H", *range(1, 240, 20)))
    put("invalid-utf8", b"\x00\xc3\x28\xff\xfe")
    put("decode-nothing", b"\x05")  # a stream finished before its first id


HEADER_BYTES, OFF_CHECKSUM = 192, 168


def chunk(n_blocks, block_size, block_bytes, key=b"\x01" * 32, parent=bytes(32), position=0,
          tokens=None, checksum=bytes(16)):
    """A spill chunk file (bank/spill_file.c's layout); the target makes the checksum agree."""
    n_tokens = n_blocks * block_size
    tokens = tokens if tokens is not None else list(range(n_tokens))
    b = bytearray(HEADER_BYTES)
    b[0:8] = b"LLMEMKV\0"
    struct.pack_into("<II", b, 8, 1, HEADER_BYTES + 4 * n_tokens)
    b[16:48] = b"\x07" * 32
    b[48:80] = key
    b[80:112] = parent
    struct.pack_into("<qiiiiiii", b, 112, position, n_tokens, n_blocks, block_size, 0, 2, 2, 8)
    struct.pack_into("<qq", b, 152, block_bytes, n_blocks * block_bytes)
    b[OFF_CHECKSUM:OFF_CHECKSUM + 16] = checksum
    return bytes(b) + struct.pack("<%di" % len(tokens), *tokens) + bytes(n_blocks * block_bytes)


def spill_seeds():
    put = corpus("fuzz-spill")
    put("one-block", chunk(1, 4, 32))
    put("two-blocks", chunk(2, 16, 64, position=32, parent=b"\x02" * 32))
    put("sixteen-blocks", chunk(16, 2, 8))
    good = chunk(2, 4, 16)
    put("truncated", good[:-1])
    put("extended", good + b"\0")
    put("header-only", good[:HEADER_BYTES])
    put("short", good[:100])
    put("bad-magic", b"LLMEMKX" + good[7:])
    put("bad-version", good[:8] + b"\x02" + good[9:])
    put("too-many-blocks", chunk(17, 1, 8))
    put("bad-tokens-bytes", good[:12] + b"\xff\xff\xff\xff" + good[16:])
    put("negative-position", chunk(1, 4, 32, position=-1))
    put("zero-blocks", chunk(0, 4, 32))
    put("checksum-set", chunk(1, 4, 32, checksum=b"\xab" * 16))


def gguf_str(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


# GGUF value types: (id, struct format)
GGUF_T = {"u8": (0, "B"), "i8": (1, "b"), "u16": (2, "H"), "i16": (3, "h"), "u32": (4, "I"),
          "i32": (5, "i"), "f32": (6, "f"), "bool": (7, "?"), "u64": (10, "Q"), "i64": (11, "q"),
          "f64": (12, "d")}


def gguf_value(t, v):
    if t == "string":
        return struct.pack("<I", 8) + gguf_str(v)
    if t.startswith("array:"):
        et = t[6:]
        if et == "string":
            body = b"".join(gguf_str(x) for x in v)
            return struct.pack("<IIQ", 9, 8, len(v)) + body
        tid, fmt = GGUF_T[et]
        return struct.pack("<IIQ", 9, tid, len(v)) + struct.pack("<%d%s" % (len(v), fmt), *v)
    tid, fmt = GGUF_T[t]
    return struct.pack("<I", tid) + struct.pack("<" + fmt, v)


def gguf_file(kvs, tensors, alignment=32, version=3):
    """A whole GGUF file: kvs [(key, type, value)], tensors [(name, ggml type, dims, bytes)]
    laid out one after the other, each aligned; the data is zeros."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += gguf_str(k) + gguf_value(t, v)
    offset, infos = 0, b""
    for name, gtype, dims, nbytes in tensors:
        infos += gguf_str(name) + struct.pack("<I", len(dims))
        infos += struct.pack("<%dQ" % len(dims), *dims) + struct.pack("<IQ", gtype, offset)
        offset += (nbytes + alignment - 1) // alignment * alignment
    out += infos
    out += bytes(-len(out) % alignment)
    return out + bytes(offset)


def gguf_model(arch, bias=False, qk_norm=False, tied=True, alignment=32, ctx_type="u32"):
    hidden, vocab = 32, 8
    kvs = [("general.architecture", "string", arch), ("general.name", "string", "seed-" + arch),
           (arch + ".block_count", "u32", 1), (arch + ".embedding_length", "u32", hidden),
           (arch + ".feed_forward_length", "u32", 64), (arch + ".attention.head_count", "u32", 2),
           (arch + ".attention.head_count_kv", "u32", 1), (arch + ".context_length", ctx_type, 512),
           (arch + ".rope.freq_base", "f32", 10000.0),
           (arch + ".attention.layer_norm_rms_epsilon", "f32", 1e-6),
           ("tokenizer.ggml.tokens", "array:string", ["t%d" % i for i in range(vocab)]),
           ("tokenizer.ggml.bos_token_id", "u32", 1), ("tokenizer.ggml.eos_token_id", "u32", 2)]
    if alignment != 32:
        kvs.append(("general.alignment", "u32", alignment))
    tensors = [("token_embd.weight", 1, [hidden, vocab], hidden * vocab * 2),  # f16
               ("output_norm.weight", 0, [hidden], hidden * 4),
               ("blk.0.attn_q.weight", 8, [hidden, hidden], hidden * hidden // 32 * 34)]  # q8_0
    if bias:
        tensors.append(("blk.0.attn_q.bias", 0, [hidden], hidden * 4))
    if qk_norm:
        tensors.append(("blk.0.attn_q_norm.weight", 0, [16], 64))
    if not tied:
        tensors.append(("output.weight", 12, [256, vocab], vocab * 144))  # q4_K
    return gguf_file(kvs, tensors, alignment)


def gguf_seeds():
    """fuzz-gguf: small whole files of each architecture (every value type among their keys), the
    fixtures' headers cut at 8 kB, and near-valid variants."""
    put = corpus("fuzz-gguf")
    llama = gguf_model("llama", tied=False)
    put("llama", llama)
    put("qwen2", gguf_model("qwen2", bias=True, alignment=64))
    put("qwen3", gguf_model("qwen3", qk_norm=True, ctx_type="u64"))
    put("every-type", gguf_file(
        [("general.architecture", "string", "llama")] +
        [("t." + t, t, v) for t, v in [("u8", 1), ("i8", -1), ("u16", 2), ("i16", -2),
                                       ("u32", 3), ("i32", -3), ("f32", 0.5), ("bool", True),
                                       ("u64", 4), ("i64", -4), ("f64", 0.25)]] +
        [("t.array_i32", "array:i32", [1, 2]), ("t.array_string", "array:string", ["a", ""]),
         ("t.array_bool", "array:bool", [True]), ("t.array_f64", "array:f64", [1.5])], []))
    put("v2", llama[:4] + struct.pack("<I", 2) + llama[8:])
    put("truncated", llama[:-1])
    put("no-tensors", gguf_file([("general.architecture", "string", "qwen2")], []))
    for f in ["pycoder-q4_k_m", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe-q8_0",
              "tiny-mixtral-bf16"]:
        put(f + "-header", read("gguf/%s.gguf" % f)[:8192])


def byte_level_chars():
    """GPT-2's ByteLevel alphabet: byte → the character that spells it in a vocabulary."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def tokenizer_json(model, added=(), normalizer=None, pre=None, decoder=None):
    return json.dumps({"version": "1.0", "truncation": None, "padding": None,
                       "added_tokens": list(added), "normalizer": normalizer,
                       "pre_tokenizer": pre, "post_processor": None, "decoder": decoder,
                       "model": model}, ensure_ascii=False).encode()


def added_token(i, content, special=True):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": not special, "special": special}


def tokenizer_seeds():
    """fuzz-tokenizer: small tokenizer.json files of the kinds the loader reads (byte-level BPE
    with a regex split, SentencePiece-style BPE with byte fallback, normalizers), with and without
    a tokenizer_config.json, GGUF files carrying a tokenizer, and near-valid variants."""
    put = corpus("fuzz-tokenizer")
    bl = byte_level_chars()
    vocab = {bl[b]: b for b in range(256)}
    merges = ["\u0120 t", "h e", "\u0120t he", "l l", "e ll", "o ,", "\u0120 w", "o r"]
    for m in merges:
        vocab.setdefault(m.replace(" ", ""), len(vocab))
    specials = [added_token(len(vocab) + i, t) for i, t in
                enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    split = {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
                                          "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s+"},
             "behavior": "Isolated", "invert": False}
    gpt2 = tokenizer_json({"type": "BPE", "dropout": None, "unk_token": None, "vocab": vocab,
                           "merges": merges, "byte_fallback": False},
                          specials, None,
                          {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                           "use_regex": True},
                          {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True})
    put("gpt2", b"\x00" + gpt2)
    chatml = json.dumps({"bos_token": None, "eos_token": "<|im_end|>",
                         "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                                          "{{ m.content }}<|im_end|>\n{% endfor %}"}).encode()
    put("gpt2-chatml", b"\x01" + gpt2 + b"\x00" + chatml)
    llama3 = tokenizer_json({"type": "BPE", "vocab": vocab, "merges": [m.split(" ") for m in merges],
                             "ignore_merges": True},
                            [added_token(len(vocab), "<|begin_of_text|>"),
                             added_token(len(vocab) + 1, "<|start_header_id|>"),
                             added_token(len(vocab) + 2, "<|end_header_id|>"),
                             added_token(len(vocab) + 3, "<|eot_id|>")], None,
                            {"type": "Sequence", "pretokenizers": [
                                split, {"type": "ByteLevel", "add_prefix_space": False,
                                        "use_regex": False}]},
                            {"type": "ByteLevel"})
    put("llama3", b"\x01" + llama3 + b"\x00" + json.dumps(
        {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>",
         "chat_template": "<|start_header_id|>{{ role }}<|end_header_id|>"}).encode())
    sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        sp_vocab["<0x%02X>" % b] = len(sp_vocab)
    for piece in ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab"]:
        sp_vocab[piece] = len(sp_vocab)
    sp = tokenizer_json({"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True,
                         "vocab": sp_vocab,
                         "merges": ["\u2581 a", "a b", "\u2581a b"]},
                        [added_token(0, "<unk>"), added_token(1, "<s>"), added_token(2, "</s>")],
                        {"type": "Sequence", "normalizers": [
                            {"type": "Prepend", "prepend": "\u2581"},
                            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
                        None,
                        {"type": "Sequence", "decoders": [
                            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                            {"type": "ByteFallback"}, {"type": "Fuse"},
                            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})
    put("sentencepiece", b"\x01" + sp + b"\x00" + json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>",
         "chat_template": "{{ bos_token }}[INST] {{ m }} [/INST]"}).encode())
    put("metaspace", b"\x00" + tokenizer_json(
        {"type": "BPE", "vocab": sp_vocab, "merges": []}, [], {"type": "NFC"},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}))
    # near-valid: each a small change the loader must refuse or survive
    base = json.loads(gpt2)
    def variant(label, change, config=None):
        t = json.loads(gpt2)
        change(t)
        body = json.dumps(t, ensure_ascii=False).encode()
        put(label, b"\x01" + body + b"\x00" + config if config is not None else b"\x00" + body)
    variant("huge-id", lambda t: t["model"]["vocab"].update({"zz": 2147483647}))
    variant("negative-id", lambda t: t["model"]["vocab"].update({"zz": -1}))
    variant("duplicate-id", lambda t: t["model"]["vocab"].update({"zz": 3}))
    variant("added-far", lambda t: t["added_tokens"].append(added_token(1 << 30, "<far>")))
    variant("unknown-merge", lambda t: t["model"]["merges"].append("q q"))
    variant("merge-three", lambda t: t["model"]["merges"].append("a b c"))
    variant("unk-missing", lambda t: t["model"].update({"unk_token": "<nope>"}))
    variant("wordpiece", lambda t: t["model"].update({"type": "WordPiece"}))
    variant("dropout", lambda t: t["model"].update({"dropout": 0.1}))
    variant("bad-regex", lambda t: t.update({"pre_tokenizer": {"type": "Split", "pattern": {
        "Regex": "(?<=a"}, "behavior": "Isolated"}}))
    variant("deep", lambda t: t.update({"normalizer": json.loads(
        '{"type": "Sequence", "normalizers": [' * 40 + '{"type": "NFC"}' + ']}' * 40)}))
    variant("vocab-list", lambda t: t["model"].update({"vocab": [["a", 0]]}))
    variant("config-list", lambda t: None, b"[1, 2]")
    variant("config-templates", lambda t: None, json.dumps({"chat_template": [
        {"name": "default", "template": "<|im_start|>"}, {"name": "rag", "template": "x"}]}).encode())
    variant("config-template-list", lambda t: None, json.dumps({"chat_template": [
        {"name": "default", "template": "<|im_start|>"}, {"name": "tool_use", "template": 3}]}).encode())
    variant("config-token-object", lambda t: None,
            json.dumps({"bos_token": {"content": 7}, "eos_token": {"content": "<|endoftext|>"}}).encode())
    put("truncated", b"\x00" + gpt2[:len(gpt2) // 2])
    # GGUF files with a tokenizer: gpt2 (merges) and llama (scores), and near-valid ones
    tokens = [bl[b] for b in range(256)] + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    gpt2_kvs = [("general.architecture", "string", "qwen2"),
                ("tokenizer.ggml.model", "string", "gpt2"), ("tokenizer.ggml.pre", "string", "qwen2"),
                ("tokenizer.ggml.tokens", "array:string", tokens),
                ("tokenizer.ggml.token_type", "array:i32", [1] * (len(tokens) - 1) + [3]),
                ("tokenizer.ggml.merges", "array:string", merges),
                ("tokenizer.ggml.bos_token_id", "u32", len(tokens) - 1),
                ("tokenizer.ggml.eos_token_id", "u32", len(tokens) - 1),
                ("tokenizer.chat_template", "string", "<|im_start|>{{ m }}<|im_end|>")]
    put("gguf-gpt2", b"\x02" + gguf_file(gpt2_kvs, []))
    sp_tokens = list(sp_vocab)
    llama_kvs = [("general.architecture", "string", "llama"),
                 ("tokenizer.ggml.model", "string", "llama"),
                 ("tokenizer.ggml.tokens", "array:string", sp_tokens),
                 ("tokenizer.ggml.scores", "array:f32", [-float(i) for i in range(len(sp_tokens))]),
                 ("tokenizer.ggml.token_type", "array:i32", [2, 3, 3] + [6] * 256 + [1] * 7),
                 ("tokenizer.ggml.bos_token_id", "u32", 1), ("tokenizer.ggml.eos_token_id", "u32", 2),
                 ("tokenizer.ggml.unknown_token_id", "u32", 0),
                 ("tokenizer.ggml.add_bos_token", "bool", True)]
    put("gguf-llama", b"\x02" + gguf_file(llama_kvs, []))
    def gguf_variant(label, kvs, i, kv):
        kvs = list(kvs)
        if kv is None:
            del kvs[i]
        else:
            kvs[i] = kv
        put(label, b"\x02" + gguf_file(kvs, []))
    gguf_variant("gguf-no-model", gpt2_kvs, 1, None)
    gguf_variant("gguf-model-bert", gpt2_kvs, 1, ("tokenizer.ggml.model", "string", "bert"))
    gguf_variant("gguf-bos-far", gpt2_kvs, 6, ("tokenizer.ggml.bos_token_id", "u32", 1 << 30))
    gguf_variant("gguf-types-short", gpt2_kvs, 4, ("tokenizer.ggml.token_type", "array:i32", [1]))
    gguf_variant("gguf-merge-unknown", gpt2_kvs, 5, ("tokenizer.ggml.merges", "array:string",
                                                     ["q q", "onlyone"]))
    gguf_variant("gguf-scores-short", llama_kvs, 3, ("tokenizer.ggml.scores", "array:f32", [0.0]))
    gguf_variant("gguf-tokens-ints", llama_kvs, 2, ("tokenizer.ggml.tokens", "array:i32", [1, 2]))
    gguf_variant("gguf-no-tokens", llama_kvs, 2, None)


if __name__ == "__main__":
    config_seeds()
    request_seeds()
    safetensors_seeds()
    tok_seeds()
    spill_seeds()
    gguf_seeds()
    tokenizer_seeds()
