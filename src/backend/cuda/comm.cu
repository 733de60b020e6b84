/*
 * backend/cuda/comm.cu — the collectives of a split model (comm.h): NCCL communicators made
 * together for one process's devices (ncclCommInitAll: no bootstrap between processes), the
 * all-reduce of a layer's partial sums grouped over the ranks. With NCCL a group of one device is
 * NCCL's too (its calls run, each a copy in place: what a one-GPU machine can check); without it,
 * such a group's sum is its own values.
 */
#include "backend/cuda/comm.h"

#include <cuda_runtime.h>
#include <stdlib.h>

#include "backend/cuda/device.h"
#include "core/log.h"
#include "llmem/status.h"

#ifdef LLMEM_NCCL
#include <nccl.h>
#endif

#define COMM_MAX 64

struct llmem_cuda_comm {
    int n;
    int devices[COMM_MAX];
#ifdef LLMEM_NCCL
    ncclComm_t comms[COMM_MAX];
#endif
};

extern "C" int llmem_cuda_comm_nccl(void) {
#ifdef LLMEM_NCCL
    return 1;
#else
    return 0;
#endif
}

#ifdef LLMEM_NCCL
static int nccl_check(ncclResult_t r, const char *what) {
    if (r == ncclSuccess)
        return LLMEM_OK;
    LLMEM_ERROR("%s: %s", what, ncclGetErrorString(r));
    return LLMEM_EIO;
}
#endif

extern "C" int llmem_cuda_comm_create(int n, const int *devices, struct llmem_cuda_comm **out) {
    LLMEM_ASSERT(devices != NULL && out != NULL);
    *out = NULL;
    const int present = llmem_cuda_device_count();
    if (n < 1 || n > COMM_MAX) {
        LLMEM_ERROR("a group of %d devices (1 to %d)", n, COMM_MAX);
        return LLMEM_EINVAL;
    }
    for (int r = 0; r < n; r++) {
        if (devices[r] < 0 || devices[r] >= present) {
            LLMEM_ERROR("no CUDA device %d (%d present)", devices[r], present);
            return LLMEM_EINVAL;
        }
        for (int q = 0; q < r; q++)
            if (devices[q] == devices[r]) {
                LLMEM_ERROR("CUDA device %d named twice in a group", devices[r]);
                return LLMEM_EINVAL;
            }
    }
#ifndef LLMEM_NCCL
    if (n > 1) {
        LLMEM_ERROR("a group of %d devices needs NCCL, which this build does not have", n);
        return LLMEM_EUNSUPPORTED;
    }
#endif
    struct llmem_cuda_comm *c = (struct llmem_cuda_comm *)calloc(1, sizeof(*c));
    if (c == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    c->n = n;
    for (int r = 0; r < n; r++)
        c->devices[r] = devices[r];
#ifdef LLMEM_NCCL
    setenv("NCCL_NVLS_ENABLE", "0", 0); /* (read by NCCL when the communicators are made) */
    int prev = 0;
    cudaGetDevice(&prev);
    const int st = nccl_check(ncclCommInitAll(c->comms, n, devices), "ncclCommInitAll");
    cudaSetDevice(prev);
    if (st != LLMEM_OK) {
        free(c);
        return st;
    }
#endif
    *out = c;
    return LLMEM_OK;
}

extern "C" void llmem_cuda_comm_free(struct llmem_cuda_comm *c) {
    if (c == NULL)
        return;
#ifdef LLMEM_NCCL
    for (int r = 0; r < c->n; r++)
        ncclCommDestroy(c->comms[r]);
#endif
    free(c);
}

extern "C" int llmem_cuda_comm_size(const struct llmem_cuda_comm *c) {
    return c->n;
}

/* LLMEM_EINVAL (logged) for a dtype NCCL is not given here. */
static int sum_dtype(enum llmem_dtype dtype) {
    if (dtype == LLMEM_DTYPE_F32 || dtype == LLMEM_DTYPE_F16 || dtype == LLMEM_DTYPE_BF16)
        return LLMEM_OK;
    LLMEM_ERROR("an all-reduce of %s values (f32, f16 or bf16)", llmem_dtype_name(dtype));
    return LLMEM_EINVAL;
}

#ifdef LLMEM_NCCL
static ncclDataType_t nccl_type(enum llmem_dtype dtype) {
    return dtype == LLMEM_DTYPE_F32 ? ncclFloat32 : dtype == LLMEM_DTYPE_F16 ? ncclFloat16 : ncclBfloat16;
}
#endif

extern "C" int llmem_cuda_comm_allreduce(struct llmem_cuda_comm *c, void *const *buf, int64_t count,
                                         enum llmem_dtype dtype,
                                         struct CUstream_st *const *streams) {
    LLMEM_ASSERT(c != NULL && buf != NULL && streams != NULL && count >= 0);
    if (sum_dtype(dtype) != LLMEM_OK)
        return LLMEM_EINVAL;
    if (count == 0)
        return LLMEM_OK;
#ifdef LLMEM_NCCL
    int st = nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; st == LLMEM_OK && r < c->n; r++)
        st = nccl_check(ncclAllReduce(buf[r], buf[r], (size_t)count, nccl_type(dtype), ncclSum,
                                      c->comms[r], streams[r]),
                        "ncclAllReduce");
    const int end = nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    return st != LLMEM_OK ? st : end;
#else
    return LLMEM_OK; /* (one rank, as a group without NCCL is: the sum is its own values) */
#endif
}

extern "C" int llmem_cuda_comm_allreduce_rank(struct llmem_cuda_comm *c, int rank, void *buf,
                                              int64_t count, enum llmem_dtype dtype,
                                              struct CUstream_st *stream) {
    LLMEM_ASSERT(c != NULL && rank >= 0 && rank < c->n && count >= 0);
    if (sum_dtype(dtype) != LLMEM_OK)
        return LLMEM_EINVAL;
    if (count == 0)
        return LLMEM_OK;
#ifdef LLMEM_NCCL
    return nccl_check(ncclAllReduce(buf, buf, (size_t)count, nccl_type(dtype), ncclSum,
                                    c->comms[rank], stream),
                      "ncclAllReduce");
#else
    (void)buf, (void)stream;
    return LLMEM_OK;
#endif
}
