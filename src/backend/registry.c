/*
 * backend/registry.c — which backends this build has, and their devices. The only file that
 * knows whether CUDA is built in (CMake defines LLMEM_CUDA for it alone), so everything else
 * compiles the same with and without CUDA.
 */
#include "llmem/backend.h"

#include <string.h>

#include "backend/ops.h"
#include "core/log.h"

#ifdef LLMEM_CUDA
#include "backend/cuda/backend.h"
#include "backend/cuda/comm.h"
#include "backend/cuda/device.h"
#endif

int llmem_backend_precision_parse(const char *name, enum llmem_backend_precision *precision) {
    LLMEM_ASSERT(name != NULL && precision != NULL);
    if (strcmp(name, "fast") == 0)
        *precision = LLMEM_PRECISION_FAST;
    else if (strcmp(name, "f32") == 0)
        *precision = LLMEM_PRECISION_F32;
    else {
        LLMEM_ERROR("unknown precision '%s' (fast or f32)", name);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

int llmem_backend_kind_parse(const char *name, enum llmem_backend_kind *kind) {
    LLMEM_ASSERT(name != NULL && kind != NULL);
    if (strcmp(name, "cpu") == 0)
        *kind = LLMEM_BACKEND_CPU;
    else if (strcmp(name, "cuda") == 0)
        *kind = LLMEM_BACKEND_CUDA;
    else {
        LLMEM_ERROR("unknown backend '%s' (cpu or cuda)", name);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

int64_t llmem_backend_cuda_scratch_bytes(enum llmem_backend_precision precision, int64_t max_tokens,
                                         int64_t max_cols, int quantized) {
    /* ops_int.h: GEMV_MAX_ROWS rows take no scratch; WIDEN_SLICE_BYTES of f32 weights at f32, of
     * f16 ones (wslice) beside the rounded activations at fast precision */
    const int64_t slice = (int64_t)64 << 20;
    if (precision == LLMEM_PRECISION_F32)
        return slice;
    return max_tokens * max_cols * 2 + (quantized ? slice : 0);
}

const char *llmem_backend_precision_name(enum llmem_backend_precision precision) {
    return precision == LLMEM_PRECISION_F32 ? "f32" : "fast";
}

int llmem_backend_cuda_available(void) {
#ifdef LLMEM_CUDA
    return 1;
#else
    return 0;
#endif
}

int llmem_backend_nccl_available(void) {
#ifdef LLMEM_CUDA
    return llmem_cuda_comm_nccl();
#else
    return 0;
#endif
}

int llmem_backend_device_count(int *n) {
    LLMEM_ASSERT(n != NULL);
#ifdef LLMEM_CUDA
    *n = llmem_cuda_device_count();
#else
    *n = 0;
#endif
    return LLMEM_OK;
}

int llmem_backend_device_info(int index, struct llmem_device_info *info) {
    LLMEM_ASSERT(info != NULL);
    int n = 0;
    llmem_backend_device_count(&n);
    if (index < 0 || index >= n) {
        LLMEM_ERROR("no device %d (%d device%s present)", index, n, n == 1 ? "" : "s");
        return LLMEM_EINVAL;
    }
#ifdef LLMEM_CUDA
    return llmem_cuda_device_info(index, info);
#else
    return LLMEM_EUNSUPPORTED; /* unreachable: n is 0 */
#endif
}

int llmem_backend_cuda_create(int device, enum llmem_backend_precision precision,
                              struct llmem_mem *mem, struct llmem_backend **out) {
    LLMEM_ASSERT(out != NULL);
    *out = NULL;
#ifdef LLMEM_CUDA
    int n = 0;
    llmem_backend_device_count(&n);
    if (device < 0 || device >= n) {
        LLMEM_ERROR("no CUDA device %d (%d device%s present)", device, n, n == 1 ? "" : "s");
        return LLMEM_EINVAL;
    }
    return llmem_cuda_backend_create(device, precision, mem, out);
#else
    (void)device, (void)precision, (void)mem;
    LLMEM_ERROR("llmem_backend_cuda_create: this build has no CUDA backend");
    return LLMEM_EUNSUPPORTED;
#endif
}

int llmem_backend_cuda_blas_load(void) {
#ifdef LLMEM_CUDA
    return llmem_cuda_blas_load();
#else
    return LLMEM_EUNSUPPORTED;
#endif
}

const struct llmem_mem_raw_ops *llmem_backend_cuda_memory(int device) {
#ifdef LLMEM_CUDA
    return llmem_cuda_mem_ops(device);
#else
    (void)device;
    return NULL;
#endif
}

const struct llmem_mem_raw_ops *llmem_backend_cuda_pinned_memory(void) {
#ifdef LLMEM_CUDA
    return llmem_cuda_pinned_ops();
#else
    return NULL;
#endif
}

int llmem_backend_cuda_group_create(int n, const struct llmem_backend *const *ranks,
                                    struct llmem_backend_group *group) {
    LLMEM_ASSERT(n >= 1 && ranks != NULL && group != NULL);
    *group = (struct llmem_backend_group){.n = 0};
#ifdef LLMEM_CUDA
    return llmem_cuda_group_create(n, ranks, group);
#else
    LLMEM_ERROR("a split over CUDA devices: this build has no CUDA backend");
    return LLMEM_EUNSUPPORTED;
#endif
}

void llmem_backend_cuda_group_free(struct llmem_backend_group *group) {
#ifdef LLMEM_CUDA
    if (group != NULL && group->ctx != NULL)
        llmem_cuda_group_free(group);
#else
    (void)group;
#endif
}
