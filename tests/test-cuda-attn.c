/*
 * tests/test-cuda-attn.c — the GPU's paged decode attention (backend/cuda/attention.h) against
 * the CPU attention of the same cache.
 *
 * Each case builds a one-layer paged cache on the CPU through the public kv API (random keys and
 * values, sequences appended in interleaved chunks so that their block tables are scattered),
 * copies every live block as llmem_kv_block_copy_out lays it out ([K | V]) to the device at its
 * block id, and compares the GPU's output with llmem_kv_attend at the last position: for f16,
 * bf16 and q8, GQA groups of 1, 4, 7 and 8, head_dim 64, 128 (and 256), ragged lengths (0, 1,
 * below, at and past a block, past a split), with the split chosen by the GPU's size and forced
 * small. The output is poisoned (NaN) before each call, so an unwritten element fails. Prefill
 * chunks too: a sequence's last positions as queries over its one table, one a warp or packed
 * several a warp. And the prefill kernel (prefill.h): two sequences' chunks in one call, its
 * tiles built as the backend builds them.
 *
 * Tolerance, per (sequence, head), ‖gpu − cpu‖ / ‖cpu‖:
 *   f16, bf16  1e-4: keys and values are used exactly; the query and the probabilities enter the
 *              tensor cores as a 16-bit value plus its 16-bit remainder (~2⁻¹⁷), sums are f32;
 *   q8         1e-3: as above, but each decoded element code·scale is rounded to f16 (2⁻¹²).
 * The measured maxima are printed (typically 1e-6 and 1e-4). The prefill kernel rounds the query
 * and the probabilities to the cache's 16-bit type (fast precision; q8's to f16, its decoded
 * elements too): bf16 1e-2, f16 2e-3, q8 3e-3.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/attention.h"
#include "backend/cuda/prefill.h"
#include "backend/ops.h"
#include "core/options.h"
#include "kv/codec.h"
#include "llmem/kv.h"
#include "testutil.h"

#define CU(call) assert_int_equal((int)(call), (int)cudaSuccess)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

struct attn_case {
    enum llmem_kv_format format;
    int n_heads, n_kv_heads, head_dim;
    int batch;
    const int *lengths;
    int split_len; /* 0: the GPU's choice */
    int q_bf16;
};

/* a's output (n_out floats) after a call, copied to the host */
static float *call_gpu(struct llmem_cuda_attn *a, size_t n_out) {
    CU(cudaMemset(a->out, 0xff, n_out * sizeof(float))); /* NaN: every output must be written */
    assert_int_equal(llmem_cuda_attn_decode(a), LLMEM_OK);
    CU(cudaDeviceSynchronize());
    float *out = malloc(n_out * sizeof(float));
    CU(cudaMemcpy(out, a->out, n_out * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
}

/* Runs the attention a describes (its workspace allocated here) and returns its n_out floats of
 * output. The splits are merged by the second kernel, then twice inside the kernel (counters
 * given): the counters are left zero, the second call gives the first's bits, and both agree
 * with the merge kernel's to 1e-6 of the output's largest magnitude (they add in other orders). */
static float *run_gpu(struct llmem_cuda_attn *a, size_t n_out) {
    void *d_ws = NULL;
    a->workspace_bytes = llmem_cuda_attn_workspace_bytes(a);
    if (a->workspace_bytes > 0) {
        CU(cudaMalloc(&d_ws, a->workspace_bytes));
        a->workspace = d_ws;
    }
    a->counters = NULL;
    float *apart = call_gpu(a, n_out);
    const size_t n_counters = llmem_cuda_attn_counters(a);
    unsigned *d_counters = NULL;
    CU(cudaMalloc((void **)&d_counters, n_counters * sizeof(unsigned)));
    CU(cudaMemset(d_counters, 0, n_counters * sizeof(unsigned)));
    a->counters = d_counters;
    a->n_counters = n_counters;
    float *fused = call_gpu(a, n_out), *again = call_gpu(a, n_out);
    unsigned *counters = malloc(n_counters * sizeof(unsigned));
    CU(cudaMemcpy(counters, d_counters, n_counters * sizeof(unsigned), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n_counters; i++)
        assert_int_equal(counters[i], 0);
    assert_memory_equal(fused, again, n_out * sizeof(float));
    double big = 0.0, diff = 0.0;
    for (size_t i = 0; i < n_out; i++) {
        assert_true(isfinite(apart[i]));
        big = fmax(big, fabs(apart[i]));
        diff = fmax(diff, fabs((double)apart[i] - fused[i]));
    }
    assert_true(diff <= 1e-6 * big);
    a->counters = NULL;
    cudaFree(d_counters);
    cudaFree(d_ws);
    free(counters);
    free(again);
    free(apart);
    return fused;
}

/* The largest ‖out − ref‖ / ‖ref‖ over `rows` rows of D; a non-finite output fails. */
static double worst_rel_error(const float *out, const float *ref, int rows, int D) {
    double worst = 0.0;
    for (int row = 0; row < rows; row++) {
        const float *g = out + (size_t)row * D, *r = ref + (size_t)row * D;
        double num = 0.0, den = 0.0;
        for (int i = 0; i < D; i++) {
            if (!isfinite(g[i])) {
                fprintf(stderr, "row %d (query × head) dim %d: %g\n", row, i, g[i]);
                fail();
            }
            num += ((double)g[i] - r[i]) * ((double)g[i] - r[i]);
            den += (double)r[i] * r[i];
        }
        worst = fmax(worst, den > 0.0 ? sqrt(num / den) : sqrt(num));
    }
    return worst;
}

/* Runs one case; returns the largest relative error over (sequence, head). */
static double run_case(const struct attn_case *tc) {
    const int H = tc->n_heads, KV = tc->n_kv_heads, D = tc->head_dim, B = tc->batch;
    int max_len = 0;
    for (int b = 0; b < B; b++)
        max_len = tc->lengths[b] > max_len ? tc->lengths[b] : max_len;

    struct llmem_kv_config cfg;
    llmem_kv_config_default(&cfg);
    cfg.layout = LLMEM_KV_LAYOUT_PAGED;
    cfg.format = tc->format;
    cfg.n_layers = 1;
    cfg.n_kv_heads = KV;
    cfg.head_dim = D;
    cfg.max_sequences = B;
    cfg.block_size = 16;
    cfg.num_blocks = 64;
    cfg.dynamic = 1;
    cfg.n_threads = 2;
    struct llmem_kv *kv = NULL;
    assert_int_equal(llmem_kv_create(&cfg, NULL, &kv), LLMEM_OK);

    /* sequences appended 40 tokens at a time, round robin: scattered block tables */
    int *seq = calloc((size_t)B, sizeof(int));
    for (int b = 0; b < B; b++)
        assert_int_equal(llmem_kv_seq_new(kv, &seq[b]), LLMEM_OK);
    const int chunk = 40;
    float *k = malloc((size_t)chunk * KV * D * sizeof(float));
    float *v = malloc((size_t)chunk * KV * D * sizeof(float));
    for (int done = 0; done < max_len; done += chunk) {
        for (int b = 0; b < B; b++) {
            int n = tc->lengths[b] - done;
            n = n > chunk ? chunk : n;
            if (n <= 0)
                continue;
            for (int i = 0; i < n * KV * D; i++) {
                /* a few large keys make the softmax peaked in places */
                k[i] = frand() * ((i % 97) == 0 ? 6.0f : 1.0f);
                v[i] = frand();
            }
            assert_int_equal(llmem_kv_append(kv, seq[b], n, k, v), LLMEM_OK);
        }
    }

    /* the pool as the device sees it: block id i at i × block_bytes, [K | V] */
    struct llmem_kv_stats st;
    llmem_kv_stats(kv, &st);
    const size_t block_bytes = (size_t)llmem_kv_block_bytes(kv);
    const int64_t n_blocks = st.n_blocks;
    uint8_t *pool = calloc((size_t)n_blocks, block_bytes);
    const int table_stride = (max_len + 15) / 16 > 0 ? (max_len + 15) / 16 : 1;
    int32_t *tables = calloc((size_t)B * table_stride, sizeof(int32_t));
    for (int b = 0; b < B; b++) {
        const int64_t *ids;
        int64_t n = llmem_kv_seq_blocks(kv, seq[b], &ids);
        assert_true(n <= table_stride);
        for (int64_t i = 0; i < n; i++) {
            llmem_kv_block_copy_out(kv, ids[i], pool + (size_t)ids[i] * block_bytes);
            tables[(size_t)b * table_stride + i] = (int32_t)ids[i];
        }
    }

    /* queries (rounded to bf16 when the GPU reads bf16) and the CPU reference */
    const size_t n_out = (size_t)B * H * D;
    float *q = malloc(n_out * sizeof(float));
    uint16_t *q16 = malloc(n_out * sizeof(uint16_t));
    for (size_t i = 0; i < n_out; i++) {
        q[i] = 2.0f * frand();
        if (tc->q_bf16) {
            q16[i] = llmem_f32_to_bf16(q[i]);
            q[i] = llmem_bf16_to_f32(q16[i]);
        }
    }
    float *ref = calloc(n_out, sizeof(float));
    struct llmem_kv_attn attn = {
        .n_heads = H, .scale = 0.0f, .window = 0, .route = LLMEM_KV_ROUTE_AUTO};
    for (int b = 0; b < B; b++)
        if (tc->lengths[b] > 0)
            assert_int_equal(llmem_kv_attend(kv, seq[b], 0, tc->lengths[b] - 1, 1,
                                             q + (size_t)b * H * D, ref + (size_t)b * H * D, &attn),
                             LLMEM_OK);

    /* the GPU */
    void *d_pool, *d_q, *d_tables, *d_len, *d_out;
    CU(cudaMalloc(&d_pool, (size_t)n_blocks * block_bytes));
    CU(cudaMalloc(&d_q, n_out * sizeof(float)));
    CU(cudaMalloc(&d_tables, (size_t)B * table_stride * sizeof(int32_t)));
    CU(cudaMalloc(&d_len, (size_t)B * sizeof(int32_t)));
    CU(cudaMalloc(&d_out, n_out * sizeof(float)));
    CU(cudaMemcpy(d_pool, pool, (size_t)n_blocks * block_bytes, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_q, tc->q_bf16 ? (void *)q16 : (void *)q,
                  n_out * (tc->q_bf16 ? sizeof(uint16_t) : sizeof(float)), cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_tables, tables, (size_t)B * table_stride * sizeof(int32_t),
                  cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_len, tc->lengths, (size_t)B * sizeof(int32_t), cudaMemcpyHostToDevice));
    CU(cudaMemset(d_out, 0xff, n_out * sizeof(float))); /* NaN */

    struct llmem_cuda_attn a = {
        .format = tc->format,
        .n_heads = H,
        .n_kv_heads = KV,
        .head_dim = D,
        .block_size = 16,
        .batch = B,
        .max_len = max_len,
        .split_len = tc->split_len,
        .q = d_q,
        .q_bf16 = tc->q_bf16,
        .k_pool = d_pool,
        .v_pool = (uint8_t *)d_pool + block_bytes / 2,
        .block_stride = (int64_t)block_bytes,
        .block_tables = d_tables,
        .table_stride = table_stride,
        .lengths = d_len,
        .fresh = 1, /* the decode's blocks asked for before the wait, all but the last */
        .out = d_out,
    };
    int split_len = 0, n_splits = 0;
    assert_int_equal(llmem_cuda_attn_split(&a, &split_len, &n_splits), LLMEM_OK);
    float *out = run_gpu(&a, n_out);
    const double worst = worst_rel_error(out, ref, B * H, D);
    printf("  %-4s heads %2d/%d d %3d batch %d max_len %5d q %s split %4d × %3d: rel err %.2e\n",
           llmem_kv_format_name(tc->format), H, KV, D, B, max_len, tc->q_bf16 ? "bf16" : "f32",
           split_len, n_splits, worst);

    cudaFree(d_pool);
    cudaFree(d_q);
    cudaFree(d_tables);
    cudaFree(d_len);
    cudaFree(d_out);
    free(out);
    free(ref);
    free(q16);
    free(q);
    free(tables);
    free(pool);
    free(k);
    free(v);
    free(seq);
    llmem_kv_destroy(kv);
    return worst;
}

static double tolerance(enum llmem_kv_format f) {
    return f == LLMEM_KV_FORMAT_Q8 ? 1e-3 : 1e-4;
}

/* lengths: empty, 1, within a block, a block exactly, just past, past a split of 32, long */
static const int ragged[] = {1, 15, 16, 17, 0, 33, 100, 517, 1000, 2049};
#define N_RAGGED ((int)(sizeof(ragged) / sizeof(ragged[0])))

static void test_formats_groups_dims(void **state) {
    (void)state;
    const enum llmem_kv_format formats[] = {LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_F16,
                                            LLMEM_KV_FORMAT_Q8};
    const int groups[][2] = {{4, 4}, {16, 4}, {16, 2}, {28, 4}}; /* GQA 1, 4, 8, 7 */
    const int dims[] = {64, 128};
    for (int f = 0; f < 3; f++)
        for (int g = 0; g < 4; g++)
            for (int d = 0; d < 2; d++)
                for (int split = 0; split <= 128; split = split == 0 ? 32 : 4 * split) {
                    struct attn_case tc = {formats[f], groups[g][0], groups[g][1], dims[d],
                                           N_RAGGED,   ragged,       split,        0};
                    assert_true(run_case(&tc) <= tolerance(formats[f]));
                }
}

static void test_bf16_query_and_dim256(void **state) {
    (void)state;
    const enum llmem_kv_format formats[] = {LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_F16,
                                            LLMEM_KV_FORMAT_Q8};
    for (int f = 0; f < 3; f++) {
        struct attn_case tc = {formats[f], 32, 8, 128, N_RAGGED, ragged, 0, 1};
        assert_true(run_case(&tc) <= tolerance(formats[f]));
        struct attn_case t256 = {formats[f], 8, 2, 256, N_RAGGED, ragged, 48, 0};
        assert_true(run_case(&t256) <= tolerance(formats[f]));
        /* 4 KV heads: q8's warps share their stages */
        struct attn_case t256s = {formats[f], 16, 4, 256, N_RAGGED, ragged, 0, 0};
        assert_true(run_case(&t256s) <= tolerance(formats[f]));
    }
}

/* One long sequence split over the whole GPU, and a wide batch in one split each. */
static void test_shapes(void **state) {
    (void)state;
    static const int one[] = {4000};
    static int wide[64];
    for (int i = 0; i < 64; i++)
        wide[i] = 1 + (i * 37) % 300;
    const enum llmem_kv_format formats[] = {LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_Q8};
    for (int f = 0; f < 2; f++) {
        struct attn_case a = {formats[f], 32, 8, 128, 1, one, 0, 0};
        assert_true(run_case(&a) <= tolerance(formats[f]));
        struct attn_case b = {formats[f], 32, 8, 128, 64, wide, 0, 0};
        assert_true(run_case(&b) <= tolerance(formats[f]));
    }
}

/* A prefill chunk: the last n_q positions of one sequence of `len` tokens, each query a "sequence"
 * of its own length over the one table, pack of them a warp (1: one). With `split_ids`, the
 * table is given twice (two identical rows) and the queries read row 0 up to query k, row 1 from
 * there, in packs that start at 0, pack, … and at k, k + pack, … (packs never take queries of two
 * tables). Compared with llmem_kv_attend over the same positions. */
static double run_chunk(enum llmem_kv_format format, int H, int KV, int D, int len, int n_q,
                        int split_len, int pack, int split_ids) {
    struct llmem_kv_config cfg;
    llmem_kv_config_default(&cfg);
    cfg.layout = LLMEM_KV_LAYOUT_PAGED;
    cfg.block_size = 16;
    cfg.format = format;
    cfg.n_layers = 1;
    cfg.n_kv_heads = KV;
    cfg.head_dim = D;
    cfg.max_sequences = 1;
    cfg.num_blocks = 64;
    cfg.n_threads = 2;
    struct llmem_kv *kv = NULL;
    assert_int_equal(llmem_kv_create(&cfg, NULL, &kv), LLMEM_OK);
    int seq = -1;
    assert_int_equal(llmem_kv_seq_new(kv, &seq), LLMEM_OK);
    float *k = malloc((size_t)len * KV * D * sizeof(float));
    float *v = malloc((size_t)len * KV * D * sizeof(float));
    for (int i = 0; i < len * KV * D; i++)
        k[i] = frand() * ((i % 97) == 0 ? 6.0f : 1.0f), v[i] = frand();
    assert_int_equal(llmem_kv_append(kv, seq, len, k, v), LLMEM_OK);
    const size_t block_bytes = (size_t)llmem_kv_block_bytes(kv);
    struct llmem_kv_stats st;
    llmem_kv_stats(kv, &st);
    uint8_t *pool = calloc((size_t)st.n_blocks, block_bytes);
    const int64_t *ids;
    const int nblk = (int)llmem_kv_seq_blocks(kv, seq, &ids);
    /* two rows of table (the second a copy), the lengths, the table ids, the packs */
    int32_t *ints = calloc((size_t)(2 * nblk + 3 * n_q), sizeof(int32_t));
    int32_t *lens = ints + 2 * nblk, *tids = lens + n_q, *packs = tids + n_q;
    for (int i = 0; i < nblk; i++) {
        llmem_kv_block_copy_out(kv, ids[i], pool + (size_t)ids[i] * block_bytes);
        ints[i] = ints[nblk + i] = (int32_t)ids[i];
    }
    const int split_at = n_q / 3;
    int n_packs = 0;
    for (int i = 0; i < n_q; i++) {
        lens[i] = len - n_q + i + 1;
        tids[i] = split_ids && i >= split_at;
        const int from = tids[i] ? split_at : 0;
        if ((i - from) % pack == 0)
            packs[n_packs++] = i;
    }
    const size_t n_out = (size_t)n_q * H * D;
    float *q = malloc(n_out * sizeof(float)), *ref = malloc(n_out * sizeof(float));
    for (size_t i = 0; i < n_out; i++)
        q[i] = 2.0f * frand();
    struct llmem_kv_attn attn = {.n_heads = H};
    assert_int_equal(llmem_kv_attend(kv, seq, 0, len - n_q, n_q, q, ref, &attn), LLMEM_OK);

    void *d_pool, *d_q, *d_ints, *d_out;
    CU(cudaMalloc(&d_pool, (size_t)st.n_blocks * block_bytes));
    CU(cudaMalloc(&d_q, n_out * sizeof(float)));
    CU(cudaMalloc(&d_ints, (size_t)(2 * nblk + 3 * n_q) * sizeof(int32_t)));
    CU(cudaMalloc(&d_out, n_out * sizeof(float)));
    CU(cudaMemcpy(d_pool, pool, (size_t)st.n_blocks * block_bytes, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_q, q, n_out * sizeof(float), cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_ints, ints, (size_t)(2 * nblk + 3 * n_q) * sizeof(int32_t),
                  cudaMemcpyHostToDevice));
    CU(cudaMemset(d_out, 0xff, n_out * sizeof(float))); /* NaN */
    const int32_t *di = (const int32_t *)d_ints;
    struct llmem_cuda_attn a = {.format = format,
                                .n_heads = H,
                                .n_kv_heads = KV,
                                .head_dim = D,
                                .block_size = 16,
                                .batch = n_q,
                                .max_len = len,
                                .split_len = split_len,
                                .q = d_q,
                                .k_pool = d_pool,
                                .v_pool = (uint8_t *)d_pool + block_bytes / 2,
                                .block_stride = (int64_t)block_bytes,
                                .block_tables = di,
                                .table_stride = split_ids ? nblk : 0,
                                .table_ids = split_ids ? di + 2 * nblk + n_q : NULL,
                                .lengths = di + 2 * nblk,
                                .fresh = n_q, /* as the engine: the chunk's KV just written */
                                .pack = pack,
                                .packs = split_ids ? di + 2 * nblk + 2 * n_q : NULL,
                                .n_packs = split_ids ? n_packs : 0,
                                .out = d_out};
    float *out = run_gpu(&a, n_out);
    const double worst = worst_rel_error(out, ref, n_q * H, D);
    printf("  chunk %-4s heads %2d/%d d %3d: %3d queries of %4d, %d a warp%s, split %3d: rel err "
           "%.2e\n",
           llmem_kv_format_name(format), H, KV, D, n_q, len, pack,
           split_ids ? " (two tables, packs listed)" : "", split_len, worst);
    cudaFree(d_pool), cudaFree(d_q), cudaFree(d_ints), cudaFree(d_out);
    free(out), free(ref), free(q), free(ints), free(pool), free(k), free(v);
    llmem_kv_destroy(kv);
    return worst;
}

/* A prefill chunk's queries, a warp each or packed 8 / group a warp (GQA 1, 2, 3, 4; 8 packs
 * one), with the packs' shorter queries skipping blocks and splits the longer ones read. */
static void test_chunk_packs(void **state) {
    (void)state;
    const enum llmem_kv_format formats[] = {LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_F16,
                                            LLMEM_KV_FORMAT_Q8};
    const int groups[][2] = {{4, 4}, {8, 4}, {12, 4}, {16, 4}, {16, 2}}; /* GQA 1, 2, 3, 4, 8 */
    for (int f = 0; f < 3; f++)
        for (int g = 0; g < 5; g++)
            for (int d = 64; d <= 128; d += 64)
                for (int variant = 0; variant < 4; variant++) {
                    const int group = groups[g][0] / groups[g][1];
                    const int pack = variant == 0 ? 1 : group <= 4 ? 8 / group : 1;
                    const int split = variant == 2 ? 32 : 0, two = variant == 3;
                    assert_true(run_chunk(formats[f], groups[g][0], groups[g][1], d, 300, 37, split,
                                          pack, two) <= tolerance(formats[f]));
                }
}

/* The prefill kernel over two sequences' chunks in one call: sequence 0's last n0 of len0 tokens,
 * then sequence 1's last n1 of len1 (their blocks interleaved in the pool), tiles of
 * llmem_cuda_prefill_tile_queries() queries, each sequence's last first. Compared with
 * llmem_kv_attend over the same positions. */
static double run_prefill(enum llmem_kv_format format, int H, int KV, int D, const int len[2],
                          const int n[2], int mblocks, int warp_mma) {
    struct llmem_kv_config cfg;
    llmem_kv_config_default(&cfg);
    cfg.layout = LLMEM_KV_LAYOUT_PAGED;
    cfg.block_size = 16;
    cfg.format = format;
    cfg.n_layers = 1;
    cfg.n_kv_heads = KV;
    cfg.head_dim = D;
    cfg.max_sequences = 2;
    cfg.num_blocks = 64;
    cfg.dynamic = 1;
    cfg.n_threads = 2;
    struct llmem_kv *kv = NULL;
    assert_int_equal(llmem_kv_create(&cfg, NULL, &kv), LLMEM_OK);
    int seq[2];
    const int most = len[0] > len[1] ? len[0] : len[1], chunk = 40;
    float *k = malloc((size_t)chunk * KV * D * sizeof(float));
    float *v = malloc((size_t)chunk * KV * D * sizeof(float));
    for (int s = 0; s < 2; s++)
        assert_int_equal(llmem_kv_seq_new(kv, &seq[s]), LLMEM_OK);
    for (int done = 0; done < most; done += chunk)
        for (int s = 0; s < 2; s++) {
            const int m = len[s] - done < chunk ? len[s] - done : chunk;
            if (m <= 0)
                continue;
            for (int i = 0; i < m * KV * D; i++)
                k[i] = frand() * ((i % 97) == 0 ? 6.0f : 1.0f), v[i] = frand();
            assert_int_equal(llmem_kv_append(kv, seq[s], m, k, v), LLMEM_OK);
        }
    const size_t block_bytes = (size_t)llmem_kv_block_bytes(kv);
    struct llmem_kv_stats st;
    llmem_kv_stats(kv, &st);
    uint8_t *pool = calloc((size_t)st.n_blocks, block_bytes);
    const int stride = (most + 15) / 16, tq = llmem_cuda_prefill_tile_queries(H / KV, mblocks);
    const int n_tiles = (n[0] + tq - 1) / tq + (n[1] + tq - 1) / tq;
    int32_t *ints = calloc((size_t)(2 * stride + 4 * n_tiles), sizeof(int32_t));
    struct llmem_cuda_prefill_tile *tiles = (struct llmem_cuda_prefill_tile *)(ints + 2 * stride);
    int t = 0;
    for (int s = 0; s < 2; s++) {
        const int64_t *ids;
        const int nb = (int)llmem_kv_seq_blocks(kv, seq[s], &ids);
        for (int i = 0; i < nb; i++) {
            llmem_kv_block_copy_out(kv, ids[i], pool + (size_t)ids[i] * block_bytes);
            ints[s * stride + i] = (int32_t)ids[i];
        }
        const int q0 = s == 0 ? 0 : n[0];
        for (int i = ((n[s] - 1) / tq) * tq; i >= 0; i -= tq)
            tiles[t++] = (struct llmem_cuda_prefill_tile){
                q0 + i, n[s] - i < tq ? n[s] - i : tq, len[s] - n[s] + i, s};
    }
    const size_t n_out = (size_t)(n[0] + n[1]) * H * D;
    float *q = malloc(n_out * sizeof(float)), *ref = malloc(n_out * sizeof(float));
    for (size_t i = 0; i < n_out; i++)
        q[i] = 2.0f * frand();
    struct llmem_kv_attn attn = {.n_heads = H};
    for (int s = 0; s < 2; s++) {
        const size_t at = s == 0 ? 0 : (size_t)n[0] * H * D;
        assert_int_equal(llmem_kv_attend(kv, seq[s], 0, len[s] - n[s], n[s], q + at, ref + at,
                                         &attn),
                         LLMEM_OK);
    }
    void *d_pool, *d_q, *d_ints, *d_out;
    const size_t ints_bytes = (size_t)(2 * stride + 4 * n_tiles) * sizeof(int32_t);
    CU(cudaMalloc(&d_pool, (size_t)st.n_blocks * block_bytes));
    CU(cudaMalloc(&d_q, n_out * sizeof(float)));
    CU(cudaMalloc(&d_ints, ints_bytes));
    CU(cudaMalloc(&d_out, n_out * sizeof(float)));
    CU(cudaMemcpy(d_pool, pool, (size_t)st.n_blocks * block_bytes, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_q, q, n_out * sizeof(float), cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d_ints, ints, ints_bytes, cudaMemcpyHostToDevice));
    CU(cudaMemset(d_out, 0xff, n_out * sizeof(float))); /* NaN: every output must be written */
    const struct llmem_cuda_prefill p = {
        .format = format,
        .n_heads = H,
        .n_kv_heads = KV,
        .head_dim = D,
        .block_size = 16,
        .q = d_q,
        .out = d_out,
        .k_pool = d_pool,
        .v_pool = (uint8_t *)d_pool + block_bytes / 2,
        .k_block_stride = (int64_t)block_bytes,
        .v_block_stride = (int64_t)block_bytes,
        .block_tables = d_ints,
        .table_stride = stride,
        .tiles = (const struct llmem_cuda_prefill_tile *)((const int32_t *)d_ints + 2 * stride),
        .n_tiles = n_tiles,
        .mblocks = mblocks,
        .warp_mma = warp_mma,
    };
    assert_int_equal(llmem_cuda_prefill(&p), LLMEM_OK);
    CU(cudaDeviceSynchronize());
    float *out = malloc(n_out * sizeof(float));
    CU(cudaMemcpy(out, d_out, n_out * sizeof(float), cudaMemcpyDeviceToHost));
    const double worst = worst_rel_error(out, ref, (n[0] + n[1]) * H, D);
    printf("  prefill %-4s heads %2d/%d d %3d: %3d of %4d and %3d of %4d, tiles of %3d, %s: rel "
           "err %.2e\n",
           llmem_kv_format_name(format), H, KV, D, n[0], len[0], n[1], len[1], tq,
           !warp_mma && llmem_cuda_prefill_wgmma(format, D) ? "wgmma" : "mma.sync", worst);
    cudaFree(d_pool), cudaFree(d_q), cudaFree(d_ints), cudaFree(d_out);
    free(out), free(ref), free(q), free(ints), free(pool), free(k), free(v);
    llmem_kv_destroy(kv);
    return worst;
}

/* The prefill kernel: bf16, f16 and q8, GQA 1, 4, 7, 8 and the 8B shape's 32/8, head_dim 64 and
 * 128, warps of 16 and of 32 rows, on the warp-level products and (head_dim 128, 16-bit, on Hopper)
 * on the warpgroup ones; a chunk late in a sequence (partly masked tiles, a partial last tile)
 * beside a whole short prompt; the choice of rows and kernel; then the shapes it refuses. */
static void test_prefill(void **state) {
    (void)state;
    const enum llmem_kv_format formats[] = {LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_F16,
                                            LLMEM_KV_FORMAT_Q8};
    const double bound[] = {1e-2, 2e-3, 3e-3};
    const int groups[][2] = {{4, 4}, {16, 4}, {28, 4}, {16, 2}, {32, 8}};
    const int len[2] = {700, 77}, n[2] = {300, 77};
    for (int warp_mma = 0; warp_mma <= 1; warp_mma++)
        for (int mb = 1; mb <= 2; mb++)
            for (int f = 0; f < 3; f++)
                for (int g = 0; g < 5; g++)
                    for (int d = 64; d <= 128; d += 64) {
                        if (warp_mma && !llmem_cuda_prefill_wgmma(formats[f], d))
                            continue; /* (the first pass ran the warp-level kernel) */
                        assert_true(run_prefill(formats[f], groups[g][0], groups[g][1], d, len, n,
                                                mb, warp_mma) <= bound[f]);
                    }
    /* Hopper (compute capability 9.0) takes the warpgroup kernel for head_dim 128 and 16 bits */
    int dev = 0, major = 0, minor = 0;
    CU(cudaGetDevice(&dev));
    CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    assert_int_equal(llmem_cuda_prefill_wgmma(LLMEM_KV_FORMAT_BF16, 128), major == 9 && minor == 0);
    assert_false(llmem_cuda_prefill_wgmma(LLMEM_KV_FORMAT_BF16, 64));
    assert_false(llmem_cuda_prefill_wgmma(LLMEM_KV_FORMAT_Q8, 128));
    /* a short prompt takes warps of 16 rows, a long chunk of 32 */
    assert_int_equal(llmem_cuda_prefill_mblocks(4, 8, 512), 1);
    assert_int_equal(llmem_cuda_prefill_mblocks(4, 8, 16384), 2);
    struct llmem_cuda_prefill p = {.format = LLMEM_KV_FORMAT_Q4,
                                   .n_heads = 8,
                                   .n_kv_heads = 8,
                                   .head_dim = 128,
                                   .block_size = 16,
                                   .mblocks = 1};
    assert_false(llmem_cuda_prefill_fits(p.format, 8, 8, 128, 16));
    assert_true(llmem_cuda_prefill_fits(LLMEM_KV_FORMAT_Q8, 8, 8, 128, 16));
    assert_int_equal(llmem_cuda_prefill(&p), LLMEM_EINVAL);
    p.format = LLMEM_KV_FORMAT_BF16;
    p.head_dim = 256;
    assert_int_equal(llmem_cuda_prefill(&p), LLMEM_EINVAL);
    p.head_dim = 128;
    p.mblocks = 3;
    assert_int_equal(llmem_cuda_prefill(&p), LLMEM_EINVAL);
    p.mblocks = 1;
    p.out = (float *)(uintptr_t)0x1004;
    assert_int_equal(llmem_cuda_prefill(&p), LLMEM_EINVAL);
}

static void test_rejects(void **state) {
    (void)state;
    struct llmem_cuda_attn a = {.format = LLMEM_KV_FORMAT_F32,
                                .n_heads = 8,
                                .n_kv_heads = 8,
                                .head_dim = 128,
                                .block_size = 16,
                                .batch = 1,
                                .max_len = 16,
                                .table_stride = 1};
    assert_int_equal(llmem_cuda_attn_decode(&a), LLMEM_EINVAL);
    a.format = LLMEM_KV_FORMAT_BF16;
    const struct llmem_backend_kv_rotation rot = {.keys = 1, .values = 1, .norm = 0.125f};
    a.rotation = &rot; /* rotated rows are q4's and tq's alone */
    assert_int_equal(llmem_cuda_attn_decode(&a), LLMEM_EINVAL);
    a.rotation = NULL;
    a.head_dim = 96;
    assert_int_equal(llmem_cuda_attn_decode(&a), LLMEM_EINVAL);
    a.head_dim = 128;
    a.n_heads = 128; /* a group of 16 */
    assert_int_equal(llmem_cuda_attn_decode(&a), LLMEM_EINVAL);
    a.n_heads = 8;
    a.out = (float *)(uintptr_t)0x1004; /* the output off its 16-byte alignment */
    assert_int_equal(llmem_cuda_attn_decode(&a), LLMEM_EINVAL);
    a.out = NULL;
    a.workspace = (void *)(uintptr_t)0x1008;
    assert_int_equal(llmem_cuda_attn_decode(&a), LLMEM_EINVAL);
}

int main(void) {
    if (tu_no_gpu())
        return 77;
    /* every call with counters and at most 32 splits merges them inside the kernel (run_gpu
     * compares that with the merge kernel), whatever the default threshold */
    llmem_option_set(LLMEM_OPT_CUDA_ATTN_FUSE, "256");
    /* the prefill's warpgroup kernel is checked against the CPU wherever the device has it */
    llmem_option_set(LLMEM_OPT_CUDA_PREFILL_WGMMA, "1");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_formats_groups_dims),
        cmocka_unit_test(test_bf16_query_and_dim256),
        cmocka_unit_test(test_shapes),
        cmocka_unit_test(test_chunk_packs),
        cmocka_unit_test(test_prefill),
        cmocka_unit_test(test_rejects),
    };
    return cmocka_run_group_tests_name("cuda attention", tests, NULL, NULL);
}
