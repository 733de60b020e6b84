/*
 * backend/cuda/attend.cu — the CUDA backend's KV operations: rows encoded into the paged pool (with
 * a queued RoPE of q and k in the same launch) and attention over it, handed to the kernels of
 * kv.cu and attention.cu (the split-K decode kernel where it applies: a step's decodes, a prefill
 * chunk's queries).
 */
#include "backend/cuda/ops_int.h"

#include <algorithm>

namespace llmem_cuda {

/* What a launch depends on of a rotation (0: none). */
static uint64_t rotation_sig(const struct llmem_backend_kv_rotation *r) {
    return r != NULL ? llmem_hash64(r, sizeof(*r), 1) : 0;
}

void cuda_kv_encode(void *ctx, enum llmem_kv_format format,
                    const struct llmem_backend_kv_rotation *rotation, const float *k,
                    const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                    uint8_t *k_pool, uint8_t *v_pool, size_t key_bytes, size_t value_bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    const int64_t per = (int64_t)(SMALL_MAX / sizeof(int64_t));
    for (int64_t t = 0; t < n && !c->failed; t += per) {
        const int64_t m = n - t < per ? n - t : per;
        const int64_t *d = (const int64_t *)small_upload(c, slots + t, (size_t)m * sizeof(int64_t));
        if (d == NULL)
            return;
        if (staged(c, OP_KV_ENCODE,
                   {arg((int64_t)format), rotation_sig(rotation), arg(k), arg(v), arg(m),
                    arg((int64_t)heads), arg((int64_t)head_dim), arg(d), arg(k_pool), arg(v_pool),
                    arg((int64_t)key_bytes), arg((int64_t)value_bytes)}))
            continue;
        const struct rope_later *r = &c->rope_later;
        if (c->rope_pending && r->k == k && r->n == n && m == n && r->n_kv_heads == heads &&
            r->head_dim == head_dim) { /* the rope_qk just before: one launch for both */
            c->rope_pending = 0;
            llmem_cuda_kv_encode_rope(c->stream, format, rotation, r->q, r->n_heads, r->k, v, n,
                                      heads, head_dim, (const int64_t *)r->d,
                                      (const float *)(r->d + (size_t)n * sizeof(int64_t)), d,
                                      k_pool, v_pool, key_bytes, value_bytes);
            launched(c, "rope + kv encode");
            continue;
        }
        rope_flush(c);
        const int64_t off = t * heads * (int64_t)head_dim;
        llmem_cuda_kv_encode(c->stream, format, rotation, k + off, v + off, m, heads, head_dim, d,
                             k_pool, v_pool, key_bytes, value_bytes);
        launched(c, "kv encode");
    }
}

/* The split-K decode kernel of attention.cu takes these queries (a sequence's last position, or a
 * chunk's queries as sequences of their own lengths): no window, f16, bf16, q8 (on tensor cores),
 * q4 or tq blocks of 16 tokens. */
static int decode_kernel_fits(const struct llmem_backend_paged_attn *a) {
    const int group = a->n_heads / a->n_kv_heads;
    return a->window == 0 && a->format != LLMEM_KV_FORMAT_F32 && a->block_size == 16 &&
           group <= 8 && (a->head_dim == 64 || a->head_dim == 128 || a->head_dim == 256);
}

/* What a launch of the decode kernel reads from c->staging (n_ints int32 in all): the block
 * tables (table_stride apart; 0: one table for all) from index 0, the queries' lengths from
 * lengths_at, the table of each query from ids_at and the first query of each pack from packs_at
 * (NO_IDS: none); queries a warp takes together: pack. */
#define NO_IDS ((size_t)-1)
struct attn_call {
    int n_queries, table_stride, max_len, pack, n_packs;
    int fresh; /* the newest tokens of a sequence, just written by the KV write before */
    size_t lengths_at, ids_at, packs_at, n_ints;
};
static_assert(sizeof(struct attn_call) == 6 * sizeof(int) + 4 * sizeof(size_t),
              "attn_call is hashed as bytes: no padding");

/* Queries of a prefill chunk a warp takes together: as many as fill the kernel's 8 rows. */
static int attn_pack(const struct llmem_backend_paged_attn *a) {
    const int group = a->n_heads / a->n_kv_heads;
    return group <= 4 ? 8 / group : 1;
}

/* Runs the decode kernel over the queries of `call`; q and out [n_queries, n_heads, head_dim]. */
static void decode_kernel(struct cuda_ctx *c, const struct llmem_backend_paged_attn *a,
                          const struct attn_call *call) {
    const int32_t *d = (const int32_t *)small_upload(c, c->staging, call->n_ints * sizeof(int32_t));
    if (d == NULL ||
        staged(c, OP_ATTN_DECODE,
               {arg((int64_t)a->format), arg((int64_t)a->n_heads), arg((int64_t)a->n_kv_heads),
                arg((int64_t)a->head_dim), arg(a->q), arg(a->k_pool), arg(a->v_pool), arg(a->out),
                arg(d), arg(a->scale), arg((int64_t)a->k_tok), arg((int64_t)a->v_tok),
                rotation_sig(a->rotation), arg((int64_t)llmem_hash64(call, sizeof(*call), 0))}))
        return;
    struct llmem_cuda_attn ca = {};
    ca.format = a->format;
    ca.n_heads = a->n_heads;
    ca.n_kv_heads = a->n_kv_heads;
    ca.head_dim = a->head_dim;
    ca.block_size = a->block_size;
    ca.batch = call->n_queries;
    ca.max_len = call->max_len;
    ca.scale = a->scale;
    ca.q = a->q;
    ca.k_pool = a->k_pool;
    ca.v_pool = a->v_pool;
    ca.block_stride = (int64_t)a->block_size * (int64_t)a->k_tok;
    ca.v_block_stride = (int64_t)a->block_size * (int64_t)a->v_tok;
    ca.rotation = a->rotation;
    ca.block_tables = d;
    ca.table_stride = call->table_stride;
    ca.lengths = d + call->lengths_at;
    ca.fresh = call->fresh;
    ca.table_ids = call->ids_at != NO_IDS ? d + call->ids_at : NULL;
    ca.pack = call->pack;
    ca.packs = call->packs_at != NO_IDS ? d + call->packs_at : NULL;
    ca.n_packs = call->n_packs;
    ca.out = a->out;
    ca.stream = c->stream;
    ca.workspace_bytes = llmem_cuda_attn_workspace_bytes(&ca);
    /* a prefill chunk's splits merged inside the kernel when they are few; a decode step's by the
     * second kernel, which measured faster inside the pass (docs/BENCHMARKS.md) */
    if (call->pack > 1) {
        ca.counters = split_counters(c);
        ca.n_counters = SPLIT_COUNTERS;
    }
    if (ca.workspace_bytes > 0 && (ca.workspace = scratch(c, ca.workspace_bytes)) == NULL)
        return;
    if (llmem_cuda_attn_decode(&ca) != LLMEM_OK)
        fail(c, LLMEM_EIO, "attention", NULL); /* logged by attention.cu */
    else
        launched(c, "attention");
}

void cuda_kv_attend(void *ctx, const struct llmem_backend_paged_attn *a) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (a->n_q == 0 || c->failed)
        return;
    const size_t max_ints = SMALL_MAX / sizeof(int32_t);
    if ((size_t)a->n_blocks + 1 > max_ints) {
        LLMEM_ERROR("cuda backend: a sequence of %lld blocks (at most %zu)", (long long)a->n_blocks,
                    max_ints - 1);
        fail(c, LLMEM_EINVAL, "per-call data", NULL);
        return;
    }
    for (int64_t b = 0; b < a->n_blocks; b++)
        c->staging[b] = (int32_t)a->blocks[b];
    if (decode_kernel_fits(a) && (size_t)(a->n_blocks + a->n_q) <= max_ints) {
        /* each query a "sequence" of its own length over the one table (on tensor cores) */
        for (int64_t i = 0; i < a->n_q; i++)
            c->staging[a->n_blocks + i] = (int32_t)(a->q_pos + i + 1);
        const struct attn_call call = {.n_queries = (int)a->n_q,
                                       .table_stride = 0,
                                       .max_len = (int)(a->q_pos + a->n_q),
                                       .pack = a->n_q > 1 ? attn_pack(a) : 1,
                                       .n_packs = 0,
                                       .fresh = (int)a->n_q,
                                       .lengths_at = (size_t)a->n_blocks,
                                       .ids_at = NO_IDS,
                                       .packs_at = NO_IDS,
                                       .n_ints = (size_t)(a->n_blocks + a->n_q)};
        decode_kernel(c, a, &call);
        return;
    }
    const int32_t *d =
        (const int32_t *)small_upload(c, c->staging, (size_t)a->n_blocks * sizeof(int32_t));
    if (d == NULL ||
        staged(c, OP_KV_ATTEND,
               {arg((int64_t)a->format), arg((int64_t)a->n_heads), arg((int64_t)a->n_kv_heads),
                arg((int64_t)a->head_dim), arg(a->k_pool), arg(a->v_pool), arg(a->q), arg(a->out),
                arg(a->q_pos), arg(a->n_q), arg(a->window), arg(a->scale), arg(d),
                arg((int64_t)a->k_tok), arg((int64_t)a->v_tok), arg((int64_t)a->key_bytes),
                arg((int64_t)a->value_bytes), rotation_sig(a->rotation)}))
        return;
    if (llmem_cuda_kv_attend(c->stream, a, d) != LLMEM_OK) {
        LLMEM_ERROR("cuda backend: attention over head_dim %d (a multiple of 32 up to 256)",
                    a->head_dim);
        fail(c, LLMEM_EINVAL, "attention", NULL);
        return;
    }
    launched(c, "kv attend");
}

/* Queries of a sequence's chunk from which the prefill kernel of prefill.cu takes it: at fast
 * precision, for the shapes it takes, LLMEM_CUDA_PREFILL_FROM (default 32); 0: never. */
static int64_t prefill_from(struct cuda_ctx *c, const struct llmem_backend_paged_attn *a) {
    static const int64_t from = [] { /* read once, by the first of the threads (−1: malformed) */
        int64_t v = 32;
        return llmem_option_int(LLMEM_OPT_CUDA_PREFILL_FROM, &v) == LLMEM_OK ? v : -1;
    }();
    if (from < 0) { /* (logged) */
        fail(c, LLMEM_EINVAL, "LLMEM_CUDA_PREFILL_FROM", NULL);
        return 0;
    }
    if (c->precision != LLMEM_PRECISION_FAST || a->window != 0 ||
        !llmem_cuda_prefill_fits(a->format, a->n_heads, a->n_kv_heads, a->head_dim,
                                 a->block_size))
        return 0;
    return from;
}

/* Where the prefill kernel's call for the sequences of `from` queries or more (n_long of them)
 * lays its upload: their tables, stride apart, then their tiles. 0 when they do not fit one. */
struct prefill_call {
    int64_t n_long, stride, n_tiles, tile_queries;
    int mblocks;
};
static int prefill_plan(const struct llmem_backend_paged_attn *a, int n_seqs,
                        const int64_t *lengths, const int64_t *n_q, int64_t from,
                        struct prefill_call *pc) {
    const int group = a->n_heads / a->n_kv_heads;
    int64_t queries = 0;
    for (int s = 0; s < n_seqs; s++)
        queries += n_q[s] >= from ? n_q[s] : 0;
    const int mb = llmem_cuda_prefill_mblocks(group, a->n_kv_heads, queries);
    *pc = (struct prefill_call){.n_long = 0,
                                .stride = 1,
                                .n_tiles = 0,
                                .tile_queries = llmem_cuda_prefill_tile_queries(group, mb),
                                .mblocks = mb};
    for (int s = 0; s < n_seqs; s++)
        if (n_q[s] >= from) {
            const int64_t nb = (lengths[s] + a->block_size - 1) / a->block_size;
            pc->stride = nb > pc->stride ? nb : pc->stride;
            pc->n_long++;
            pc->n_tiles += (n_q[s] + pc->tile_queries - 1) / pc->tile_queries;
        }
    const size_t n_ints = (size_t)(pc->n_long * pc->stride + 4 * pc->n_tiles);
    return pc->n_long > 0 && n_ints <= SMALL_MAX / sizeof(int32_t) && pc->n_tiles <= 65535;
}

/* The prefill kernel over the chunks of the sequences with `from` queries or more, as planned:
 * their tiles heaviest (latest position) first. */
static void prefill_launch(struct cuda_ctx *c, const struct llmem_backend_paged_attn *a, int n_seqs,
                           const int64_t *const *blocks, const int64_t *lengths,
                           const int64_t *n_q, int64_t from, const struct prefill_call *pc) {
    const int64_t tq = pc->tile_queries, stride = pc->stride;
    struct llmem_cuda_prefill_tile *tiles =
        (struct llmem_cuda_prefill_tile *)(c->staging + pc->n_long * stride);
    int64_t row = 0, at = 0, k = 0;
    for (int s = 0; s < n_seqs; at += n_q[s], s++) {
        if (n_q[s] < from)
            continue;
        int32_t *t = c->staging + row * stride;
        const int64_t nb = (lengths[s] + a->block_size - 1) / a->block_size;
        for (int64_t b = 0; b < stride; b++)
            t[b] = b < nb ? (int32_t)blocks[s][b] : 0;
        const int64_t pos0 = lengths[s] - n_q[s];
        for (int64_t i = ((n_q[s] - 1) / tq) * tq; i >= 0; i -= tq) /* the last tile first */
            tiles[k++] = {(int32_t)(at + i), (int32_t)(n_q[s] - i < tq ? n_q[s] - i : tq),
                          (int32_t)(pos0 + i), (int32_t)row};
        row++;
    }
    if (pc->n_long > 1)
        std::sort(tiles, tiles + pc->n_tiles,
                  [](const llmem_cuda_prefill_tile &x, const llmem_cuda_prefill_tile &y) {
                      return x.pos + x.n_q > y.pos + y.n_q;
                  });
    const size_t n_ints = (size_t)(pc->n_long * stride + 4 * pc->n_tiles);
    const int32_t *d = (const int32_t *)small_upload(c, c->staging, n_ints * sizeof(int32_t));
    if (d == NULL ||
        staged(c, OP_PREFILL,
               {arg((int64_t)a->format), arg((int64_t)a->n_heads), arg((int64_t)a->n_kv_heads),
                arg((int64_t)a->head_dim), arg(a->q), arg(a->k_pool), arg(a->v_pool), arg(a->out),
                arg(d), arg(a->scale), arg((int64_t)a->k_tok), arg((int64_t)n_ints),
                arg((int64_t)pc->mblocks),
                arg((int64_t)llmem_hash64(c->staging, n_ints * sizeof(int32_t), 0))}))
        return;
    struct llmem_cuda_prefill p = {};
    p.format = a->format;
    p.n_heads = a->n_heads;
    p.n_kv_heads = a->n_kv_heads;
    p.head_dim = a->head_dim;
    p.block_size = a->block_size;
    p.scale = a->scale;
    p.q = a->q;
    p.out = a->out;
    p.k_pool = a->k_pool;
    p.v_pool = a->v_pool;
    p.k_block_stride = (int64_t)a->block_size * (int64_t)a->k_tok;
    p.v_block_stride = (int64_t)a->block_size * (int64_t)a->v_tok;
    p.block_tables = d;
    p.table_stride = (int)stride;
    p.tiles = (const struct llmem_cuda_prefill_tile *)(d + pc->n_long * stride);
    p.n_tiles = (int)pc->n_tiles;
    p.mblocks = pc->mblocks;
    p.stream = c->stream;
    if (llmem_cuda_prefill(&p) != LLMEM_OK)
        fail(c, LLMEM_EIO, "prefill attention", NULL); /* logged by prefill.cu */
    else
        launched(c, "prefill attention");
}

/* The last n_q[s] positions (n_q NULL: the last one) of each of n_seqs sequences. At fast
 * precision the chunks of LLMEM_CUDA_PREFILL_FROM queries or more go to the prefill kernel, after
 * the rest. The rest: one launch of the decode kernel for all their queries where it applies and
 * the tables fit one upload (each query a "sequence" of its own length over its sequence's table;
 * the prefill kernel's queries there of length 0, their outputs written over), else sequence by
 * sequence. */
void cuda_kv_attend_last(void *ctx, const struct llmem_backend_paged_attn *a, int n_seqs,
                         const int64_t *const *blocks, const int64_t *lengths, const int64_t *n_q) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (n_seqs == 0 || c->failed)
        return;
    struct prefill_call pc = {};
    int64_t from = n_q != NULL ? prefill_from(c, a) : 0;
    if (from > 0 && !prefill_plan(a, n_seqs, lengths, n_q, from, &pc))
        from = 0;
    /* the decode kernel's queries: every one but the prefill kernel's */
    auto decoded = [&](int s) { return from == 0 || n_q[s] < from; };
    int64_t most = 0, queries = 0, fresh = 1;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t m = n_q != NULL ? n_q[s] : 1;
        queries += m;
        if (decoded(s)) {
            most = lengths[s] > most ? lengths[s] : most;
            fresh = m > fresh ? m : fresh;
        }
    }
    if (from > 0 && pc.n_long == n_seqs) {
        prefill_launch(c, a, n_seqs, blocks, lengths, n_q, from, &pc);
        return;
    }
    /* tables padded to a power of two of blocks: the same launch (and graph) for many steps */
    int64_t stride = 8;
    while (stride * a->block_size < most)
        stride *= 2;
    most = stride * a->block_size;
    /* the tables, the queries' lengths, and with n_q the table of each query and the packs of
     * a sequence's queries that a warp takes together (a decode's one query its own) */
    const int pack = n_q != NULL ? attn_pack(a) : 1;
    int64_t packs = 0;
    for (int s = 0; n_q != NULL && s < n_seqs; s++)
        packs += decoded(s) ? (n_q[s] + pack - 1) / pack : 0;
    struct attn_call call = {.n_queries = (int)queries,
                             .table_stride = (int)stride,
                             .max_len = (int)most,
                             .pack = packs < queries ? pack : 1,
                             .n_packs = packs < queries ? (int)packs : 0,
                             .fresh = (int)fresh,
                             .lengths_at = (size_t)n_seqs * (size_t)stride,
                             .ids_at = NO_IDS,
                             .packs_at = NO_IDS,
                             .n_ints = 0};
    call.n_ints = call.lengths_at + (size_t)queries;
    if (n_q != NULL)
        call.ids_at = call.n_ints, call.n_ints += (size_t)queries;
    if (call.pack > 1)
        call.packs_at = call.n_ints, call.n_ints += (size_t)packs;
    if (decode_kernel_fits(a) && call.n_ints <= SMALL_MAX / sizeof(int32_t)) {
        size_t at = 0, pk = 0;
        for (int s = 0; s < n_seqs; s++) {
            const int64_t nb =
                decoded(s) ? (lengths[s] + a->block_size - 1) / a->block_size : 0;
            int32_t *row = c->staging + (size_t)s * (size_t)stride;
            for (int64_t b = 0; b < stride; b++)
                row[b] = b < nb ? (int32_t)blocks[s][b] : 0;
            const int64_t m = n_q != NULL ? n_q[s] : 1;
            for (int64_t i = 0; i < m; i++, at++) {
                c->staging[call.lengths_at + at] =
                    decoded(s) ? (int32_t)(lengths[s] - m + i + 1) : 0;
                if (call.ids_at != NO_IDS)
                    c->staging[call.ids_at + at] = s;
                if (call.packs_at != NO_IDS && decoded(s) && i % call.pack == 0)
                    c->staging[call.packs_at + pk++] = (int32_t)at;
            }
        }
        decode_kernel(c, a, &call);
    } else {
        const size_t row = (size_t)a->n_heads * (size_t)a->head_dim;
        size_t at = 0;
        for (int s = 0; s < n_seqs; s++) {
            struct llmem_backend_paged_attn one = *a;
            one.blocks = blocks[s];
            one.n_blocks = (lengths[s] + a->block_size - 1) / a->block_size;
            one.n_q = n_q != NULL ? n_q[s] : 1;
            one.q_pos = lengths[s] - one.n_q;
            one.q = a->q + at * row;
            one.out = a->out + at * row;
            if (decoded(s))
                cuda_kv_attend(ctx, &one);
            at += (size_t)one.n_q;
        }
    }
    if (from > 0)
        prefill_launch(c, a, n_seqs, blocks, lengths, n_q, from, &pc);
}

} // namespace llmem_cuda
