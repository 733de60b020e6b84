/*
 * backend/cuda/attention.h — paged decode attention on the GPU (SPEC §4.4, §8), callable from C
 * (implemented in attention.cu).
 *
 * One query token per sequence attends to every token its block table holds (decode: the query is
 * the last position, so the causal mask is the sequence's length). A prefill chunk is such a batch
 * too: its queries, each a "sequence" of its own length (position + 1), over one shared table
 * (table_stride 0); the chunk's K and V rows then come from L2 once the first query read them.
 * The block pool is the CPU
 * paged cache's layout for one layer, on the device: block `id`'s keys start at
 * k_pool + id × block_stride, token-major [block_size][n_kv_heads][key row bytes], and its values
 * likewise at v_pool + id × block_stride. With the pool copied as llmem_kv_block_copy_out writes a
 * one-layer block ([K | V]), v_pool = k_pool + block_size × n_kv_heads × key row bytes and
 * block_stride is the whole block; with separate K and V pools, block_stride is one block of K.
 *
 * Formats f16, bf16 and q8 (int8 codes with one f16 scale per 32 elements, 34 bytes a group: the
 * bytes of kv/codec.c), on tensor cores, q8 decoded inside the kernel; q4 and tq (kv/codec.h, with
 * their rotations) decoded inside a kernel on CUDA cores, whose values rows (tq's are smaller than
 * its keys) may take their own block stride. GQA groups of up to 8 query heads per KV
 * head; head_dim 64, 128 or 256; block_size 16. Every pointer below is device memory.
 */
#ifndef LLMEM_BACKEND_CUDA_ATTENTION_H
#define LLMEM_BACKEND_CUDA_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* In C++ (the .cu files), plan.h's llmem_kv_format_info() hides the struct of that name. */
#if defined(__cplusplus) && defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#endif
#include "llmem/plan.h"
#if defined(__cplusplus) && defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_backend_kv_rotation; /* backend/ops.h */

struct llmem_cuda_attn {
    enum llmem_kv_format format; /* F16, BF16, Q8, Q4 or TQ */
    int n_heads;                 /* query heads, n_kv_heads × (1..8) */
    int n_kv_heads;
    int head_dim;   /* 64, 128 or 256 */
    int block_size; /* 16 */
    int batch;      /* sequences */
    int max_len;    /* no sequence is longer (host-side: it sizes the grid and the split) */
    float scale;    /* 0: 1 / sqrt(head_dim) */
    int split_len;  /* tokens per split, a multiple of block_size; 0: chosen from the GPU's size */

    const void *q; /* [batch, n_heads, head_dim], f32, or bf16 when q_bf16; 16-byte aligned */
    int q_bf16;
    const void *k_pool, *v_pool; /* 16-byte aligned */
    int64_t block_stride;        /* bytes from one block to the next, in both pools */
    int64_t v_block_stride;      /* (q4, tq) in the value pool, when not block_stride (0) */
    /* (q4, tq; NULL: none) how the rows are rotated (host memory, read at the call) */
    const struct llmem_backend_kv_rotation *rotation;
    const int32_t *block_tables; /* [batch, table_stride]: block ids of each sequence in order */
    int table_stride; /* 0: every "sequence" reads the one table (which covers max_len tokens):
                       * the queries of one sequence at several positions, a prefill chunk */
    const int32_t *table_ids; /* (optional) [batch]: the row of block_tables each sequence reads
                               * (NULL: row b): the queries of several sequences' chunks */
    const int32_t *lengths;   /* [batch] tokens of each sequence, ≤ max_len; 0 gives zeros */
    /* The newest tokens of each sequence (up to its length) that the kernel before this one on
     * the stream may still be writing (the KV write of the tokens attended): blocks wholly before
     * them are asked for while that kernel ends. 0: none are read before it has finished. */
    int fresh;
    /* (optional) the queries of one table (a prefill chunk's) a warp takes together, up to
     * 8 / group of them in the tensor cores' 16 rows, so that each K and V block is read once for
     * all: pack of them (0 or 1: one query a warp), starting at packs[i] for i < n_packs (NULL:
     * at multiples of pack); a pack's queries past the batch or of another table are skipped. */
    int pack;
    const int32_t *packs;
    int n_packs;
    float *out; /* [batch, n_heads, head_dim] f32, 16-byte aligned */

    void *workspace; /* (optional when one split suffices) llmem_cuda_attn_workspace_bytes,
                      * 16-byte aligned */
    size_t workspace_bytes;
    /* (optional) n_counters of llmem_cuda_attn_counters, zero before the first call, which every
     * call leaves zero again: then the warp that finishes a sequence's splits last merges them
     * inside the kernel, when they are few (LLMEM_CUDA_ATTN_FUSE); otherwise, or without them, a
     * second kernel merges them. Calls that may run at the same time need counters of their own. */
    unsigned *counters;
    size_t n_counters;
    void *stream; /* cudaStream_t; NULL: the default stream */
};

/* The split of the context a call with these parameters uses: tokens per split and splits per
 * sequence (1: no merge pass, no workspace). Chosen so that batch × n_kv_heads × splits warps fill
 * the GPU in whole waves. */
int llmem_cuda_attn_split(const struct llmem_cuda_attn *a, int *split_len, int *n_splits);
/* Bytes of workspace the call needs (0 when one split suffices). */
size_t llmem_cuda_attn_workspace_bytes(const struct llmem_cuda_attn *a);
/* Counters the call's merge inside the kernel needs (one per sequence, or pack, and KV head). */
size_t llmem_cuda_attn_counters(const struct llmem_cuda_attn *a);

/* Launches the attention on the stream (asynchronous). LLMEM_EINVAL (logged) for parameters out of
 * the supported set or a workspace too small; LLMEM_EIO (logged) when a launch fails. */
int llmem_cuda_attn_decode(const struct llmem_cuda_attn *a);

#ifdef __cplusplus
}
#endif

#endif
