# Makes the extra reference tokenizers of tests/data/tok (tok-metaspace-split, tok-bytelevel-prefix):
# forms the model references do not cover (Metaspace with prepend_scheme "first" and split,
# ByteLevel with add_prefix_space, added tokens with lstrip/rstrip and non-special ones). Needs the
# `tokenizers` Python package; writes <name>/tokenizer.json and <name>/cases.json under $OUT.
import json, os
from tokenizers import Tokenizer, AddedToken, models, trainers, pre_tokenizers, decoders

OUT = os.environ.get("OUT", ".")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello tokenizers! def f(x):\n    return x * 2  # comment\n",
    "numbers 1234567 and 3.14159; it's they're we'll I'd",
    "emoji 🚀 and ünïcödé 漢字 — mixedCASE_snake_case-kebab",
] * 20
TEXTS = [
    "Hello world", " leading space", "  two  spaces  ", "", "   ", "tabs\tand\nnewlines\n\n  x",
    "emoji 🚀 and ünïcödé 漢字", "it's they're we'll I'd", "▁already▁metaspace",
    "Hello <mask> world", "a<s>b</s> c", "  <mask>  x", "<mask>", "x[SEP]y [SEP] z",
    "<s> first", "end </s>", "ÀÁÂ ☃ nul", "\r\nwindows\r\n",
]
ADDED = [AddedToken("<mask>", lstrip=True, rstrip=True, special=True),
         AddedToken("[SEP]", special=False, normalized=False)]


def cases(tok):
    out = []
    for s in TEXTS:
        ids = tok.encode(s, add_special_tokens=False).ids
        out.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    return out


def save(name, tok):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump({"source": "make_extra.py", "cases": cases(tok), "decode_cases": []}, f,
                  ensure_ascii=False, indent=1)


tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
specials = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                                    show_progress=False))
tok.add_tokens(ADDED)
save("tok-metaspace-split", tok)

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
    vocab_size=500, special_tokens=["<s>", "</s>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.add_tokens(ADDED)
save("tok-bytelevel-prefix", tok)
print("tokenizers", __import__("tokenizers").__version__)
