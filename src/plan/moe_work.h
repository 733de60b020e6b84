/*
 * plan/moe_work.h — the workspace of one mixture-of-experts layer for a step of T tokens, laid
 * out once here for the planner (geometry.c counts it), the forward pass (which allocates it) and
 * the backends (which carve it up). Each part starts on a 64-byte boundary:
 *   ids, probs, order  T·k each    the k experts a token runs, their weights, and the (token, slot)
 *                                  pairs sorted by expert (int32, f32, int32)
 *   offsets            E + 1       where each expert's pairs start in order (int32)
 *   x                  T·hidden    the rows of one expert gathered (f32)
 *   gate, up           T·inter     their SwiGLU's two products (f32 each)
 *   acc                T·hidden    the weighted sum of the experts' outputs (f32)
 */
#ifndef LLMEM_PLAN_MOE_WORK_H
#define LLMEM_PLAN_MOE_WORK_H

#include <stddef.h>
#include <stdint.h>

struct llmem_moe_work {
    int32_t *ids;
    float *probs;
    int32_t *order;
    int32_t *offsets;
    float *x, *gate, *up, *acc;
};

static inline int64_t llmem_moe_work_round(int64_t bytes) {
    return (bytes + 63) & ~(int64_t)63;
}

/* The bytes of the workspace, and in w (when not NULL) its parts from base (64-byte aligned). */
static inline int64_t llmem_moe_work_layout(int64_t T, int64_t hidden, int64_t inter,
                                            int64_t n_experts, int64_t k, void *base,
                                            struct llmem_moe_work *w) {
    const int64_t sizes[8] = {T * k * 4,      T * k * 4,     T * k * 4,     (n_experts + 1) * 4,
                              T * hidden * 4, T * inter * 4, T * inter * 4, T * hidden * 4};
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
                                     .offsets = (int32_t *)(void *)at[3],
                                     .x = (float *)(void *)at[4],
                                     .gate = (float *)(void *)at[5],
                                     .up = (float *)(void *)at[6],
                                     .acc = (float *)(void *)at[7]};
    return bytes;
}

#endif
