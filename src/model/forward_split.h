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
 * the share's KV heads). One thread queues every rank's operations, layer by layer (each rank's
 * device made current: the backends' bind); the ranks' partial sums are joined by the group's
 * allreduce after the embeddings and after each attention and MLP block, and the logits rows
 * gathered from the ranks' shares of the vocabulary, or their top k (llmem_forward_run_top: each
 * rank's share's, merged by llmem_forward_wait). A split's passes are not recorded as graphs nor
 * fed from the device (llmem_forward_start_next). The group is copied; its table of backends and
 * its ctx must outlive the pass. A group of one is llmem_forward_create. */
int llmem_forward_create_split(struct llmem_model *const *models,
                               const struct llmem_backend_group *group, struct llmem_kv *kv,
                               int64_t max_batch_tokens, struct llmem_forward **out);

#endif
