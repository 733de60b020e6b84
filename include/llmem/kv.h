/*
 * llmem/kv.h — KV caches (SPEC §4): where keys and values live, how they grow, how they are
 * stored, and how attention reads them.
 *
 * One interface over four layouts, all holding every layer of many sequences:
 *   paged       (the default) a block pool per layer, [num_blocks, block_size, kv_heads, head_dim],
 *               block ids shared across layers, one block table per sequence, reference-counted
 *               blocks (fork shares them; a write to a shared block copies it first), growth ×1.5
 *               clamped to max_blocks;
 *   contiguous  per sequence one buffer per layer, grown to the next multiple of `step` tokens;
 *   blocks      per sequence a list of independent blocks of block_size (default 1024) tokens;
 *   ragged      one buffer per layer of [max_sequences rows, capacity, kv_heads, head_dim] with
 *               per-row lengths; capacity grows in steps, or is pinned by freeze_capacity.
 * Storage formats f32, f16, bf16, q8, q4 (rotated by default), tq: the bytes per token are exactly
 * the planner's ratio table (llmem_kv_bytes_per_token_effective). All memory comes from a
 * struct llmem_mem with the tag `kv`.
 *
 * Writing is three steps, so that a forward pass can write layer by layer: reserve room for n
 * tokens (the only step that allocates: it may fail cleanly, leaving the sequence intact), write
 * each layer, then set the new length. Attention (GQA, causal, optional sliding window) walks the
 * sequence's storage in place — blocks are never concatenated — by one of three routes:
 * `direct` (one pass with an online softmax), `partitioned` (partitions of 512 tokens merged
 * exactly, in ascending order; used from 2048 tokens or when there are too few query heads to
 * keep every thread busy) and `fallback` (gather to f32 rows and run the reference).
 */
#ifndef LLMEM_KV_H
#define LLMEM_KV_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#include "llmem/mem.h"
#include "llmem/plan.h"
#include "llmem/status.h"

struct llmem_pool;
struct llmem_backend;

#ifdef __cplusplus
extern "C" {
#endif

enum llmem_kv_layout {
    LLMEM_KV_LAYOUT_PAGED = 0,
    LLMEM_KV_LAYOUT_CONTIGUOUS,
    LLMEM_KV_LAYOUT_BLOCKS,
    LLMEM_KV_LAYOUT_RAGGED,
    LLMEM_KV_LAYOUT_COUNT
};
LLMEM_API const char *llmem_kv_layout_name(enum llmem_kv_layout layout);
/* LLMEM_EINVAL (logged, listing the names) for an unknown name. */
LLMEM_API int llmem_kv_layout_parse(const char *name, enum llmem_kv_layout *layout);

/* The instruction set of the CPU attention kernels this process uses, picked once from the CPU's
 * features: "avx512", "avx2" or "scalar" (portable C). */
LLMEM_API const char *llmem_kv_kernels_name(void);

struct llmem_kv_config {
    enum llmem_kv_layout layout;
    enum llmem_kv_format format;
    int n_layers;
    int n_kv_heads;
    int head_dim;       /* a multiple of 32 */
    int max_sequences;  /* sequence ids are 0..max_sequences−1 (ragged: the rows) */
    int block_size;     /* paged: tokens per block (16); blocks layout: 1024 */
    int64_t num_blocks; /* paged: the initial pool (1024) */
    int64_t max_blocks; /* paged: growth stops here (0: only the memory limit stops it) */
    int dynamic;        /* paged: grow when the pool runs out (else an overflowing reserve fails) */
    int step;           /* contiguous and ragged: growth step in tokens (256) */
    int rotate;         /* q4: randomized Hadamard rotation (on) */
    uint64_t seed;      /* the rotation's signs */
    int n_threads;      /* attention threads; ≤ 0: online CPUs */
    struct llmem_pool *pool; /* (optional) the threads to run attention on, shared with the
                              * caller's other work (not destroyed); NULL: a pool of n_threads */
    /* (optional) a device backend (llmem_backend_cuda_create: one that encodes and attends)
     * whose memory holds the pool: the mem given to llmem_kv_create allocates that memory. The
     * paged layout and the f32, f16, bf16 and q8 formats only; writes, attention and block copies
     * run on the device, and the write and attend calls (and their _last forms) take the
     * backend's memory for k, v, q, out. */
    const struct llmem_backend *device;
    /* (optional) a split model's cache over its n_ranks ranks (2, 4 or 8; its layers rank by
     * rank: layer l on rank l / (n_layers / n_ranks)): each layer's pool, and its attention's
     * workspace, in the memory of rank_mems[r], and with a device on rank_devices[r] (device and
     * the mem given to llmem_kv_create are rank 0's; rank_devices NULL in host memory). A block's
     * bytes are then every rank's layers in turn. */
    int n_ranks;
    const struct llmem_backend *const *rank_devices;
    struct llmem_mem *const *rank_mems;
};

/* The defaults above (paged, f16, 64 sequences); the geometry fields are left 0. */
LLMEM_API void llmem_kv_config_default(struct llmem_kv_config *config);
/* Applies LLMEM_KV_LAYOUT, LLMEM_KV_FORMAT, LLMEM_KV_BLOCK_SIZE, LLMEM_KV_NUM_BLOCKS and
 * LLMEM_KV_DYNAMIC (0/1) where set; LLMEM_EINVAL (logged, naming the variable) for a bad value. */
LLMEM_API int llmem_kv_config_from_env(struct llmem_kv_config *config);

/* Stored bytes of one token, all layers, K and V: n_layers × n_kv_heads × (K + V row bytes). */
LLMEM_API int64_t llmem_kv_token_bytes(const struct llmem_kv_config *config);

struct llmem_kv;

/* mem: where the KV memory comes from (tag kv); NULL makes a private host allocator (its cache
 * holds up to 16 MiB of freed buffers). */
LLMEM_API int llmem_kv_create(const struct llmem_kv_config *config, struct llmem_mem *mem,
                              struct llmem_kv **out);
LLMEM_API void llmem_kv_destroy(struct llmem_kv *kv);

/* Sequences. */
LLMEM_API int llmem_kv_seq_new(struct llmem_kv *kv, int *seq);
/* A new sequence with src's contents: paged layouts share src's blocks (copy on write), the
 * others copy. */
LLMEM_API int llmem_kv_seq_fork(struct llmem_kv *kv, int src, int *dst);
LLMEM_API void llmem_kv_seq_free(struct llmem_kv *kv, int seq);
LLMEM_API int64_t llmem_kv_seq_length(const struct llmem_kv *kv, int seq);

/* Room for n more tokens after the current length. LLMEM_ENOMEM or LLMEM_ERANGE (logged) when it
 * cannot grow (memory limit, max_blocks, growth off, frozen capacity): nothing changes then. */
LLMEM_API int llmem_kv_reserve(struct llmem_kv *kv, int seq, int64_t n);
/* Writes n tokens of one layer at positions [pos, pos + n): k and v are [n, n_kv_heads, head_dim].
 * pos may be below the length (a rewrite); pos + n must lie within the reserved room. A write
 * into a block shared with another sequence copies the block first (all layers), which can fail
 * with LLMEM_ENOMEM (logged) before anything is written. */
LLMEM_API int llmem_kv_write(struct llmem_kv *kv, int seq, int layer, int64_t pos, int64_t n,
                             const float *k, const float *v);
/* Prepares a step of n sequences, each writing and attending its last n_q[i] positions (length −
 * n_q[i] … length − 1: the lengths already cover them; n_q NULL: one each, a decode step): every
 * block those positions fall in made the sequence's own (copy on write: the only part that can
 * fail, with LLMEM_ENOMEM logged), and on a device the pool slots they take. Then, until a
 * sequence changes, the step's llmem_kv_write_last and llmem_kv_attend_last of every layer only
 * read the cache's bookkeeping: several threads may make them at once, each for layers of its own
 * (a split cache's ranks'; on the host their attention takes turns on the cache's pool). */
LLMEM_API int llmem_kv_step(struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q);
/* The step's writes (llmem_kv_step first, with the same sequences): of `layer`, their rows of k
 * and v one sequence after the other. The same as llmem_kv_write for each, but on a device in one
 * launch. */
LLMEM_API int llmem_kv_write_last(struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q,
                                  int layer, const float *k, const float *v);
/* Sets the sequence's length (≤ the reserved room) after every layer was written. */
LLMEM_API void llmem_kv_set_length(struct llmem_kv *kv, int seq, int64_t length);
/* reserve + write every layer + set_length, for k and v of [n_layers, n, n_kv_heads, head_dim]. */
LLMEM_API int llmem_kv_append(struct llmem_kv *kv, int seq, int64_t n, const float *k,
                              const float *v);
/* Drops the last n tokens (releasing whole blocks that no longer hold any). */
LLMEM_API void llmem_kv_trim(struct llmem_kv *kv, int seq, int64_t n);
/* Ragged: grows every row to `capacity` tokens now and never allocates again; a reserve past it
 * fails with LLMEM_ERANGE. Other layouts: LLMEM_EUNSUPPORTED. */
LLMEM_API int llmem_kv_freeze_capacity(struct llmem_kv *kv, int64_t capacity);

/* Paged: blocks held outside any sequence — what the session bank keeps of finished sequences.
 * A held block stays allocated (and is never written: a sequence that shares it copies it first)
 * until its last holder and its last sequence let go. */
LLMEM_API int llmem_kv_block_size(const struct llmem_kv *kv);
LLMEM_API int64_t
llmem_kv_block_bytes(const struct llmem_kv *kv); /* one block, all layers, K and V */
LLMEM_API int64_t llmem_kv_blocks_free(const struct llmem_kv *kv); /* paged; 0 for other layouts */
/* Paged: gives the memory pages of the free blocks back to the operating system (they stay
 * allocated, and accounted, to the pool, and read as zeros until written again), so that the
 * resident memory falls after a sequence or the session bank let blocks go; the bytes released.
 * 0 for other layouts. */
LLMEM_API int64_t llmem_kv_release_free(struct llmem_kv *kv);
/* The ids of the blocks holding a sequence's tokens: ceil(length / block_size) of them. */
LLMEM_API int64_t llmem_kv_seq_blocks(struct llmem_kv *kv, int seq, const int64_t **ids);
/* One more holder of a block in use / one fewer (the last reference frees it). */
LLMEM_API void llmem_kv_block_hold(struct llmem_kv *kv, int64_t id);
LLMEM_API void llmem_kv_block_release(struct llmem_kv *kv, int64_t id);
/* A new sequence whose first n_blocks × block_size tokens are these blocks, shared (no copy);
 * LLMEM_ERANGE when no sequence is free, LLMEM_ENOMEM (logged). */
LLMEM_API int llmem_kv_seq_new_from_blocks(struct llmem_kv *kv, const int64_t *ids,
                                           int64_t n_blocks, int *seq);
/* Paged: a block's stored bytes, every layer, as one run of llmem_kv_block_bytes bytes laid out
 * [n_layers][K: block_size × n_kv_heads × key bytes | V: block_size × n_kv_heads × value bytes]
 * (the session bank's spill files hold blocks in this form). */
LLMEM_API void llmem_kv_block_copy_out(const struct llmem_kv *kv, int64_t id, void *dst);
/* Blocks ids[0 .. n) copied so, back to back, without waiting for a device cache's copies (a
 * copy on the host): dst is complete once llmem_kv_copies_wait has returned LLMEM_OK, which any
 * thread may call (the work of the thread that generates goes on meanwhile). A block given out
 * again, or a pool let go, is written only after these copies have read it. Runs of consecutive
 * ids take one copy a layer for K and one for V. */
LLMEM_API void llmem_kv_blocks_copy_out_async(struct llmem_kv *kv, const int64_t *ids, int64_t n,
                                              void *dst);
LLMEM_API int llmem_kv_copies_wait(const struct llmem_kv *kv);
/* Paged: a free block filled with bytes in that layout, held once by the caller (let go with
 * llmem_kv_block_release). The pool does not grow for it: LLMEM_ERANGE (not logged) when no
 * block is free, so callers check llmem_kv_blocks_free first. */
LLMEM_API int llmem_kv_block_new_from(struct llmem_kv *kv, const void *src, int64_t *id);
/* The configuration the cache was created with (defaults filled in). */
LLMEM_API const struct llmem_kv_config *llmem_kv_get_config(const struct llmem_kv *kv);

enum llmem_kv_route {
    LLMEM_KV_ROUTE_AUTO = 0,
    LLMEM_KV_ROUTE_DIRECT,
    LLMEM_KV_ROUTE_PARTITIONED,
    LLMEM_KV_ROUTE_FALLBACK
};

struct llmem_kv_attn {
    int n_heads;    /* query heads, a multiple of n_kv_heads (GQA) */
    float scale;    /* 0: 1 / sqrt(head_dim) */
    int64_t window; /* 0: full causal; else each query sees its last `window` tokens */
    enum llmem_kv_route route;
};

/* Attention of n_q queries at positions [q_pos, q_pos + n_q) of one layer: q and out are
 * [n_q, n_heads, head_dim]; query i sees keys at positions ≤ q_pos + i (within the window).
 * q_pos + n_q must not exceed the sequence's length. LLMEM_ENOMEM (logged) when the workspace
 * cannot be allocated. */
LLMEM_API int llmem_kv_attend(struct llmem_kv *kv, int seq, int layer, int64_t q_pos, int64_t n_q,
                              const float *q, float *out, const struct llmem_kv_attn *attn);

/* The step's attention (llmem_kv_step first, with the same sequences): the queries at each
 * sequence's last n_q[i] positions; q and out [Σ n_q, n_heads, head_dim], one sequence's rows
 * after the other's. The same as llmem_kv_attend for each, but on a device in one launch where
 * the kernel allows. */
LLMEM_API int llmem_kv_attend_last(struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q,
                                   int layer, const float *q, float *out,
                                   const struct llmem_kv_attn *attn);

#define LLMEM_KV_STATS_FIELDS(X)                                                                   \
    X(n_sequences)                                                                                 \
    X(tokens)          /* Σ sequence lengths */                                                   \
    X(capacity_tokens) /* tokens the storage can hold without growing */                           \
    X(bytes)           /* KV memory held */                                                        \
    X(n_blocks)        /* paged: the pool */                                                       \
    X(n_blocks_used)                                                                               \
    X(n_blocks_free)                                                                               \
    X(n_blocks_shared) /* paged: blocks with more than one reference */                            \
    X(grow_events)                                                                                 \
    X(cow_copies)                                                                                  \
    X(updates) /* write calls */                                                                   \
    X(bytes_written)                                                                               \
    X(route_direct)                                                                                \
    X(route_partitioned)                                                                           \
    X(route_fallback)                                                                              \
    X(route_device) /* attention on the device backend that holds the pool */                      \
    X(attend_ns)    /* time spent in attention */

#define LLMEM_KV_STATS_FIELD_(name) int64_t name;
struct llmem_kv_stats {
    LLMEM_KV_STATS_FIELDS(LLMEM_KV_STATS_FIELD_)
};
#undef LLMEM_KV_STATS_FIELD_

LLMEM_API void llmem_kv_stats(struct llmem_kv *kv, struct llmem_kv_stats *stats);

/* Checks every invariant (reference counts equal the references in block tables, free and used
 * blocks partition the pool, lengths within capacity, byte counts); LLMEM_EFORMAT with the broken
 * invariant logged. For tests. */
LLMEM_API int llmem_kv_check(struct llmem_kv *kv);

#ifdef __cplusplus
}
#endif

#endif
