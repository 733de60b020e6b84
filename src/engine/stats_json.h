/*
 * engine/stats_json.h — the session bank's statistics (struct llmem_engine_bank_stats) as JSON,
 * for `llmem run --json --stats`, `llmem chat` and `llmem gc`: every field of the RAM tier's and
 * the spill store's X-macro lists, under their own names.
 */
#ifndef LLMEM_ENGINE_STATS_JSON_H
#define LLMEM_ENGINE_STATS_JSON_H

#include <cjson/cJSON.h>

#include "llmem/engine.h"
#include "llmem/spill.h"

/* {"ram": {...}, "spill": {...} or null, "reused_ram_tokens", "reused_disk_tokens",
 *  "guard": {"warnings", "criticals", "deferred", "suppressed"}}; NULL on out of memory
 * (logged). */
cJSON *llmem_engine_bank_stats_json(const struct llmem_engine_bank_stats *st);
/* Every field of the spill store's stats as an object; NULL on out of memory (logged). */
cJSON *llmem_spill_stats_json(const struct llmem_spill_stats *st);

#endif
