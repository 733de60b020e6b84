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
    /* the penalties and biases (adjusts set): the adjusted row, each token's count in the output
     * and whether the prompt holds it, and the tokens with either (each once, in `seen`) */
    int adjusts;
    float *row;       /* (vocab) */
    uint32_t *counts; /* (vocab) */
    uint8_t *in_prompt; /* (vocab) */
    int32_t *seen;    /* (vocab) */
    int64_t n_seen;
    struct llmem_logit_bias *bias; /* (p.n_logit_bias) */
    /* a grammar: its matcher, the tokens it allows (the tokenizer's vocabulary), the end ids,
     * the tokens accepted so far */
    struct llmem_grammar_state *gs;
    uint8_t *allowed;
    int32_t *end_ids;
    int64_t n_out;
    int64_t n_allowed; /* ≥ 0: allowed holds the next draw's mask (llmem_sampler_prepare) */
    /* a grammar for a part of the output (p.grammar_trigger): gs is made when the trigger has
     * come; armed: it may still come; matched: how many of its bytes end the output so far */
    int armed;
    size_t matched;
    int lazy_status; /* LLMEM_ENOMEM: a matcher could not be made */
};

void llmem_sampling_default(struct llmem_sampling *s) {
    *s = (struct llmem_sampling){.temperature = 0, .top_k = 0, .top_p = 1.0, .min_p = 0, .seed = 0,
                                 .repetition_penalty = 1.0};
}

static int adjusts(const struct llmem_sampling *p) {
    return p->presence_penalty != 0 || p->frequency_penalty != 0 ||
           (p->repetition_penalty != 0 && p->repetition_penalty != 1) || p->n_logit_bias > 0 ||
           p->grammar != NULL;
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
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty) ||
        !(p->repetition_penalty >= 0 && isfinite(p->repetition_penalty)) || p->n_logit_bias < 0 ||
        p->n_logit_bias > LLMEM_MAX_LOGIT_BIAS || (p->n_logit_bias > 0 && p->logit_bias == NULL)) {
        LLMEM_ERROR("bad penalties: presence %g and frequency %g (finite), repetition %g (> 0; 0 "
                    "or 1: off), %d logit biases (at most %d)",
                    p->presence_penalty, p->frequency_penalty, p->repetition_penalty,
                    p->n_logit_bias, LLMEM_MAX_LOGIT_BIAS);
        return LLMEM_EINVAL;
    }
    for (int i = 0; i < p->n_logit_bias; i++)
        if (p->logit_bias[i].id < 0 || p->logit_bias[i].id >= vocab ||
            !isfinite(p->logit_bias[i].bias)) {
            LLMEM_ERROR("logit bias %d: token %d (0 to %lld) by %g (finite)", i,
                        p->logit_bias[i].id, (long long)vocab - 1, (double)p->logit_bias[i].bias);
            return LLMEM_EINVAL;
        }
    if (p->grammar != NULL && (p->grammar_vocab == NULL || p->n_end_ids < 0 ||
                               (p->n_end_ids > 0 && p->end_ids == NULL))) {
        LLMEM_ERROR("a grammar needs its vocabulary and the end ids");
        return LLMEM_EINVAL;
    }
    for (int i = 0; p->grammar != NULL && i < p->n_end_ids; i++)
        if (p->end_ids[i] < 0 || p->end_ids[i] >= vocab) {
            LLMEM_ERROR("end id %d is outside the vocabulary (0 to %lld)", p->end_ids[i],
                        (long long)vocab - 1);
            return LLMEM_EINVAL;
        }
    struct llmem_sampler *s = calloc(1, sizeof(*s));
    if (s != NULL)
        s->c = malloc((size_t)vocab * sizeof(*s->c));
    int ok = s != NULL && s->c != NULL;
    if (ok && adjusts(p)) {
        s->adjusts = 1;
        s->row = malloc((size_t)vocab * sizeof(*s->row));
        s->counts = calloc((size_t)vocab, sizeof(*s->counts));
        s->in_prompt = calloc((size_t)vocab, 1);
        s->seen = malloc((size_t)vocab * sizeof(*s->seen));
        s->bias = malloc((size_t)(p->n_logit_bias > 0 ? p->n_logit_bias : 1) * sizeof(*s->bias));
        ok = s->row != NULL && s->counts != NULL && s->in_prompt != NULL && s->seen != NULL &&
             s->bias != NULL;
    }
    if (ok)
        s->n_allowed = -1;
    if (ok && p->grammar != NULL) {
        s->allowed = malloc((size_t)llmem_grammar_vocab_size(p->grammar_vocab));
        s->end_ids = malloc((size_t)(p->n_end_ids > 0 ? p->n_end_ids : 1) * sizeof(int32_t));
        ok = s->allowed != NULL && s->end_ids != NULL &&
             (p->grammar_trigger != NULL ||
              llmem_grammar_state_create(p->grammar, p->grammar_vocab, &s->gs) == LLMEM_OK);
        s->armed = p->grammar_trigger != NULL && p->grammar_trigger[0] != '\0';
        if (ok && p->n_end_ids > 0)
            memcpy(s->end_ids, p->end_ids, (size_t)p->n_end_ids * sizeof(int32_t));
    }
    if (!ok) {
        llmem_sampler_free(s);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    s->p = *p;
    if (s->adjusts) {
        if (p->n_logit_bias > 0)
            memcpy(s->bias, p->logit_bias, (size_t)p->n_logit_bias * sizeof(*s->bias));
        s->p.logit_bias = s->bias;
    } else {
        s->p.logit_bias = NULL;
        s->p.n_logit_bias = 0;
    }
    s->p.end_ids = s->end_ids;
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
    free(s->row);
    free(s->counts);
    free(s->in_prompt);
    free(s->seen);
    free(s->bias);
    llmem_grammar_state_free(s->gs);
    free(s->allowed);
    free(s->end_ids);
    free(s);
}

static void see(struct llmem_sampler *s, int32_t id) {
    if (s->counts[id] == 0 && !s->in_prompt[id])
        s->seen[s->n_seen++] = id;
}

void llmem_sampler_prompt(struct llmem_sampler *s, const int32_t *ids, int64_t n) {
    for (int64_t i = 0; s->adjusts && i < n; i++)
        if (ids[i] >= 0 && ids[i] < s->vocab) {
            see(s, ids[i]);
            s->in_prompt[ids[i]] = 1;
        }
}

/* How many of t's bytes end the text once c follows the m that did: the longest prefix of t that
 * is a suffix of t[0, m) then c. */
static size_t next_match(const char *t, size_t m, char c) {
    if (t[m] == c)
        return m + 1;
    for (size_t k = m; k > 0; k--)
        if (t[k - 1] == c && memcmp(t, t + m - k + 1, k - 1) == 0)
            return k;
    return 0;
}

/* The trigger has come, rest[0, n) after it in the same token: the grammar's matcher from its
 * start, past the trigger and the rest; where the grammar does not take them the output stays
 * free (an anchored trigger then never comes). */
static void trigger(struct llmem_sampler *s, const char *rest, size_t n) {
    const char *t = s->p.grammar_trigger;
    s->matched = 0;
    if (llmem_grammar_state_create(s->p.grammar, s->p.grammar_vocab, &s->gs) != LLMEM_OK) {
        s->lazy_status = LLMEM_ENOMEM;
        s->armed = 0;
        return;
    }
    if (llmem_grammar_accept_bytes(s->gs, t, strlen(t)) != LLMEM_OK ||
        (n > 0 && llmem_grammar_accept_bytes(s->gs, rest, n) != LLMEM_OK)) {
        llmem_grammar_state_free(s->gs);
        s->gs = NULL;
        s->armed = !s->p.trigger_at_start;
    }
}

/* A token of the free output: whether it brings the trigger. */
static void watch(struct llmem_sampler *s, int32_t id) {
    size_t n = 0;
    const char *b = llmem_grammar_vocab_token(s->p.grammar_vocab, id, &n),
               *t = s->p.grammar_trigger;
    for (size_t i = 0; b != NULL && i < n && s->armed && s->gs == NULL; i++) {
        if (!s->p.trigger_at_start)
            s->matched = next_match(t, s->matched, b[i]);
        else if (s->matched == 0 && (b[i] == ' ' || b[i] == '\n'))
            continue;
        else if (b[i] == t[s->matched])
            s->matched++;
        else
            s->armed = 0;
        if (s->armed && t[s->matched] == '\0')
            trigger(s, b + i + 1, n - i - 1);
    }
}

void llmem_sampler_accept(struct llmem_sampler *s, int32_t id) {
    if (!s->adjusts || id < 0 || id >= s->vocab)
        return;
    see(s, id);
    s->counts[id]++;
    if (s->p.grammar == NULL)
        return;
    s->n_out++;
    s->n_allowed = -1;
    if (s->gs == NULL) {
        if (s->armed)
            watch(s, id);
        return;
    }
    (void)llmem_grammar_accept(s->gs, id); /* (an end id, or one the mask allowed) */
    if (s->p.grammar_trigger != NULL && s->p.rearm && llmem_grammar_must_end(s->gs)) {
        llmem_grammar_state_free(s->gs); /* the part is whole: free again until the next */
        s->gs = NULL;
    }
}

int llmem_sampler_must_end(const struct llmem_sampler *s) {
    return s->gs != NULL && llmem_grammar_state_status(s->gs) == LLMEM_OK &&
           llmem_grammar_must_end(s->gs);
}

int llmem_sampler_status(const struct llmem_sampler *s) {
    return s->lazy_status != LLMEM_OK ? s->lazy_status
           : s->gs != NULL            ? llmem_grammar_state_status(s->gs)
                                      : LLMEM_OK;
}

/* The grammar's mask on s->row: the tokens it does not allow at −∞, the end ids only where the
 * output is complete (and alone where nothing else may come). */
void llmem_sampler_prepare(struct llmem_sampler *s) {
    llmem_sampler_prepare_on(s, NULL, NULL);
}

void llmem_sampler_prepare_on(struct llmem_sampler *s, struct llmem_grammar_walkers *walkers,
                              struct llmem_pool *pool) {
    if (s->gs == NULL || s->n_allowed >= 0)
        return;
    const int64_t left = s->p.max_tokens > 0 ? s->p.max_tokens - s->n_out : 0;
    s->n_allowed = llmem_grammar_allowed_on(s->gs, left > 0 ? left : 0, s->allowed, walkers, pool);
}

static void mask(struct llmem_sampler *s) {
    llmem_sampler_prepare(s);
    int64_t n = s->n_allowed;
    s->n_allowed = -1; /* (the end ids below change it) */
    const int64_t nv = llmem_grammar_vocab_size(s->p.grammar_vocab);
    const int end = llmem_grammar_complete(s->gs) && (!s->p.end_last || n == 0);
    for (int i = 0; end && i < s->p.n_end_ids; i++)
        if (s->end_ids[i] >= 0 && s->end_ids[i] < nv && !s->allowed[s->end_ids[i]])
            s->allowed[s->end_ids[i]] = 1, n++;
    for (int64_t i = 0; i < s->vocab; i++)
        if (i >= nv || !s->allowed[i])
            s->row[i] = -INFINITY;
    if (n == 0 && s->p.n_end_ids > 0) /* nothing fits (a parse too deep): the output ends */
        s->row[s->end_ids[0]] = 0.0f;
}

/* The row with the penalties and biases applied (into s->row; only the tokens they touch
 * change), in the order of llmem/sampler.h. */
static const float *adjusted(struct llmem_sampler *s, const float *logits) {
    memcpy(s->row, logits, (size_t)s->vocab * sizeof(float));
    const double rep = s->p.repetition_penalty;
    for (int64_t i = 0; i < s->n_seen; i++) {
        const int32_t id = s->seen[i];
        double v = s->row[id];
        if (rep != 0 && rep != 1)
            v = v > 0 ? v / rep : v * rep;
        const uint32_t n = s->counts[id];
        v -= (double)n * s->p.frequency_penalty + (n > 0 ? s->p.presence_penalty : 0.0);
        s->row[id] = (float)v;
    }
    for (int i = 0; i < s->p.n_logit_bias; i++)
        s->row[s->p.logit_bias[i].id] += s->p.logit_bias[i].bias;
    if (s->gs != NULL)
        mask(s);
    return s->row;
}

const float *llmem_sampler_adjusted(struct llmem_sampler *s, const float *logits) {
    return s->adjusts ? adjusted(s, logits) : logits;
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
    if (adjusts(p))
        return 0;
    return p->temperature == 0 || p->top_k == 1 ? 1 : p->top_k;
}

/* The draw where no order matters (no top-k, no top-p: every token keeps its mass): softmax at
 * the temperature over the row in id order, min-p relative to the largest (best) — the
 * distribution draw() gives the sorted row, without sorting it. */
static int32_t draw_unsorted(struct llmem_sampler *s, const float *logits, int64_t best) {
    const double inv_t = 1.0 / s->p.temperature, top = logits[best];
    double sum = 0;
    for (int64_t i = 0; i < s->vocab; i++) {
        float e = logits[i] == -INFINITY ? 0.0f : (float)exp(((double)logits[i] - top) * inv_t);
        s->c[i].prob = e < (float)s->p.min_p ? 0.0f : e;
        sum += s->c[i].prob;
    }
    double u = (double)(next_u64(s->s) >> 11) * 0x1p-53 * sum, acc = 0;
    for (int64_t i = 0; i < s->vocab; i++) {
        acc += s->c[i].prob;
        if (u < acc)
            return (int32_t)i;
    }
    return (int32_t)best;
}

int32_t llmem_sampler_sample(struct llmem_sampler *s, const float *logits) {
    if (s->adjusts)
        logits = adjusted(s, logits);
    int64_t best = 0;
    for (int64_t i = 1; i < s->vocab; i++)
        if (logits[i] > logits[best])
            best = i;
    if (s->p.temperature == 0 || s->p.top_k == 1) /* greedy */
        return (int32_t)best;
    if (s->p.top_k == 0 && s->p.top_p >= 1)
        return draw_unsorted(s, logits, best);

    /* Candidates: all tokens but those masked out (−∞: no mass; a grammar masks most), or the
     * top k, sorted by logit. */
    int64_t n = 0;
    for (int64_t i = 0; i < s->vocab; i++)
        if (logits[i] != -INFINITY)
            s->c[n++] = (struct cand){.logit = logits[i], .id = (int32_t)i};
    if (n == 0) /* (every token masked: the greedy pick) */
        return (int32_t)best;
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
