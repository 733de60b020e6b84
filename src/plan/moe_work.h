/*
 * plan/moe_work.h — the workspace of one mixture-of-experts layer for a step of T tokens, laid
 * out once here for the planner (geometry.c counts it), the forward pass (which allocates it) and
 * the backends (which carve it up). Each part starts on a 64-byte boundary:
 *   ids, probs     T·k each        the k experts a token runs and their weights (int32, f32)
 *   order, slot    T·k each        the (token, slot) pairs sorted by expert, and each pair's place
 *                                  in that order (int32)
 *   offsets        E + 1           where each expert's pairs start in order (int32)
 *   x              T·k·hidden      each pair's row of x, in order; then its expert's output (f32)
 *   gate, up       T·k·inter       the pairs' SwiGLU products (f32 each)
 */
#ifndef LLMEM_PLAN_MOE_WORK_H
#define LLMEM_PLAN_MOE_WORK_H

#include <stddef.h>
#include <stdint.h>

/* The most experts a token may run (the configurations refuse more). */
#define LLMEM_MOE_MAX_K 64

struct llmem_moe_work {
    int32_t *ids;
    float *probs;
    int32_t *order, *slot;
    int32_t *offsets;
    float *x, *gate, *up;
};

static inline int64_t llmem_moe_work_round(int64_t bytes) {
    return (bytes + 63) & ~(int64_t)63;
}

/* The bytes of the workspace, and in w (when not NULL) its parts from base (64-byte aligned). */
static inline int64_t llmem_moe_work_layout(int64_t T, int64_t hidden, int64_t inter,
                                            int64_t n_experts, int64_t k, void *base,
                                            struct llmem_moe_work *w) {
    const int64_t pairs = T * k;
    const int64_t sizes[8] = {pairs * 4,          pairs * 4,         pairs * 4,
                              pairs * 4,          (n_experts + 1) * 4, pairs * hidden * 4,
                              pairs * inter * 4,  pairs * inter * 4};
    char *at[8];
    int64_t bytes = 0;
    for (int i = 0; i < 8; i++) {
        at[i] = base != NULL ? (char *)base + bytes : NULL;
        bytes += llmem_moe_work_round(sizes[i]);
    }
    if (w != NULL)
        *w = (struct llmem_moe_work){.ids = (int32_t *)(void *)at[0],
                                     .probs = (float *)(void *)at[1],
                                     .order = (int32_t *)(void *)at[2],
                                     .slot = (int32_t *)(void *)at[3],
                                     .offsets = (int32_t *)(void *)at[4],
                                     .x = (float *)(void *)at[5],
                                     .gate = (float *)(void *)at[6],
                                     .up = (float *)(void *)at[7]};
    return bytes;
}

#endif
