/*
 * engine/stats_json.c — the session bank's statistics as JSON (see engine/stats_json.h), built
 * from the X-macro field lists so that a new counter shows up without touching this file.
 */
#include "engine/stats_json.h"

#include "core/json.h"
#include "core/log.h"

cJSON *llmem_spill_stats_json(const struct llmem_spill_stats *st) {
    cJSON *o = cJSON_CreateObject();
    int bad = o == NULL;
#define ADD_(name) bad = bad || llmem_json_add_int(o, #name, st->name);
    LLMEM_SPILL_STATS_FIELDS(ADD_)
#undef ADD_
    if (bad) {
        cJSON_Delete(o);
        LLMEM_ERROR("out of memory");
        return NULL;
    }
    return o;
}

cJSON *llmem_engine_bank_stats_json(const struct llmem_engine_bank_stats *st) {
    cJSON *o = cJSON_CreateObject(), *ram = cJSON_CreateObject(), *guard = cJSON_CreateObject();
    cJSON *spill = st->spill_on ? llmem_spill_stats_json(&st->spill) : cJSON_CreateNull();
    int bad = o == NULL || ram == NULL || guard == NULL || spill == NULL;
#define ADD_(name) bad = bad || llmem_json_add_int(ram, #name, st->ram.name);
    if (!bad) {
        LLMEM_BANK_STATS_FIELDS(ADD_)
    }
#undef ADD_
    bad = bad || llmem_json_add_int(o, "reused_ram_tokens", st->reused_ram_tokens) ||
          llmem_json_add_int(o, "reused_disk_tokens", st->reused_disk_tokens) ||
          llmem_json_add_int(guard, "warnings", st->guard_warnings) ||
          llmem_json_add_int(guard, "criticals", st->guard_criticals) ||
          llmem_json_add_int(guard, "deferred", st->guard_deferred) ||
          llmem_json_add_int(guard, "suppressed", st->guard_suppressed);
    if (bad) {
        cJSON_Delete(o), cJSON_Delete(ram), cJSON_Delete(guard), cJSON_Delete(spill);
        LLMEM_ERROR("out of memory");
        return NULL;
    }
    cJSON_AddItemToObject(o, "ram", ram);
    cJSON_AddItemToObject(o, "spill", spill);
    cJSON_AddItemToObject(o, "guard", guard);
    return o;
}
