/*
 * backend/cuda/group.cu — the ranks of a split model on CUDA devices (backend/ops.h
 * llmem_backend_group): their backends, one device each, and NCCL's all-reduce over the
 * communicator they share (comm.h), queued on each rank's compute stream after its operations,
 * every rank's from the one thread that drives them; or, every rank on one device
 * (LLMEM_SPLIT_ONE_DEVICE: a split checked on one GPU), the sum made there by rank 0's stream.
 */
#include <stdlib.h>

#include "backend/cuda/backend.h"
#include "backend/cuda/comm.h"
#include "backend/cuda/ops_int.h"

namespace llmem_cuda {

struct group {
    struct llmem_cuda_comm *comm; /* NULL: every rank on one device (LLMEM_SPLIT_ONE_DEVICE) */
    int n;
    struct cuda_ctx *ctx[LLMEM_SPLIT_MAX];
    cudaStream_t streams[LLMEM_SPLIT_MAX];
    cudaEvent_t ready[LLMEM_SPLIT_MAX]; /* one device: each rank's part written; the sum made */
};

static __global__ void sum_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

/* Every rank on one device: rank 0's stream waits for the others' parts, adds them to its own in
 * rank order and copies the sum back to them; their streams wait for that. */
static int one_device_sum(struct group *g, float *const *buf, int64_t count) {
    struct cuda_ctx *c0 = g->ctx[0];
    const size_t bytes = (size_t)count * sizeof(float);
    const unsigned blocks = (unsigned)((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096);
    for (int r = 1; r < g->n; r++) {
        if (check(c0, cudaEventRecord(g->ready[r], g->streams[r]), "cudaEventRecord") != LLMEM_OK ||
            check(c0, cudaStreamWaitEvent(g->streams[0], g->ready[r], 0), "cudaStreamWaitEvent") !=
                LLMEM_OK)
            return c0->failed;
        sum_kernel<<<blocks > 0 ? blocks : 1, 256, 0, g->streams[0]>>>(buf[0], buf[r], count);
    }
    for (int r = 1; r < g->n; r++)
        if (check(c0, cudaMemcpyAsync(buf[r], buf[0], bytes, cudaMemcpyDeviceToDevice,
                                      g->streams[0]),
                  "cudaMemcpyAsync") != LLMEM_OK)
            return c0->failed;
    if (check(c0, cudaEventRecord(g->ready[0], g->streams[0]), "cudaEventRecord") != LLMEM_OK)
        return c0->failed;
    for (int r = 1; r < g->n; r++)
        if (check(c0, cudaStreamWaitEvent(g->streams[r], g->ready[0], 0), "cudaStreamWaitEvent") !=
            LLMEM_OK)
            return c0->failed;
    return check(c0, cudaGetLastError(), "the sum of a split");
}

/* The sum over the ranks, in place. The ranks' 16-bit copies of their last output (shadow_x) are
 * dropped, as by any other operation; a rank that failed before fails the group's sum. */
static int group_allreduce(void *arg, float *const *buf, int64_t count) {
    struct group *g = (struct group *)arg;
    for (int r = 0; r < g->n; r++) {
        if (g->ctx[r]->failed)
            return g->ctx[r]->failed;
        g->ctx[r]->shadow_x = NULL;
    }
    int status = g->comm == NULL ? one_device_sum(g, buf, count)
                                 : llmem_cuda_comm_allreduce(g->comm, (void *const *)buf, count,
                                                             LLMEM_DTYPE_F32, g->streams);
    for (int r = 0; status != LLMEM_OK && r < g->n; r++)
        if (!g->ctx[r]->failed)
            g->ctx[r]->failed = status;
    return status;
}

static void free_group(struct group *g) {
    llmem_cuda_comm_free(g->comm);
    for (int r = 0; r < g->n; r++)
        if (g->ready[r] != NULL)
            cudaEventDestroy(g->ready[r]);
    free(g);
}

} // namespace llmem_cuda

using namespace llmem_cuda;

extern "C" int llmem_cuda_group_create(int n, const struct llmem_backend *const *ranks,
                                       struct llmem_backend_group *out) {
    if (n < 1 || n > LLMEM_SPLIT_MAX) {
        LLMEM_ERROR("a split over %d devices; llmem splits over 1 to %d", n, LLMEM_SPLIT_MAX);
        return LLMEM_EINVAL;
    }
    struct group *g = (struct group *)calloc(1, sizeof(*g));
    if (g == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    int devices[LLMEM_SPLIT_MAX], one = 1;
    g->n = n;
    for (int r = 0; r < n; r++) {
        g->ctx[r] = (struct cuda_ctx *)ranks[r]->ctx;
        g->streams[r] = g->ctx[r]->stream;
        devices[r] = g->ctx[r]->device;
        one &= devices[r] == devices[0];
    }
    int status = LLMEM_OK;
    if (one && n > 1) { /* no communicator: the sum made on the device (one_device_sum) */
        cudaSetDevice(devices[0]);
        for (int r = 0; status == LLMEM_OK && r < n; r++)
            if (cudaEventCreateWithFlags(&g->ready[r], cudaEventDisableTiming) != cudaSuccess) {
                LLMEM_ERROR("cudaEventCreate failed");
                status = LLMEM_EIO;
            }
    } else {
        status = llmem_cuda_comm_create(n, devices, &g->comm);
    }
    if (status != LLMEM_OK) {
        free_group(g);
        return status;
    }
    *out = (struct llmem_backend_group){
        .n = n, .ranks = ranks, .allreduce = group_allreduce, .ctx = g};
    return LLMEM_OK;
}

extern "C" void llmem_cuda_group_free(struct llmem_backend_group *group) {
    free_group((struct group *)group->ctx);
    group->ctx = NULL;
}
