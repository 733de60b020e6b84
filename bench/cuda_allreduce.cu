/*
 * bench/cuda_allreduce.cu — llmem-bench-cuda-allreduce: the floor under a model split over GPUs
 * (tensor parallelism): the all-reduce of a layer's partial sums over a group of this machine's
 * devices (backend/cuda/comm.h: NCCL, NVLink multicast off), µs a call for the activations of 1 …
 * 128 tokens of a hidden size, and what a decode token of a model of L layers pays for its 2·L of
 * them (one after the attention, one after the MLP).
 *
 * Each point: 100 all-reduces queued back to back on every rank's stream, CUDA events on rank 0's
 * around them (launches included, as a decode step pays them), the median of --reps such runs.
 * A group of one device measures NCCL's own cost (its all-reduce a copy in place); the floor
 * needs a machine with several.
 *
 *   llmem-bench-cuda-allreduce [--devices N] [--hidden H] [--layers L] [--tokens 1,8,32,128]
 *                              [--dtype bf16|f32] [--reps N]
 */
#include <algorithm>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "backend/cuda/comm.h"
#include "cuda_check.h"
#include "llmem/status.h"

static const int CALLS = 100;

int main(int argc, char **argv) {
    int n = 0, hidden = 4096, layers = 32, reps = 5;
    enum llmem_dtype dt = LLMEM_DTYPE_BF16;
    std::vector<int> tokens = {1, 8, 32, 128};
    CHECK(cudaGetDeviceCount(&n));
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--devices") == 0 && v != NULL && atoi(v) > 0)
            n = atoi(argv[++i]);
        else if (strcmp(a, "--hidden") == 0 && v != NULL && atoi(v) > 0)
            hidden = atoi(argv[++i]);
        else if (strcmp(a, "--layers") == 0 && v != NULL && atoi(v) > 0)
            layers = atoi(argv[++i]);
        else if (strcmp(a, "--reps") == 0 && v != NULL && atoi(v) > 0)
            reps = atoi(argv[++i]);
        else if (strcmp(a, "--dtype") == 0 && v != NULL &&
                 (strcmp(v, "bf16") == 0 || strcmp(v, "f32") == 0))
            dt = strcmp(argv[++i], "f32") == 0 ? LLMEM_DTYPE_F32 : LLMEM_DTYPE_BF16;
        else if (strcmp(a, "--tokens") == 0 && v != NULL) {
            tokens.clear();
            for (const char *p = argv[++i]; *p;) {
                const int t = atoi(p);
                if (t < 1) {
                    fprintf(stderr, "llmem-bench-cuda-allreduce: --tokens takes counts such as "
                                    "1,8,32\n");
                    return 2;
                }
                tokens.push_back(t);
                p += strcspn(p, ",");
                p += *p == ',';
            }
        } else {
            fprintf(stderr, "usage: llmem-bench-cuda-allreduce [--devices N] [--hidden H] "
                            "[--layers L] [--tokens LIST] [--dtype bf16|f32] [--reps N]\n");
            return 2;
        }
    }
    std::vector<int> devices(n);
    for (int r = 0; r < n; r++)
        devices[r] = r;
    struct llmem_cuda_comm *c = NULL;
    if (llmem_cuda_comm_create(n, devices.data(), &c) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench-cuda-allreduce: cannot make a group of %d devices (%s)\n", n,
                llmem_last_error());
        return 1;
    }
    const size_t es = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    const int most = *std::max_element(tokens.begin(), tokens.end());
    std::vector<void *> buf(n);
    std::vector<cudaStream_t> streams(n);
    for (int r = 0; r < n; r++) {
        CHECK(cudaSetDevice(r));
        CHECK(cudaMalloc(&buf[r], (size_t)most * hidden * es));
        CHECK(cudaMemset(buf[r], 0, (size_t)most * hidden * es));
        CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
    CHECK(cudaSetDevice(0));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    printf("llmem-bench-cuda-allreduce: %d device(s), %s, hidden %d, %d layers (%d all-reduces a "
           "token)\n",
           n, es == 4 ? "f32" : "bf16", hidden, layers, 2 * layers);
    printf("%7s %10s %10s %10s %16s\n", "tokens", "bytes", "us", "GB/s", "a token's, ms");
    for (int t : tokens) {
        const int64_t count = (int64_t)t * hidden;
        std::vector<double> us;
        for (int rep = 0; rep <= reps; rep++) { /* (the first a warm-up) */
            for (int r = 0; r < n; r++) {
                CHECK(cudaSetDevice(r));
                CHECK(cudaStreamSynchronize(streams[r]));
            }
            CHECK(cudaSetDevice(0));
            CHECK(cudaEventRecord(e0, streams[0]));
            for (int k = 0; k < CALLS; k++)
                if (llmem_cuda_comm_allreduce(c, buf.data(), count, dt, streams.data()) !=
                    LLMEM_OK) {
                    fprintf(stderr, "llmem-bench-cuda-allreduce: %s\n", llmem_last_error());
                    return 1;
                }
            CHECK(cudaSetDevice(0));
            CHECK(cudaEventRecord(e1, streams[0]));
            CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (rep > 0)
                us.push_back(1e3 * ms / CALLS);
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2], bytes = (double)count * es;
        printf("%7d %10.0f %10.2f %10.1f %16.3f\n", t, bytes, med,
               med > 0 ? bytes / (med * 1e3) : 0.0, 2 * layers * med * 1e-3);
    }
    for (int r = 0; r < n; r++) {
        CHECK(cudaSetDevice(r));
        CHECK(cudaStreamSynchronize(streams[r]));
        CHECK(cudaStreamDestroy(streams[r]));
        CHECK(cudaFree(buf[r]));
    }
    llmem_cuda_comm_free(c);
    return 0;
}
