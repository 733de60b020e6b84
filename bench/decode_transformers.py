#!/usr/bin/env python3
"""bench/decode_transformers.py — Hugging Face transformers on the same GPU and model as
`llmem-bench decode|serve --backend cuda`, for the comparison BENCHMARKS.md records.

The model directory is loaded with AutoModelForCausalLM in bf16 on the GPU (no tokenizer: random
token ids, seeded). Measured, each the median of --reps runs, with the GPU synchronised around
each:
  prefill   tokens/s of one forward pass over a --prefill-token prompt (no cache kept);
  batch B   generated tokens/s of model.generate on B prompts of --prompt tokens, greedy,
            --gen new tokens each (EOS ignored): B · gen / the whole call's time, prefill
            included, as `llmem-bench serve` counts its tokens/s.

    python3 bench/decode_transformers.py MODEL_DIR [--batches 1,32,128] [--prompt 128] [--gen 128]
                                         [--prefill 512] [--reps 3] [--json OUT]
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def timed(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    out = {"model": a.model, "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "transformers": __import__("transformers").__version__}

    with torch.inference_mode():
        ids = torch.randint(5, vocab, (1, a.prefill), device="cuda")
        model(ids, use_cache=False)  # warm-up
        s = timed(lambda: model(ids, use_cache=False), a.reps)
        out["prefill_tokens"] = a.prefill
        out["prefill_tokens_per_s"] = a.prefill / s
        out["batches"] = []
        for b in [int(x) for x in a.batches.split(",")]:
            prompts = torch.randint(5, vocab, (b, a.prompt), device="cuda")
            mask = torch.ones_like(prompts)

            def gen():
                model.generate(prompts, attention_mask=mask, max_new_tokens=a.gen,
                               min_new_tokens=a.gen, do_sample=False, pad_token_id=0)

            gen()  # warm-up
            s = timed(gen, a.reps)
            out["batches"].append({"batch": b, "tokens_per_s": b * a.gen / s, "seconds": s})

    print(f"transformers {out['transformers']}, torch {out['torch']}, {out['gpu']}: {a.model}")
    print(f"prefill {a.prefill} tokens: {out['prefill_tokens_per_s']:,.0f} tokens/s")
    for r in out["batches"]:
        print(f"batch {r['batch']:>4}: {r['tokens_per_s']:>10,.0f} generated tokens/s "
              f"(prompt {a.prompt}, {a.gen} new tokens each, {r['seconds']:.2f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
