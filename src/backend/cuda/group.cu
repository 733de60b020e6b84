/*
 * backend/cuda/group.cu — the ranks of a split model on CUDA devices (backend/ops.h
 * llmem_backend_group): their backends, one device each, and NCCL's all-reduce over the
 * communicator they share (comm.h), queued on each rank's compute stream after its operations by
 * the rank's own thread; or, every rank on one device (LLMEM_SPLIT_ONE_DEVICE: a split checked on
 * one GPU), the sum made there by rank 0's stream once the ranks' threads have met.
 */
#include <pthread.h>
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
    /* one device: the ranks' threads meet before and after rank 0's stream sums their parts;
     * each rank's part written, the sum made */
    int met_made;
    pthread_barrier_t met;
    float *buf[LLMEM_SPLIT_MAX];
    cudaEvent_t ready[LLMEM_SPLIT_MAX];
};

static __global__ void sum_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

/* Every rank on one device: each rank's stream marks its part written; once every rank's thread
 * has, rank 0's stream waits for the others' parts, adds them to its own in rank order and copies
 * the sum back to them, and their streams wait for that. */
static int one_device_sum(struct group *g, int r, float *buf, int64_t count) {
    struct cuda_ctx *c = g->ctx[r];
    g->buf[r] = buf;
    int status = r > 0 ? check(c, cudaEventRecord(g->ready[r], g->streams[r]), "cudaEventRecord")
                       : LLMEM_OK;
    pthread_barrier_wait(&g->met); /* every part queued, its event recorded */
    if (r == 0) {
        const size_t bytes = (size_t)count * sizeof(float);
        const unsigned blocks = (unsigned)((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096);
        for (int q = 1; status == LLMEM_OK && q < g->n; q++) {
            status = check(c, cudaStreamWaitEvent(g->streams[0], g->ready[q], 0),
                           "cudaStreamWaitEvent");
            sum_kernel<<<blocks > 0 ? blocks : 1, 256, 0, g->streams[0]>>>(buf, g->buf[q], count);
        }
        for (int q = 1; status == LLMEM_OK && q < g->n; q++)
            status = check(c, cudaMemcpyAsync(g->buf[q], buf, bytes, cudaMemcpyDeviceToDevice,
                                              g->streams[0]),
                           "cudaMemcpyAsync");
        if (status == LLMEM_OK)
            status = check(c, cudaEventRecord(g->ready[0], g->streams[0]), "cudaEventRecord");
        if (status == LLMEM_OK)
            status = check(c, cudaGetLastError(), "the sum of a split");
    }
    pthread_barrier_wait(&g->met); /* the sum queued */
    if (r > 0 && status == LLMEM_OK)
        status = check(c, cudaStreamWaitEvent(g->streams[r], g->ready[0], 0),
                       "cudaStreamWaitEvent");
    return status;
}

/* Rank r's part of the sum over the ranks, in place, from its thread: NCCL's call recorded in the
 * rank's graph with its other operations (staged, when the graph is replayed). Its 16-bit copy of
 * its last output (shadow_x) is dropped, as by any other operation. A rank that failed before
 * still takes part (so that the others' sums complete) and returns its failure. */
static int group_allreduce_rank(void *ctx, int r, float *buf, int64_t count) {
    struct group *g = (struct group *)ctx;
    struct cuda_ctx *c = g->ctx[r];
    c->shadow_x = NULL;
    if (g->comm != NULL && staged(c, OP_ALLREDUCE, {arg(buf), (uint64_t)count}))
        return c->failed; /* (part of a recording staged for launch) */
    const int status = g->comm == NULL ? one_device_sum(g, r, buf, count)
                                       : llmem_cuda_comm_allreduce_rank(
                                             g->comm, r, buf, count, LLMEM_DTYPE_F32, g->streams[r]);
    if (status != LLMEM_OK && !c->failed)
        c->failed = status;
    return c->failed;
}

static void free_group(struct group *g) {
    llmem_cuda_comm_free(g->comm);
    for (int r = 0; r < g->n; r++)
        if (g->ready[r] != NULL)
            cudaEventDestroy(g->ready[r]);
    if (g->met_made)
        pthread_barrier_destroy(&g->met);
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
        g->met_made = pthread_barrier_init(&g->met, NULL, (unsigned)n) == 0;
        if (!g->met_made) {
            LLMEM_ERROR("out of memory");
            status = LLMEM_ENOMEM;
        }
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
        .n = n,
        .ranks = ranks,
        .allreduce_rank = group_allreduce_rank,
        .graphs = g->comm != NULL, /* (one device: the sum crosses the ranks' streams) */
        .ctx = g};
    return LLMEM_OK;
}

extern "C" void llmem_cuda_group_free(struct llmem_backend_group *group) {
    struct group *g = (struct group *)group->ctx;
    for (int r = 0; g->comm != NULL && r < g->n; r++) { /* NCCL's destroy waits for the graphs
                                                        * that hold its calls */
        cudaSetDevice(g->ctx[r]->device);
        graph_drop_all(g->ctx[r]);
    }
    free_group(g);
    group->ctx = NULL;
}
