/*
 * kv/attention.c — attention over a KV cache, by three routes (SPEC §4.4):
 *   direct       one task per query: a single pass over the visible tokens with an online
 *                softmax per head (running max m, sum l, accumulator acc rescaled when m grows),
 *                folded partition by partition;
 *   partitioned  the visible range split at absolute multiples of 512 tokens; one task per
 *                (query, partition) computes (m_p, l_p, acc_p) per head, and the partitions are
 *                merged in ascending order against their largest maximum M:
 *                out = Σ e^(m_p−M)·acc_p / Σ e^(m_p−M)·l_p — direct's arithmetic up to rounding,
 *                spread over threads;
 *   fallback     the visible keys and values gathered as f32 rows and the reference (two passes,
 *                double accumulation).
 * A task reads each token's keys and values (all KV heads, contiguous in every layout) once, in
 * storage order, and each KV head's row serves its whole GQA group. Keys are read in their stored
 * domain: a rotated format gets the query rotated once, and values are accumulated rotated with one
 * inverse rotation at the end. The routes differ only by float rounding.
 * Where the kernels have one (AVX2 and AVX-512, every format and group), a tile of 16 tokens of
 * one KV head is two calls for four (or two, or one) query heads: scores with the softmax, then
 * values (attn_tile in kv/codec_internal.h), and the values of each call wait until the scores of
 * the next have been issued; otherwise scores come from dot_group per token and values from
 * axpy_tile. The next tile's bytes are prefetched while a tile is computed (direct: across its
 * partitions' boundaries too).
 */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "backend/ops.h"
#include "core/clock.h"
#include "core/log.h"
#include "kv/codec_internal.h"
#include "kv/kv_int.h"

#define PARTITION      512
#define PARTITION_FROM 2048
/* direct splits the KV heads over threads from this many multiply-adds (span × heads × hd) */
#define DIRECT_SPLIT_MIN (1 << 16)
/* fewer queries than threads take the partitioned route from this many (and over PARTITION
 * tokens): splitting by tokens streams whole rows, split KV heads read half-rows (whose
 * neighbouring halves the other core's prefetchers fetch too); below it a second dispatch (the
 * merge) costs more than it saves */
#define PARTITION_SPLIT_MIN (1 << 20)
#define TILE                LLMEM_KV_TILE /* tokens scored and accumulated together */
/* floats of fallback scratch per thread: scores, a row, and hd doubles (aligned) */
#define FALLBACK_STRIDE(window, hd) ((window) + 3 * (hd) + 2)

struct attn_job {
    struct llmem_kv *kv;
    int seq, layer, n_heads, group;
    int kv_split; /* direct: each query's KV heads in this many contiguous ranges, one task each */
    int64_t q_pos, n_q, window, n_parts, first_part;
    const float *q; /* scaled and (for rotated keys) rotated: [n_q, n_heads, hd] */
    float *out;
    float *parts;   /* partitioned: [n_q, n_heads, n_parts, hd + 2] */
    float *scratch; /* per thread: direct and partitioned HEADS_STRIDE, fallback FALLBACK_STRIDE */
};

/* Per-thread scratch of direct and partitioned: one partition's state for every head (acc, m, l),
 * and direct's running m and l per head. A tile rewrites its heads' state, so each thread's slice
 * starts on its own 4 KiB page and 16 KiB lie between slices: with slices back to back, the stream
 * prefetcher of the core writing one slice runs on into the next and takes its lines from the core
 * that is writing them (two threads at 32K tokens: 30 → 46 GB/s). */
#define PAGE_FLOATS       1024
#define THREAD_GAP_FLOATS 4096
#define HEADS_STRIDE(n_heads, hd)                                                                  \
    ((((size_t)(n_heads) * (size_t)((hd) + 4) + PAGE_FLOATS - 1) & ~(size_t)(PAGE_FLOATS - 1)) +   \
     THREAD_GAP_FLOATS)

static void visible(const struct attn_job *j, int64_t i, int64_t *lo, int64_t *hi) {
    *hi = j->q_pos + i;
    *lo = j->window > 0 && *hi - j->window + 1 > 0 ? *hi - j->window + 1 : 0;
}

/* Share i of n of the `total` bytes at base to prefetch: the same slice of each of their pages,
 * whole lines, the n slices together covering every page once (struct llmem_kv_prefetch). */
static struct llmem_kv_prefetch pf_share(const uint8_t *base, size_t total, int i, int n) {
    const size_t slice = ((LLMEM_KV_PF_PAGE + (size_t)n - 1) / (size_t)n + 63) & ~(size_t)63;
    struct llmem_kv_prefetch pf = {base, total, (size_t)i * slice, slice};
    if (base == NULL || pf.off >= LLMEM_KV_PF_PAGE)
        pf.len = 0;
    else if (pf.off + slice > LLMEM_KV_PF_PAGE)
        pf.len = LLMEM_KV_PF_PAGE - pf.off;
    return pf;
}

/* All of a share's lines at once (the routes without tile kernels). */
static void prefetch_share(struct llmem_kv_prefetch pf) {
    for (size_t page = 0; pf.len > 0 && page + pf.off < pf.bytes; page += LLMEM_KV_PF_PAGE)
        for (size_t x = page + pf.off; x < page + pf.off + pf.len && x < pf.bytes; x += 64)
            __builtin_prefetch(pf.at + x, 0, 3);
}

/* The online-softmax state over [lo, hi] (within one partition) of the query heads of KV heads
 * [kv0, kv1) of one query: q holds its n_heads rows; state h is acc at st + h·(hd+2), then m, l.
 * Tokens are read in storage order, each token's K and V rows once, and a KV head's row serves its
 * whole GQA group. A head's state is the same whichever other heads are computed with it.
 * pf_hi ≥ hi: the caller goes on with the tokens up to pf_hi next, so the last tile prefetches
 * the first of them. */
static void segment(const struct attn_job *j, const float *q, int64_t lo, int64_t hi, float *st,
                    int kv0, int kv1, int64_t pf_hi) {
    const struct llmem_kv *kv = j->kv;
    const struct llmem_kv_codec *c = &kv->codec;
    const int hd = kv->cfg.head_dim, group = j->group, n_kv = j->n_heads / group;
    const size_t hs = (size_t)(hd + 2);
    /* The tile kernels serve four query heads a call, then two, then one: a GQA group of 4k + r
     * takes k calls of four, and one of two and one of one as r needs. */
    const struct llmem_kv_kernels *kk = llmem_kv_kernels();
    const struct llmem_kv_attn_tile *t4 = &kk->attn_tile[c->format],
                                    *t2 = &kk->attn_tile2[c->format],
                                    *t1 = &kk->attn_tile1[c->format];
    const bool tiled = (group < 4 || t4->scores != NULL) && (group % 4 < 2 || t2->scores != NULL) &&
                       (group % 2 == 0 || t1->scores != NULL);
    /* The values of the last tile call still to do: they run after the next call's scores. */
    struct {
        const struct llmem_kv_attn_tile *fn;
        const uint8_t *v;
        int T;
        float *st;
        struct llmem_kv_prefetch pf;
    } held = {NULL, NULL, 0, NULL, {NULL, 0, 0, 0}};
    float sc[2][LLMEM_KV_TILE_SC] __attribute__((aligned(64)));
    int cur = 0;
    for (int h = kv0 * group; h < kv1 * group; h++) {
        float *sh = st + (size_t)h * hs;
        memset(sh, 0, (size_t)hd * sizeof(float));
        sh[hd] = -INFINITY;
        sh[hd + 1] = 0;
    }
    uint8_t *kp, *vp;
    int64_t run = llmem_kv_span(kv, j->seq, j->layer, lo, &kp, &vp);
    for (int64_t pos = lo; pos <= hi;) {
        if (run > hi - pos + 1)
            run = hi - pos + 1;
        /* The next run (the next block of a paged cache), looked up ahead for the prefetches. */
        uint8_t *nkp = NULL, *nvp = NULL;
        int64_t nrun =
            pos + run <= pf_hi ? llmem_kv_span(kv, j->seq, j->layer, pos + run, &nkp, &nvp) : 0;
        /* Tiles of up to TILE tokens: scores for the tile, one softmax rescale per tile, and the
         * values accumulated with the accumulators held across the tile. */
        for (int64_t t0 = 0; t0 < run; t0 += TILE) {
            int T = run - t0 < TILE ? (int)(run - t0) : TILE;
            const uint8_t *ktile = kp + (size_t)t0 * kv->k_tok,
                          *vtile = vp + (size_t)t0 * kv->v_tok;
            /* The next tile's K and V bytes, prefetched a share (1 / n_kv of each page) per KV
             * head while this tile is computed (by the tile kernels, spread over their loops): a
             * tile reads its rows with a stride of a token, which the hardware prefetchers do not
             * follow far enough ahead. */
            const uint8_t *pk = NULL, *pv = NULL;
            int64_t pT = 0;
            if (t0 + TILE < run) {
                pk = ktile + (size_t)TILE * kv->k_tok, pv = vtile + (size_t)TILE * kv->v_tok;
                pT = run - t0 - TILE;
            } else if (nrun > 0) {
                pk = nkp, pv = nvp, pT = nrun;
            }
            pT = pT < TILE ? pT : TILE;
            const size_t pk_bytes = (size_t)pT * kv->k_tok, pv_bytes = (size_t)pT * kv->v_tok;
            if (tiled) {
                for (int kvh = kv0; kvh < kv1; kvh++) {
                    struct llmem_kv_prefetch pfk = pf_share(pk, pk_bytes, kvh, n_kv),
                                             pfv = pf_share(pv, pv_bytes, kvh, n_kv);
                    const uint8_t *kh = ktile + (size_t)kvh * c->key_bytes,
                                  *vh = vtile + (size_t)kvh * c->value_bytes;
                    const size_t h0 = (size_t)kvh * (size_t)group;
                    for (int g = 0, size; g < group; g += size) { /* the first call prefetches */
                        size = group - g >= 4 ? 4 : group - g >= 2 ? 2 : 1;
                        const struct llmem_kv_attn_tile *fn = size == 4 ? t4 : size == 2 ? t2 : t1;
                        struct llmem_kv_prefetch none = {NULL, 0, 0, 0};
                        float *sg = st + (h0 + (size_t)g) * hs;
                        fn->scores(kh, kv->k_tok, T, q + (h0 + (size_t)g) * (size_t)hd, hd, sg, hs,
                                   sc[cur], g == 0 ? pfk : none);
                        if (held.fn != NULL)
                            held.fn->values(held.v, kv->v_tok, held.T, sc[cur ^ 1], hd, held.st, hs,
                                            held.pf);
                        held.fn = fn, held.v = vh, held.T = T, held.st = sg;
                        held.pf = g == 0 ? pfv : none;
                        cur ^= 1;
                    }
                }
                continue;
            }
            for (int kvh = kv0; kvh < kv1; kvh++) {
                float s[TILE][64], w[64 * TILE];
                prefetch_share(pf_share(pk, pk_bytes, kvh, n_kv));
                prefetch_share(pf_share(pv, pv_bytes, kvh, n_kv));
                float *sg = st + (size_t)kvh * (size_t)group * hs;
                const float *qg = q + (size_t)kvh * (size_t)group * (size_t)hd;
                for (int t = 0; t < T; t++)
                    llmem_kv_dot_key_group(
                        c, ktile + (size_t)t * kv->k_tok + (size_t)kvh * c->key_bytes, qg, group,
                        s[t]);
                for (int g = 0; g < group; g++) {
                    float *sh = sg + (size_t)g * hs, top = sh[hd];
                    for (int t = 0; t < T; t++)
                        top = s[t][g] > top ? s[t][g] : top;
                    if (top > sh[hd]) {
                        float corr = expf(sh[hd] - top);
                        sh[hd + 1] *= corr;
                        for (int d = 0; d < hd; d++)
                            sh[d] *= corr;
                        sh[hd] = top;
                    }
                    float sum = 0;
                    for (int t = 0; t < T; t++) {
                        w[g * T + t] = expf(s[t][g] - top);
                        sum += w[g * T + t];
                    }
                    sh[hd + 1] += sum;
                }
                llmem_kv_axpy_value_tile(c, vtile + (size_t)kvh * c->value_bytes, kv->v_tok, T, w,
                                         group, sg, hs);
            }
        }
        pos += run;
        kp = nkp, vp = nvp, run = nrun;
    }
    if (held.fn != NULL)
        held.fn->values(held.v, kv->v_tok, held.T, sc[cur ^ 1], hd, held.st, hs, held.pf);
}

/* Folds a partition's state (acc_p, m_p, l_p at p[hd], p[hd+1]) into a running one, in
 * ascending order: m' = max(m, m_p), l' = l·e^(m−m') + l_p·e^(m_p−m'), acc likewise. */
static void fold(int hd, float *m, float *l, float *acc, const float *p) {
    float m_p = p[hd], l_p = p[hd + 1];
    if (l_p == 0)
        return;
    float top = m_p > *m ? m_p : *m;
    float a = *l > 0 ? expf(*m - top) : 0, b = expf(m_p - top);
    for (int d = 0; d < hd; d++)
        acc[d] = acc[d] * a + p[d] * b;
    *l = *l * a + l_p * b;
    *m = top;
}

static void finish(const struct llmem_kv *kv, float *out, float l) {
    const int hd = kv->cfg.head_dim;
    for (int d = 0; d < hd; d++)
        out[d] = l > 0 ? out[d] / l : 0;
    if (kv->codec.rotate_values)
        llmem_kv_rotate_inverse(&kv->codec, out);
}

/* direct: task = (query, range of KV heads); one pass, partition by partition, folded as it
 * goes. */
static void direct_task(void *arg, int task, int thread) {
    const struct attn_job *j = arg;
    const int hd = j->kv->cfg.head_dim, n_heads = j->n_heads, n_kv = n_heads / j->group;
    int64_t i = task / j->kv_split, lo, hi;
    const int part = task % j->kv_split;
    const int kv0 = part * n_kv / j->kv_split, kv1 = (part + 1) * n_kv / j->kv_split;
    const int h0 = kv0 * j->group, h1 = kv1 * j->group;
    visible(j, i, &lo, &hi);
    size_t row = (size_t)i * (size_t)n_heads * (size_t)hd;
    float *st = j->scratch + (size_t)thread * HEADS_STRIDE(n_heads, hd);
    float *m = st + (size_t)n_heads * (size_t)(hd + 2), *l = m + n_heads;
    float *out = j->out + row;
    memset(out + (size_t)h0 * (size_t)hd, 0, (size_t)(h1 - h0) * (size_t)hd * sizeof(float));
    for (int h = h0; h < h1; h++)
        m[h] = -INFINITY, l[h] = 0;
    for (int64_t p_lo = lo; p_lo <= hi;) {
        int64_t p_hi = (p_lo / PARTITION + 1) * PARTITION - 1;
        if (p_hi > hi)
            p_hi = hi;
        segment(j, j->q + row, p_lo, p_hi, st, kv0, kv1, hi);
        for (int h = h0; h < h1; h++)
            fold(hd, &m[h], &l[h], out + (size_t)h * (size_t)hd, st + (size_t)h * (size_t)(hd + 2));
        p_lo = p_hi + 1;
    }
    for (int h = h0; h < h1; h++)
        finish(j->kv, out + (size_t)h * (size_t)hd, l[h]);
}

/* partitioned: task = (query, partition); the states of every head land in j->parts. */
static void partition_task(void *arg, int task, int thread) {
    const struct attn_job *j = arg;
    const int hd = j->kv->cfg.head_dim, n_heads = j->n_heads;
    int64_t p = task % j->n_parts, i = task / j->n_parts;
    int64_t lo, hi;
    visible(j, i, &lo, &hi);
    int64_t p_lo = (j->first_part + p) * PARTITION, p_hi = p_lo + PARTITION - 1;
    p_lo = p_lo < lo ? lo : p_lo;
    p_hi = p_hi > hi ? hi : p_hi;
    float *st = j->scratch + (size_t)thread * HEADS_STRIDE(n_heads, hd);
    if (p_lo <= p_hi) {
        segment(j, j->q + (size_t)i * (size_t)n_heads * (size_t)hd, p_lo, p_hi, st, 0,
                j->n_heads / j->group, p_hi);
    } else {
        for (int h = 0; h < n_heads; h++) { /* empty: contributes nothing */
            st[(size_t)h * (size_t)(hd + 2) + (size_t)hd] = -INFINITY;
            st[(size_t)h * (size_t)(hd + 2) + (size_t)hd + 1] = 0;
        }
    }
    for (int h = 0; h < n_heads; h++) {
        size_t head = (size_t)i * (size_t)n_heads + (size_t)h;
        float *slot = j->parts + (head * (size_t)j->n_parts + (size_t)p) * (size_t)(hd + 2);
        memcpy(slot, st + (size_t)h * (size_t)(hd + 2), (size_t)(hd + 2) * sizeof(float));
    }
}

/* merge: task = (query, head); the partitions weighed against their largest maximum M, in
 * ascending order: out = Σ e^(m_p − M)·acc_p / Σ e^(m_p − M)·l_p (one exponential a partition). */
static void merge_task(void *arg, int task, int thread) {
    (void)thread;
    const struct attn_job *j = arg;
    const int hd = j->kv->cfg.head_dim;
    const size_t hs = (size_t)(hd + 2);
    const float *parts = j->parts + (size_t)task * (size_t)j->n_parts * hs;
    float *out = j->out + (size_t)task * (size_t)hd;
    float top = -INFINITY, l = 0;
    for (int64_t p = 0; p < j->n_parts; p++) {
        /* the partials have left the caches while the KV streamed through them: asked for
         * all at once here, not line by line below */
        for (size_t x = 0; x < hs * sizeof(float); x += 64)
            __builtin_prefetch((const char *)(parts + p * hs) + x, 0, 3);
        if (parts[p * hs + hd + 1] > 0 && parts[p * hs + hd] > top)
            top = parts[p * hs + hd];
    }
    void (*axpy)(const uint8_t *, float, float *, int) =
        llmem_kv_kernels()->axpy[LLMEM_KV_FORMAT_F32];
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int64_t p = 0; p < j->n_parts; p++) {
        const float *acc = parts + p * hs;
        if (acc[hd + 1] == 0)
            continue;
        const float w = expf(acc[hd] - top);
        l += acc[hd + 1] * w;
        axpy((const uint8_t *)acc, w, out, hd);
    }
    finish(j->kv, out, l);
}

static void fallback_task(void *arg, int task, int thread) {
    const struct attn_job *j = arg;
    const struct llmem_kv *kv = j->kv;
    const struct llmem_kv_codec *c = &kv->codec;
    const int hd = kv->cfg.head_dim;
    int64_t i = task / j->n_heads;
    int h = task % j->n_heads, kvh = h / j->group;
    int64_t lo, hi;
    visible(j, i, &lo, &hi);
    int64_t n = hi - lo + 1, window = j->window > 0 ? j->window : j->q_pos + j->n_q;
    /* per-thread scratch: scores (window), one decoded row (hd), a double accumulator (hd) */
    float *scores = j->scratch + (size_t)thread * (size_t)FALLBACK_STRIDE(window, hd);
    float *row = scores + window;
    double *acc = (double *)(((uintptr_t)(row + hd) + 7) & ~(uintptr_t)7);
    memset(acc, 0, (size_t)hd * sizeof(double));
    const float *q = j->q + ((size_t)i * (size_t)j->n_heads + (size_t)h) * (size_t)hd;
    double m = -INFINITY, l = 0;
    for (int64_t t = 0; t < n; t++) {
        uint8_t *kp, *vp;
        llmem_kv_span(kv, j->seq, j->layer, lo + t, &kp, &vp);
        llmem_kv_decode_key(c, kp + (size_t)kvh * c->key_bytes, row);
        double s = 0;
        for (int d = 0; d < hd; d++)
            s += (double)q[d] * row[d];
        scores[t] = (float)s;
        if (s > m)
            m = s;
    }
    for (int64_t t = 0; t < n; t++) {
        uint8_t *kp, *vp;
        llmem_kv_span(kv, j->seq, j->layer, lo + t, &kp, &vp);
        llmem_kv_decode_value(c, vp + (size_t)kvh * c->value_bytes, row);
        double p = exp((double)scores[t] - m);
        l += p;
        for (int d = 0; d < hd; d++)
            acc[d] += p * row[d];
    }
    float *out = j->out + ((size_t)i * (size_t)j->n_heads + (size_t)h) * (size_t)hd;
    for (int d = 0; d < hd; d++)
        out[d] = (float)(acc[d] / l);
    if (c->rotate_values)
        llmem_kv_rotate_inverse(c, out);
}

/* The fields of a device attention call that do not depend on the sequence. */
static struct llmem_backend_paged_attn device_attn(const struct llmem_kv *kv, int layer,
                                                   const struct llmem_kv_attn *attn, const float *q,
                                                   float *out) {
    const int hd = kv->cfg.head_dim;
    return (struct llmem_backend_paged_attn){.format = kv->cfg.format,
                                             .rotation = llmem_kv_device_rotation(kv),
                                             .n_heads = attn->n_heads,
                                             .n_kv_heads = kv->cfg.n_kv_heads,
                                             .head_dim = hd,
                                             .block_size = kv->cfg.block_size,
                                             .k_pool = kv->k_pool[layer],
                                             .v_pool = kv->v_pool[layer],
                                             .k_tok = kv->k_tok,
                                             .v_tok = kv->v_tok,
                                             .key_bytes = kv->codec.key_bytes,
                                             .value_bytes = kv->codec.value_bytes,
                                             .window = attn->window,
                                             .scale = attn->scale > 0 ? attn->scale
                                                                      : 1.0f / sqrtf((float)hd),
                                             .q = q,
                                             .out = out};
}

int llmem_kv_attend_last(struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q, int layer,
                         const float *q, float *out, const struct llmem_kv_attn *attn) {
    LLMEM_ASSERT(llmem_kv_step_is(kv, n, seqs, n_q));
    const size_t row = (size_t)attn->n_heads * (size_t)kv->cfg.head_dim;
    const struct llmem_backend *d = llmem_kv_layer_device(kv, layer);
    if (d == NULL || attn->window > 0) {
        size_t at = 0;
        for (int i = 0; i < n; i++) {
            const int64_t m = n_q != NULL ? n_q[i] : 1;
            const int64_t pos = llmem_kv_seq_length(kv, seqs[i]) - m;
            int status =
                llmem_kv_attend(kv, seqs[i], layer, pos, m, q + at * row, out + at * row, attn);
            if (status != LLMEM_OK)
                return status;
            at += (size_t)m;
        }
        return LLMEM_OK;
    }
    const struct llmem_backend_paged_attn a = device_attn(kv, layer, attn, q, out);
    d->ops->kv_attend_last(d->ctx, &a, n, kv->step_blocks, kv->step_lengths, n_q);
    KV_COUNT(kv, route_device, n);
    return LLMEM_OK;
}

int llmem_kv_attend(struct llmem_kv *kv, int seq, int layer, int64_t q_pos, int64_t n_q,
                    const float *q, float *out, const struct llmem_kv_attn *attn) {
    const struct kv_seq *s = &kv->seqs[seq];
    const int hd = kv->cfg.head_dim, n_heads = attn->n_heads;
    LLMEM_ASSERT(seq >= 0 && seq < kv->cfg.max_sequences && s->used);
    LLMEM_ASSERT(layer >= 0 && layer < kv->cfg.n_layers && q_pos >= 0 && n_q > 0);
    LLMEM_ASSERT(q_pos + n_q <= s->length);
    LLMEM_ASSERT(n_heads > 0 && n_heads % kv->cfg.n_kv_heads == 0 &&
                 n_heads / kv->cfg.n_kv_heads <= 64);
    const uint64_t t0 = llmem_clock_ns();
    if (kv->cfg.device != NULL) { /* on the device that holds the pool */
        const struct llmem_backend *d = llmem_kv_layer_device(kv, layer);
        struct llmem_backend_paged_attn a = device_attn(kv, layer, attn, q, out);
        a.blocks = s->table;
        a.n_blocks = (q_pos + n_q + kv->cfg.block_size - 1) / kv->cfg.block_size;
        a.q_pos = q_pos;
        a.n_q = n_q;
        d->ops->kv_attend(d->ctx, &a);
        KV_COUNT(kv, route_device, 1);
        return LLMEM_OK;
    }
    struct attn_job j = {.kv = kv,
                         .seq = seq,
                         .layer = layer,
                         .n_heads = n_heads,
                         .group = n_heads / kv->cfg.n_kv_heads,
                         .q_pos = q_pos,
                         .n_q = n_q,
                         .window = attn->window,
                         .out = out};
    float scale = attn->scale > 0 ? attn->scale : 1.0f / sqrtf((float)hd);
    size_t q_floats = (size_t)n_q * (size_t)n_heads * (size_t)hd;

    /* The visible range over all queries decides the route. */
    int64_t lo0, hi0, lo1, hi1;
    visible(&j, 0, &lo0, &hi0);
    visible(&j, n_q - 1, &lo1, &hi1);
    int64_t span = hi1 - lo0 + 1;
    int threads = llmem_pool_threads(kv->pool);
    enum llmem_kv_route route = attn->route;
    if (route == LLMEM_KV_ROUTE_AUTO)
        route = span >= PARTITION_FROM || (n_q < threads && span > PARTITION &&
                                           span * n_heads * hd >= PARTITION_SPLIT_MIN)
                    ? LLMEM_KV_ROUTE_PARTITIONED
                    : LLMEM_KV_ROUTE_DIRECT;

    size_t work = q_floats + PAGE_FLOATS; /* the scratch starts on a page */
    if (route == LLMEM_KV_ROUTE_FALLBACK) {
        int64_t window = attn->window > 0 ? attn->window : q_pos + n_q;
        work += (size_t)threads * (size_t)FALLBACK_STRIDE(window, hd);
    } else {
        work += (size_t)threads * HEADS_STRIDE(n_heads, hd);
    }
    if (route == LLMEM_KV_ROUTE_PARTITIONED) {
        j.first_part = lo0 / PARTITION;
        j.n_parts = hi1 / PARTITION - j.first_part + 1;
        work += (size_t)n_q * (size_t)n_heads * (size_t)j.n_parts * (size_t)(hd + 2);
    }
    struct llmem_mem *mem = llmem_kv_layer_mem(kv, layer);
    float *ws = llmem_mem_alloc(mem, work * sizeof(float), LLMEM_TAG_SCRATCH);
    if (ws == NULL)
        return LLMEM_ENOMEM;
    float *qs = ws;
    for (size_t x = 0; x < q_floats; x++)
        qs[x] = q[x] * scale;
    if (kv->codec.rotate_keys)
        for (size_t r = 0; r < q_floats; r += (size_t)hd)
            llmem_kv_rotate(&kv->codec, qs + r);
    j.q = qs;

    int tasks = (int)(n_q * n_heads);
    j.scratch = (float *)(((uintptr_t)(ws + q_floats) + 4 * PAGE_FLOATS - 1) &
                          ~(uintptr_t)(4 * PAGE_FLOATS - 1));
    switch (route) {
    case LLMEM_KV_ROUTE_PARTITIONED:
        j.parts = j.scratch + (size_t)threads * HEADS_STRIDE(n_heads, hd);
        llmem_pool_run(kv->pool, (int)(n_q * j.n_parts), partition_task, &j);
        llmem_pool_run(kv->pool, tasks, merge_task, &j);
        KV_COUNT(kv, route_partitioned, 1);
        break;
    case LLMEM_KV_ROUTE_FALLBACK:
        llmem_pool_run(kv->pool, tasks, fallback_task, &j);
        KV_COUNT(kv, route_fallback, 1);
        break;
    default:
        /* Fewer queries than threads (decode): the KV heads split too, when the work pays for a
         * dispatch. */
        j.kv_split = 1;
        if (n_q < threads && span * n_heads * hd >= DIRECT_SPLIT_MIN) {
            int n_kv = n_heads / j.group, want = (int)((threads + n_q - 1) / n_q);
            j.kv_split = want < n_kv ? want : n_kv;
        }
        llmem_pool_run(kv->pool, (int)n_q * j.kv_split, direct_task, &j);
        KV_COUNT(kv, route_direct, 1);
    }
    llmem_mem_free(mem, ws);
    KV_COUNT(kv, attend_ns, (int64_t)(llmem_clock_ns() - t0));
    return LLMEM_OK;
}
