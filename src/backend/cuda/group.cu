/*
 * backend/cuda/group.cu — the ranks of a split model on CUDA devices (backend/ops.h
 * llmem_backend_group): their backends, one device each, and NCCL's all-reduce over the
 * communicator they share (comm.h), queued on each rank's compute stream after its operations,
 * every rank's from the one thread that drives them.
 */
#include <stdlib.h>

#include "backend/cuda/backend.h"
#include "backend/cuda/comm.h"
#include "backend/cuda/ops_int.h"

namespace llmem_cuda {

#define GROUP_MAX 8

struct group {
    struct llmem_cuda_comm *comm;
    int n;
    struct cuda_ctx *ctx[GROUP_MAX];
    cudaStream_t streams[GROUP_MAX];
};

/* The sum over the ranks, in place. The ranks' 16-bit copies of their last output (shadow_x) are
 * dropped, as by any other operation; a rank that failed before fails the group's sum. */
static int group_allreduce(void *arg, float *const *buf, int64_t count) {
    struct group *g = (struct group *)arg;
    for (int r = 0; r < g->n; r++) {
        if (g->ctx[r]->failed)
            return g->ctx[r]->failed;
        g->ctx[r]->shadow_x = NULL;
    }
    int status = llmem_cuda_comm_allreduce(g->comm, (void *const *)buf, count, LLMEM_DTYPE_F32,
                                           g->streams);
    for (int r = 0; status != LLMEM_OK && r < g->n; r++)
        if (!g->ctx[r]->failed)
            g->ctx[r]->failed = status;
    return status;
}

} // namespace llmem_cuda

using namespace llmem_cuda;

extern "C" int llmem_cuda_group_create(int n, const struct llmem_backend *const *ranks,
                                       struct llmem_backend_group *out) {
    if (n < 1 || n > GROUP_MAX) {
        LLMEM_ERROR("a split over %d devices; llmem splits over 1 to %d", n, GROUP_MAX);
        return LLMEM_EINVAL;
    }
    struct group *g = (struct group *)calloc(1, sizeof(*g));
    if (g == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    int devices[GROUP_MAX];
    g->n = n;
    for (int r = 0; r < n; r++) {
        g->ctx[r] = (struct cuda_ctx *)ranks[r]->ctx;
        g->streams[r] = g->ctx[r]->stream;
        devices[r] = g->ctx[r]->device;
    }
    int status = llmem_cuda_comm_create(n, devices, &g->comm);
    if (status != LLMEM_OK) {
        free(g);
        return status;
    }
    *out = (struct llmem_backend_group){
        .n = n, .ranks = ranks, .allreduce = group_allreduce, .ctx = g};
    return LLMEM_OK;
}

extern "C" void llmem_cuda_group_free(struct llmem_backend_group *group) {
    struct group *g = (struct group *)group->ctx;
    llmem_cuda_comm_free(g->comm);
    free(g);
    group->ctx = NULL;
}
