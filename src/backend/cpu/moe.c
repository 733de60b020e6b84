/*
 * backend/cpu/moe.c — a mixture-of-experts MLP on the CPU (ops.h `moe`): each token's experts
 * picked from its router logits, the (token, slot) pairs sorted by expert, and each chosen expert
 * run once as a GEMM over the rows that chose it (gathered), so that a step reads an expert's
 * matrices only when some token runs it, and once however many do. The experts' outputs are
 * added to each row in increasing expert order: a row's result does not depend on the other rows
 * (the matmuls are batch invariant, and the order is the row's own).
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "core/log.h"
#include "plan/moe_work.h"

/* The k largest of v[n] into ids (largest first; the lower index first among equals). */
static void top_k(const float *v, int64_t n, int64_t k, int32_t *ids) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++)
                taken = ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best]))
                best = e;
        }
        ids[j] = (int32_t)best;
    }
}

/* A row's experts and weights: softmax over the logits in f32 (exp is increasing: the k largest
 * probabilities are those of the k largest logits), renormalized over the k when asked. */
static void route(const struct llmem_backend_moe *m, const float *logits, int32_t *ids,
                  float *probs) {
    const int64_t n = m->n_experts, k = m->k;
    float max = logits[0];
    for (int64_t e = 1; e < n; e++)
        max = logits[e] > max ? logits[e] : max;
    float sum = 0.0f;
    for (int64_t e = 0; e < n; e++)
        sum += expf(logits[e] - max);
    top_k(logits, n, k, ids);
    float s = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        probs[j] = expf(logits[ids[j]] - max) / sum;
        s += probs[j];
    }
    for (int64_t j = 0; m->norm_topk && j < k; j++)
        probs[j] /= s;
}

void llmem_cpu_moe(void *ctx, const struct llmem_backend_moe *m, const float *logits,
                   const float *x, int64_t T, float *y, void *work) {
    LLMEM_ASSERT(m != NULL && logits != NULL && x != NULL && y != NULL && work != NULL && T > 0);
    const int64_t E = m->n_experts, k = m->k, hidden = m->down[0].rows,
                  inter = m->gate[0].rows;
    struct llmem_moe_work w;
    llmem_moe_work_layout(T, hidden, inter, E, k, work, &w);

    for (int64_t t = 0; t < T; t++)
        route(m, logits + t * E, w.ids + t * k, w.probs + t * k);
    /* the pairs by expert, each expert's in row order (a counting sort) */
    memset(w.offsets, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < T * k; i++)
        w.offsets[w.ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++)
        w.offsets[e + 1] += w.offsets[e];
    for (int64_t i = 0; i < T * k; i++) {
        /* offsets[e] advances as its pairs are placed, then is restored below */
        w.order[w.offsets[w.ids[i]]++] = (int32_t)i;
    }
    for (int64_t e = E; e > 0; e--)
        w.offsets[e] = w.offsets[e - 1];
    w.offsets[0] = 0;

    /* each chosen expert over its rows; the weighted outputs summed in expert order per row */
    memset(w.acc, 0, (size_t)(T * hidden) * sizeof(float));
    for (int64_t e = 0; e < E; e++) {
        const int64_t begin = w.offsets[e], n = w.offsets[e + 1] - begin;
        if (n == 0)
            continue;
        for (int64_t r = 0; r < n; r++)
            memcpy(w.x + r * hidden, x + (w.order[begin + r] / k) * hidden,
                   (size_t)hidden * sizeof(float));
        const struct llmem_weight *pair[2] = {&m->gate[e], &m->up[e]};
        float *out[2] = {w.gate, w.up};
        llmem_cpu_matmul_multi(ctx, 2, pair, w.x, n, out, NULL);
        llmem_cpu_swiglu(ctx, w.gate, w.up, n * inter, w.gate);
        llmem_cpu_matmul(ctx, &m->down[e], w.gate, n, w.x, NULL);
        for (int64_t r = 0; r < n; r++) {
            const int32_t pair_index = w.order[begin + r];
            const float p = w.probs[pair_index];
            float *acc = w.acc + (pair_index / k) * hidden;
            const float *row = w.x + r * hidden;
            for (int64_t c = 0; c < hidden; c++)
                acc[c] += p * row[c];
        }
    }
    memcpy(y, w.acc, (size_t)(T * hidden) * sizeof(float));
}
