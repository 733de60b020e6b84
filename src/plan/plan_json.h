/*
 * plan/plan_json.h — the plan as a cJSON object, for callers that add their own keys (the CLI,
 * the server's /health). Public callers use llmem_plan_to_json.
 */
#ifndef LLMEM_PLAN_JSON_H
#define LLMEM_PLAN_JSON_H

#include <cjson/cJSON.h>

#include "llmem/plan.h"

/* A new object with every plan field; NULL on out of memory (logged). */
cJSON *llmem_plan_json(const struct llmem_plan *plan);

#endif
