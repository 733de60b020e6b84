/*
 * backend/cuda/backend.h — the CUDA backend's entry points, callable from C (implemented in the
 * .cu files beside it). Only backend/registry.c includes this, and only in a CUDA build.
 */
#ifndef LLMEM_BACKEND_CUDA_BACKEND_H
#define LLMEM_BACKEND_CUDA_BACKEND_H

#include "backend/ops.h"
#include "llmem/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device memory of GPU `device` (cudaMalloc/cudaFree), for a struct llmem_mem; NULL when the
 * device does not exist. The table lives as long as the process. */
const struct llmem_mem_raw_ops *llmem_cuda_mem_ops(int device);
/* Page-locked host memory (cudaHostAlloc/cudaFreeHost): staging for transfers. */
const struct llmem_mem_raw_ops *llmem_cuda_pinned_ops(void);

/* See llmem_backend_cuda_blas_load (backend/ops.h); in blas.cu, once per process.
 * llmem_cuda_backend_create calls it first. */
int llmem_cuda_blas_load(void);

/* See llmem_backend_cuda_create (backend/ops.h). */
int llmem_cuda_backend_create(int device, enum llmem_backend_precision precision,
                              struct llmem_mem *mem, struct llmem_backend **out);

/* See llmem_backend_cuda_group_create (backend/ops.h); in group.cu. */
int llmem_cuda_group_create(int n, const struct llmem_backend *const *ranks,
                            struct llmem_backend_group *group);
void llmem_cuda_group_free(struct llmem_backend_group *group);

#ifdef __cplusplus
}
#endif

#endif
