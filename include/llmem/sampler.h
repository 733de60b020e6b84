/*
 * llmem/sampler.h — sampling parameters and the sampler: temperature, top-k, top-p, min-p, seeded;
 * repetition, frequency and presence penalties and logit biases.
 */
#ifndef LLMEM_SAMPLER_H
#define LLMEM_SAMPLER_H

#include <stdint.h>

#include "llmem/api.h"
#include "llmem/grammar.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A bias added to one token's logit (OpenAI's logit_bias: −100 bans it, 100 all but forces it). */
struct llmem_logit_bias {
    int32_t id;
    float bias;
};
#define LLMEM_MAX_LOGIT_BIAS 1024 /* entries of one request's logit_bias */

/* The logits a request samples from are its row adjusted, in this order (as transformers' and
 * vLLM's logits processors): repetition_penalty on every token of the prompt and of the output
 * so far (a positive logit divided by it, a negative one multiplied), then the output's counts:
 * logit − count × frequency_penalty − (count > 0) × presence_penalty (OpenAI's), then
 * logit_bias; temperature, top-k, top-p and min-p then apply to the result. */
struct llmem_sampling {
    double temperature; /* 0: greedy */
    int64_t top_k;      /* 0: off */
    double top_p;       /* 1: off */
    double min_p;       /* 0: off */
    uint64_t seed;
    double presence_penalty;  /* 0: off */
    double frequency_penalty; /* 0: off */
    double repetition_penalty; /* 1 (or 0): off; else > 0 */
    const struct llmem_logit_bias *logit_bias; /* (n_logit_bias), copied by the sampler */
    int n_logit_bias;
    /* Constrained decoding (llmem/grammar.h), after the biases: every token the grammar does not
     * allow next is masked out, and end_ids (copied) only where the output is complete; with
     * max_tokens (> 0: the output's budget) the grammar closes in time; with end_last, an end id
     * only where the grammar allows nothing else (ignore_eos: the output runs on while it may).
     * The grammar and its vocabulary outlive the sampler. NULL: none. */
    const struct llmem_grammar *grammar;
    const struct llmem_grammar_vocab *grammar_vocab;
    const int32_t *end_ids;
    int n_end_ids;
    int64_t max_tokens;
    int end_last;
    /* A grammar for a part of the output (a tool call among free text): grammar_trigger (NUL-
     * terminated, outliving the sampler) is the bytes that open it, and the grammar begins with
     * them. Until they come the output runs free; from them on the grammar constrains it. With
     * trigger_at_start they count only as the output's first bytes after spaces and newlines;
     * with rearm a complete part leaves the output free again until they come anew (else the
     * grammar ends the output). NULL: the grammar constrains the whole output. */
    const char *grammar_trigger;
    int trigger_at_start, rearm;
};
/* Greedy. */
LLMEM_API void llmem_sampling_default(struct llmem_sampling *s);

struct llmem_sampler;
/* LLMEM_EINVAL (logged) for out-of-range parameters, LLMEM_ENOMEM. */
LLMEM_API int llmem_sampler_create(const struct llmem_sampling *params, int64_t vocab,
                                   struct llmem_sampler **out);
LLMEM_API void llmem_sampler_free(struct llmem_sampler *s);
/* The next token for a row of vocab logits. */
LLMEM_API int32_t llmem_sampler_sample(struct llmem_sampler *s, const float *logits);
/* How many of a row's largest logits the sampling needs: 1 (greedy, or top_k 1), top_k (when
 * set), or 0: the whole row (always with a penalty, a logit bias or a grammar, which can move
 * any token). */
LLMEM_API int64_t llmem_sampling_top_needed(const struct llmem_sampling *params);
/* The next token from a row's k largest logits (ids and values by logit descending, equal logits
 * by the lower id), k ≥ llmem_sampling_top_needed > 0: the same token, and the same draw of the
 * generator, as llmem_sampler_sample over the whole row. */
LLMEM_API int32_t llmem_sampler_sample_top(struct llmem_sampler *s, const int32_t *ids,
                                           const float *vals, int64_t k);
/* The tokens the penalties look at: the prompt's (repetition_penalty; once, before the first
 * sample) and each token the request goes on with (llmem_sampler_accept: every penalty, and the
 * grammar's matcher moves past it). A sampler without penalties or grammar ignores both. */
LLMEM_API void llmem_sampler_prompt(struct llmem_sampler *s, const int32_t *ids, int64_t n);
LLMEM_API void llmem_sampler_accept(struct llmem_sampler *s, int32_t id);
/* Computes the grammar's mask for the next draw now (a no-op without a grammar, or when it is
 * ready): a caller may do it while the row's pass runs, or for many samplers at once on several
 * threads (one thread a sampler); the draw then uses it. */
LLMEM_API void llmem_sampler_prepare(struct llmem_sampler *s);
/* The same with the mask's walk on a pool's threads (llmem_grammar_allowed_on): for one sampler
 * whose mask is wanted sooner than one thread makes it. */
struct llmem_grammar_walkers;
struct llmem_pool;
LLMEM_API void llmem_sampler_prepare_on(struct llmem_sampler *s,
                                        struct llmem_grammar_walkers *walkers,
                                        struct llmem_pool *pool);
/* LLMEM_OK, or LLMEM_ENOMEM when the grammar's matcher ran out of memory or of its planned bytes
 * (llmem_grammar_state_status): the tokens drawn since may break the grammar, and the output
 * ends as an error. */
LLMEM_API int llmem_sampler_status(const struct llmem_sampler *s);
/* Whether the output is complete under its grammar and nothing else may come: it ends here (an
 * end id would be the only draw left). */
LLMEM_API int llmem_sampler_must_end(const struct llmem_sampler *s);

#ifdef __cplusplus
}
#endif

#endif
