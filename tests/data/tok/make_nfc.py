# Makes tests/data/tok/tok-nfc: a byte-level BPE with Qwen's NFC normalizer and the Llama 3 /
# Qwen split regex, with cases computed by the `tokenizers` Python package (writes under $OUT).
import json, os
from tokenizers import Tokenizer, Regex, models, normalizers, trainers, pre_tokenizers, decoders

PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["café naïve résumé Ångström Ωmega 한국어 पढ़ाई e\u0301 a\u030a The quick brown fox."] * 30
TEXTS = ["café", "cafe\u0301", "A\u030angstro\u0308m", "\u212bngstr\u00f6m \u2126", "\u1100\u1161\u11a8",
         "\u1e0a\u0323 q\u0307\u0323", "\u0915\u093c\u093e", "plain ascii", "<|im_start|>e\u0301",
         "\u0344\u0f73 \uf900"]
tok = Tokenizer(models.BPE())
tok.normalizer = normalizers.NFC()
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(PAT), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
    vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
d = os.path.join(os.environ.get("OUT", "."), "tok-nfc")
os.makedirs(d, exist_ok=True)
tok.save(os.path.join(d, "tokenizer.json"))
cases = []
for s in TEXTS:
    ids = tok.encode(s, add_special_tokens=False).ids
    cases.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
json.dump({"source": "make_nfc.py", "cases": cases, "decode_cases": []},
          open(os.path.join(d, "cases.json"), "w"), ensure_ascii=False, indent=1)
