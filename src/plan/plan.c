/*
 * plan/plan.c — the memory plan (SPEC §2.2–§2.3, §3.1).
 *
 * Steps, in order: the envelope (usable bytes: the 75 % rule with an 8 GiB floor and a 192 GiB cap,
 * or --budget / --util / --memory-limit), the commitments (weights, the runtime baseline that
 * lives outside the allocator, runtime transients), the
 * bank floor, the context that fits in what is left, the KV reserve of one full window, the bank's
 * idle and steady sizes, and the three limits (allocation limit, trip, ceiling) with the util band.
 *
 * Guarantee: for every available plan that fits and is not overcommitted,
 * weights + baseline + transients + kv_reserve + bank_steady ≤ usable (the steady state fits),
 * because the
 * window never exceeds kv_budget / per_token and the bank takes only what the window leaves.
 * All sizes are signed 64-bit; products go through 128-bit intermediates and every difference that
 * the spec bounds with max(0, …) is clamped, never wrapped.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/log.h"
#include "llmem/plan.h"
#include "llmem/size.h"

#define USABLE_CAP            (192 * LLMEM_GIB)
#define USABLE_FLOOR          (8 * LLMEM_GIB)
#define TRANSIENTS_CAP        (3 * LLMEM_GIB)
#define BANK_FLOOR_CAP        LLMEM_GIB
#define BANK_CAP              (48 * LLMEM_GIB)
#define TRANSIENT_RESERVE_CAP (16 * LLMEM_GIB)
#define CONTEXT_ALIGN         4096
#define CONTEXT_MINIMUM       4096
#define TRIP_OFFSET           0.05

static int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}
static int64_t max64(int64_t a, int64_t b) {
    return a > b ? a : b;
}
static int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

/* floor(a × num / den) for a ≥ 0, without overflow. */
static int64_t muldiv(int64_t a, int64_t num, int64_t den) {
    return (int64_t)((__int128)a * num / den);
}

/* a × b saturated to INT64_MAX (a, b ≥ 0). */
static int64_t mul_sat(int64_t a, int64_t b) {
    __int128 r = (__int128)a * b;
    return r > INT64_MAX ? INT64_MAX : (int64_t)r;
}

/* a − b and a + b as signed values, saturated (never wrapped). */
static int64_t sat(__int128 r) {
    return r < INT64_MIN ? INT64_MIN : r > INT64_MAX ? INT64_MAX : (int64_t)r;
}
static int64_t sub_sat(int64_t a, int64_t b) {
    return sat((__int128)a - b);
}
static int64_t add_sat(int64_t a, int64_t b) {
    return sat((__int128)a + b);
}

static void note(struct llmem_plan *plan, const char *fmt, ...) LLMEM_PRINTF(2, 3);
static void note(struct llmem_plan *plan, const char *fmt, ...) {
    if (plan->n_notes >= LLMEM_PLAN_MAX_NOTES)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(plan->notes[plan->n_notes++], LLMEM_PLAN_NOTE_MAX, fmt, ap);
    va_end(ap);
}

const char *llmem_usable_source_name(enum llmem_usable_source source) {
    switch (source) {
    case LLMEM_USABLE_FORMULA: return "formula";
    case LLMEM_USABLE_BUDGET: return "budget";
    case LLMEM_USABLE_UTIL: return "util";
    case LLMEM_USABLE_MEMORY_LIMIT: return "memory_limit";
    }
    return "unknown";
}

static int check_params(const struct llmem_plan_params *p) {
    const struct {
        const char *name;
        int64_t value;
    } sizes[] = {
        {"total_bytes", p->total_bytes},
        {"ceiling_bytes", p->ceiling_bytes},
        {"weights_bytes", p->weights_bytes},
        {"kv_bytes_per_token", p->kv_bytes_per_token},
        {"aux_bytes_per_token", p->aux_bytes_per_token},
        {"prefill_transient_bytes_per_token", p->prefill_transient_bytes_per_token},
        {"model_max_context", p->model_max_context},
        {"requested_context", p->requested_context},
        {"memory_budget_bytes", p->memory_budget_bytes},
        {"memory_limit_bytes", p->memory_limit_bytes},
        {"max_sequences", p->max_sequences},
        {"max_batch_tokens", p->max_batch_tokens},
        {"computed_workspace_bytes", p->computed_workspace_bytes},
        {"runtime_baseline_bytes", p->runtime_baseline_bytes},
    };
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        if (sizes[i].value < 0) {
            LLMEM_ERROR("%s is negative (%lld)", sizes[i].name, (long long)sizes[i].value);
            return LLMEM_EINVAL;
        }
    }
    if (isnan(p->util) || p->util < 0 || p->util > 1) {
        LLMEM_ERROR("util %g is outside (0, 1]", p->util);
        return LLMEM_EINVAL;
    }
    if (llmem_kv_format_info(p->kv_format) == NULL) {
        LLMEM_ERROR("unknown KV format %d", (int)p->kv_format);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

/* ---- step 1: the envelope ------------------------------------------------------------------- */

static void plan_envelope(const struct llmem_plan_params *p, struct llmem_plan *plan) {
    plan->ceiling_bytes = p->ceiling_bytes > 0 ? p->ceiling_bytes : p->total_bytes;
    plan->budget_bytes = p->memory_budget_bytes;
    int64_t planning = min64(plan->total_bytes, plan->ceiling_bytes);
    if (p->memory_budget_bytes > 0)
        planning = min64(planning, p->memory_budget_bytes);
    plan->planning_bytes = planning;

    if (p->memory_limit_bytes > 0) {
        plan->usable_bytes = min64(p->memory_limit_bytes, planning);
        plan->usable_source = LLMEM_USABLE_MEMORY_LIMIT;
    } else if (p->util > 0) {
        int64_t by_util = (int64_t)(p->util * (double)plan->ceiling_bytes);
        plan->usable_bytes = min64(by_util, planning);
        plan->usable_source = LLMEM_USABLE_UTIL;
    } else {
        int64_t floor8 = min64(USABLE_FLOOR, muldiv(planning, 9, 10));
        int64_t rule = max64(floor8, muldiv(planning, 3, 4));
        plan->usable_bytes = min64(min64(planning, rule), USABLE_CAP);
        plan->usable_source =
            p->memory_budget_bytes > 0 ? LLMEM_USABLE_BUDGET : LLMEM_USABLE_FORMULA;
    }
}

/* ---- steps 2–5: commitments, caches, context ---------------------------------------------- */

/* What the engine's budget leaves after the commitments that do not depend on the context:
 * usable − weights − runtime baseline − `transients` (signed). */
static int64_t play_after(const struct llmem_plan *plan, int64_t transients) {
    return sub_sat(
        sub_sat(sub_sat(plan->usable_bytes, plan->weights_bytes), plan->runtime_baseline_bytes),
        transients);
}

/* The next format down in bytes per token, to name as a lever; COUNT when none is smaller. */
static enum llmem_kv_format smaller_format(enum llmem_kv_format f) {
    switch (f) {
    case LLMEM_KV_FORMAT_F32: return LLMEM_KV_FORMAT_F16;
    case LLMEM_KV_FORMAT_F16:
    case LLMEM_KV_FORMAT_BF16: return LLMEM_KV_FORMAT_Q8;
    case LLMEM_KV_FORMAT_Q8: return LLMEM_KV_FORMAT_Q4;
    default: return LLMEM_KV_FORMAT_COUNT;
    }
}

static void plan_context(const struct llmem_plan_params *p, struct llmem_plan *plan) {
    plan->kv_bytes_per_token_effective =
        llmem_kv_bytes_per_token_effective(p->kv_bytes_per_token, p->kv_format);
    plan->per_token_bytes = plan->kv_bytes_per_token_effective + p->aux_bytes_per_token +
                            p->prefill_transient_bytes_per_token;
    plan->computed_workspace_bytes = p->computed_workspace_bytes;
    plan->runtime_transients_bytes =
        max64(p->computed_workspace_bytes, min64(TRANSIENTS_CAP, plan->usable_bytes / 8));
    plan->bank_floor_bytes = min64(BANK_FLOOR_CAP, plan->usable_bytes / 16);

    int64_t left = play_after(plan, plan->runtime_transients_bytes);
    plan->kv_budget_bytes = max64(0, sub_sat(left, plan->bank_floor_bytes));
    /* the windows whose KV stays strictly inside the budget: footprint < allocation limit */
    int64_t raw = max64(0, plan->kv_budget_bytes - 1) / plan->per_token_bytes;
    int64_t fit = raw >= CONTEXT_ALIGN ? raw / CONTEXT_ALIGN * CONTEXT_ALIGN : raw;
    int64_t model_max = p->model_max_context > 0 ? p->model_max_context : INT64_MAX;
    int64_t minimum =
        min64(p->requested_context > 0 ? p->requested_context : CONTEXT_MINIMUM, model_max);

    plan->context_raw = raw;
    plan->pool_tokens = raw;
    plan->context_window_fit = min64(fit, model_max);
    plan->machine_bound = fit < model_max;
    plan->model_fits = raw >= minimum;

    if (p->requested_context > 0) {
        plan->context_window_resolved = min64(p->requested_context, model_max);
        plan->overcommitted = plan->context_window_resolved > raw;
    } else if (plan->model_fits) {
        plan->context_window_resolved = plan->context_window_fit;
    } else {
        plan->context_window_resolved = min64(CONTEXT_MINIMUM, model_max);
    }
    int64_t resolved = plan->context_window_resolved;
    plan->kv_reserve_bytes =
        mul_sat(resolved, plan->kv_bytes_per_token_effective + p->aux_bytes_per_token);
    plan->max_full_window_sequences = resolved > 0 ? raw / resolved : 0;
}

/* ---- step 6: the bank ------------------------------------------------------------------------ */

static void plan_bank(struct llmem_plan *plan) {
    int64_t left = play_after(plan, plan->runtime_transients_bytes);
    int64_t steady = sub_sat(left, plan->kv_reserve_bytes);
    plan->bank_cap_bytes = BANK_CAP;
    plan->bank_idle_max_bytes = clamp64(left, plan->bank_floor_bytes, BANK_CAP);
    plan->bank_steady_bytes = clamp64(steady, plan->bank_floor_bytes, BANK_CAP);
    plan->headroom_bytes = max64(0, sub_sat(steady, plan->bank_steady_bytes));
}

/* ---- §3.1: allocation limit, trip, ceiling and the util band --------------------------------- */

static void plan_limits(const struct llmem_plan_params *p, struct llmem_plan *plan) {
    /* A budget simulates a smaller machine: the limits are derived against it too. */
    int64_t budget = plan->budget_bytes > 0 ? plan->budget_bytes : INT64_MAX;
    double ceiling = (double)min64(plan->ceiling_bytes, budget);
    double total = (double)min64(plan->total_bytes, budget);
    plan->util_requested = p->util;
    plan->allocation_limit_bytes = plan->usable_bytes;
    plan->allocator_limit_bytes =
        max64(0, sub_sat(plan->usable_bytes, plan->runtime_baseline_bytes));
    plan->util = (double)plan->usable_bytes / ceiling;
    plan->trip_bytes = (int64_t)((plan->util + TRIP_OFFSET) * total);
    int64_t footprint = add_sat(add_sat(add_sat(plan->weights_bytes, plan->runtime_baseline_bytes),
                                        plan->runtime_transients_bytes),
                                add_sat(plan->kv_reserve_bytes, plan->bank_floor_bytes));
    plan->footprint_bytes = footprint;
    plan->band_low = (double)footprint / ceiling;
    plan->band_high = ceiling / total - TRIP_OFFSET;
    plan->band_empty = plan->band_low >= plan->band_high;
    plan->util_in_band = plan->util > plan->band_low && plan->util < plan->band_high;
    plan->trip_above_ceiling = plan->trip_bytes >= (int64_t)ceiling;
}

/* ---- step 7: notes ----------------------------------------------------------------------------
 */

#define SZ(v)  llmem_size_format((v), (char[LLMEM_SIZE_STR_MAX]){0}, LLMEM_SIZE_STR_MAX)
#define GIB(v) llmem_size_format_short((v), (char[LLMEM_SIZE_STR_MAX]){0}, LLMEM_SIZE_STR_MAX)

static void plan_notes(const struct llmem_plan_params *p, struct llmem_plan *plan) {
    int64_t model_max = p->model_max_context;
    int64_t resolved = plan->context_window_resolved;
    int64_t window_kv = plan->kv_reserve_bytes;

    if (plan->budget_bytes > 0 &&
        plan->budget_bytes < min64(plan->total_bytes, plan->ceiling_bytes))
        note(plan, "planning for a budget of %s instead of this machine's %s (--budget)",
             SZ(plan->budget_bytes), SZ(min64(plan->total_bytes, plan->ceiling_bytes)));
    if (plan->ceiling_bytes < plan->total_bytes)
        note(plan,
             "the ceiling %s (a cgroup, wired or device limit) is below the memory size %s;"
             " the plan is made against the ceiling",
             SZ(plan->ceiling_bytes), SZ(plan->total_bytes));
    if (p->requested_context > 0 && model_max > 0 && p->requested_context > model_max)
        note(plan, "requested context %lld is above the model's maximum %lld; using %lld",
             (long long)p->requested_context, (long long)model_max, (long long)model_max);

    plan->verdict_note = plan->overcommitted || !plan->model_fits ? plan->n_notes : -1;
    if (plan->overcommitted) {
        note(plan,
             "requested context %lld exceeds the machine fit %lld: KV at the full window needs %s"
             " but %s is left for it; cap the context (--context) or quantize the KV (--kv-format)",
             (long long)resolved, (long long)plan->context_raw, GIB(window_kv),
             GIB(plan->kv_budget_bytes));
    } else if (!plan->model_fits) {
        int64_t need =
            add_sat(add_sat(add_sat(plan->weights_bytes, plan->runtime_baseline_bytes),
                            plan->runtime_transients_bytes),
                    add_sat(plan->bank_floor_bytes, mul_sat(resolved, plan->per_token_bytes)));
        int formula = plan->usable_source == LLMEM_USABLE_FORMULA ||
                      plan->usable_source == LLMEM_USABLE_BUDGET;
        char baseline[96] = "";
        if (plan->runtime_baseline_bytes > 0)
            snprintf(baseline, sizeof(baseline), " (%s of it the runtime baseline)",
                     GIB(plan->runtime_baseline_bytes));
        note(plan,
             LLMEM_PLAN_NO_FIT
             ": weights + minimum runtime (%lld tokens of context) need %s%s but"
             " the engine budget is %s; use fewer bits per weight or a smaller model%s",
             (long long)resolved, GIB(need), baseline, GIB(plan->usable_bytes),
             formula && need <= plan->planning_bytes
                 ? ", or give the engine more of this machine (--util, --memory-limit)"
                 : "");
    } else if (plan->machine_bound) {
        enum llmem_kv_format smaller = smaller_format(p->kv_format);
        char lever[160] = "";
        if (smaller != LLMEM_KV_FORMAT_COUNT) {
            int64_t per = llmem_kv_bytes_per_token_effective(p->kv_bytes_per_token, smaller) +
                          p->aux_bytes_per_token + p->prefill_transient_bytes_per_token;
            int64_t raw = plan->kv_budget_bytes / per;
            int64_t fit = raw >= CONTEXT_ALIGN ? raw / CONTEXT_ALIGN * CONTEXT_ALIGN : raw;
            if (model_max > 0)
                fit = min64(fit, model_max);
            snprintf(lever, sizeof(lever), "; --kv-format %s fits %lld",
                     llmem_kv_format_name(smaller), (long long)fit);
        }
        if (model_max > 0) {
            int64_t full = mul_sat(model_max, plan->per_token_bytes);
            note(plan,
                 "context is machine-bound: %lld of the model's %lld tokens fit; the full window"
                 " needs %s of KV, %s more than the budget leaves%s",
                 (long long)plan->context_window_fit, (long long)model_max, GIB(full),
                 GIB(full - plan->kv_budget_bytes), lever);
        } else {
            note(plan, "context is machine-bound at %lld tokens%s",
                 (long long)plan->context_window_fit, lever);
        }
    } else if (p->requested_context == 0) {
        note(plan,
             "context is the model's maximum %lld (the machine would fit %lld); one full"
             " window of KV is %s",
             (long long)plan->context_window_fit, (long long)plan->context_raw, SZ(window_kv));
    }
    if (plan->model_fits && !plan->overcommitted && plan->max_full_window_sequences > 1)
        note(plan, "the KV pool holds %lld tokens: %lld full windows side by side",
             (long long)plan->pool_tokens, (long long)plan->max_full_window_sequences);

    if (plan->band_empty)
        note(plan,
             "the util band is empty: the footprint %s needs util > %.3f, but the trip stays below"
             " the ceiling only for util < %.3f; raise the ceiling or shrink the footprint"
             " (a smaller context, --kv-format q8, a smaller model)",
             GIB(plan->footprint_bytes), plan->band_low, plan->band_high);
    else if (!plan->util_in_band)
        note(plan, "util %.3f is outside its band (%.3f, %.3f): %s", plan->util, plan->band_low,
             plan->band_high,
             plan->util <= plan->band_low
                 ? "the allocation limit is below the footprint; raise --util"
                 : "the trip would sit at or above the ceiling; lower --util");
    if (plan->trip_above_ceiling)
        note(plan,
             "the trip %s is at or above the ceiling %s: the soft valve would never fire before"
             " the hard limit",
             GIB(plan->trip_bytes), GIB(plan->ceiling_bytes));

    if (plan->usable_source == LLMEM_USABLE_FORMULA || plan->usable_source == LLMEM_USABLE_BUDGET)
        note(plan,
             "the engine budget is %s of %s, leaving %s to the system and other programs;"
             " if it must share the machine, lower it with --budget or --memory-limit",
             GIB(plan->usable_bytes), GIB(plan->planning_bytes),
             GIB(plan->planning_bytes - plan->usable_bytes));
}

/* ---- the plan ---------------------------------------------------------------------------------
 */

int llmem_plan_compute(const struct llmem_plan_params *params, struct llmem_plan *plan) {
    memset(plan, 0, sizeof(*plan));
    plan->verdict_note = -1;
    plan->unavailable_reason = "";
    int status = check_params(params);
    if (status != LLMEM_OK)
        return status;

    plan->target = params->target;
    plan->total_bytes = params->total_bytes;
    plan->weights_bytes = params->weights_bytes;
    plan->runtime_baseline_bytes = params->runtime_baseline_bytes;
    plan->kv_bytes_per_token = params->kv_bytes_per_token;
    plan->kv_format = params->kv_format;
    plan->aux_bytes_per_token = params->aux_bytes_per_token;
    plan->prefill_transient_bytes_per_token = params->prefill_transient_bytes_per_token;
    plan->model_max_context = params->model_max_context;
    plan->requested_context = params->requested_context;
    plan->max_sequences = params->max_sequences > 0 ? params->max_sequences : 1;
    plan->max_batch_tokens = params->max_batch_tokens > 0 ? params->max_batch_tokens : 512;
    plan->bank_cap_bytes = BANK_CAP;

    if (params->total_bytes <= 0)
        plan->unavailable_reason = "total_memory_unknown";
    else if (params->weights_bytes <= 0)
        plan->unavailable_reason = "model_weights_unknown";
    else if (params->kv_bytes_per_token <= 0)
        plan->unavailable_reason = "kv_bytes_per_token_unknown";
    if (plan->unavailable_reason[0] != '\0')
        return LLMEM_OK;
    plan->available = 1;

    plan_envelope(params, plan);
    plan_context(params, plan);
    plan_bank(plan);
    plan_limits(params, plan);
    plan_notes(params, plan);
    return LLMEM_OK;
}

char *llmem_plan_describe(const struct llmem_plan *plan, char *buf, size_t buf_size) {
    if (!plan->available) {
        snprintf(buf, buf_size, "memory plan unavailable (%s)", plan->unavailable_reason);
        return buf;
    }
    char budget[64] = "";
    if (plan->budget_bytes > 0)
        snprintf(budget, sizeof(budget), " (budget %s)", SZ(plan->budget_bytes));
    const char *why = plan->overcommitted           ? "OVERCOMMITTED"
                      : plan->requested_context > 0 ? "requested"
                      : !plan->model_fits           ? "minimum"
                      : plan->machine_bound         ? "machine-bound"
                                                    : "model maximum";
    snprintf(buf, buf_size,
             "%s %s%s: engine budget %s, weights %s, context %lld (%s), session bank up to %s"
             " (yields to %s under long-context load)%s",
             SZ(plan->total_bytes), plan->target == LLMEM_PLAN_CUDA ? "cuda" : "host", budget,
             GIB(plan->usable_bytes), GIB(plan->weights_bytes),
             (long long)plan->context_window_resolved, why, GIB(plan->bank_idle_max_bytes),
             GIB(plan->bank_steady_bytes),
             !plan->model_fits && !plan->overcommitted ? " — " LLMEM_PLAN_NO_FIT : "");
    return buf;
}

/* ---- §3.1: the invariant --------------------------------------------------------------------- */

int64_t llmem_plan_limits_ceiling(const struct llmem_plan *plan) {
    return plan->budget_bytes > 0 ? min64(plan->ceiling_bytes, plan->budget_bytes)
                                  : plan->ceiling_bytes;
}

int llmem_plan_limits_check(const struct llmem_plan *plan, char *buf, size_t buf_size) {
    if (buf_size > 0)
        buf[0] = '\0';
    if (!plan->available)
        return 0;
    const struct {
        int bit;
        const char *lo_name, *hi_name;
        int64_t lo, hi;
    } chain[] = {
        {LLMEM_PLAN_BREAKS_FOOTPRINT, "footprint", "allocation limit", plan->footprint_bytes,
         plan->allocation_limit_bytes},
        {LLMEM_PLAN_BREAKS_LIMIT, "allocation limit", "trip", plan->allocation_limit_bytes,
         plan->trip_bytes},
        {LLMEM_PLAN_BREAKS_TRIP, "trip", "ceiling", plan->trip_bytes,
         llmem_plan_limits_ceiling(plan)},
    };
    int broken = 0;
    size_t used = 0;
    for (size_t i = 0; i < sizeof(chain) / sizeof(chain[0]); i++) {
        if (chain[i].lo < chain[i].hi)
            continue;
        broken |= chain[i].bit;
        if (used < buf_size) {
            int n = snprintf(buf + used, buf_size - used, "%s%s %s < %s %s does not hold",
                             used > 0 ? "; " : "", chain[i].lo_name, GIB(chain[i].lo),
                             chain[i].hi_name, GIB(chain[i].hi));
            used += n > 0 ? (size_t)n : 0;
        }
    }
    return broken;
}

/* ---- §2.3 runtime functions ------------------------------------------------------------------ */

int64_t llmem_plan_bank_dynamic_ceiling(const struct llmem_plan *plan, int64_t working_set_bytes,
                                        int64_t observed_reserve_bytes) {
    if (!plan->available)
        return BANK_CAP;
    int64_t reserve = max64(plan->runtime_transients_bytes, observed_reserve_bytes);
    int64_t ceiling = sub_sat(play_after(plan, reserve), max64(0, working_set_bytes));
    return max64(plan->bank_floor_bytes, min64(plan->bank_idle_max_bytes, ceiling));
}

int64_t llmem_plan_transient_reserve(int64_t peak, int64_t active, int64_t play, int64_t floor) {
    int64_t spike = max64(0, sub_sat(peak, active));
    int64_t cap = min64(TRANSIENT_RESERVE_CAP, max64(floor, play / 2));
    return max64(floor, min64(cap, spike));
}
