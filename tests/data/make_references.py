#!/usr/bin/env python3
# Regenerates the references of tests/data/ from the fixtures beside them (tests/data/README.md
# says what each folder holds):
#
#   models  tests/data/models/<name>/reference.json and ref_logits_<i>.npy for every model with
#           weights (pycoder's weights are the embedded default, models/pycoder): transformers
#           loads the checkpoint with from_pretrained(dtype=float32), eager attention — f32 math on
#           the stored weights, rotary frequencies in f32 — and gives, for each prompt, the greedy
#           continuation and the teacher-forced logits [prompt + continuation, vocab] (float32
#           .npy), plus the ids and decoded text of a fixed set of strings (tokenizer_cases).
#   tok     the ids and decoded text of every case in tests/data/tok/<name>/cases.json, recomputed
#           by `tokenizers` from the tokenizer.json beside it (the texts stay as they are).
#   nfc     tests/data/tok/nfc.json: seeded random strings of combining marks, Hangul jamo and
#           syllables, singletons and composition exclusions, with unicodedata's NFC of each.
#
# Needs Python 3.9+; `models` needs torch, transformers (5.x), tokenizers and numpy, `tok` needs
# tokenizers; `nfc` needs nothing else. The model references are computed on the CPU: run it
# where those packages are installed (a GPU is not needed), from anywhere:
#
#   python3 tests/data/make_references.py [--out DIR] [--model NAME ...] [models|tok|nfc ...]
#
# With no part named it runs all three. It writes in place, or under --out DIR with the same
# layout (models/<name>/..., tok/<name>/cases.json, tok/nfc.json), and prints for each logits file
# the largest |difference| from the file it replaces, so a regeneration that changes nothing shows
# as 0.
import argparse
import json
import os
import random
import sys
import unicodedata

DATA = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(DATA))

# ---- models ----------------------------------------------------------------------------------

# The prompts of the random-weight models, tokenized without special tokens; the last prompt of
# tiny-mistral-swa is instead 120 random ids, longer than its 32-token sliding window.
TEXTS = ["The quick brown fox", "def main():\n    print(", "In 1969, the first",
         "Memory is a budget, not"]
CODE_TEXTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
              "class Stack:\n    def __init__(self):\n", "# Parse the command line arguments\n"]
# tokenizer_cases: text -> ids -> decoded text, for exact tokenizer tests.
TOKENIZER_STRINGS = [
    "Hello world", " leading space", "The quick brown fox jumps over the lazy dog.",
    "numbers 1234567 and 3.14159", "tabs\tand\nnewlines\n\n  indented", "emoji 🚀 and ünïcödé 漢字",
    "def f(x):\n    return x*2  # comment", "   ", "", "it's they're we'll I'd",
    "<|im_start|>user\nhi<|im_end|>", "mixedCASE_snake_case-kebab",
]

# name -> (weights directory, prompts, new tokens, length of a last random prompt, trained): a
# random-weight model gets tokenizer_cases; the trained one gets the prompt and continuation as
# text instead (its tokenizer cases are those).
MODELS = {
    "tiny-llama3": ("tests/data/models/tiny-llama3", TEXTS, 40, 0, False),
    "tiny-qwen2": ("tests/data/models/tiny-qwen2", TEXTS, 40, 0, False),
    "tiny-qwen3": ("tests/data/models/tiny-qwen3", TEXTS, 40, 0, False),
    "tiny-mistral-swa": ("tests/data/models/tiny-mistral-swa", TEXTS, 40, 120, False),
    "pycoder": ("models/pycoder", CODE_TEXTS, 64, 0, True),
    # weights by make_moe_models.py (numpy)
    "tiny-qwen3-moe": ("tests/data/models/tiny-qwen3-moe", TEXTS, 40, 0, False),
    "tiny-mixtral": ("tests/data/models/tiny-mixtral", TEXTS, 40, 120, False),
}


def make_model(name, out):
    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer

    weights, texts, n_new, long_prompt, trained = MODELS[name]
    weights = os.path.join(ROOT, weights)
    here = os.path.join(DATA, "models", name)
    dest = os.path.join(out, "models", name)
    os.makedirs(dest, exist_ok=True)
    old = {}
    if os.path.exists(os.path.join(here, "reference.json")):
        with open(os.path.join(here, "reference.json")) as f:
            old = json.load(f)

    tok = Tokenizer.from_file(os.path.join(weights, "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        weights, dtype=torch.float32, attn_implementation="eager").eval()
    with open(os.path.join(weights, "config.json")) as f:
        cfg = json.load(f)
    vocab = tok.get_vocab_size()
    assert vocab == cfg["vocab_size"], (name, vocab, cfg["vocab_size"])

    ref = {"model": name, "transformers": transformers.__version__, "torch": torch.__version__}
    if trained:  # facts of its training, kept as they are
        ref.update({k: old[k] for k in ("train_steps", "val_loss") if k in old})
    else:
        ref["dtype"] = "torch." + str(cfg.get("dtype") or cfg.get("torch_dtype"))
    ref["math"] = "float32"
    if not trained:
        ref["tokenizer_cases"] = []
        for s in TOKENIZER_STRINGS:
            ids = tok.encode(s, add_special_tokens=False).ids
            ref["tokenizer_cases"].append(
                {"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    ref["generations"] = []
    g = torch.Generator().manual_seed(7)
    for i, text in enumerate(texts):
        gen = {}
        if long_prompt and i == len(texts) - 1:
            ids = torch.randint(5, vocab, (long_prompt,), generator=g).tolist()
        else:
            ids = tok.encode(text, add_special_tokens=False).ids
            if trained:
                gen["prompt"] = text
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new,
                                  do_sample=False, pad_token_id=0)
            logits = model(full).logits[0].float().numpy().astype(np.float32)
        greedy = full[0].tolist()[len(ids):]
        gen["prompt_ids"] = ids
        gen["greedy_ids"] = greedy
        if trained:
            gen["greedy_text"] = tok.decode(greedy, skip_special_tokens=False)
        gen["logits_file"] = "ref_logits_%d.npy" % i
        ref["generations"].append(gen)
        before = os.path.join(here, gen["logits_file"])
        change = "new"
        if os.path.exists(before):
            prev = np.load(before)
            change = ("max |Δ| %.2e vs the file it replaces" % float(np.abs(prev - logits).max())
                      if prev.shape == logits.shape else "shape %s, was %s" % (logits.shape,
                                                                                prev.shape))
        np.save(os.path.join(dest, gen["logits_file"]), logits)
        print("%-17s %s: %d + %d tokens, %s" % (name, gen["logits_file"], len(ids), len(greedy),
                                                change))
    ref["load"] = "from_pretrained(dtype=float32), eager attention"
    with open(os.path.join(dest, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


# ---- tok: the cases of the tokenizer-only fixtures ---------------------------------------------


def case_text(c, key):
    if key + "_hex" in c:
        return bytes.fromhex(c[key + "_hex"]).decode("utf-8")
    return c[key]


def set_text(c, key, s):
    if "\0" in s:
        c.pop(key, None)
        c[key + "_hex"] = s.encode("utf-8").hex()
    else:
        c.pop(key + "_hex", None)
        c[key] = s


def make_tok(name, out):
    from tokenizers import Tokenizer

    here = os.path.join(DATA, "tok", name)
    tok = Tokenizer.from_file(os.path.join(here, "tokenizer.json"))
    with open(os.path.join(here, "cases.json")) as f:
        cases = json.load(f)
    changed = 0
    for c in cases["cases"]:
        ids = tok.encode(case_text(c, "text"), add_special_tokens=False).ids
        decoded = tok.decode(ids, skip_special_tokens=False)
        changed += ids != c["ids"] or decoded != case_text(c, "decoded")
        c["ids"] = ids
        set_text(c, "decoded", decoded)
    for c in cases.get("decode_cases", []):
        text = tok.decode(c["ids"], skip_special_tokens=False)
        changed += text != c["text"]
        c["text"] = text
    dest = os.path.join(out, "tok", name)
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("%-20s %d cases, %d changed" % (name, len(cases["cases"]), changed))


# ---- nfc ---------------------------------------------------------------------------------------


def ranges(*spans):
    return [chr(c) for a, b in spans for c in range(a, b + 1)]


# Characters whose NFC differs from themselves or from their neighbours': starters that compose
# with a following mark, the marks (of several combining classes, so that NFC reorders them),
# Hangul L, V and T jamo and LV/LVT syllables, singletons (Ω K Å 豈 丽) and composition exclusions
# (क़, ཱི, ̈́, Ḋ's decomposition).
NFC_POOLS = [
    ranges((0x20, 0x20), (0x0A, 0x0A), (0x41, 0x5A), (0x61, 0x7A), (0x5B, 0x60)),
    ranges((0xC0, 0x17F)),
    ranges((0x300, 0x34F), (0x350, 0x36F)),
    ranges((0x391, 0x3A9), (0x3AA, 0x3B0), (0x3B1, 0x3C9), (0x1F00, 0x1F1F)),
    ranges((0x915, 0x939), (0x93A, 0x93D), (0x93E, 0x93F), (0x94D, 0x94D), (0x958, 0x95F)),
    ranges((0xB3E, 0xB3E), (0xB47, 0xB48), (0xB57, 0xB57), (0xF71, 0xF76), (0x344, 0x344)),
    ranges((0x1100, 0x1112), (0x1161, 0x1175), (0x11A8, 0x11C2), (0xAC00, 0xAC3F)),
    ranges((0x304B, 0x3062), (0x3099, 0x309A)),
    ranges((0x2126, 0x2126), (0x212A, 0x212B), (0xF900, 0xF900), (0x2F800, 0x2F800),
           (0x1E0A, 0x1E0C), (0x0323, 0x0323)),
]


def make_nfc(out):
    rng = random.Random(20241129)
    vectors = []
    while len(vectors) < 416:
        n = rng.randint(1, 12)
        s = "".join(rng.choice(rng.choice(NFC_POOLS)) for _ in range(n))
        vectors.append([s, unicodedata.normalize("NFC", s)])
    dest = os.path.join(out, "tok")
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "nfc.json"), "w") as f:
        json.dump({"unicode": unicodedata.unidata_version, "vectors": vectors}, f, indent=0,
                  ensure_ascii=False)
        f.write("\n")
    changed = sum(a != b for a, b in vectors)
    print("nfc.json: %d vectors, %d changed by NFC (Unicode %s)" % (len(vectors), changed,
                                                                  unicodedata.unidata_version))


def main():
    ap = argparse.ArgumentParser(description="Regenerates the references of tests/data/.")
    ap.add_argument("--out", default=DATA, help="where to write (default: in place)")
    ap.add_argument("--model", action="append", choices=sorted(MODELS),
                    help="only this model of the part 'models' (repeatable)")
    ap.add_argument("parts", nargs="*", help="models, tok or nfc (default: all three)")
    args = ap.parse_args()
    parts = args.parts or ["models", "tok", "nfc"]
    for p in parts:
        if p not in ("models", "tok", "nfc"):
            ap.error("unknown part '%s'" % p)
    if "models" in parts:
        for name in args.model or MODELS:
            make_model(name, args.out)
    if "tok" in parts:
        for name in sorted(os.listdir(os.path.join(DATA, "tok"))):
            if os.path.exists(os.path.join(DATA, "tok", name, "tokenizer.json")):
                make_tok(name, args.out)
    if "nfc" in parts:
        make_nfc(args.out)


if __name__ == "__main__":
    sys.exit(main())
