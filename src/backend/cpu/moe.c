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

/* Each expert's products over its pairs: gate and up (op 0) or down (op 1). Experts with few
 * pairs (decode) go together in one dispatch, a batch of at most CPU_MATMUL_MANY_MAX matrices;
 * an expert with many pairs is a GEMM of its own. */
static void experts_matmul(void *ctx, const struct llmem_backend_moe *m,
                           const struct llmem_moe_work *w, int op) {
    const struct cpu_ctx *c = ctx;
    const int64_t E = m->n_experts, hidden = m->down[0].rows, inter = m->gate[0].rows;
    const struct llmem_weight *mw[CPU_MATMUL_MANY_MAX];
    const float *mx[CPU_MATMUL_MANY_MAX];
    int64_t mn[CPU_MATMUL_MANY_MAX];
    float *my[CPU_MATMUL_MANY_MAX];
    int count = 0;
    for (int64_t e = 0; e <= E; e++) {
        const int64_t at = e < E ? w->offsets[e] : 0, n = e < E ? w->offsets[e + 1] - at : 0;
        const int few = n > 0 && n < c->gemm_min_n;
        if (count > 0 && (e == E || (few && count + 2 > CPU_MATMUL_MANY_MAX))) {
            llmem_cpu_matmul_many((void *)ctx, count, mw, mx, mn, my);
            count = 0;
        }
        if (n == 0 || e == E)
            continue;
        if (op == 0) {
            const struct llmem_weight *pair[2] = {&m->gate[e], &m->up[e]};
            float *out[2] = {w->gate + at * inter, w->up + at * inter};
            if (few) {
                for (int i = 0; i < 2; i++, count++) {
                    mw[count] = pair[i], mx[count] = w->x + at * hidden, mn[count] = n;
                    my[count] = out[i];
                }
            } else {
                llmem_cpu_matmul_multi((void *)ctx, 2, pair, w->x + at * hidden, n, out, NULL);
            }
        } else if (few) {
            mw[count] = &m->down[e], mx[count] = w->gate + at * inter, mn[count] = n;
            my[count++] = w->x + at * hidden;
        } else {
            llmem_cpu_matmul((void *)ctx, &m->down[e], w->gate + at * inter, n,
                             w->x + at * hidden, NULL);
        }
    }
}

void llmem_cpu_moe(void *ctx, const struct llmem_backend_moe *m, const float *logits,
                   const float *x, int64_t T, float *y, void *work) {
    LLMEM_ASSERT(m != NULL && logits != NULL && x != NULL && y != NULL && work != NULL && T > 0 &&
                 m->k >= 1 && m->k <= LLMEM_MOE_MAX_K);
    const int64_t E = m->n_experts, k = m->k, hidden = m->down[0].rows,
                  inter = m->gate[0].rows, pairs = T * k;
    struct llmem_moe_work w;
    llmem_moe_work_layout(T, hidden, inter, E, k, work, &w);

    for (int64_t t = 0; t < T; t++)
        route(m, logits + t * E, w.ids + t * k, w.probs + t * k);
    /* the pairs by expert, each expert's in row order (a counting sort), and their rows of x */
    memset(w.offsets, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < pairs; i++)
        w.offsets[w.ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++)
        w.offsets[e + 1] += w.offsets[e];
    for (int64_t i = 0; i < pairs; i++) /* offsets[e] advances as its pairs are placed */
        w.order[w.slot[i] = w.offsets[w.ids[i]]++] = (int32_t)i;
    for (int64_t e = E; e > 0; e--)
        w.offsets[e] = w.offsets[e - 1];
    w.offsets[0] = 0;
    for (int64_t r = 0; r < pairs; r++)
        memcpy(w.x + r * hidden, x + (w.order[r] / k) * hidden, (size_t)hidden * sizeof(float));

    /* gate and up, SwiGLU over every pair at once, down (into x's rows, read no more) */
    experts_matmul(ctx, m, &w, 0);
    llmem_cpu_swiglu(ctx, w.gate, w.up, pairs * inter, w.gate);
    experts_matmul(ctx, m, &w, 1);

    /* each row: its experts' outputs weighted, in increasing expert order (x is read no more) */
    for (int64_t t = 0; t < T; t++) {
        int32_t s[LLMEM_MOE_MAX_K];
        for (int64_t j = 0; j < k; j++) { /* the row's slots by expert (insertion sort) */
            int64_t i = j;
            while (i > 0 && w.ids[t * k + s[i - 1]] > w.ids[t * k + j]) {
                s[i] = s[i - 1];
                i--;
            }
            s[i] = (int32_t)j;
        }
        float *yr = y + t * hidden;
        for (int64_t c = 0; c < hidden; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++)
                acc += w.probs[t * k + s[j]] * w.x[w.slot[t * k + s[j]] * hidden + c];
            yr[c] = acc;
        }
    }
}
