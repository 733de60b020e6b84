#!/usr/bin/env python3
"""bench/cuda_attn_sdpa.py — llmem's paged decode attention next to PyTorch's SDPA.

Runs llmem-bench-cuda-attn --json (the paged kernel: bf16 and q8, 32 query heads / 8 KV heads,
head_dim 128, blocks of 16) and times torch.nn.functional.scaled_dot_product_attention(q, k, v,
enable_gqa=True) on the same shapes with a contiguous [B, H, T, D] bf16 cache, one query token,
as the C benchmark times its kernels: per call in replays of a CUDA graph of 10 calls (median of
--reps replays), and "1 call": CUDA events around single calls (median of --reps after warm-up). Shapes whose cache is
under 256 MiB rotate over several caches, as the C benchmark does, so neither runs from L2.
Prints one table: our time (bf16, q8), SDPA's, the ratios, and bytes/s against the copy bandwidth
measured by the C benchmark in the same run.

    python3 bench/cuda_attn_sdpa.py --bench build/llmem-bench-cuda-attn [--reps 50] [--json OUT]
"""
import argparse
import json
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ROTATE_BYTES = 256 << 20
GRAPH_CALLS = 10


def time_sdpa(batch, ctx, reps, warmup):
    kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    sets = max(1, -(-ROTATE_BYTES // kv_bytes))
    g = torch.Generator(device="cuda").manual_seed(1)
    qs, ks, vs = [], [], []
    for _ in range(sets):
        qs.append(torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                              generator=g))
        ks.append(torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda",
                              dtype=torch.bfloat16, generator=g))
        vs.append(torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda",
                              dtype=torch.bfloat16, generator=g))
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    stop = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    with torch.no_grad():
        for i in range(warmup + reps):
            s = i % sets
            if i >= warmup:
                start[i - warmup].record()
            F.scaled_dot_product_attention(qs[s], ks[s], vs[s], enable_gqa=True)
            if i >= warmup:
                stop[i - warmup].record()
    torch.cuda.synchronize()
    ms_events = statistics.median(a.elapsed_time(b) for a, b in zip(start, stop))
    # a CUDA graph of GRAPH_CALLS calls, events around each replay (as the C benchmark does)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                F.scaled_dot_product_attention(qs[0], ks[0], vs[0], enable_gqa=True)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for i in range(GRAPH_CALLS):
                s = i % sets
                F.scaled_dot_product_attention(qs[s], ks[s], vs[s], enable_gqa=True)
    for i in range(2 + reps):
        if i >= 2:
            start[i - 2].record()
        graph.replay()
        if i >= 2:
            stop[i - 2].record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in zip(start, stop)) / GRAPH_CALLS
    del graph, qs, ks, vs
    torch.cuda.empty_cache()
    return ms, ms_events, kv_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="path of llmem-bench-cuda-attn")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", help="write the combined results here")
    args = ap.parse_args()

    run = subprocess.run([args.bench, "--json", "--reps", str(args.reps), "--warmup",
                          str(args.warmup)], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{args.bench} failed ({run.returncode}):\n{run.stderr}")
    ours = json.loads(run.stdout)
    copy_bw = ours["copy"]["bytes_per_s"]
    by_shape = {}
    for r in ours["attention"]:
        by_shape.setdefault((r["batch"], r["context"]), {})[r["format"]] = r

    rows = []
    for (batch, ctx), fm in by_shape.items():
        sdpa_ms, sdpa_ms_events, kv_bytes = time_sdpa(batch, ctx, args.reps, args.warmup)
        rows.append({"batch": batch, "context": ctx, "sdpa_ms": sdpa_ms,
                     "sdpa_ms_events": sdpa_ms_events,
                     "sdpa_bytes_per_s": kv_bytes / (sdpa_ms * 1e-3),
                     "bf16": fm.get("bf16"), "q8": fm.get("q8")})

    print(f"{ours['gpu']}, {ours['sms']} SMs, torch {torch.__version__}; "
          f"{HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}; median of {args.reps}")
    print(f"copy D2D: {copy_bw / 1e9:.0f} GB/s (read + write)")
    hdr = (f"{'batch x ctx':>12} | {'bf16 us':>8} {'GB/s':>6} {'%copy':>6} | {'q8 us':>7} "
           f"{'GB/s':>6} {'%copy':>6} {'bf16/q8':>7} | {'SDPA us':>8} {'GB/s':>6} | "
           f"{'SDPA/bf16':>9} {'SDPA/q8':>8} | 1 call: {'bf16':>6} {'SDPA':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        b, q = r["bf16"], r["q8"]
        bt = b["ms"] * 1e3 if b else float("nan")
        qt = q["ms"] * 1e3 if q else float("nan")
        st = r["sdpa_ms"] * 1e3
        print(f"{r['batch']:>5} x {r['context']:<5} | "
              f"{bt:8.1f} {b['bytes_per_s'] / 1e9 if b else 0:6.0f} "
              f"{100 * b['of_copy'] if b else 0:5.1f}% | "
              f"{qt:7.1f} {q['bytes_per_s'] / 1e9 if q else 0:6.0f} "
              f"{100 * q['of_copy'] if q else 0:5.1f}% {bt / qt:7.2f} | "
              f"{st:8.1f} {r['sdpa_bytes_per_s'] / 1e9:6.0f} | {st / bt:9.2f} {st / qt:8.2f} | "
              f"{b['ms_events'] * 1e3 if b else 0:14.1f} {r['sdpa_ms_events'] * 1e3:6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ours": ours, "sdpa": rows, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
