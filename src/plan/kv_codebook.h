/*
 * plan/kv_codebook.h — the tq format's value codebook (SPEC §4.4), one spelling for the host codec
 * (kv/codec.c) and the device kernels (backend/cuda): the Lloyd–Max quantizer of a unit normal with
 * 8 levels, ascending, and the decision thresholds between neighbouring levels (their midpoints),
 * as initializers.
 */
#ifndef LLMEM_PLAN_KV_CODEBOOK_H
#define LLMEM_PLAN_KV_CODEBOOK_H

#define LLMEM_KV_TQ_CENTROIDS                                                                      \
    { -2.15195f, -1.34391f, -0.75601f, -0.24509f, 0.24509f, 0.75601f, 1.34391f, 2.15195f }

#define LLMEM_KV_TQ_BOUNDS                                                                         \
    {                                                                                              \
        (-2.15195f - 1.34391f) / 2, (-1.34391f - 0.75601f) / 2, (-0.75601f - 0.24509f) / 2, 0.0f,  \
            (0.24509f + 0.75601f) / 2, (0.75601f + 1.34391f) / 2, (1.34391f + 2.15195f) / 2        \
    }

#endif
