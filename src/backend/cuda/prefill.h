/*
 * backend/cuda/prefill.h — causal attention of prefill chunks over the paged KV cache on tensor
 * cores (implemented in prefill.cu), callable from C.
 *
 * A prefill chunk's queries attend to their sequence's earlier tokens and to each other, causally:
 * query i of a chunk that starts at position p sees tokens 0 … p + i. The work comes in tiles: a
 * tile is up to llmem_cuda_prefill_tile_queries() consecutive queries of one sequence, and a CTA
 * takes a tile and one KV head, its rows (64 or 128) the (query, head) pairs of that head's GQA
 * group, so that every K and V row it reads from the pool serves all of them. The queries are rounded to the
 * cache's 16-bit type, the probabilities too (fast precision: FlashAttention's arithmetic, f32
 * accumulation); the exact path for f32 precision is the decode kernel of attention.h. A q8
 * cache's rows are decoded to f16 as each tile is loaded (code × scale rounded to f16). Two
 * kernels compute it: the warp-level products (mma.sync) on every device, and on Hopper, for
 * head_dim 128 and a 16-bit cache, the warpgroup products (wgmma) from the same tiles.
 *
 * The pool is attention.h's: block `id`'s keys at k_pool + id × k_block_stride, token-major
 * [block_size][n_kv_heads][key row bytes], its values likewise in v_pool. Formats f16, bf16 and q8
 * (kv/codec.c's bytes), head_dim 64 or 128, block_size 16, any GQA group. Every pointer below is
 * device memory.
 */
#ifndef LLMEM_BACKEND_CUDA_PREFILL_H
#define LLMEM_BACKEND_CUDA_PREFILL_H

#include <stddef.h>
#include <stdint.h>

#include "llmem/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tile: the index of its first query in q (and out), its queries, the position of the first in
 * its sequence, and the row of block_tables the sequence's blocks are in. */
struct llmem_cuda_prefill_tile {
    int32_t q0, n_q, pos, table;
};

struct llmem_cuda_prefill {
    enum llmem_kv_format format; /* F16, BF16 or Q8 */
    int n_heads, n_kv_heads;     /* n_heads a multiple of n_kv_heads */
    int head_dim;                /* 64 or 128 */
    int block_size;              /* 16 */
    float scale;                 /* 0: 1 / sqrt(head_dim) */
    const float *q;              /* [queries, n_heads, head_dim] f32, 8-byte aligned */
    float *out;                  /* [queries, n_heads, head_dim] f32, 8-byte aligned */
    const void *k_pool, *v_pool; /* 16-byte aligned */
    int64_t k_block_stride, v_block_stride; /* bytes from one block to the next in each pool */
    const int32_t *block_tables;            /* rows of table_stride block ids */
    int table_stride;
    /* the tiles, heaviest (latest positions) first: the GPU starts the longest work first */
    const struct llmem_cuda_prefill_tile *tiles;
    int n_tiles;
    int mblocks; /* llmem_cuda_prefill_mblocks(): the tiles hold tile_queries(group, mblocks) */
    int warp_mma; /* 1: the warp-level kernel even where the warpgroup kernel runs (a comparison) */
    void *stream; /* cudaStream_t; NULL: the default stream */
};

/* Whether the kernel takes this shape and format. */
int llmem_cuda_prefill_fits(enum llmem_kv_format format, int n_heads, int n_kv_heads, int head_dim,
                            int block_size);
/* The blocks of 16 rows a warp takes (a CTA has 4 warps) for a call of `queries` queries: 2 when
 * the CTAs of 2 still fill the GPU about twice over (a larger tile reads each K and V row for twice
 * the rows; H200, 32K tokens: 294 against 238 TFLOP/s), else 1 (a short prompt: 190 against 124).
 * LLMEM_CUDA_PREFILL_MBLOCKS (1 or 2) forces it. */
int llmem_cuda_prefill_mblocks(int group, int n_kv_heads, int64_t queries);
/* The most queries a tile holds for this GQA group (n_heads / n_kv_heads) and m-blocks. */
int llmem_cuda_prefill_tile_queries(int group, int mblocks);
/* Whether a call of this format and head_dim on the current device takes the warpgroup kernel
 * (Hopper's wgmma; unless warp_mma): head_dim 128, f16 or bf16, a device of compute capability
 * 9.0 running the build's sm_90a code, and LLMEM_CUDA_PREFILL_WGMMA on (off by default). */
int llmem_cuda_prefill_wgmma(enum llmem_kv_format format, int head_dim);
/* Launches the attention on the stream (asynchronous). LLMEM_EINVAL (logged) for parameters out
 * of the supported set; LLMEM_EIO (logged) when the launch fails. */
int llmem_cuda_prefill(const struct llmem_cuda_prefill *p);

#ifdef __cplusplus
}
#endif

#endif
