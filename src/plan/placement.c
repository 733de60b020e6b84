/*
 * plan/placement.c — where a mixture's experts live on a device (llmem/plan.h
 * llmem_plan_place_experts): the fewest MoE layers whose experts stay on the host for which the
 * device's plan fits, each such layer's experts taken off the device's weights.
 */
#include <stdio.h>

#include "core/log.h"
#include "llmem/plan.h"
#include "llmem/size.h"

int llmem_plan_place_experts(struct llmem_plan_params *params,
                             const struct llmem_model_geometry *g, int64_t experts_on_host,
                             struct llmem_expert_placement *out) {
    LLMEM_ASSERT(params != NULL && g != NULL && out != NULL);
    *out = (struct llmem_expert_placement){.device_weights_bytes = params->weights_bytes,
                                           .device_read_bytes = llmem_geometry_active_bytes(g)};
    const int64_t experts = llmem_geometry_expert_bytes(g);
    if (experts <= 0 || params->target != LLMEM_PLAN_CUDA)
        return LLMEM_OK;
    const int64_t layers = g->n_moe_layers, per = experts / layers;
    const int64_t read = per / g->n_experts * g->n_experts_used; /* a token's, in one layer */
    out->moe_layers = layers;
    out->layer_bytes = per;
    int64_t n = experts_on_host < 0 ? 0 : experts_on_host > layers ? layers : experts_on_host;
    out->forced = experts_on_host >= 0;
    const int64_t all = params->weights_bytes;
    for (;; n++) {
        params->weights_bytes = all - n * per;
        if (out->forced || n == layers)
            break;
        struct llmem_plan plan;
        const int status = llmem_plan_compute(params, &plan);
        if (status != LLMEM_OK)
            return status;
        if (!plan.available || (plan.model_fits && !plan.overcommitted))
            break;
    }
    out->host_layers = n;
    out->device_weights_bytes = params->weights_bytes;
    out->host_bytes = n * per;
    out->host_read_bytes = n * read;
    out->device_read_bytes -= out->host_read_bytes;
    return LLMEM_OK;
}

char *llmem_plan_describe_experts(const struct llmem_expert_placement *p, char *buf,
                                  size_t buf_size) {
    char a[LLMEM_SIZE_STR_MAX], b[LLMEM_SIZE_STR_MAX], c[LLMEM_SIZE_STR_MAX];
    llmem_size_format_short(p->device_read_bytes, b, sizeof(b));
    if (p->host_layers == 0) {
        snprintf(buf, buf_size, "every MoE layer's experts on the device%s; a token reads %s there",
                 p->forced ? " (--experts-on-host 0)" : "", b);
        return buf;
    }
    snprintf(buf, buf_size,
             "the experts of the first %lld of %lld MoE layers on the host (%s, run on the CPU%s), "
             "the rest on the device; a token reads %s on the device, %s on the host",
             (long long)p->host_layers, (long long)p->moe_layers,
             llmem_size_format_short(p->host_bytes, a, sizeof(a)),
             p->forced ? ": --experts-on-host" : ": the fewest with which the model fits", b,
             llmem_size_format_short(p->host_read_bytes, c, sizeof(c)));
    return buf;
}
