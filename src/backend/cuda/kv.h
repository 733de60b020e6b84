/*
 * backend/cuda/kv.h — the paged KV cache's kernels (kv.cu), queued on a stream; used by ops.cu.
 */
#ifndef LLMEM_BACKEND_CUDA_KV_H
#define LLMEM_BACKEND_CUDA_KV_H

#include <cuda_runtime.h>

#include "backend/ops.h"

#ifdef __CUDACC__
/* The angle of RoPE pair i of token t (pos[t] · inv_freq[i]): its cosine and sine, in double as
 * the CPU backend computes them. Shared by rope_kernel (ops.cu) and rope_encode_kernel. */
__device__ __forceinline__ void rope_angle(const int64_t *pos, const float *inv_freq, int64_t t,
                                           int i, float *cs, float *sn) {
    float angle = __fmul_rn((float)pos[t], inv_freq[i]);
    *cs = (float)cos((double)angle), *sn = (float)sin((double)angle);
}

/* A RoPE pair (x0, x1) turned by the angle of (c, s). */
__device__ __forceinline__ void rope_turn(float *x0, float *x1, float c, float s) {
    const float a = *x0, b = *x1;
    *x0 = __fadd_rn(__fmul_rn(a, c), __fmul_rn(-b, s));
    *x1 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* See kv_encode in backend/ops.h; slots in device memory. */
void llmem_cuda_kv_encode(cudaStream_t stream, enum llmem_kv_format format, const float *k,
                          const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                          uint8_t *k_pool, uint8_t *v_pool, size_t tok_bytes, size_t row_bytes);
/* rope_qk (backend/ops.h) of q and k, then k (turned) and v encoded as llmem_cuda_kv_encode
 * does, in one launch: the same bits as the two. pos and inv_freq in device memory; head_dim a
 * multiple of 64 up to 256 (llmem_cuda_kv_encode_rope_fits), n ≤ 65,535. */
int llmem_cuda_kv_encode_rope_fits(int64_t n, int head_dim);
void llmem_cuda_kv_encode_rope(cudaStream_t stream, enum llmem_kv_format format, float *q,
                               int n_heads, float *k, const float *v, int64_t n, int heads,
                               int head_dim, const int64_t *pos, const float *inv_freq,
                               const int64_t *slots, uint8_t *k_pool, uint8_t *v_pool,
                               size_t tok_bytes, size_t row_bytes);
/* See kv_attend in backend/ops.h; blocks: the block ids in device memory. LLMEM_EINVAL for a
 * head_dim that is not a multiple of 32 up to 256. */
int llmem_cuda_kv_attend(cudaStream_t stream, const struct llmem_backend_paged_attn *attn,
                         const int32_t *blocks);

#ifdef __cplusplus
}
#endif

#endif
