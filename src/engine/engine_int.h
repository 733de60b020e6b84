/*
 * engine/engine_int.h — the engine's inside (engine.c): the model opened inside its plan, the
 * session bank and guard around a request, and the scheduler it owns (sched.h), which calls back
 * through a table of operations and never sees these fields.
 */
#ifndef LLMEM_ENGINE_INT_H
#define LLMEM_ENGINE_INT_H

#include <stdint.h>

#include "backend/ops.h"
#include "engine/hooks.h"
#include "engine/sched.h"
#include "llmem/engine.h"
#include "llmem/sys.h"

struct llmem_engine {
    struct llmem_engine_config cfg;
    struct llmem_engine_hooks hooks; /* zeros: the machine's own readings and disk */
    struct llmem_plan plan;
    struct llmem_mem *mem;         /* the memory the plan governs: the host's, or the device's */
    struct llmem_mem *staging_mem; /* pinned host memory for the spill store's staging (CUDA) */
    struct llmem_mem *host_mem;    /* host memory: mem on the CPU; its own allocator with a device
                                    * (the logits the sampler reads; the spill store's staging
                                    * where none is pinned) */
    struct llmem_model *model;
    struct llmem_expert_placement placement; /* a device's mixture of experts */
    struct llmem_model *host_model; /* on a device with experts on the host: the host's copy,
                                     * which they stay in; else NULL */
    struct llmem_backend *host_be;  /* … and the CPU backend that runs them */
    struct llmem_tokenizer *tok;
    struct llmem_grammar_vocab *gvocab; /* the tokenizer's for constrained decoding: made with it,
                                         * so that the runtime baseline holds it */
    struct llmem_pool *pool; /* the threads every kernel runs on */
    struct llmem_backend *be;
    struct llmem_kv *kv;
    struct llmem_bank *bank;   /* the RAM tier of the session bank (paged layout), or NULL */
    struct llmem_spill *spill; /* the bank's spill store, or NULL */
    uint8_t root[32];          /* the bank's chain root: the model's identity */
    int64_t ram_bytes;         /* this machine's RAM (for the spill store's default cap) */
    struct llmem_guard guard;
    struct llmem_sys_pressure pressure; /* the last read of /proc, and when */
    double pressure_at;
    int refusing;              /* a critical is in effect: no new request is admitted */
    int64_t cache_limit_saved; /* the allocator's cache limit, set to 0 while refusing */
    struct llmem_forward *fwd;
    /* a split model (cfg.tensor_parallel > 1): each rank's share (model is shares[0]), backend
     * (on the CPU be, named n times; on devices their own) and device memory (mem is
     * rank_mem[0]), and the group that sums over them */
    int n_ranks;
    struct llmem_model *shares[LLMEM_SPLIT_MAX];
    const struct llmem_backend *ranks[LLMEM_SPLIT_MAX];
    struct llmem_backend *rank_be[LLMEM_SPLIT_MAX];
    struct llmem_mem *rank_mem[LLMEM_SPLIT_MAX];
    int rank_device[LLMEM_SPLIT_MAX]; /* with cuda: the device of each rank */
    struct llmem_backend_group group;
    void *group_comm;  /* the devices' communicator (backend/cuda), or NULL */
    int top_on_device; /* sample from the device's top k where it can (LLMEM_SAMPLE_ON_DEVICE) */
    int decode_ahead;  /* queue greedy decode steps ahead on a device (LLMEM_DECODE_AHEAD) */
    int64_t vocab;
    struct llmem_sched *sched; /* the requests; its operations run on the thread that steps it */
};


#endif
