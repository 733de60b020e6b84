/*
 * plan/plan_json.c — the plan as one JSON object. The only part of plan/ that allocates (the
 * cJSON tree and the printed string); the arithmetic in plan.c never does.
 */
#include <stdlib.h>

#include "core/json.h"
#include "core/log.h"
#include "llmem/plan.h"
#include "plan/plan_json.h"

cJSON *llmem_plan_json(const struct llmem_plan *plan) {
    cJSON *o = cJSON_CreateObject();
    if (o == NULL) {
        LLMEM_ERROR("out of memory");
        return NULL;
    }
    char describe[512];
    int st = 0;
    st |= llmem_json_add_bool(o, "available", plan->available);
    if (plan->available)
        st |= llmem_json_add_null(o, "unavailable_reason");
    else
        st |= llmem_json_add_string(o, "unavailable_reason", plan->unavailable_reason);
    st |=
        llmem_json_add_string(o, "describe", llmem_plan_describe(plan, describe, sizeof(describe)));
    st |= llmem_json_add_string(o, "target", plan->target == LLMEM_PLAN_CUDA ? "cuda" : "host");

#define I64(name)  st |= llmem_json_add_int(o, #name, plan->name)
#define BOOL(name) st |= llmem_json_add_bool(o, #name, plan->name)
#define DBL(name)  st |= llmem_json_add_double(o, #name, plan->name)
    I64(total_bytes);
    I64(ceiling_bytes);
    I64(budget_bytes);
    I64(planning_bytes);
    I64(usable_bytes);
    st |= llmem_json_add_string(o, "usable_source", llmem_usable_source_name(plan->usable_source));
    I64(weights_bytes);
    I64(kv_bytes_per_token);
    I64(kv_bytes_per_token_effective);
    st |= llmem_json_add_string(o, "kv_format", llmem_kv_format_name(plan->kv_format));
    I64(aux_bytes_per_token);
    I64(prefill_transient_bytes_per_token);
    I64(per_token_bytes);
    I64(computed_workspace_bytes);
    I64(runtime_transients_bytes);
    I64(runtime_baseline_bytes);
    I64(bank_floor_bytes);
    I64(bank_cap_bytes);
    I64(kv_budget_bytes);
    I64(context_raw);
    I64(model_max_context);
    I64(requested_context);
    BOOL(model_fits);
    I64(context_window_fit);
    I64(context_window_resolved);
    BOOL(machine_bound);
    BOOL(overcommitted);
    I64(kv_reserve_bytes);
    I64(pool_tokens);
    I64(max_full_window_sequences);
    I64(max_sequences);
    I64(max_batch_tokens);
    I64(bank_idle_max_bytes);
    I64(bank_steady_bytes);
    I64(headroom_bytes);
    DBL(util);
    DBL(util_requested);
    I64(allocation_limit_bytes);
    I64(allocator_limit_bytes);
    I64(trip_bytes);
    I64(footprint_bytes);
    DBL(band_low);
    DBL(band_high);
    BOOL(band_empty);
    BOOL(util_in_band);
    BOOL(trip_above_ceiling);
#undef I64
#undef BOOL
#undef DBL

    cJSON *notes = cJSON_AddArrayToObject(o, "notes");
    st |= notes == NULL;
    for (int i = 0; notes != NULL && i < plan->n_notes; i++) {
        cJSON *s = cJSON_CreateString(plan->notes[i]);
        st |= s == NULL || !cJSON_AddItemToArray(notes, s);
    }
    if (st != 0) {
        LLMEM_ERROR("out of memory");
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

char *llmem_plan_to_json(const struct llmem_plan *plan, int pretty) {
    cJSON *o = llmem_plan_json(plan);
    if (o == NULL)
        return NULL;
    char *text = llmem_json_print(o, pretty);
    cJSON_Delete(o);
    return text;
}
