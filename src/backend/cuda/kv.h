/*
 * backend/cuda/kv.h — the paged KV cache's kernels (kv.cu), queued on a stream; used by ops.cu.
 */
#ifndef LLMEM_BACKEND_CUDA_KV_H
#define LLMEM_BACKEND_CUDA_KV_H

#include <cuda_runtime.h>

#include "backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* See kv_encode in backend/ops.h; slots in device memory. */
void llmem_cuda_kv_encode(cudaStream_t stream, enum llmem_kv_format format, const float *k,
                          const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                          uint8_t *k_pool, uint8_t *v_pool, size_t tok_bytes, size_t row_bytes);
/* See kv_attend in backend/ops.h; blocks: the block ids in device memory. LLMEM_EINVAL for a
 * head_dim that is not a multiple of 32 up to 256. */
int llmem_cuda_kv_attend(cudaStream_t stream, const struct llmem_backend_paged_attn *attn,
                         const int32_t *blocks);

#ifdef __cplusplus
}
#endif

#endif
