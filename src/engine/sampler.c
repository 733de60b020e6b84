/*
 * engine/sampler.c — the next token from a row of logits: greedy (temperature 0), or a draw from
 * softmax(logits / temperature) restricted, in this order, to the top-k tokens, the smallest set
 * whose probability reaches top-p, and the tokens at least min-p × the most likely one's
 * probability (the order of transformers' logits processors). The generator is seeded
 * (splitmix64 → xoshiro256**), so a seed gives the same tokens on every run and thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/rng.h"
#include "engine/sampler.h"
#include "llmem/engine.h"

struct llmem_sampler {
    struct llmem_sampling p;
    int64_t vocab;
    uint64_t s[4];
    struct cand {
        float logit;
        int32_t id;
        float prob;
    } * c; /* (vocab) */
};

void llmem_sampling_default(struct llmem_sampling *s) {
    *s = (struct llmem_sampling){.temperature = 0, .top_k = 0, .top_p = 1.0, .min_p = 0, .seed = 0};
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

static uint64_t next_u64(uint64_t *s) {
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

int llmem_sampler_create(const struct llmem_sampling *p, int64_t vocab,
                         struct llmem_sampler **out) {
    if (!(p->temperature >= 0) || p->top_k < 0 || !(p->top_p > 0 && p->top_p <= 1) ||
        !(p->min_p >= 0 && p->min_p <= 1) || vocab <= 0) {
        LLMEM_ERROR("bad sampling parameters: temperature %g (≥ 0), top_k %lld (≥ 0), top_p %g "
                    "(in (0, 1]), min_p %g (in [0, 1])",
                    p->temperature, (long long)p->top_k, p->top_p, p->min_p);
        return LLMEM_EINVAL;
    }
    struct llmem_sampler *s = calloc(1, sizeof(*s));
    if (s != NULL)
        s->c = malloc((size_t)vocab * sizeof(*s->c));
    if (s == NULL || s->c == NULL) {
        free(s);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    s->p = *p;
    s->vocab = vocab;
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->s[i] = llmem_splitmix64_next(&x);
    *out = s;
    return LLMEM_OK;
}

void llmem_sampler_free(struct llmem_sampler *s) {
    if (s == NULL)
        return;
    free(s->c);
    free(s);
}

static int by_logit_desc(const void *a, const void *b) {
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* A draw from s->c[0, n), sorted by logit descending: softmax at the temperature, top-p, min-p. */
static int32_t draw(struct llmem_sampler *s, int64_t n) {
    double sum = 0, inv_t = 1.0 / s->p.temperature;
    for (int64_t i = 0; i < n; i++) {
        double e = exp(((double)s->c[i].logit - (double)s->c[0].logit) * inv_t);
        s->c[i].prob = (float)e;
        sum += e;
    }
    /* top-p: the smallest prefix whose mass reaches top_p (at least one token). */
    double mass = 0;
    int64_t keep = n;
    for (int64_t i = 0; i < n; i++) {
        mass += s->c[i].prob / sum;
        if (mass >= s->p.top_p) {
            keep = i + 1;
            break;
        }
    }
    n = keep;
    /* min-p: relative to the most likely token (prob[0] = 1 before normalization). */
    if (s->p.min_p > 0)
        while (n > 1 && s->c[n - 1].prob < (float)s->p.min_p * s->c[0].prob)
            n--;
    sum = 0;
    for (int64_t i = 0; i < n; i++)
        sum += s->c[i].prob;
    double u = (double)(next_u64(s->s) >> 11) * 0x1p-53 * sum, acc = 0;
    for (int64_t i = 0; i < n; i++) {
        acc += s->c[i].prob;
        if (u < acc)
            return s->c[i].id;
    }
    return s->c[n - 1].id;
}

int64_t llmem_sampling_top_needed(const struct llmem_sampling *p) {
    return p->temperature == 0 || p->top_k == 1 ? 1 : p->top_k;
}

int32_t llmem_sampler_sample(struct llmem_sampler *s, const float *logits) {
    int64_t best = 0;
    for (int64_t i = 1; i < s->vocab; i++)
        if (logits[i] > logits[best])
            best = i;
    if (llmem_sampling_top_needed(&s->p) == 1)
        return (int32_t)best;

    /* Candidates: all tokens, or the top k, sorted by logit. */
    int64_t n = s->vocab;
    for (int64_t i = 0; i < n; i++)
        s->c[i] = (struct cand){.logit = logits[i], .id = (int32_t)i};
    qsort(s->c, (size_t)n, sizeof(*s->c), by_logit_desc);
    if (s->p.top_k > 0 && s->p.top_k < n)
        n = s->p.top_k;
    return draw(s, n);
}

int32_t llmem_sampler_sample_top(struct llmem_sampler *s, const int32_t *ids, const float *vals,
                                 int64_t k) {
    int64_t need = llmem_sampling_top_needed(&s->p);
    LLMEM_ASSERT(need > 0 && k >= need);
    if (need == 1)
        return ids[0];
    for (int64_t i = 0; i < need; i++)
        s->c[i] = (struct cand){.logit = vals[i], .id = ids[i]};
    return draw(s, need < s->vocab ? need : s->vocab);
}

void llmem_logprobs(const float *logits, int64_t vocab, double temperature, int32_t id, int n,
                    float *logprob, int32_t *top_ids, float *top_logprobs) {
    const double t = temperature > 0 ? temperature : 1.0;
    float top = logits[0];
    for (int64_t i = 1; i < vocab; i++)
        top = logits[i] > top ? logits[i] : top;
    double sum = 0;
    for (int64_t i = 0; i < vocab; i++)
        sum += exp(((double)logits[i] - top) / t);
    const double lse = (double)top / t + log(sum);
    *logprob = (float)((double)logits[id] / t - lse);
    /* the n largest, by insertion into a sorted list (n ≤ 20) */
    int have = 0;
    for (int64_t i = 0; i < vocab && n > 0; i++) {
        float x = logits[i];
        if (have == n && x <= logits[top_ids[n - 1]])
            continue;
        int at = have < n ? have++ : n - 1;
        while (at > 0 && logits[top_ids[at - 1]] < x) {
            top_ids[at] = top_ids[at - 1];
            at--;
        }
        top_ids[at] = (int32_t)i;
    }
    for (int i = 0; i < have; i++)
        top_logprobs[i] = (float)((double)logits[top_ids[i]] / t - lse);
}
