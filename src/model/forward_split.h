/*
 * model/forward_split.h — the forward pass of a model split over several backends (tensor
 * parallelism), for the engine and the tests: the public llmem_forward_create runs a whole model
 * on one backend; this one runs the ranks' shares made by llmem_model_to_device.
 */
#ifndef LLMEM_MODEL_FORWARD_SPLIT_H
#define LLMEM_MODEL_FORWARD_SPLIT_H

#include "backend/ops.h"
#include "llmem/forward.h"

/* llmem_forward_create for a model split over a group of backends (tensor parallelism, in
 * forward.c): models[r], rank r's share (llmem_model_to_device with rank r of group->n), runs on
 * group->ranks[r]; kv's layers are the ranks' in turn (rank r's layer l at r · n_layers + l, each
 * the share's KV heads). The ranks' partial sums are joined by the group's sum after the
 * embeddings and after each attention and MLP block, and the logits rows gathered from the ranks'
 * shares of the vocabulary, or their top k (llmem_forward_run_top: each rank's share's, merged by
 * llmem_forward_wait). Each rank's pass runs on a thread of its own (rank 0's on the caller's),
 * the cache's step prepared first (llmem_kv_step); where the group's sums can be recorded
 * (group->graphs), its decode steps are graphs, the ranks agreeing on how each pass runs and
 * launching together or not at all. A split's steps are not fed from the device
 * (llmem_forward_start_next). The group is copied; its table of backends and its ctx must
 * outlive the pass. A group of one is llmem_forward_create. */
int llmem_forward_create_split(struct llmem_model *const *models,
                               const struct llmem_backend_group *group, struct llmem_kv *kv,
                               int64_t max_batch_tokens, struct llmem_forward **out);

#endif
