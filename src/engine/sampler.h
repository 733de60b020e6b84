/*
 * engine/sampler.h — what the sampler (sampler.c) offers the scheduler beyond the public
 * llmem_sampler_* calls: a token's log-probability and the most likely alternatives.
 */
#ifndef LLMEM_ENGINE_SAMPLER_H
#define LLMEM_ENGINE_SAMPLER_H

#include <stdint.h>

/* The row s samples from: logits with its penalties and biases applied (in the sampler's own
 * buffer, valid until its next call), or logits itself when it has none. */
struct llmem_sampler;
const float *llmem_sampler_adjusted(struct llmem_sampler *s, const float *logits);

/* log-softmax(logits / temperature) (temperature ≤ 0: 1): the log-probability of id, and the n
 * most likely tokens with theirs (most likely first). */
void llmem_logprobs(const float *logits, int64_t vocab, double temperature, int32_t id, int n,
                    float *logprob, int32_t *top_ids, float *top_logprobs);

#endif
