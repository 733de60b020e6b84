/*
 * bench/cuda_prefill.cu — llmem-bench-cuda-prefill: the causal attention of a whole prompt's
 * prefill on the GPU, in the chunks the engine would give it, by the prefill kernel (prefill.h,
 * fast precision; on Hopper its warpgroup kernel and the warp-level one beside it) and by the
 * decode kernel's packed queries (attention.h, the f32-precision path),
 * in TFLOP/s of the causal product (4 · head_dim · query heads · Σ over queries of the tokens each
 * sees: the count FlashAttention's benchmarks use, which PyTorch's SDPA is compared by).
 *
 * Shape: 32 query heads, 8 KV heads (--heads), head_dim 128 (--dim), bf16 cache (--format f16|q8),
 * blocks of 16 scattered over the pool (a random permutation), one sequence of --tokens tokens
 * attended by chunks of --chunk queries (each chunk over the tokens before it and itself). Times
 * are CUDA events around the whole prefill (every chunk), median of --reps after one warm-up.
 * LLMEM_CUDA_PREFILL_MBLOCKS forces the rows a warp takes, as in the engine.
 *
 *   llmem-bench-cuda-prefill [--tokens 32768] [--chunk 4096] [--heads 32/8] [--dim 128]
 *                            [--format bf16|f16|q8] [--reps 3] [--no-decode-kernel]
 */
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/prefill.h"
#include "core/options.h"
#include "cuda_check.h"

__device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* 16-bit elements uniform in (-1, 1) (fmt 1: bf16 bits, 0: f16), or q8 groups (fmt 2: random
 * codes, f16 scales in [2⁻⁸, 2⁻⁶)); floats uniform in (-scale, scale) */
__global__ void fill16(uint16_t *p, size_t n, int fmt, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = (float)(hash32(seed + i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
        if (fmt == 2) {
            const uint32_t h = hash32(seed + i);
            p[i] = (2 * i) % 34 == 32 ? (uint16_t)(0x1c00 + (h & 0x7ff)) : (uint16_t)h;
        } else if (fmt == 1) {
            const uint32_t bits = __float_as_uint(x);
            p[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        } else {
            p[i] = __half_as_ushort(__float2half_rn(x));
        }
    }
}
__global__ void fill_f32(float *p, size_t n, float scale, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = scale * ((float)(hash32(seed + i) >> 8) * (2.0f / 16777216.0f) - 1.0f);
}

static double median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
    int tokens = 32768, chunk = 4096, heads = 32, kv = 8, dim = 128, reps = 3, decode = 1;
    enum llmem_kv_format format = LLMEM_KV_FORMAT_BF16;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc)
            chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc &&
                 sscanf(argv[++i], "%d/%d", &heads, &kv) == 2 && kv > 0 && heads % kv == 0)
            continue;
        else if (!strcmp(argv[i], "--dim") && i + 1 < argc)
            dim = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--format") && i + 1 < argc)
            format = !strcmp(argv[++i], "f16")  ? LLMEM_KV_FORMAT_F16
                     : !strcmp(argv[i], "q8") ? LLMEM_KV_FORMAT_Q8
                                              : LLMEM_KV_FORMAT_BF16;
        else if (!strcmp(argv[i], "--no-decode-kernel"))
            decode = 0;
        else {
            fprintf(stderr,
                    "usage: %s [--tokens N] [--chunk N] [--heads Q/KV] [--dim 64|128] "
                    "[--format bf16|f16|q8] [--reps N] [--no-decode-kernel]\n",
                    argv[0]);
            return 2;
        }
    }
    if (tokens < 1 || chunk < 1 || reps < 1 ||
        !llmem_cuda_prefill_fits(format, heads, kv, dim, 16)) {
        fprintf(stderr, "llmem-bench-cuda-prefill: unsupported shape\n");
        return 2;
    }
    const int nb = (tokens + 15) / 16, group = heads / kv;
    const int fmt = format == LLMEM_KV_FORMAT_Q8 ? 2 : format == LLMEM_KV_FORMAT_BF16;
    /* a token's rows (of K, and of V) and a block of them */
    const size_t row = (size_t)kv * (fmt == 2 ? 34 * dim / 32 : 2 * dim), block_bytes = 16 * row;
    uint8_t *k_pool, *v_pool;
    float *q, *out;
    int32_t *d_ints;
    CHECK(cudaMalloc(&k_pool, (size_t)nb * block_bytes));
    CHECK(cudaMalloc(&v_pool, (size_t)nb * block_bytes));
    CHECK(cudaMalloc(&q, (size_t)tokens * heads * dim * sizeof(float)));
    CHECK(cudaMalloc(&out, (size_t)tokens * heads * dim * sizeof(float)));
    fill16<<<1024, 256>>>((uint16_t *)k_pool, (size_t)nb * block_bytes / 2, fmt, 1);
    fill16<<<1024, 256>>>((uint16_t *)v_pool, (size_t)nb * block_bytes / 2, fmt, 2);
    fill_f32<<<1024, 256>>>(q, (size_t)tokens * heads * dim, 2.0f, 3);
    CHECK(cudaGetLastError());

    /* the table (a random permutation of the blocks), then per chunk: lengths (decode kernel),
     * then tiles (prefill kernel) */
    std::vector<int32_t> table(nb);
    for (int i = 0; i < nb; i++)
        table[i] = i;
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int i = nb - 1; i > 0; i--) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        std::swap(table[i], table[(int)(r % (uint64_t)(i + 1))]);
    }
    const int mb = llmem_cuda_prefill_mblocks(group, kv, std::min(chunk, tokens));
    const int tq = llmem_cuda_prefill_tile_queries(group, mb);
    std::vector<int32_t> ints(table);
    std::vector<size_t> len_at, tiles_at;
    std::vector<int> n_tiles;
    for (int c0 = 0; c0 < tokens; c0 += chunk) {
        const int n = std::min(chunk, tokens - c0);
        len_at.push_back(ints.size());
        for (int i = 0; i < n; i++)
            ints.push_back(c0 + i + 1);
        tiles_at.push_back(ints.size());
        int t = 0;
        for (int i = ((n - 1) / tq) * tq; i >= 0; i -= tq, t++) {
            ints.push_back(c0 + i), ints.push_back(std::min(tq, n - i));
            ints.push_back(c0 + i), ints.push_back(0);
        }
        n_tiles.push_back(t);
    }
    CHECK(cudaMalloc(&d_ints, ints.size() * sizeof(int32_t)));
    CHECK(cudaMemcpy(d_ints, ints.data(), ints.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

    double flops = 0;
    for (int i = 0; i < tokens; i++)
        flops += 4.0 * dim * heads * (i + 1);
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    /* the decode kernel's split workspace, at most (one chunk) */
    void *ws = NULL;
    size_t ws_bytes = 0;

    /* the prefill kernel as the engine runs it; where that is the warpgroup kernel, the
     * warp-level one beside it; the decode kernel */
    const bool wg = llmem_cuda_prefill_wgmma(format, dim) != 0;
    const char *names[3] = {wg ? "prefill kernel (wgmma)" : "prefill kernel (mma.sync)",
                            "prefill kernel (mma.sync)", "decode kernel (packed)"};
    printf("causal prefill attention, %d tokens in chunks of %d, %d/%d heads, dim %d, %s cache, "
           "warps of %d rows\n",
           tokens, chunk, heads, kv, dim, fmt == 2 ? "q8" : fmt ? "bf16" : "f16", 16 * mb);
    for (int kind = 0; kind < 3; kind++) {
        if ((kind == 1 && !wg) || (kind == 2 && !decode))
            continue;
        std::vector<float> ms;
        for (int rep = 0; rep <= reps; rep++) {
            CHECK(cudaEventRecord(e0));
            for (size_t ci = 0; ci < len_at.size(); ci++) {
                const int c0 = (int)ci * chunk, n = std::min(chunk, tokens - c0);
                if (kind < 2) {
                    struct llmem_cuda_prefill p = {};
                    p.format = format;
                    p.n_heads = heads;
                    p.n_kv_heads = kv;
                    p.head_dim = dim;
                    p.block_size = 16;
                    p.q = q, p.out = out;
                    p.k_pool = k_pool, p.v_pool = v_pool;
                    p.k_block_stride = p.v_block_stride = (int64_t)block_bytes;
                    p.block_tables = d_ints;
                    p.table_stride = nb;
                    p.tiles = (const llmem_cuda_prefill_tile *)(d_ints + tiles_at[ci]);
                    p.n_tiles = n_tiles[ci];
                    p.mblocks = mb;
                    p.warp_mma = kind == 1;
                    if (llmem_cuda_prefill(&p) != 0)
                        return 1;
                } else {
                    llmem_cuda_attn a = {};
                    a.format = format;
                    a.n_heads = heads;
                    a.n_kv_heads = kv;
                    a.head_dim = dim;
                    a.block_size = 16;
                    a.batch = n;
                    a.max_len = c0 + n;
                    a.q = q + (size_t)c0 * heads * dim;
                    a.out = out + (size_t)c0 * heads * dim;
                    a.k_pool = k_pool, a.v_pool = v_pool;
                    a.block_stride = (int64_t)block_bytes;
                    a.block_tables = d_ints;
                    a.table_stride = 0;
                    a.lengths = d_ints + len_at[ci];
                    a.fresh = n;
                    a.pack = group <= 4 ? 8 / group : 1;
                    const size_t need = llmem_cuda_attn_workspace_bytes(&a);
                    if (need > ws_bytes) {
                        CHECK(cudaDeviceSynchronize());
                        cudaFree(ws);
                        CHECK(cudaMalloc(&ws, need));
                        ws_bytes = need;
                    }
                    a.workspace = ws, a.workspace_bytes = ws_bytes;
                    if (llmem_cuda_attn_decode(&a) != 0)
                        return 1;
                }
            }
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            float t = 0;
            CHECK(cudaEventElapsedTime(&t, e0, e1));
            if (rep > 0)
                ms.push_back(t);
        }
        const double m = median(ms);
        printf("  %-24s %9.2f ms  %7.1f TFLOP/s\n", names[kind], m, flops / (m * 1e-3) / 1e12);
    }
    CHECK(cudaGetLastError());
    return 0;
}
