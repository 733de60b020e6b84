/*
 * llmem/forward.h — the forward pass of a loaded model over its KV caches, on a backend.
 *
 * One batch mixes sequences (chunked prefill and decode alike); it returns the logits rows asked
 * for, or on a device only each row's largest entries, and on a device a greedy step can be queued
 * behind the one in flight.
 */
#ifndef LLMEM_FORWARD_H
#define LLMEM_FORWARD_H

#include <stdint.h>

#include "llmem/api.h"
#include "llmem/backend.h"
#include "llmem/kv.h"
#include "llmem/model.h"

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_kv;
struct llmem_forward;

/* One sequence's part of a batch: n_tokens consecutive tokens at positions [pos, pos + n_tokens)
 * of KV sequence `seq` (pos at most the sequence's length: tokens past it are rewritten). */
struct llmem_batch_seq {
    int seq;
    int64_t pos;
    int64_t n_tokens;
    int all_logits; /* 1: logits of every token; 0: of the last one */
};

/* A forward pass of `model` on `backend` over `kv` (whose geometry must match the model), for
 * batches of up to max_batch_tokens tokens; its activations come from the model's allocator (tag
 * scratch). LLMEM_ENOMEM (logged). */
LLMEM_API int llmem_forward_create(struct llmem_model *model, const struct llmem_backend *backend,
                                   struct llmem_kv *kv, int64_t max_batch_tokens,
                                   struct llmem_forward **out);
/* The host backend that runs the MoE layers whose experts a device model left on the host
 * (llmem_model_to_device's experts_on_host), and its buffers for max_batch_tokens tokens (host
 * memory); such a layer's input and output cross between the memories each step, and the steps
 * are not recorded as graphs. Once, before the first pass; LLMEM_ENOMEM (logged). */
LLMEM_API int llmem_forward_set_host(struct llmem_forward *forward,
                                     const struct llmem_backend *host);
LLMEM_API void llmem_forward_free(struct llmem_forward *forward);
LLMEM_API int64_t llmem_forward_max_tokens(const struct llmem_forward *forward);

/* Runs one batch: tokens holds each sequence's tokens in order; logits receives the requested rows
 * ([Σ (all_logits ? n_tokens : 1), vocab], in order). The KV of every sequence is extended (or
 * rewritten) first; on any failure (LLMEM_ENOMEM from the cache, LLMEM_EINVAL for a token id out
 * of the vocabulary or a bad position — logged) the sequences keep their previous lengths. */
LLMEM_API int llmem_forward_run(struct llmem_forward *forward, const int32_t *tokens,
                                const struct llmem_batch_seq *seqs, int n_seqs, float *logits);

/* The most entries of a row that llmem_forward_run_top returns. */
#define LLMEM_TOP_K_MAX 64

/* Whether llmem_forward_run_top can run: the model is on a device whose backend selects the
 * largest logits there. */
LLMEM_API int llmem_forward_has_top(const struct llmem_forward *forward);

/* llmem_forward_run, but of each logits row only its k (1 to LLMEM_TOP_K_MAX) largest entries
 * come back, selected on the device: ids and vals [rows, k], by logit descending and equal logits
 * by the lower id — all that greedy decoding (k = 1) or a sampler with top_k ≤ k needs, in a
 * fraction of the bytes. LLMEM_EINVAL (logged) where llmem_forward_has_top is 0. */
LLMEM_API int llmem_forward_run_top(struct llmem_forward *forward, const int32_t *tokens,
                                    const struct llmem_batch_seq *seqs, int n_seqs, int k,
                                    int32_t *ids, float *vals);

/* llmem_forward_run_top in two halves, for a caller with work to do while the device computes:
 * start returns once the pass is queued (a failure to queue it is returned at once, the lengths
 * restored); llmem_forward_wait waits for it, and ids and vals hold its rows when it returns
 * LLMEM_OK (on a failure the sequences keep their previous lengths). One pass at a time (but for
 * llmem_forward_start_next): every start is followed by a wait before the next pass; wait without
 * a pass started returns LLMEM_OK.
 * The KV of the pass's sequences must not be freed, trimmed or forked in between. */
LLMEM_API int llmem_forward_start_top(struct llmem_forward *forward, const int32_t *tokens,
                                      const struct llmem_batch_seq *seqs, int n_seqs, int k,
                                      int32_t *ids, float *vals);
LLMEM_API int llmem_forward_wait(struct llmem_forward *forward);

/* llmem_forward_run in the same two halves, for a caller that needs whole rows: on a device the
 * pass is queued and llmem_forward_wait copies its rows into logits (which must stay valid until
 * then); on the host the pass runs in the call and the wait has nothing to do. */
LLMEM_API int llmem_forward_start(struct llmem_forward *forward, const int32_t *tokens,
                                  const struct llmem_batch_seq *seqs, int n_seqs, float *logits);
/* Whether the oldest pass started is still running on the device (0 when none is, or where the
 * backend cannot tell): what a caller did in between finished before the pass did. */
LLMEM_API int llmem_forward_busy(const struct llmem_forward *forward);

/* Whether llmem_forward_start_next can run: llmem_forward_has_top, and the backend can read a
 * pass's tokens on the device. */
LLMEM_API int llmem_forward_has_next(const struct llmem_forward *forward);

/* A greedy decode step queued behind the one pass in flight (llmem_forward_start_top with k = 1,
 * one token for each sequence, not yet waited for) before that pass's results reach the host: the
 * same sequences in the same order, each fed the id that pass selected for it, at the position
 * after it; ids and vals as llmem_forward_start_top's with k = 1 (other arrays than the pass
 * before's). Two passes are then in flight, and each llmem_forward_wait waits for the older one.
 * A caller that does not take a selected id (it stops the sequence there) discards this step's
 * result for it and sets the sequence's length back by one once the step is waited for.
 * LLMEM_EINVAL (logged) without such a pass or where llmem_forward_has_next is 0; other failures
 * as llmem_forward_start_top's. */
LLMEM_API int llmem_forward_start_next(struct llmem_forward *forward, int32_t *ids, float *vals);

/* Whether a decode step of n_seqs sequences (one token each, at their ends) would replay a
 * recorded pass on the device: then starting it takes little of the host's time. */
LLMEM_API int llmem_forward_replays(const struct llmem_forward *forward, int n_seqs);

#ifdef __cplusplus
}
#endif

#endif
