/*
 * backend/cuda/kv.h — the paged KV cache's kernels (kv.cu), queued on a stream; used by attend.cu.
 */
#ifndef LLMEM_BACKEND_CUDA_KV_H
#define LLMEM_BACKEND_CUDA_KV_H

#include <cuda_runtime.h>

#include "backend/ops.h"
#include "plan/kv_codebook.h"

#ifdef __CUDACC__
/* The angle of RoPE pair i of token t (pos[t] · inv_freq[i]): its cosine and sine, in double as
 * the CPU backend computes them. Shared by rope_kernel (elementwise.cu) and rope_encode_kernel. */
__device__ __forceinline__ void rope_angle(const int64_t *pos, const float *inv_freq, int64_t t,
                                           int i, float *cs, float *sn) {
    float angle = __fmul_rn((float)pos[t], inv_freq[i]);
    *cs = (float)cos((double)angle), *sn = (float)sin((double)angle);
}

/* The rotation of kv/codec.h on a warp (shared by kv.cu and attention.cu). A warp holds a row as
 * x[j] = element lane + 32j (j < per). The Walsh–Hadamard transform runs kv/codec.c's butterflies
 * in its order (strides 1, 2, 4, … : lanes first, then registers), each a + b and a − b of the same
 * two floats, so a rotated row has the host's bits. */

__device__ __forceinline__ void warp_fwht(float *x, int per, int lane) {
    constexpr int MAX_PER = LLMEM_BACKEND_ROTATION_DIMS / 32;
#pragma unroll
    for (int h = 1; h < 32; h *= 2)
#pragma unroll
        for (int j = 0; j < MAX_PER; j++)
            if (j < per) {
                const float o = __shfl_xor_sync(0xffffffffu, x[j], h);
                x[j] = lane & h ? __fsub_rn(o, x[j]) : __fadd_rn(x[j], o);
            }
#pragma unroll
    for (int h = 1; h < MAX_PER; h *= 2)
#pragma unroll
        for (int j = 0; j < MAX_PER; j++)
            if (j + h < per && !(j & h)) {
                const float a = x[j], b = x[j + h];
                x[j] = __fadd_rn(a, b), x[j + h] = __fsub_rn(a, b);
            }
}

/* x times D/√head_dim (D's sign of element lane + 32j). */
__device__ __forceinline__ void rotation_signs(const llmem_backend_kv_rotation &r, float *x,
                                               int per, int lane) {
    constexpr int MAX_PER = LLMEM_BACKEND_ROTATION_DIMS / 32;
#pragma unroll
    for (int j = 0; j < MAX_PER; j++)
        if (j < per)
            x[j] = __fmul_rn(x[j], (r.neg[j] >> lane) & 1u ? -r.norm : r.norm);
}

/* x ← R x and x ← Rᵀ x (llmem_kv_rotate, llmem_kv_rotate_inverse). */
__device__ __forceinline__ void kv_rotate(const llmem_backend_kv_rotation &r, float *x, int per,
                                          int lane) {
    rotation_signs(r, x, per, lane);
    warp_fwht(x, per, lane);
}

__device__ __forceinline__ void kv_rotate_inverse(const llmem_backend_kv_rotation &r, float *x,
                                                  int per, int lane) {
    warp_fwht(x, per, lane);
    rotation_signs(r, x, per, lane);
}

/* tq's level k (< 8) of plan/kv_codebook.h, from immediates: the modules hold no __constant__
 * data of their own. */
__device__ __forceinline__ float tq_level(int k) {
    constexpr float c[8] = LLMEM_KV_TQ_CENTROIDS;
    const float lo = k & 2 ? (k & 1 ? c[3] : c[2]) : (k & 1 ? c[1] : c[0]);
    const float hi = k & 2 ? (k & 1 ? c[7] : c[6]) : (k & 1 ? c[5] : c[4]);
    return k & 4 ? hi : lo;
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

/* See kv_encode in backend/ops.h; slots in device memory, a rotated format's head_dim ≤ 256. */
void llmem_cuda_kv_encode(cudaStream_t stream, enum llmem_kv_format format,
                          const struct llmem_backend_kv_rotation *rotation, const float *k,
                          const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                          uint8_t *k_pool, uint8_t *v_pool, size_t key_bytes, size_t value_bytes);
/* rope_qk (backend/ops.h) of q and k, then k (turned) and v encoded as llmem_cuda_kv_encode
 * does, in one launch: the same bits as the two. pos and inv_freq in device memory; head_dim a
 * multiple of 64 up to 256 (llmem_cuda_kv_encode_rope_fits), n ≤ 65,535. */
int llmem_cuda_kv_encode_rope_fits(int64_t n, int head_dim);
void llmem_cuda_kv_encode_rope(cudaStream_t stream, enum llmem_kv_format format,
                               const struct llmem_backend_kv_rotation *rotation, float *q,
                               int n_heads, float *k, const float *v, int64_t n, int heads,
                               int head_dim, const int64_t *pos, const float *inv_freq,
                               const int64_t *slots, uint8_t *k_pool, uint8_t *v_pool,
                               size_t key_bytes, size_t value_bytes);
/* See kv_attend in backend/ops.h; blocks: the block ids in device memory. LLMEM_EINVAL for a
 * head_dim that is not a multiple of 32 up to 256. */
int llmem_cuda_kv_attend(cudaStream_t stream, const struct llmem_backend_paged_attn *attn,
                         const int32_t *blocks);

#ifdef __cplusplus
}
#endif

#endif
