/*
 * bench/cuda_layer.cu — llmem-bench-cuda-layer: the weight streams of a batch-1 decode step on
 * the GPU, alone and between stand-ins for the latency-bound kernels of a layer, to see what the
 * launch order costs (launch.h: where a kernel lets the next one launch).
 *
 * The matrices are those of the 1B model that tools/make_random_llama.py writes (hidden 2048,
 * intermediate 8192, 16 layers, q/k/v 3072 rows, vocabulary 4096; bf16, 1.963 GB): per layer
 * q+k+v (3072 × 2048), o (2048 × 2048), gate+up (16384 × 2048) and down (2048 × 8192), then the
 * LM head (4096 × 2048), each through a copy of the backend's one-row GEMV (gemm.cu gemv_row: a
 * warp a row, two for rows of 4096 columns and more, eight 16-byte loads a lane in flight, the
 * first asked for before the wait). Reported, as medians of --reps replays of a CUDA graph:
 *   - the device's copy (bytes read + written) and read bandwidth;
 *   - each GEMV alone (20 calls in a graph, µs a call), and all of a token's back to back;
 *   - a layer as the pass has it, the kernels between the GEMVs stand-ins that spin as long as
 *     they take (norm 1 µs, RoPE and the KV write 1.5 µs, attention and its merge 4 µs, norm
 *     1 µs), with the launch trigger after the wait, before it in the stand-ins, and before it
 *     everywhere (as the backend does).
 *
 *   llmem-bench-cuda-layer [--reps N]
 */
#include <algorithm>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "backend/cuda/launch.h"
#include "cuda_check.h"

static const int LAYERS = 16, UNROLL = 8;

/* EARLY: let the next kernel launch before waiting for the one before (launch.h pdl_begin). */
template <bool EARLY> __device__ __forceinline__ void begin() {
    if (EARLY)
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!EARLY)
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void step(uint4 v, const float *x, int64_t k, float &acc) {
    const uint32_t p[4] = {v.x, v.y, v.z, v.w};
    const float4 *xr = reinterpret_cast<const float4 *>(x + k * 8);
    const float4 a = __ldg(xr), b = __ldg(xr + 1);
    float w[8];
    for (int j = 0; j < 4; j++)
        w[2 * j] = __uint_as_float(p[j] << 16), w[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
    acc += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y +
           w[6] * b.z + w[7] * b.w;
}

/* y = W · x, bf16 W (rows × cols), W warps a row, eight rows of warps a block. */
template <int W, bool EARLY>
__global__ void __launch_bounds__(256, 4)
    gemv_kernel(const uint16_t *w, int rows, int cols, const float *x, float *y) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, part = warp % W;
    const int64_t r = blockIdx.x * (int64_t)(8 / W) + warp / W;
    float acc = 0;
    bool waited = false;
    if (r < rows) {
        const uint4 *wr = reinterpret_cast<const uint4 *>(w + r * cols);
        const int64_t per = cols / 8 / W, end = (part + 1) * per;
        int64_t k = part * per + lane;
        for (; k + 32 * (UNROLL - 1) < end; k += 32 * UNROLL) {
            uint4 raw[UNROLL];
            for (int u = 0; u < UNROLL; u++)
                raw[u] = __ldcs(wr + k + 32 * u);
            if (!waited)
                begin<EARLY>(), waited = true;
            for (int u = 0; u < UNROLL; u++)
                step(raw[u], x, k + 32 * u, acc);
        }
        if (!waited)
            begin<EARLY>(), waited = true;
        for (; k < end; k += 32)
            step(__ldcs(wr + k), x, k, acc);
    }
    if (!waited)
        begin<EARLY>();
    for (int o = 16; o > 0; o /= 2)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ float sums[8];
    if (W > 1) {
        if (lane == 0)
            sums[warp] = acc;
        __syncthreads();
        if (part != 0 || r >= rows)
            return;
        for (int i = 1; i < W; i++)
            acc += sums[warp + i];
    }
    if (lane == 0 && r < rows)
        y[r] = acc;
}

/* A latency-bound kernel's stand-in: waits for the one before, then spins `ns`. */
template <bool EARLY> __global__ void spin_kernel(long long ns) {
    begin<EARLY>();
    const long long t0 = clock64();
    while (clock64() - t0 < ns * 2) { /* ~2 GHz */
    }
}

__global__ void read_kernel(const uint4 *p, int64_t n, unsigned *out) {
    uint32_t s = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(p + i);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x9e3779b9u)
        out[0] = s;
}

/* A kernel launched as the backend launches its kernels (launch.h). */
template <typename... P, typename... A>
static void launch(cudaStream_t st, void (*kernel)(P...), unsigned grid, unsigned block,
                   A... args) {
    CHECK(pdl_launch(st, kernel, dim3(grid), dim3(block), 0, args...));
}

struct mat {
    uint16_t *w;
    int rows, cols;
};

static float *g_x, *g_y;

static void gemv(cudaStream_t st, const mat &m, bool early) {
    const uint16_t *w = m.w;
    const float *x = g_x;
    if (m.cols >= 4096)
        launch(st, early ? gemv_kernel<2, true> : gemv_kernel<2, false>, (m.rows + 3) / 4, 256, w,
               m.rows, m.cols, x, g_y);
    else
        launch(st, early ? gemv_kernel<1, true> : gemv_kernel<1, false>, (m.rows + 7) / 8, 256, w,
               m.rows, m.cols, x, g_y);
}

static void spin(cudaStream_t st, bool early, unsigned blocks, long long ns) {
    launch(st, early ? spin_kernel<true> : spin_kernel<false>, blocks, 128, ns);
}

/* The median time of `reps` runs of what `enqueue` queues on st (after one to warm up), in ms. */
template <typename F> static double median_ms(cudaStream_t st, int reps, F enqueue) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int i = 0; i <= reps; i++) {
        CHECK(cudaEventRecord(e0, st));
        enqueue();
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i > 0)
            t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return t[t.size() / 2];
}

/* The same for replays of a CUDA graph of what `record` queues. */
template <typename F> static double timed(cudaStream_t st, int reps, F record) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    record();
    CHECK(cudaStreamEndCapture(st, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    const double ms = median_ms(st, reps, [&] { CHECK(cudaGraphLaunch(ge, st)); });
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    return ms;
}

int main(int argc, char **argv) {
    int reps = 15;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc && atoi(argv[i + 1]) > 0) {
            reps = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: llmem-bench-cuda-layer [--reps N]\n");
            return 2;
        }
    }
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CHECK(cudaMalloc(&g_x, 8192 * sizeof(float)));
    CHECK(cudaMalloc(&g_y, 16384 * sizeof(float)));
    CHECK(cudaMemset(g_x, 0, 8192 * sizeof(float)));
    std::vector<mat> seq; /* per layer q+k+v, o, gate+up, down; then the LM head */
    size_t total = 0;
    auto add = [&](int rows, int cols) {
        mat m = {NULL, rows, cols};
        const size_t bytes = (size_t)rows * cols * 2;
        CHECK(cudaMalloc(&m.w, bytes));
        CHECK(cudaMemset(m.w, 0x3c, bytes));
        seq.push_back(m);
        total += bytes;
    };
    for (int l = 0; l < LAYERS; l++)
        add(3072, 2048), add(2048, 2048), add(16384, 2048), add(2048, 8192);
    add(4096, 2048);

    const size_t probe = (size_t)1 << 30;
    void *a, *b;
    CHECK(cudaMalloc(&a, probe));
    CHECK(cudaMalloc(&b, probe));
    CHECK(cudaMemset(a, 1, probe));
    /* the copy on the stream (a graph's copy node takes another path, slower) */
    const double copy_ms = median_ms(
        st, reps, [&] { CHECK(cudaMemcpyAsync(b, a, probe, cudaMemcpyDeviceToDevice, st)); });
    const double read_ms = timed(st, reps, [&] {
        read_kernel<<<sms * 8, 256, 0, st>>>((const uint4 *)a, (int64_t)(probe / 16),
                                             (unsigned *)b);
    });
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    printf("weights %.3f GB, %d SMs; copy %.2f TB/s (read + write), read %.2f TB/s\n", total / 1e9,
           sms, 2.0 * probe / (copy_ms * 1e-3) / 1e12, probe / (read_ms * 1e-3) / 1e12);

    const char *names[5] = {"q+k+v", "o", "gate+up", "down", "lm head"};
    for (int s = 0; s < 5; s++) {
        const int first = s < 4 ? s : (int)seq.size() - 1;
        const double ms = timed(st, reps, [&] {
            for (int i = 0; i < 20; i++) /* a different layer's copy each time */
                gemv(st, seq[s < 4 ? first + 4 * (i % LAYERS) : first], true);
        });
        const mat &m = seq[first];
        printf("%-8s %5d x %4d  %6.2f us a call, %.2f TB/s\n", names[s], m.rows, m.cols,
               ms * 1e3 / 20, (double)m.rows * m.cols * 2 / (ms * 1e-3 / 20) / 1e12);
    }
    const double all_ms = timed(st, reps, [&] {
        for (const mat &m : seq)
            gemv(st, m, true);
    });
    printf("a token's GEMVs back to back: %.4f ms, %.2f TB/s\n", all_ms,
           total / (all_ms * 1e-3) / 1e12);

    const char *orders[3] = {"trigger after the wait", "stand-ins trigger first",
                             "every kernel triggers first"};
    for (int o = 0; o < 3; o++) {
        const bool spins_early = o >= 1, gemvs_early = o >= 2;
        const double ms = timed(st, reps, [&] {
            for (int l = 0; l < LAYERS; l++) {
                spin(st, spins_early, 1, 1000); /* norm */
                gemv(st, seq[4 * l], gemvs_early);
                spin(st, spins_early, sms, 1500); /* RoPE and the KV write */
                spin(st, spins_early, 64, 4000);  /* attention and its merge */
                gemv(st, seq[4 * l + 1], gemvs_early);
                spin(st, spins_early, 1, 1000); /* norm */
                gemv(st, seq[4 * l + 2], gemvs_early);
                gemv(st, seq[4 * l + 3], gemvs_early);
            }
            gemv(st, seq.back(), gemvs_early);
        });
        printf("a token with stand-ins, %-28s %.4f ms\n", orders[o], ms);
    }
    for (mat &m : seq)
        CHECK(cudaFree(m.w));
    CHECK(cudaFree(g_x));
    CHECK(cudaFree(g_y));
    return 0;
}
