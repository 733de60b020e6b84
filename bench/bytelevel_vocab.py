#!/usr/bin/env python3
"""A byte-level BPE tokenizer of up to 131,072 tokens without a trainer, for `llmem-bench grammar`.

    bench/bytelevel_vocab.py OUT_DIR [TEXT_DIR]

The most frequent pieces of TEXT_DIR's .py/.txt/.rst files (default: this Python's standard
library), split as Llama 3's pre-tokenizer splits (approximately, with `re`), and every prefix
of them, as GPT-2 byte-level tokens; each longer token merged from its prefix and its last
byte. Its trie is what a trained vocabulary's is (words, identifiers, punctuation runs, a space
before them); llmem loads it as any tokenizer.json. Writes tokenizer.json, tokenizer_config.json
and a config.json of the 1B shape (hidden 2048, 16 layers) for `--load-format dummy`.
"""
import collections, json, os, re, sys, sysconfig

VOCAB = 131072
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PIECE = re.compile(r"""'(?:[sdmt]|ll|ve|re)|[^\r\n\w]?[A-Za-z_]+|\d{1,3}| ?[^\s\w]+[\r\n]*"""
                   r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_chars():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main():
    out = sys.argv[1]
    src = sys.argv[2] if len(sys.argv) > 2 else sysconfig.get_paths()["stdlib"]
    chars = byte_chars()
    counts, total = collections.Counter(), 0
    for d, _, files in sorted(os.walk(src)):
        for f in sorted(files):
            if f.endswith((".py", ".txt", ".rst")) and total < 120e6:
                try:
                    text = open(os.path.join(d, f), encoding="utf-8").read()
                except (OSError, UnicodeDecodeError):
                    continue
                total += len(text)
                counts.update(PIECE.findall(text))
    vocab = {}
    for b in range(256):
        vocab[chars[b]] = len(vocab)
    for piece, _ in counts.most_common():
        tok = "".join(chars[b] for b in piece.encode("utf-8"))
        new = [tok[:i] for i in range(2, len(tok) + 1) if tok[:i] not in vocab]
        if len(tok) > 48:
            continue
        if len(vocab) + len(new) > VOCAB - len(SPECIALS):
            break
        for t in new:
            vocab[t] = len(vocab)
    order = sorted(vocab, key=vocab.get)
    merges = [t[:-1] + " " + t[-1] for t in order[256:]]
    added = []
    for s in SPECIALS:
        vocab[s] = len(vocab)
        added.append({"id": vocab[s], "content": s, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    os.makedirs(out, exist_ok=True)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PAT}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges}}
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
                   "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "tie_word_embeddings": True,
                   "vocab_size": len(vocab), "bos_token_id": vocab[SPECIALS[0]],
                   "eos_token_id": vocab[SPECIALS[1]], "torch_dtype": "bfloat16"}, f)
    print(f"{out}: {len(vocab)} tokens from {total / 1e6:.0f} MB of text", file=sys.stderr)


if __name__ == "__main__":
    main()
