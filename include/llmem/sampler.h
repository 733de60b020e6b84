/*
 * llmem/sampler.h — sampling parameters and the sampler: temperature, top-k, top-p, min-p, seeded.
 */
#ifndef LLMEM_SAMPLER_H
#define LLMEM_SAMPLER_H

#include <stdint.h>

#include "llmem/api.h"

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_sampling {
    double temperature; /* 0: greedy */
    int64_t top_k;      /* 0: off */
    double top_p;       /* 1: off */
    double min_p;       /* 0: off */
    uint64_t seed;
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
 * set), or 0: the whole row. */
LLMEM_API int64_t llmem_sampling_top_needed(const struct llmem_sampling *params);
/* The next token from a row's k largest logits (ids and values by logit descending, equal logits
 * by the lower id), k ≥ llmem_sampling_top_needed > 0: the same token, and the same draw of the
 * generator, as llmem_sampler_sample over the whole row. */
LLMEM_API int32_t llmem_sampler_sample_top(struct llmem_sampler *s, const int32_t *ids,
                                           const float *vals, int64_t k);

#ifdef __cplusplus
}
#endif

#endif
