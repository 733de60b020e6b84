/*
 * backend/ops.h — the backend table (SPEC §8): the operations a forward pass needs, as function
 * pointers over a context, so that the model code never knows which backend runs it.
 *
 * Activations are f32, row-major. Weights are used in place, in the dtype the checkpoint stores
 * (bf16, f16 or f32). Small per-channel vectors (norm weights, biases) are handed over as f32.
 * Activations, weights, norm weights and biases live in the backend's memory (`memory`: host
 * memory for the CPU, device memory for CUDA), moved there with `copy`; the small per-call
 * arrays (positions, token ids, rotary frequencies) are host memory.
 * The CPU backend's operations are synchronous; a device backend's are queued in order on its
 * stream, and `copy` and `sync` wait for them. All are deterministic; the CPU matmul is also
 * batch invariant: each output row depends only on its row of x (not on the other rows, the
 * thread count or the path taken), bit for bit, so a sequence's logits do not depend on what it
 * is batched with (a device backend's GEMMs are batch invariant only within their rounding).
 * None allocates model-sized memory.
 */
#ifndef LLMEM_BACKEND_OPS_H
#define LLMEM_BACKEND_OPS_H

#include <stdint.h>

#include "llmem/backend.h"
#include "llmem/dtype.h"
#include "quant/quant.h"
#include "llmem/mem.h"
#include "llmem/plan.h"

/* A weight matrix [rows, cols], row-major: rows are output features, cols input features. Each
 * row is either `cols` values of `dtype`, or, where `quant` is set, cols / block_elems blocks of
 * that block type (quant/quant.h): a GGUF file's quantized weights, or an MLX file's codes with
 * their scales and biases beside them (three tensors of the file), all used in place. */
struct llmem_weight {
    const void *data;
    enum llmem_dtype dtype; /* F32, F16 or BF16 (when quant is 0) */
    int64_t rows;
    int64_t cols;
    int quant;          /* 0: not quantized; else LLMEM_QTYPE_Q8_0, _Q4_K, ..., or an MLX type */
    const void *scales; /* MLX types: (rows, cols / group) of the type's scale dtype; else NULL */
    const void *biases; /* MLX types: (rows, cols / group); else NULL */
    int f32_x;          /* its activations stay f32 at fast precision too, where a backend would
                         * round them to 16 bits (the CPU's bf16 kernels): 1 for the down
                         * projections and LM head, whose inputs' rounding moves the logits the
                         * most (the CPU's AMX tiles take x as two bf16 parts, within 2⁻¹⁸); 2 for
                         * the routers, multiplied exactly as at f32 precision (a choice of
                         * experts must not depend on how a file stores its router) */
};

/* Bytes of one row of w (for an MLX type, of its codes). */
static inline int64_t llmem_weight_row_bytes(const struct llmem_weight *w) {
    return w->quant != 0 ? llmem_qtype_bytes(w->quant, w->cols)
                         : w->cols * llmem_dtype_size(w->dtype);
}

/* Row r of a quantized w dequantized exactly into dst[cols] (quant/quant.h: ggml's blocks as
 * ggml's dequantize_row_*, MLX's groups as mx.dequantize). */
static inline int llmem_weight_dequantize_row(const struct llmem_weight *w, int64_t r, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + r * llmem_weight_row_bytes(w);
    int group, st;
    if (!llmem_qtype_mlx_params(w->quant, NULL, &group, &st))
        return llmem_quant_dequantize_row(w->quant, row, dst, w->cols);
    const int64_t at = r * (w->cols / group) * (st == LLMEM_QTYPE_F32 ? 4 : 2);
    return llmem_quant_dequantize_mlx_row(w->quant, row, (const uint8_t *)w->scales + at,
                                          (const uint8_t *)w->biases + at, dst, w->cols);
}

/* Whether b has a's shape and dtype and its bytes right after a's (one buffer holding both, as a
 * device model's k and v, gate and up: a backend may multiply the pair as one batch). Never for
 * an MLX type, whose scales and biases travel apart (model/device.c uploads each alone). */
static inline int llmem_weight_follows(const struct llmem_weight *a, const struct llmem_weight *b) {
    return a->data != NULL && a->scales == NULL && a->dtype == b->dtype && a->quant == b->quant &&
           a->rows == b->rows && a->cols == b->cols &&
           (const char *)b->data == (const char *)a->data + a->rows * llmem_weight_row_bytes(a);
}

/* One layer's mixture of experts: n_experts SwiGLU MLPs, of which each token runs the k that its
 * router's logits select. */
struct llmem_backend_moe {
    int64_t n_experts, k;
    int norm_topk; /* the k probabilities renormalized to sum to 1 (Mixtral; Qwen3-MoE's
                    * norm_topk_prob) */
    const struct llmem_weight *gate, *up; /* (n_experts) each: (inter, hidden) */
    const struct llmem_weight *down;      /* (n_experts): (hidden, inter) */
};

/* How a KV format stores its rows rotated (kv/codec.h: R = H·D/√head_dim, H the Walsh–Hadamard
 * matrix): which rows, D's signs as bits (bit i % 32 of neg[i / 32] set: −1) and the norm
 * 1/√head_dim as kv/codec.c computes it. q4 (with rotation) rotates keys and values, tq values. */
#define LLMEM_BACKEND_ROTATION_DIMS 256 /* the largest head_dim a device cache rotates */
struct llmem_backend_kv_rotation {
    int keys, values;
    float norm;
    uint32_t neg[LLMEM_BACKEND_ROTATION_DIMS / 32];
};

/* Attention of one sequence over a paged KV cache in the backend's memory (kv_attend); for
 * kv_attend_last, the shared fields of a batch whose blocks, lengths come apart (q and out then
 * [Σ n_q, n_heads, head_dim]: each sequence's queries at its last n_q positions, no window). */
struct llmem_backend_paged_attn {
    enum llmem_kv_format format;                      /* any (kv/codec.h's bytes) */
    const struct llmem_backend_kv_rotation *rotation; /* host memory; NULL: nothing rotated */
    int n_heads, n_kv_heads, head_dim, block_size;
    const uint8_t *k_pool, *v_pool; /* this layer's pools: block b's token j at b·block_size + j */
    size_t k_tok, v_tok;            /* bytes of one token, all KV heads */
    size_t key_bytes, value_bytes;  /* bytes of one head's row */
    const int64_t *blocks;          /* host memory: the sequence's block ids, in order */
    int64_t n_blocks;
    int64_t q_pos, n_q; /* queries for positions q_pos … q_pos + n_q − 1, causal */
    int64_t window;     /* 0: all earlier tokens; else each query sees its last `window` */
    float scale;        /* of the scores (1 / sqrt(head_dim) usually) */
    const float *q;     /* [n_q, n_heads, head_dim] */
    float *out;         /* [n_q, n_heads, head_dim] */
};

/* What a backend did beyond the operations themselves. */
struct llmem_backend_counters {
    int64_t graphs_recorded; /* passes recorded as graphs (graph_begin) */
    int64_t graphs_replayed; /* passes run as one launch of a recording */
    int64_t graphs_missed;   /* passes that did not match their recording (run again) */
    double graphs_device_s;  /* the device's time running the replays, launch to last kernel */
    int64_t top_k_rows;      /* rows of which only the largest k came back (top_k) */
    int64_t rounds; /* activations rounded to 16 bits for the fast GEMMs by a kernel of their own
                     * (not written so by the operation that produced them) */
    int64_t weight_bytes; /* bytes of the weight matrices the matmuls read (the CPU's: each
                           * matrix's rows × row bytes per call, the experts' included) */
};

/* How a backend runs a pass between graph_begin and graph_end, in increasing order. */
enum { LLMEM_GRAPH_RUN, LLMEM_GRAPH_RECORD, LLMEM_GRAPH_REPLAY };

struct llmem_backend_ops {
    const char *name; /* "cpu" */
    void (*destroy)(void *ctx);
    int (*threads)(void *ctx);

    /* y[n, w.rows] = x[n, w.cols] · wᵀ, plus bias[w.rows] on every row when bias is not NULL.
     * f32 accumulation; x and y do not alias. */
    void (*matmul)(void *ctx, const struct llmem_weight *w, const float *x, int64_t n, float *y,
                   const float *bias);
    /* count matmuls of the same x — y[i] = x · w[i]ᵀ (+ bias[i] where bias and bias[i] are not
     * NULL) — with exactly the results of `matmul` on each, in one dispatch where that saves the
     * threads' hand-offs (decode: q, k and v; gate and up). count ≤ 4. */
    void (*matmul_multi)(void *ctx, int count, const struct llmem_weight *const *w, const float *x,
                         int64_t n, float *const *y, const float *const *bias);
    /* For each of n rows of `dim`: y = x / sqrt(mean(x²) + eps) · weight (the HF Llama RMSNorm, in
     * f32). y may equal x. */
    void (*rmsnorm)(void *ctx, const float *x, const float *weight, int64_t n, int64_t dim,
                    float eps, float *y);
    /* (optional) x += res, then y = rmsnorm(x): exactly `add` then `rmsnorm`, in one pass. res
     * may equal y. */
    void (*add_rmsnorm)(void *ctx, float *x, const float *res, const float *weight, int64_t n,
                        int64_t dim, float eps, float *y);
    /* Rotary embedding in place on x [n, n_heads, head_dim], HF "rotate_half" pairing (i with
     * i + head_dim/2). Token t is at position pos[t]; angle = (float)pos[t] · inv_freq[i] in f32,
     * cos/sin of that f32 angle rounded to f32 (inv_freq has head_dim/2 entries). */
    void (*rope)(void *ctx, float *x, int64_t n, int n_heads, int head_dim, const int64_t *pos,
                 const float *inv_freq);
    /* (optional) rope of rows whose pairs sit side by side — pair i at (2i, 2i + 1), as the GGUF
     * converter permutes the q and k rows of Llama-family models for llama.cpp's interleaved
     * rope — written back in rope's layout (pair i at i and i + head_dim/2): bit for bit what
     * `rope` gives on the rows before the permutation, so that the KV cache and attention are
     * the unpermuted model's. A backend without it cannot run such files. */
    void (*rope_pairs)(void *ctx, float *x, int64_t n, int n_heads, int head_dim,
                       const int64_t *pos, const float *inv_freq);
    /* (optional) rope on q [n, n_heads, head_dim] and on k [n, n_kv_heads, head_dim]: exactly the
     * two `rope` calls, in one pass. */
    void (*rope_qk)(void *ctx, float *q, float *k, int64_t n, int n_heads, int n_kv_heads,
                    int head_dim, const int64_t *pos, const float *inv_freq);
    /* out[i] = silu(gate[i]) · up[i] for i < n; out may equal gate. */
    void (*swiglu)(void *ctx, const float *gate, const float *up, int64_t n, float *out);
    /* (optional) matmul_multi of x with gate and up (one shape) into g and u, then swiglu of them
     * into out (which may equal g), as one operation where the backend can: then g and u may be
     * left unwritten. The bits of the two operations. */
    void (*matmul_swiglu)(void *ctx, const struct llmem_weight *gate, const struct llmem_weight *up,
                          const float *x, int64_t n, float *g, float *u, float *out);
    /* out[t, :] = table[ids[t], :] as f32, for t < n (table is [vocab, dim]; ids < vocab), and
     * zeros for a negative id (a token of another rank's share of the vocabulary). */
    void (*embedding)(void *ctx, const struct llmem_weight *table, const int32_t *ids, int64_t n,
                      float *out);
    /* y[i] += x[i] for i < n. */
    void (*add)(void *ctx, float *y, const float *x, int64_t n);
    /* A mixture-of-experts MLP for T rows of x[T, hidden]: per row, p = softmax(logits[t]) over
     * the n_experts (f32), its k largest (the lower index first among equals), renormalized when
     * norm_topk, then y[t] = Σ p_j · down_e(silu(gate_e·x_t) ⊙ up_e·x_t) over those experts e in
     * increasing order. Only the chosen experts' matrices are read, each for the rows that chose
     * it. work: plan/moe_work.h's layout for T, hidden, the experts' width, n_experts and k, in
     * the backend's memory. y may equal x. Optional (NULL: the backend runs no MoE layers). */
    void (*moe)(void *ctx, const struct llmem_backend_moe *moe, const float *logits, const float *x,
                int64_t T, float *y, void *work);

    /* (optional: backends whose memory is not the host's, which then hold the paged KV pool)
     * Encodes n tokens of keys and values, each `heads` rows of head_dim floats (k, v
     * [n, heads·head_dim]), into `format` (byte for byte as kv/codec.h, rotated as `rotation`
     * says: NULL for none): token i into pool slot slots[i] (host memory), its key rows at
     * k_pool + slots[i]·heads·key_bytes, head h at + h·key_bytes, its value rows likewise with
     * value_bytes. Then attention over such a pool: one sequence's queries, or the last n_q[s]
     * positions of each of several sequences (n_q NULL: one each). */
    void (*kv_encode)(void *ctx, enum llmem_kv_format format,
                      const struct llmem_backend_kv_rotation *rotation, const float *k,
                      const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                      uint8_t *k_pool, uint8_t *v_pool, size_t key_bytes, size_t value_bytes);
    void (*kv_attend)(void *ctx, const struct llmem_backend_paged_attn *attn);
    void (*kv_attend_last)(void *ctx, const struct llmem_backend_paged_attn *attn, int n_seqs,
                           const int64_t *const *blocks, const int64_t *lengths,
                           const int64_t *n_q);

    /* The raw memory the operations work on, for an allocator (llmem_mem) over it. */
    const struct llmem_mem_raw_ops *(*memory)(void *ctx);
    /* Copies `bytes` from src to dst, each host memory or the backend's, after every operation
     * queued before it. LLMEM_EIO (logged) when the copy or an earlier operation failed. */
    int (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
    /* (optional: backends whose memory is not the host's) Queues a copy of `rows` runs of
     * `bytes` from the backend's memory at src (src_pitch apart) to host memory at dst (dst_pitch
     * apart) on a queue of its own, after every operation queued before it, and returns at once:
     * the operations queued after it do not wait for it (dst pinned where the backend pins host
     * memory, or the copy may wait for the host).
     * copy_out_wait waits for every copy so queued, from any thread (LLMEM_EIO, logged, when one
     * failed); copy_out_fence makes every operation queued after it wait, on the device, for
     * those copies: before anything may write over what they read. */
    void (*copy_out)(void *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                     size_t bytes, size_t rows);
    int (*copy_out_wait)(void *ctx);
    void (*copy_out_fence)(void *ctx);
    /* Waits for every operation queued. The first failure of any of them (LLMEM_EIO, or
     * LLMEM_ENOMEM for scratch) is logged once and returned by every later copy and sync. */
    int (*sync)(void *ctx);
    /* (optional) Whether operations queued are still running: 1, or 0 (all done, or failed). */
    int (*busy)(void *ctx);

    /* (optional: backends whose memory is not the host's) The k ≤ LLMEM_TOP_K_MAX largest entries
     * of each of n rows of x ([n, cols], the backend's memory, k ≤ cols), sorted by value
     * descending and equal values by the lower column, after every operation queued before it:
     * their columns into ids and their values into vals ([n, k], host memory) by the time the
     * next sync (or copy) returns: it queues the work and does not wait. A sampler needs no more
     * of a row than that, and k entries cross to the host instead of the row. Returns the first
     * failure so far, as sync does. */
    int (*top_k)(void *ctx, const float *x, int64_t n, int64_t cols, int k, int32_t *ids,
                 float *vals);
    /* (optional, with top_k and embedding_top) Waits for the oldest top_k whose results have not
     * reached the host yet and delivers them, leaving the work queued after it running: two top_k
     * calls may be outstanding (each its own ids and vals). Returns the first failure so far. */
    int (*top_k_wait)(void *ctx);
    /* (optional, with top_k) embedding, its ids read on the device when it runs: row t's is the
     * largest column of row t of the last top_k queued before it, with k = 1 (n ≤ its rows): a
     * greedy decode's next tokens, queued before the host has seen them. */
    void (*embedding_top)(void *ctx, const struct llmem_weight *table, int64_t n, float *out);

    /* (optional) A pass the caller repeats with the same shapes, between graph_begin and
     * graph_end (a decode step): the backend may run it as usual (LLMEM_GRAPH_RUN), record it
     * (LLMEM_GRAPH_RECORD) or replay its recording with the pass's own small per-call arrays, as
     * one launch (LLMEM_GRAPH_REPLAY): the way graph_want names, or run it as usual where that is
     * more than `most` (the ranks of a split agree on the least any of them wants). Recorded or
     * replayed, nothing of the pass runs before graph_launch, its operations are queued only
     * there, and so may copies between the backend's buffers (those are queued ahead of the
     * pass). graph_end returns LLMEM_OK when the pass ran, or is held for graph_launch;
     * LLMEM_EBUSY when nothing of it ran or is held (it did not match its recording, or could not
     * be recorded): the caller then runs the same pass again, right away; or the backend's
     * failure. graph_launch launches what graph_end held (go) or drops it (nothing of the pass
     * ran; its recording is kept), and returns the first failure so far. `key` tells passes of
     * different shapes apart (the backend also compares every operation and argument). */
    int (*graph_begin)(void *ctx, uint64_t key, int most);
    int (*graph_end)(void *ctx);
    int (*graph_launch)(void *ctx, int go);
    /* (with graph_begin) How graph_begin would run a pass of this key (no more than
     * LLMEM_GRAPH_REPLAY asked): LLMEM_GRAPH_REPLAY when its recording is ready (graph_begin and
     * graph_end then only stage it; no recording, no run). */
    int (*graph_want)(void *ctx, uint64_t key);
    /* (optional) */
    void (*counters)(void *ctx, struct llmem_backend_counters *out);
    /* (optional: backends of a device) Makes the backend's device the calling thread's current
     * one: before its operations where one thread drives the backends of several devices (the
     * ranks of a split model, their KV cache). */
    void (*bind)(void *ctx);
};

struct llmem_backend {
    const struct llmem_backend_ops *ops;
    void *ctx;
};

/* Backends that run one model split over them (tensor parallelism: rank r's share of each layer
 * on ranks[r], each rank's operations queued by a thread of its own), and the sum that joins their
 * partial results. */
#define LLMEM_SPLIT_MAX 8 /* the most ranks a model is split over */
struct llmem_backend_group {
    int n;
    const struct llmem_backend *const *ranks; /* (n) */
    /* buf (count floats in rank r's memory) ← Σ over the ranks of their bufs, in place, the same
     * sum on every rank, after the operations queued on each before it (and queued as they are):
     * each rank's thread calls it with its buf (the same count), every rank once for each sum and
     * in the same order, and it returns once that rank's part is done (queued, on a device). A
     * rank that failed still makes every call, so that the others do not wait for it; its failure
     * is returned to it. NULL for a group of one. */
    int (*allreduce_rank)(void *ctx, int rank, float *buf, int64_t count);
    int graphs; /* allreduce_rank may be recorded in its ranks' graphs (graph_begin), which then
                 * launch together or not at all */
    void *ctx;
};

/* A group of n CPU backends of their own (a rank's thread runs its operations; backends on one
 * pool take turns on it) whose allreduce_rank meets the ranks' threads on the host: each rank
 * sums its slice of the buffers in rank order and writes it to every rank's. Freed with
 * llmem_backend_host_group_free. In backend/cpu/cpu.c. */
int llmem_backend_host_group_create(int n, const struct llmem_backend *const *ranks,
                                    struct llmem_backend_group *group);
void llmem_backend_host_group_free(struct llmem_backend_group *group);

/* The group of n CUDA backends (llmem_backend_cuda_create, each on a device of its own), their
 * communicator made (backend/cuda/comm.h): its allreduce_rank is NCCL's on the rank's stream,
 * each rank's thread queueing its own. LLMEM_EUNSUPPORTED (logged) in a build without CUDA or, for
 * n > 1, without NCCL; LLMEM_EIO (logged) when NCCL fails. Freed with
 * llmem_backend_cuda_group_free (a group of none is a no-op). In backend/registry.c. */
int llmem_backend_cuda_group_create(int n, const struct llmem_backend *const *ranks,
                                    struct llmem_backend_group *group);
void llmem_backend_cuda_group_free(struct llmem_backend_group *group);

/* Opens cuBLAS and cuBLASLt, as the first llmem_backend_cuda_create does (backend/cuda/blas.h):
 * LLMEM_OK, LLMEM_EIO (logged, naming the library missing), or LLMEM_EUNSUPPORTED in a build
 * without CUDA. In backend/registry.c. */
int llmem_backend_cuda_blas_load(void);

#endif
