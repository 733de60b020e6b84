/*
 * backend/cpu/cpu_int.h — the CPU backend's context and its kernel tables, shared by cpu.c (the
 * backend table and the small operations) and matmul.c (the matrix products).
 */
#ifndef LLMEM_BACKEND_CPU_INT_H
#define LLMEM_BACKEND_CPU_INT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend/ops.h"

struct llmem_pool;

/* GEMM blocking (matmul.c). The portable and AVX2 GEMM: CPU_GEMM_MR W rows converted at a time,
 * the whole row (at most CPU_GEMM_K_MAX columns; longer rows take the decode kernels). The AVX-512
 * GEMM: tiles of CPU_GEMM512_MR W rows × CPU_GEMM512_NR rows of x, W converted in chunks of
 * CPU_GEMM512_KC columns; with more than one chunk, the partial sums of at most
 * CPU_GEMM512_STRIPS strips of x wait in per-thread scratch between chunks. A block of x (at most
 * CPU_GEMM_XBLOCK_BYTES, at least one strip) is packed once for all threads. */
#define CPU_GEMM_MR           4
#define CPU_GEMM_K_MAX        16384
#define CPU_GEMM512_MR        32
#define CPU_GEMM512_NR        12
#define CPU_GEMM512_KC        2048
#define CPU_GEMM512_STRIPS    12
#define CPU_GEMM_XBLOCK_BYTES ((size_t)9 << 19)
#define CPU_GEMM_XT_BYTES     CPU_GEMM_XBLOCK_BYTES
_Static_assert(CPU_GEMM_XBLOCK_BYTES >= (size_t)CPU_GEMM_K_MAX * CPU_GEMM512_NR * 4,
               "a block of x holds at least one strip");
/* Per-thread scratch, in floats: the larger of the portable panel and the AVX-512 W chunk plus
 * the partial sums (16 lanes of every output of CPU_GEMM512_STRIPS tiles). */
#define CPU_GEMM_THREAD_FLOATS_512                                                                 \
    ((size_t)CPU_GEMM512_MR * CPU_GEMM512_KC +                                                     \
     (size_t)CPU_GEMM512_STRIPS * 16 * CPU_GEMM512_MR * CPU_GEMM512_NR)
#define CPU_GEMM_THREAD_FLOATS                                                                     \
    ((size_t)CPU_GEMM_MR * CPU_GEMM_K_MAX > CPU_GEMM_THREAD_FLOATS_512                             \
         ? (size_t)CPU_GEMM_MR * CPU_GEMM_K_MAX                                                    \
         : CPU_GEMM_THREAD_FLOATS_512)

/* Which kernels run (the best the CPU supports unless capped for tests and benchmarks). */
enum cpu_isa { CPU_ISA_SCALAR = 0, CPU_ISA_AVX2, CPU_ISA_AVX512 };

/* How a matmul is computed: by the row count n (AUTO), or forced for tests and benchmarks. */
enum cpu_matmul_path {
    CPU_MATMUL_AUTO = 0,
    CPU_MATMUL_DECODE, /* stream W once, all n rows of x per weight row */
    CPU_MATMUL_GEMM    /* packed, cache-blocked GEMM */
};

struct cpu_ctx {
    struct llmem_pool *pool;
    int own_pool;          /* the pool was created here (else it is the caller's) */
    struct llmem_mem *mem; /* where xt and wpanel come from (tag scratch); NULL: the C heap */
    int n_threads;
    enum cpu_isa isa;
    enum cpu_matmul_path path;
    int64_t gemm_min_n; /* AUTO: n at or above this takes the GEMM path */
    enum llmem_backend_precision precision; /* fast: quantized weights take matmul_q.c */
    int no_vnni; /* matmul_q.c's AVX-512 kernels without VNNI (tests; else VNNI where present) */
    int no_amx;  /* bf16 weights at fast precision without AMX (tests; else AMX where present) */
    float *xt;          /* (CPU_GEMM_XT_BYTES) a block of x, packed (AVX-512 GEMM) */
    float *wpanel;      /* (n_threads, CPU_GEMM_THREAD_FLOATS): W converted to f32, sums */
    int64_t weight_bytes; /* bytes of the weight matrices the matmuls were handed (counters) */
};

/* The matmul of the backend table (matmul.c). */
void llmem_cpu_matmul_multi(void *ctx, int count, const struct llmem_weight *const *w,
                            const float *x, int64_t n, float *const *y, const float *const *bias);
void llmem_cpu_matmul(void *ctx, const struct llmem_weight *w, const float *x, int64_t n, float *y,
                      const float *bias);

/* count products y[i] = x[i] · w[i]ᵀ, each of its own n[i] rows of x (no bias), with exactly the
 * results of llmem_cpu_matmul on each: matrices of few rows (below the GEMM crossover) in one
 * dispatch, their row ranges run together (a mixture's experts in decode); the others one by
 * one. count ≤ CPU_MATMUL_MANY_MAX. */
#define CPU_MATMUL_MANY_MAX 128
void llmem_cpu_matmul_many(void *ctx, int count, const struct llmem_weight *const *w,
                           const float *const *x, const int64_t *n, float *const *y);
/* The same for quantized weights with integer kernels (matmul_q.c): LLMEM_ENOMEM, having done
 * nothing, when the inputs' quantized forms do not fit the packed-x scratch together. */
int llmem_cpu_matmul_q_many(struct cpu_ctx *c, int count, const struct llmem_weight *const *w,
                            const float *const *x, const int64_t *n, float *const *y);

/* SwiGLU of the backend table (cpu.c) and its mixture of experts (moe.c). */
void llmem_cpu_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out);
void llmem_cpu_moe(void *ctx, const struct llmem_backend_moe *m, const float *logits,
                   const float *x, int64_t T, float *y, void *work);

/* The fast path for quantized weights (matmul_q.c): whether a weight of this type and row length
 * has integer kernels, and the matmul through them (x quantized per block; see matmul_q.c). */
int llmem_cpu_matmul_q_supported(int type, int64_t cols);
void llmem_cpu_matmul_q(struct cpu_ctx *c, const struct llmem_weight *w, const float *x, int64_t n,
                        float *y, const float *bias);
/* The instruction set of the kernels matmul_q.c runs at this ISA: "avx512_vnni", "avx2" or
 * "scalar". */
const char *llmem_cpu_q_kernels_name(enum cpu_isa isa);
/* Row r of a quantized w dequantized exactly into dst[cols], as llmem_weight_dequantize_row (the
 * same bits), MLX's groups with the ISA's vectors (dequant_mlx.c). */
int llmem_cpu_dequantize_row(enum cpu_isa isa, const struct llmem_weight *w, int64_t r, float *dst);
/* Test hook: 0 makes the AVX-512 integer kernels of a backend skip VNNI (as on a CPU without). */
void llmem_backend_cpu_set_vnni(struct llmem_backend *backend, int on);

/* Whether kernels of this ISA have the AVX512-BF16 ones (activations rounded to bf16,
 * VDPBF16PS) on this CPU, and whether a backend's bf16 weights take them (fast precision). */
int llmem_cpu_bf16_isa(enum cpu_isa isa);
int llmem_cpu_bf16_fast(const struct cpu_ctx *c);

/* bf16 weights at fast precision on the AMX tiles (matmul_amx.c): whether a matrix takes them
 * (for every row count, a matter of the matrix and the backend alone), and count products
 * y[i] = x[i] · w[i]ᵀ (+ bias[i]) of matrices that do, of n[i] > 0 rows each, as
 * llmem_cpu_matmul computes each; with count > 1 LLMEM_ENOMEM, having done nothing, when the
 * inputs' packed forms do not fit the packed-x scratch together. */
int llmem_cpu_amx_takes(const struct cpu_ctx *c, const struct llmem_weight *w);
int llmem_cpu_matmul_amx(struct cpu_ctx *c, int count, const struct llmem_weight *const *w,
                         const float *const *x, const int64_t *n, float *const *y,
                         const float *const *bias);
/* Test hook: 0 makes a backend's bf16 weights at fast precision skip AMX (as on a CPU without). */
void llmem_backend_cpu_set_amx(struct llmem_backend *backend, int on);

/* The best ISA of this CPU for the kernels. */
enum cpu_isa llmem_cpu_isa_best(void);
const char *llmem_cpu_isa_name(enum cpu_isa isa);

/* Test and benchmark hooks on a backend made by llmem_backend_cpu_create: the kernels' ISA
 * (capped to the best supported; returns the one in effect) and the matmul path. */
enum cpu_isa llmem_backend_cpu_set_isa(struct llmem_backend *backend, enum cpu_isa isa);
void llmem_backend_cpu_set_matmul_path(struct llmem_backend *backend, enum cpu_matmul_path path);

/* Element k of 16-bit data that may be misaligned (tensors of a safetensors file sit at any
 * byte offset). */
static inline uint16_t cpu_u16_at(const void *p, int64_t k) {
    uint16_t v;
    memcpy(&v, (const uint8_t *)p + 2 * k, sizeof(v));
    return v;
}

/* bf16 and f16 to f32, exact. */
static inline float cpu_bf16_to_f32(uint16_t b) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)b << 16};
    return v.f;
}
float llmem_cpu_f16_to_f32(uint16_t h);

#endif
