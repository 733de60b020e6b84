/*
 * backend/cuda/comm.h — the collectives of a model split over several GPUs of this process
 * (tensor parallelism): a communicator a device, made together, and the sum over them that
 * follows a layer's attention and its MLP. Callable from C (implemented in comm.cu), with NCCL
 * where the build found it (a group of one device too); without NCCL only a group of one device
 * is made (its sum is the identity).
 */
#ifndef LLMEM_BACKEND_CUDA_COMM_H
#define LLMEM_BACKEND_CUDA_COMM_H

#include <stdint.h>

#include "llmem/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* (cudaStream_t) */
struct llmem_cuda_comm;

/* Whether this build has NCCL (more than one device a group). */
int llmem_cuda_comm_nccl(void);

/* A group over devices[0, n): rank r on devices[r]. NVLink multicast (NVLS) stays off unless the
 * environment's NCCL_NVLS_ENABLE says otherwise (it is unsafe on shared machines). LLMEM_EINVAL for
 * a device the machine lacks or one named twice, LLMEM_EUNSUPPORTED for n > 1 without NCCL,
 * LLMEM_EIO when NCCL fails (its reason logged). */
int llmem_cuda_comm_create(int n, const int *devices, struct llmem_cuda_comm **out);
void llmem_cuda_comm_free(struct llmem_cuda_comm *c);
int llmem_cuda_comm_size(const struct llmem_cuda_comm *c);

/* buf[r] (count values of dtype — f32, f16 or bf16 — on rank r's device) ← their sum over the
 * ranks, in place, queued on streams[r]; every rank's in one call, so that one thread drives the
 * group. LLMEM_EINVAL for another dtype, LLMEM_EIO when NCCL fails. */
int llmem_cuda_comm_allreduce(struct llmem_cuda_comm *c, void *const *buf, int64_t count,
                              enum llmem_dtype dtype, struct CUstream_st *const *streams);

/* Rank `rank`'s part of the same sum, from a thread of its own (the thread of each rank calls
 * it, in the same order): buf on its device, queued on its stream; returns once queued. */
int llmem_cuda_comm_allreduce_rank(struct llmem_cuda_comm *c, int rank, void *buf, int64_t count,
                                   enum llmem_dtype dtype, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif
