/*
 * kv/attention.c — attention over a KV cache, by three routes (SPEC §4.4):
 *   direct       one task per (query, head): a single pass over the visible tokens with an online
 *                softmax (running max m, sum l, accumulator acc rescaled when m grows), folded
 *                partition by partition;
 *   partitioned  the visible range split at absolute multiples of 512 tokens; one task per
 *                (query, head, partition) computes (m_p, l_p, acc_p), and the partitions are
 *                folded in ascending order: m' = max(m, m_p), l' = l·e^(m−m') + l_p·e^(m_p−m'),
 *                acc likewise — the same arithmetic as direct, spread over threads;
 *   fallback     the visible keys and values gathered as f32 rows and the reference (two passes,
 *                double accumulation).
 * Keys are read in their stored domain: a rotated format gets the query rotated once, and values
 * are accumulated rotated with one inverse rotation at the end. The routes differ only by float
 * rounding.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/log.h"
#include "kv/kv_int.h"

#define PARTITION      512
#define PARTITION_FROM 2048
/* floats of fallback scratch per thread: scores, a row, and hd doubles (aligned) */
#define FALLBACK_STRIDE(window, hd) ((window) + 3 * (hd) + 2)

struct attn_job {
    struct llmem_kv *kv;
    int seq, layer, n_heads, group;
    int64_t q_pos, n_q, window, n_parts, first_part;
    const float *q; /* scaled and (for rotated keys) rotated: [n_q, n_heads, hd] */
    float *out;
    float *parts;   /* partitioned: [n_q, n_heads, n_parts, hd + 2] */
    float *scratch; /* fallback: per thread */
};

static void visible(const struct attn_job *j, int64_t i, int64_t *lo, int64_t *hi) {
    *hi = j->q_pos + i;
    *lo = j->window > 0 && *hi - j->window + 1 > 0 ? *hi - j->window + 1 : 0;
}

/* The online-softmax state of one query head over [lo, hi], a range within one partition. */
static void segment(const struct attn_job *j, int kvh, const float *q, int64_t lo, int64_t hi,
                    float *m_out, float *l_out, float *acc) {
    const struct llmem_kv *kv = j->kv;
    const struct llmem_kv_codec *c = &kv->codec;
    const int hd = kv->cfg.head_dim;
    float m = -INFINITY, l = 0;
    memset(acc, 0, (size_t)hd * sizeof(float));
    size_t k_off = (size_t)kvh * c->key_bytes, v_off = (size_t)kvh * c->value_bytes;
    for (int64_t pos = lo; pos <= hi;) {
        uint8_t *kp, *vp;
        int64_t run = llmem_kv_span(kv, j->seq, j->layer, pos, &kp, &vp);
        if (run > hi - pos + 1)
            run = hi - pos + 1;
        for (int64_t t = 0; t < run; t++) {
            float s = llmem_kv_dot_key(c, kp + (size_t)t * kv->k_tok + k_off, q);
            if (s > m) {
                float corr = expf(m - s);
                l *= corr;
                for (int d = 0; d < hd; d++)
                    acc[d] *= corr;
                m = s;
            }
            float p = expf(s - m);
            l += p;
            llmem_kv_axpy_value(c, vp + (size_t)t * kv->v_tok + v_off, p, acc);
        }
        pos += run;
    }
    *m_out = m;
    *l_out = l;
}

/* Folds a partition's state (m_p, l_p, acc_p) into a running one, in ascending order. */
static void fold(int hd, float *m, float *l, float *acc, float m_p, float l_p, const float *acc_p) {
    if (l_p == 0)
        return;
    float top = m_p > *m ? m_p : *m;
    float a = *l > 0 ? expf(*m - top) : 0, b = expf(m_p - top);
    for (int d = 0; d < hd; d++)
        acc[d] = acc[d] * a + acc_p[d] * b;
    *l = *l * a + l_p * b;
    *m = top;
}

/* One pass over [lo, hi]: the state of one query head, built partition by partition (the same
 * 512-token partitions and the same folding as the partitioned route, so the routes agree). */
static void partial(const struct attn_job *j, int kvh, const float *q, int64_t lo, int64_t hi,
                    float *m_out, float *l_out, float *acc) {
    const int hd = j->kv->cfg.head_dim;
    float part[1024], m = -INFINITY, l = 0;
    memset(acc, 0, (size_t)hd * sizeof(float));
    for (int64_t p_lo = lo; p_lo <= hi;) {
        int64_t p_hi = (p_lo / PARTITION + 1) * PARTITION - 1;
        if (p_hi > hi)
            p_hi = hi;
        float m_p, l_p;
        segment(j, kvh, q, p_lo, p_hi, &m_p, &l_p, part);
        fold(hd, &m, &l, acc, m_p, l_p, part);
        p_lo = p_hi + 1;
    }
    *m_out = m;
    *l_out = l;
}

static void finish(const struct llmem_kv *kv, float *out, const float *acc, float l) {
    const int hd = kv->cfg.head_dim;
    for (int d = 0; d < hd; d++)
        out[d] = l > 0 ? acc[d] / l : 0;
    if (kv->codec.rotate_values)
        llmem_kv_rotate_inverse(&kv->codec, out);
}

static void direct_task(void *arg, int task, int thread) {
    (void)thread;
    const struct attn_job *j = arg;
    int64_t i = task / j->n_heads;
    int h = task % j->n_heads;
    int64_t lo, hi;
    visible(j, i, &lo, &hi);
    size_t row = ((size_t)i * (size_t)j->n_heads + (size_t)h) * (size_t)j->kv->cfg.head_dim;
    float m, l;
    partial(j, h / j->group, j->q + row, lo, hi, &m, &l, j->out + row);
    finish(j->kv, j->out + row, j->out + row, l);
}

static void partition_task(void *arg, int task, int thread) {
    (void)thread;
    const struct attn_job *j = arg;
    const int hd = j->kv->cfg.head_dim;
    int64_t p = task % j->n_parts, ih = task / j->n_parts;
    int64_t i = ih / j->n_heads;
    int h = (int)(ih % j->n_heads);
    float *slot = j->parts + (size_t)task * (size_t)(hd + 2);
    int64_t lo, hi;
    visible(j, i, &lo, &hi);
    int64_t p_lo = (j->first_part + p) * PARTITION, p_hi = p_lo + PARTITION - 1;
    if (p_lo < lo)
        p_lo = lo;
    if (p_hi > hi)
        p_hi = hi;
    if (p_lo > p_hi) {
        slot[hd] = -INFINITY; /* empty: contributes nothing */
        slot[hd + 1] = 0;
        return;
    }
    size_t row = ((size_t)i * (size_t)j->n_heads + (size_t)h) * (size_t)hd;
    segment(j, h / j->group, j->q + row, p_lo, p_hi, &slot[hd], &slot[hd + 1], slot);
}

static void merge_task(void *arg, int task, int thread) {
    (void)thread;
    const struct attn_job *j = arg;
    const int hd = j->kv->cfg.head_dim;
    const float *parts = j->parts + (size_t)task * (size_t)j->n_parts * (size_t)(hd + 2);
    float *out = j->out + (size_t)task * (size_t)hd;
    float m = -INFINITY, l = 0;
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int64_t p = 0; p < j->n_parts; p++) {
        const float *slot = parts + p * (hd + 2);
        fold(hd, &m, &l, out, slot[hd], slot[hd + 1], slot);
    }
    finish(j->kv, out, out, l);
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

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int llmem_kv_attend(struct llmem_kv *kv, int seq, int layer, int64_t q_pos, int64_t n_q,
                    const float *q, float *out, const struct llmem_kv_attn *attn) {
    const struct kv_seq *s = &kv->seqs[seq];
    const int hd = kv->cfg.head_dim, n_heads = attn->n_heads;
    LLMEM_ASSERT(seq >= 0 && seq < kv->cfg.max_sequences && s->used);
    LLMEM_ASSERT(layer >= 0 && layer < kv->cfg.n_layers && q_pos >= 0 && n_q > 0);
    LLMEM_ASSERT(q_pos + n_q <= s->length);
    LLMEM_ASSERT(n_heads > 0 && n_heads % kv->cfg.n_kv_heads == 0);
    int64_t t0 = now_ns();
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
        route = span >= PARTITION_FROM || (n_q * n_heads < threads && span > PARTITION)
                    ? LLMEM_KV_ROUTE_PARTITIONED
                    : LLMEM_KV_ROUTE_DIRECT;

    size_t work = q_floats;
    if (route == LLMEM_KV_ROUTE_PARTITIONED) {
        j.first_part = lo0 / PARTITION;
        j.n_parts = hi1 / PARTITION - j.first_part + 1;
        work += (size_t)n_q * (size_t)n_heads * (size_t)j.n_parts * (size_t)(hd + 2);
    } else if (route == LLMEM_KV_ROUTE_FALLBACK) {
        int64_t window = attn->window > 0 ? attn->window : q_pos + n_q;
        work += (size_t)threads * (size_t)FALLBACK_STRIDE(window, hd);
    }
    float *ws = llmem_mem_alloc(kv->mem, work * sizeof(float), LLMEM_TAG_SCRATCH);
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
    switch (route) {
    case LLMEM_KV_ROUTE_PARTITIONED:
        j.parts = ws + q_floats;
        llmem_pool_run(kv->pool, (int)(tasks * j.n_parts), partition_task, &j);
        llmem_pool_run(kv->pool, tasks, merge_task, &j);
        kv->st.route_partitioned++;
        break;
    case LLMEM_KV_ROUTE_FALLBACK:
        j.scratch = ws + q_floats;
        llmem_pool_run(kv->pool, tasks, fallback_task, &j);
        kv->st.route_fallback++;
        break;
    default: llmem_pool_run(kv->pool, tasks, direct_task, &j); kv->st.route_direct++;
    }
    llmem_mem_free(kv->mem, ws);
    kv->st.attend_ns += now_ns() - t0;
    return LLMEM_OK;
}
