/*
 * bench/cuda_attn.cu — llmem-bench-cuda-attn: the GPU's paged decode attention against the
 * device's copy bandwidth (SPEC §8: bandwidth is bytes moved over time; attention moves the K + V
 * bytes it reads, a device-to-device copy the bytes it reads plus those it writes; both are
 * measured in the same run).
 *
 * Shapes: 32 query heads, 8 KV heads (--heads), head_dim 128, blocks of 16 tokens, every sequence
 * of the batch at the full context, blocks scattered over the pool (a random permutation). A shape
 * whose K + V is smaller than 256 MiB rotates over enough disjoint copies of its cache that
 * repeated calls do not run from the L2 cache. Times are CUDA events (around both kernels when the
 * context is split): the reported time is per call in replays of a CUDA graph of 10 calls (median
 * of --reps replays; what a decode step captured in a graph pays), and "1 call" the median of
 * --reps single calls with events around each (after --warmup), host launch gaps included;
 * "host us" the median host time of those calls (what enqueueing one costs the CPU).
 *
 *   llmem-bench-cuda-attn [--json] [--reps N] [--warmup N] [--formats bf16,q8]
 *                         [--shapes 64x8192,1x4096,16x2048,4x16384] [--copy-mib N]
 *                         [--split-len TOKENS]   (a multiple of 16; default: the kernel's choice)
 *                         [--heads Q/KV]         (query / KV heads; default 32/8)
 */
#include <algorithm>
#include <chrono>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "backend/cuda/attention.h"
#include "cuda_check.h"

static const int HEAD_DIM = 128, BLOCK = 16;
static int n_heads = 32, n_kv = 8; /* --heads */
static const size_t ROTATE_BYTES = (size_t)256 << 20;
static const int GRAPH_CALLS = 10;

__device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* bf16 elements uniform in (-1, 1); q8 rows of 136 bytes: random codes, f16 scales in [2⁻⁸, 2⁻⁶).
 */
__global__ void fill_pool(uint16_t *p, size_t n, int q8, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = hash32(seed + i);
        if (q8) {
            int at = (int)((2 * i) % 136) % 34;
            p[i] = at == 32 ? (uint16_t)(0x1c00 + (h & 0x7ff)) : (uint16_t)h;
        } else {
            float x = (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
            uint32_t bits = __float_as_uint(x);
            p[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        }
    }
}

__global__ void fill_f32(float *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = (float)(hash32(seed + i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

static double median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Shape {
    int batch, ctx;
};

struct Result {
    const char *format;
    Shape s;
    int split_len, n_splits, n_sets;
    double ms, ms_events,
        ms_host; /* per call: in graph replays; one call (events); its host time */
    double kv_bytes;
};

int main(int argc, char **argv) {
    int json = 0, reps = 50, warmup = 10, split = 0;
    size_t copy_mib = 2048;
    std::vector<const char *> formats = {"bf16", "q8"};
    std::vector<Shape> shapes = {{64, 8192}, {1, 4096}, {16, 2048}, {4, 16384}};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--copy-mib") && i + 1 < argc)
            copy_mib = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--split-len") && i + 1 < argc)
            split = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc &&
                 sscanf(argv[++i], "%d/%d", &n_heads, &n_kv) == 2 && n_kv > 0 &&
                 n_heads % n_kv == 0 && n_heads / n_kv <= 8)
            continue;
        else if (!strcmp(argv[i], "--formats") && i + 1 < argc) {
            formats.clear();
            for (char *t = strtok(argv[++i], ","); t; t = strtok(NULL, ","))
                formats.push_back(t);
        } else if (!strcmp(argv[i], "--shapes") && i + 1 < argc) {
            shapes.clear();
            for (char *t = strtok(argv[++i], ","); t; t = strtok(NULL, ",")) {
                Shape s;
                if (sscanf(t, "%dx%d", &s.batch, &s.ctx) == 2)
                    shapes.push_back(s);
            }
        } else {
            fprintf(stderr,
                    "usage: %s [--json] [--reps N] [--warmup N] [--formats bf16,q8,f16] "
                    "[--shapes BxT,...] [--copy-mib N] [--split-len TOKENS] [--heads Q/KV]\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1)
        reps = 1;

    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    std::vector<cudaEvent_t> ev0(reps), ev1(reps);
    for (int i = 0; i < reps; i++) {
        CHECK(cudaEventCreate(&ev0[i]));
        CHECK(cudaEventCreate(&ev1[i]));
    }

    /* ---- the copy bandwidth ---- */
    size_t copy_bytes = copy_mib << 20;
    void *src, *dst;
    CHECK(cudaMalloc(&src, copy_bytes));
    CHECK(cudaMalloc(&dst, copy_bytes));
    fill_f32<<<1024, 256, 0, stream>>>((float *)src, copy_bytes / 4, 7);
    std::vector<float> copy_ms;
    int copy_reps = std::min(reps, 20);
    for (int i = 0; i < 3; i++)
        CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
    for (int i = 0; i < copy_reps; i++) {
        CHECK(cudaEventRecord(ev0[i], stream));
        CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
        CHECK(cudaEventRecord(ev1[i], stream));
    }
    CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < copy_reps; i++) {
        float ms;
        CHECK(cudaEventElapsedTime(&ms, ev0[i], ev1[i]));
        copy_ms.push_back(ms);
    }
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
    const double copy_t = median(copy_ms);
    const double copy_bw = 2.0 * (double)copy_bytes / (copy_t * 1e-3);

    /* ---- attention ---- */
    std::vector<Result> results;
    for (const char *fname : formats) {
        enum llmem_kv_format fmt;
        if (!strcmp(fname, "bf16"))
            fmt = LLMEM_KV_FORMAT_BF16;
        else if (!strcmp(fname, "f16"))
            fmt = LLMEM_KV_FORMAT_F16;
        else if (!strcmp(fname, "q8"))
            fmt = LLMEM_KV_FORMAT_Q8;
        else {
            fprintf(stderr, "unknown format %s\n", fname);
            return 2;
        }
        const int row = fmt == LLMEM_KV_FORMAT_Q8 ? 34 * HEAD_DIM / 32 : 2 * HEAD_DIM;
        const size_t half = (size_t)BLOCK * n_kv * row; /* K (or V) of one block */
        const size_t block_bytes = 2 * half;

        /* one pool for the largest shape (or its rotated copies) */
        size_t max_blocks = 0;
        for (const Shape &s : shapes) {
            size_t nb = (size_t)s.batch * ((s.ctx + BLOCK - 1) / BLOCK);
            size_t sets =
                std::max<size_t>(1, (ROTATE_BYTES + nb * block_bytes - 1) / (nb * block_bytes));
            max_blocks = std::max(max_blocks, nb * sets);
        }
        void *pool;
        CHECK(cudaMalloc(&pool, max_blocks * block_bytes));
        fill_pool<<<4096, 256, 0, stream>>>((uint16_t *)pool, max_blocks * block_bytes / 2,
                                            fmt == LLMEM_KV_FORMAT_Q8, 12345);
        CHECK(cudaGetLastError());

        for (const Shape &s : shapes) {
            const int nblk = (s.ctx + BLOCK - 1) / BLOCK;
            const size_t nb = (size_t)s.batch * nblk;
            const int sets = (int)std::max<size_t>(1, (ROTATE_BYTES + nb * block_bytes - 1) /
                                                          (nb * block_bytes));
            /* tables [sets][batch][nblk]: a random permutation of the first sets × nb blocks */
            std::vector<int32_t> ids(nb * sets);
            for (size_t i = 0; i < ids.size(); i++)
                ids[i] = (int32_t)i;
            uint64_t x = 88172645463325252ull;
            for (size_t i = ids.size() - 1; i > 0; i--) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                std::swap(ids[i], ids[x % (i + 1)]);
            }
            std::vector<int32_t> lens(s.batch, s.ctx);
            int32_t *d_tables, *d_len;
            float *d_q, *d_out;
            CHECK(cudaMalloc(&d_tables, ids.size() * sizeof(int32_t)));
            CHECK(cudaMalloc(&d_len, lens.size() * sizeof(int32_t)));
            CHECK(cudaMalloc(&d_q, (size_t)s.batch * n_heads * HEAD_DIM * sizeof(float)));
            CHECK(cudaMalloc(&d_out, (size_t)s.batch * n_heads * HEAD_DIM * sizeof(float)));
            CHECK(cudaMemcpy(d_tables, ids.data(), ids.size() * sizeof(int32_t),
                             cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(d_len, lens.data(), lens.size() * sizeof(int32_t),
                             cudaMemcpyHostToDevice));
            fill_f32<<<256, 256, 0, stream>>>(d_q, (size_t)s.batch * n_heads * HEAD_DIM, 99);

            struct llmem_cuda_attn a;
            memset(&a, 0, sizeof(a));
            a.format = fmt;
            a.n_heads = n_heads;
            a.n_kv_heads = n_kv;
            a.head_dim = HEAD_DIM;
            a.block_size = BLOCK;
            a.batch = s.batch;
            a.max_len = s.ctx;
            a.q = d_q;
            a.k_pool = pool;
            a.v_pool = (uint8_t *)pool + half;
            a.block_stride = (int64_t)block_bytes;
            a.table_stride = nblk;
            a.lengths = d_len;
            a.fresh = 1; /* as a decode step: the last token's block waits for the kernel before */
            a.out = d_out;
            a.stream = stream;
            a.split_len = split; /* 0: the kernel's own choice */
            int split_len = 0, n_splits = 0;
            if (llmem_cuda_attn_split(&a, &split_len, &n_splits) != 0)
                return 1;
            a.workspace_bytes = llmem_cuda_attn_workspace_bytes(&a);
            void *ws = NULL;
            if (a.workspace_bytes)
                CHECK(cudaMalloc(&ws, a.workspace_bytes));
            a.workspace = ws;
            /* the splits merged inside the kernel, as the engine calls it (LLMEM_CUDA_ATTN_FUSE=0:
             * by the second kernel) */
            unsigned *counters = NULL;
            a.n_counters = llmem_cuda_attn_counters(&a);
            CHECK(cudaMalloc(&counters, a.n_counters * sizeof(unsigned)));
            CHECK(cudaMemset(counters, 0, a.n_counters * sizeof(unsigned)));
            a.counters = counters;

            /* 1: events around each call, and the host's time in the call (its enqueue) */
            std::vector<float> t, tg, th;
            for (int i = 0; i < warmup + reps; i++) {
                a.block_tables = d_tables + (size_t)(i % sets) * nb;
                if (i >= warmup)
                    CHECK(cudaEventRecord(ev0[i - warmup], stream));
                const auto h0 = std::chrono::steady_clock::now();
                if (llmem_cuda_attn_decode(&a) != 0)
                    return 1;
                const auto h1 = std::chrono::steady_clock::now();
                if (i >= warmup) {
                    CHECK(cudaEventRecord(ev1[i - warmup], stream));
                    th.push_back(std::chrono::duration<float, std::milli>(h1 - h0).count());
                }
            }
            CHECK(cudaStreamSynchronize(stream));
            CHECK(cudaGetLastError());
            for (int i = 0; i < reps; i++) {
                float ms;
                CHECK(cudaEventElapsedTime(&ms, ev0[i], ev1[i]));
                t.push_back(ms);
            }
            /* 2: a graph of GRAPH_CALLS calls (as a decode step replays them), events around
             * each replay: the time of the kernels without the host's launch gaps */
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < GRAPH_CALLS; i++) {
                a.block_tables = d_tables + (size_t)(i % sets) * nb;
                if (llmem_cuda_attn_decode(&a) != 0)
                    return 1;
            }
            CHECK(cudaStreamEndCapture(stream, &graph));
            CHECK(cudaGraphInstantiate(&exec, graph, 0));
            for (int i = 0; i < 2 + reps; i++) {
                if (i >= 2)
                    CHECK(cudaEventRecord(ev0[i - 2], stream));
                CHECK(cudaGraphLaunch(exec, stream));
                if (i >= 2)
                    CHECK(cudaEventRecord(ev1[i - 2], stream));
            }
            CHECK(cudaStreamSynchronize(stream));
            for (int i = 0; i < reps; i++) {
                float ms;
                CHECK(cudaEventElapsedTime(&ms, ev0[i], ev1[i]));
                tg.push_back(ms / GRAPH_CALLS);
            }
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(graph));
            Result r;
            r.format = fname;
            r.s = s;
            r.split_len = split_len;
            r.n_splits = n_splits;
            r.n_sets = sets;
            r.ms = median(tg);
            r.ms_events = median(t);
            r.ms_host = median(th);
            r.kv_bytes = (double)s.batch * s.ctx * n_kv * 2.0 * row;
            results.push_back(r);
            CHECK(cudaFree(ws));
            CHECK(cudaFree(counters));
            CHECK(cudaFree(d_tables));
            CHECK(cudaFree(d_len));
            CHECK(cudaFree(d_q));
            CHECK(cudaFree(d_out));
        }
        CHECK(cudaFree(pool));
    }

    if (json) {
        printf("{\"gpu\": \"%s\", \"sms\": %d, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d,"
               " \"block_size\": %d, \"reps\": %d,\n \"copy\": {\"bytes\": %zu, \"ms\": %.4f, "
               "\"bytes_per_s\": %.4e},\n \"attention\": [",
               prop.name, prop.multiProcessorCount, n_heads, n_kv, HEAD_DIM, BLOCK, reps,
               copy_bytes, copy_t, copy_bw);
        for (size_t i = 0; i < results.size(); i++) {
            const Result &r = results[i];
            double bw = r.kv_bytes / (r.ms * 1e-3);
            printf("%s\n  {\"format\": \"%s\", \"batch\": %d, \"context\": %d, \"split_len\": %d,"
                   " \"splits\": %d, \"cache_copies\": %d, \"ms\": %.5f, \"ms_events\": %.5f,"
                   " \"ms_host\": %.5f, \"kv_bytes\": %.0f,"
                   " \"bytes_per_s\": %.4e, \"of_copy\": %.4f}",
                   i ? "," : "", r.format, r.s.batch, r.s.ctx, r.split_len, r.n_splits, r.n_sets,
                   r.ms, r.ms_events, r.ms_host, r.kv_bytes, bw, bw / copy_bw);
        }
        printf("\n]}\n");
    } else {
        printf("%s, %d SMs; %d heads / %d KV heads, head_dim %d, blocks of %d; median of %d\n",
               prop.name, prop.multiProcessorCount, n_heads, n_kv, HEAD_DIM, BLOCK, reps);
        printf("copy D2D %zu MiB: %.3f ms, %.0f GB/s (read + write)\n", copy_mib, copy_t,
               copy_bw / 1e9);
        printf("%-5s %6s %6s %7s %10s %9s %8s %10s %8s\n", "fmt", "batch", "ctx", "split",
               "time us", "K+V GB/s", "of copy", "1 call us", "host us");
        for (const Result &r : results) {
            double bw = r.kv_bytes / (r.ms * 1e-3);
            printf("%-5s %6d %6d %3d×%-4d %9.1f %9.0f %7.1f%% %10.1f %8.1f\n", r.format, r.s.batch,
                   r.s.ctx, r.n_splits, r.split_len, r.ms * 1e3, bw / 1e9, 100.0 * bw / copy_bw,
                   r.ms_events * 1e3, r.ms_host * 1e3);
        }
    }
    return 0;
}
