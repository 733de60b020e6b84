/*
 * tests/test-plan.c — the memory plan, with integers alone: the reference numbers of SPEC §2.4,
 * the envelope across machine sizes, overrides, context fit, the steady-state guarantee, notes,
 * the runtime functions of §2.3, the util band of §3.1, KV format ratios and the catalog.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmem/plan.h"
#include "testutil.h"

#define GiB         LLMEM_GIB
#define MiB         LLMEM_MIB
#define REF_WEIGHTS 21313949792LL

static struct llmem_plan_params ref_params(int64_t total) {
    struct llmem_plan_params p = {0};
    p.total_bytes = total;
    p.weights_bytes = REF_WEIGHTS;
    p.kv_bytes_per_token = 65536;
    p.model_max_context = 262144;
    return p;
}

static struct llmem_plan compute(const struct llmem_plan_params *p) {
    struct llmem_plan plan;
    assert_int_equal(llmem_plan_compute(p, &plan), LLMEM_OK);
    return plan;
}

static int has_note(const struct llmem_plan *plan, const char *phrase) {
    for (int i = 0; i < plan->n_notes; i++)
        if (strstr(plan->notes[i], phrase) != NULL)
            return 1;
    return 0;
}

/* The steady state of §2.2 step 6: what is committed plus the steady bank fits in usable. */
static void assert_steady_state_fits(const struct llmem_plan *p) {
    if (!p->available || !p->model_fits || p->overcommitted)
        return;
    assert_true(p->weights_bytes + p->runtime_baseline_bytes + p->runtime_transients_bytes +
                    p->bank_steady_bytes + p->kv_reserve_bytes <=
                p->usable_bytes);
    assert_true(p->context_window_resolved <= p->context_raw);
}

/* ---- SPEC §2.4 ----------------------------------------------------------------------------- */

static void test_reference_48g(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    struct llmem_plan p = compute(&params);
    assert_true(p.available);
    assert_int_equal(p.usable_bytes, 36 * GiB);
    assert_int_equal(p.usable_source, LLMEM_USABLE_FORMULA);
    assert_int_equal(p.runtime_transients_bytes, 3 * GiB);
    assert_int_equal(p.bank_floor_bytes, 1 * GiB);
    assert_int_equal(p.context_window_resolved, 196608);
    assert_int_equal(p.context_window_fit, 196608);
    assert_true(p.machine_bound);
    assert_true(p.model_fits);
    assert_false(p.overcommitted);
    assert_int_equal(p.bank_idle_max_bytes, 14119530400LL);
    assert_int_equal(p.bank_steady_bytes, 1234628512LL);
    assert_int_equal(p.kv_reserve_bytes, 196608LL * 65536);
    assert_int_equal(p.headroom_bytes, 0);
    char line[512];
    assert_string_equal(llmem_plan_describe(&p, line, sizeof(line)),
                        "48G host: engine budget 36.0G, weights 19.9G, context 196608"
                        " (machine-bound), session bank up to 13.1G (yields to 1.1G under"
                        " long-context load)");
    assert_true(has_note(&p, "machine-bound: 196608 of the model's 262144"));
    assert_true(has_note(&p, "--kv-format q8 fits 262144"));
    assert_steady_state_fits(&p);
}

static void test_reference_48g_q8_fits_full_window(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    params.kv_format = LLMEM_KV_FORMAT_Q8;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.kv_bytes_per_token_effective, 34816);
    assert_int_equal(p.context_window_resolved, 262144);
    assert_false(p.machine_bound);
    assert_true(p.model_fits);
    assert_steady_state_fits(&p);
}

static void test_reference_128g(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(128 * GiB);
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.usable_bytes, 96 * GiB);
    assert_int_equal(p.context_window_resolved, 262144);
    assert_int_equal(p.bank_idle_max_bytes, 48 * GiB);
    assert_int_equal(p.bank_steady_bytes, 48 * GiB);
    assert_false(p.machine_bound);
    assert_true(has_note(&p, "model's maximum 262144"));
    assert_steady_state_fits(&p);
}

static void test_envelope_sizes(void **state) {
    (void)state;
    const struct {
        int64_t total_gib;
        int64_t usable;
    } cases[] = {
        {8, 7730941132LL}, {16, 12 * GiB},   {24, 18 * GiB},   {32, 24 * GiB},
        {48, 36 * GiB},    {64, 48 * GiB},   {96, 72 * GiB},   {128, 96 * GiB},
        {192, 144 * GiB},  {256, 192 * GiB}, {512, 192 * GiB},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct llmem_plan_params params = ref_params(cases[i].total_gib * GiB);
        params.weights_bytes = 1 * GiB;
        struct llmem_plan p = compute(&params);
        assert_int_equal(p.usable_bytes, cases[i].usable);
        assert_int_equal(p.usable_source, LLMEM_USABLE_FORMULA);
        /* transients min(3G, usable/8), bank floor min(1G, usable/16) */
        assert_int_equal(p.runtime_transients_bytes,
                         cases[i].usable / 8 < 3 * GiB ? cases[i].usable / 8 : 3 * GiB);
        assert_int_equal(p.bank_floor_bytes,
                         cases[i].usable / 16 < GiB ? cases[i].usable / 16 : GiB);
        assert_true(p.allocation_limit_bytes == p.usable_bytes);
        assert_true(p.trip_bytes > p.allocation_limit_bytes);
        assert_true(p.trip_bytes < p.ceiling_bytes);
        assert_steady_state_fits(&p);
    }
}

/* ---- overrides ------------------------------------------------------------------------------ */

static void test_budget_override(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(128 * GiB);
    params.memory_budget_bytes = 48 * GiB;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.planning_bytes, 48 * GiB);
    assert_int_equal(p.usable_bytes, 36 * GiB);
    assert_int_equal(p.usable_source, LLMEM_USABLE_BUDGET);
    assert_int_equal(p.context_window_resolved, 196608);
    assert_true(has_note(&p, "budget of 48G instead of this machine's 128G"));
    char line[512];
    llmem_plan_describe(&p, line, sizeof(line));
    assert_non_null(strstr(line, "128G host (budget 48G): engine budget 36.0G"));
    /* A budget above the machine changes nothing. */
    params.memory_budget_bytes = 1024 * GiB;
    p = compute(&params);
    assert_int_equal(p.usable_bytes, 96 * GiB);
}

static void test_memory_limit_override(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    params.memory_limit_bytes = 40 * GiB;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.usable_bytes, 40 * GiB);
    assert_int_equal(p.usable_source, LLMEM_USABLE_MEMORY_LIMIT);
    assert_int_equal(p.allocation_limit_bytes, 40 * GiB);
    /* Bounded by the machine. */
    params.memory_limit_bytes = 100 * GiB;
    p = compute(&params);
    assert_int_equal(p.usable_bytes, 48 * GiB);
    assert_steady_state_fits(&p);
}

static void test_util_override(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    params.util = 0.5;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.usable_bytes, 24 * GiB);
    assert_int_equal(p.usable_source, LLMEM_USABLE_UTIL);
    assert_int_equal(p.allocation_limit_bytes, 24 * GiB);
    assert_true(fabs(p.util - 0.5) < 1e-12);
    assert_int_equal(p.trip_bytes, (int64_t)(0.55 * (double)(48 * GiB)));
    /* util of the ceiling, not of the total */
    params.ceiling_bytes = 40 * GiB;
    p = compute(&params);
    assert_int_equal(p.usable_bytes, 20 * GiB);
    /* bounded by planning (budget) */
    params.ceiling_bytes = 0;
    params.util = 1.0;
    params.memory_budget_bytes = 16 * GiB;
    p = compute(&params);
    assert_int_equal(p.usable_bytes, 16 * GiB);
}

/* The invariant footprint < allocation limit < trip < ceiling, checked inequality by inequality. */
static void test_limits_check(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    struct llmem_plan p = compute(&params);
    char why[256] = "x";
    assert_int_equal(llmem_plan_limits_check(&p, why, sizeof(why)), 0);
    assert_string_equal(why, "");
    /* the whole machine: the trip 1.05 × total sits above the ceiling */
    params.memory_limit_bytes = 1000 * GiB;
    p = compute(&params);
    assert_int_equal(llmem_plan_limits_check(&p, why, sizeof(why)), LLMEM_PLAN_BREAKS_TRIP);
    assert_string_equal(why, "trip 50.4G < ceiling 48.0G does not hold");
    /* an allocation limit below the footprint */
    params.memory_limit_bytes = 0;
    params.util = 0.5;
    p = compute(&params);
    assert_int_equal(llmem_plan_limits_check(&p, why, sizeof(why)), LLMEM_PLAN_BREAKS_FOOTPRINT);
    assert_non_null(strstr(why, "footprint 24.1G < allocation limit 24.0G does not hold"));
    /* with a budget the ceiling is the budget's */
    params = ref_params(48 * GiB);
    params.memory_budget_bytes = 32 * GiB;
    params.util = 0.99;
    p = compute(&params);
    assert_int_equal(llmem_plan_limits_ceiling(&p), 32 * GiB);
    assert_true(llmem_plan_limits_check(&p, NULL, 0) & LLMEM_PLAN_BREAKS_TRIP);
}

static void test_invalid_params(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    struct llmem_plan p;
    params.util = 1.5;
    assert_int_equal(llmem_plan_compute(&params, &p), LLMEM_EINVAL);
    params.util = NAN;
    assert_int_equal(llmem_plan_compute(&params, &p), LLMEM_EINVAL);
    params = ref_params(48 * GiB);
    params.requested_context = -1;
    assert_int_equal(llmem_plan_compute(&params, &p), LLMEM_EINVAL);
    params = ref_params(48 * GiB);
    params.kv_format = (enum llmem_kv_format)99;
    assert_int_equal(llmem_plan_compute(&params, &p), LLMEM_EINVAL);
}

static void test_unavailable(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(0);
    struct llmem_plan p = compute(&params);
    assert_false(p.available);
    assert_string_equal(p.unavailable_reason, "total_memory_unknown");
    char line[256];
    assert_string_equal(llmem_plan_describe(&p, line, sizeof(line)),
                        "memory plan unavailable (total_memory_unknown)");
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, 0, 0), 48 * GiB);
    params = ref_params(48 * GiB);
    params.weights_bytes = 0;
    p = compute(&params);
    assert_string_equal(p.unavailable_reason, "model_weights_unknown");
}

/* ---- ceilings -------------------------------------------------------------------------------- */

static void test_cgroup_ceiling_below_75_percent(void **state) {
    (void)state;
    /* 64G of RAM in a 32G cgroup: total = min(RAM, cgroup) = 32G, not 75 % of 64G. */
    struct llmem_plan_params params = ref_params(32 * GiB);
    params.weights_bytes = 8 * GiB;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.usable_bytes, 24 * GiB);
    assert_true(p.usable_bytes < 48 * GiB);
    assert_true(p.trip_bytes < 32 * GiB);

    /* The same machine described as total 64G with a 20G ceiling: planned against the ceiling,
     * and the trip (a fraction of the total) lands above it — said in the notes. */
    params.total_bytes = 64 * GiB;
    params.ceiling_bytes = 20 * GiB;
    p = compute(&params);
    assert_int_equal(p.planning_bytes, 20 * GiB);
    assert_int_equal(p.usable_bytes, 15 * GiB);
    assert_true(p.trip_above_ceiling);
    assert_true(has_note(&p, "the ceiling 20G"));
    assert_true(has_note(&p, "soft valve would never fire"));
}

static void test_util_band_empty_seed_trap(void **state) {
    (void)state;
    /* seed 003: --total 96G --ceiling 72G --util 0.9 → trip 0.95 × 96G above the 72G ceiling. */
    struct llmem_plan_params params = ref_params(96 * GiB);
    params.ceiling_bytes = 72 * GiB;
    params.util = 0.9;
    params.weights_bytes = 40 * GiB; /* machine-bound: the window fills the budget */
    params.kv_bytes_per_token = 131072;
    params.model_max_context = 1048576;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.allocation_limit_bytes, (int64_t)(0.9 * (double)(72 * GiB)));
    assert_int_equal(p.trip_bytes, (int64_t)(0.95 * (double)(96 * GiB)));
    assert_true(p.trip_above_ceiling);
    assert_true(fabs(p.band_high - 0.70) < 1e-12);
    assert_true(p.band_empty);
    assert_false(p.util_in_band);
    assert_true(has_note(&p, "util band is empty"));
    assert_true(has_note(&p, "raise the ceiling or shrink the footprint"));

    /* A small model on the same machine: the band exists, util 0.9 is above it. */
    params.weights_bytes = 4 * GiB;
    params.model_max_context = 8192;
    p = compute(&params);
    assert_false(p.band_empty);
    assert_false(p.util_in_band);
    assert_true(has_note(&p, "outside its band"));
    /* ... and util 0.6 is inside it. */
    params.util = 0.6;
    p = compute(&params);
    assert_true(p.util_in_band);
    assert_false(p.trip_above_ceiling);
}

/* ---- context fit ----------------------------------------------------------------------------- */

static void test_fit_monotonic_in_memory(void **state) {
    (void)state;
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        int64_t prev_ctx = 0, prev_raw = 0, prev_usable = 0;
        int prev_fits = 0;
        for (int64_t total = 1 * GiB; total <= 1024 * GiB; total += GiB / 2) {
            struct llmem_plan_params params = ref_params(total);
            params.kv_format = (enum llmem_kv_format)f;
            struct llmem_plan p = compute(&params);
            assert_true(p.usable_bytes >= prev_usable);
            assert_true(p.context_raw >= prev_raw);
            if (p.model_fits)
                assert_true(p.context_window_resolved >= prev_ctx);
            assert_true(p.model_fits >= prev_fits);
            assert_steady_state_fits(&p);
            prev_usable = p.usable_bytes;
            prev_raw = p.context_raw;
            prev_fits = p.model_fits;
            if (p.model_fits)
                prev_ctx = p.context_window_resolved;
        }
    }
}

static void test_steady_state_fits_sweep(void **state) {
    (void)state;
    /* A seeded sweep over machines, models, formats, budgets and requests. */
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    int checked = 0;
    for (int i = 0; i < 20000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        struct llmem_plan_params params = {0};
        params.total_bytes = (int64_t)(x % (600 * (uint64_t)GiB)) + GiB / 4;
        params.weights_bytes = (int64_t)((x >> 11) % (200 * (uint64_t)GiB)) + 1;
        params.kv_bytes_per_token = 128 * (int64_t)(1 + (x >> 23) % 4096);
        params.kv_format = (enum llmem_kv_format)((x >> 37) % LLMEM_KV_FORMAT_COUNT);
        params.model_max_context = (x >> 40) % 4 == 0 ? 0 : 1024 * (int64_t)(1 + (x >> 42) % 1024);
        params.requested_context = (x >> 52) % 3 == 0 ? 512 * (int64_t)(1 + (x >> 54) % 512) : 0;
        params.computed_workspace_bytes = (x >> 45) % 2 ? (int64_t)((x >> 20) % (4 * GiB)) : 0;
        if ((x >> 60) % 4 == 0)
            params.memory_budget_bytes = params.total_bytes / 2;
        struct llmem_plan p = compute(&params);
        assert_steady_state_fits(&p);
        assert_true(p.headroom_bytes >= 0);
        assert_true(p.bank_steady_bytes >= p.bank_floor_bytes);
        assert_true(p.bank_steady_bytes <= p.bank_idle_max_bytes);
        assert_true(p.bank_idle_max_bytes <= 48 * GiB);
        assert_true(p.kv_budget_bytes >= 0);
        if (p.model_fits && !p.overcommitted)
            assert_false(llmem_plan_limits_check(&p, NULL, 0) & LLMEM_PLAN_BREAKS_FOOTPRINT);
        checked += p.model_fits && !p.overcommitted;
    }
    assert_true(checked > 1000);
}

/* A budget that the windows' KV divides exactly: the fit leaves the footprint strictly below the
 * allocation limit, as the limits' chain asks (it equalled it). */
static void test_fit_inside_exact_budget(void **state) {
    (void)state;
    struct llmem_plan_params params = {.total_bytes = 48 * GiB,
                                       .weights_bytes = 10 * GiB,
                                       .kv_bytes_per_token = 65536,
                                       .kv_format = LLMEM_KV_FORMAT_F16};
    struct llmem_plan p = compute(&params);
    assert_true(p.model_fits && p.machine_bound);
    assert_true(p.footprint_bytes < p.allocation_limit_bytes);
    assert_int_equal(llmem_plan_limits_check(&p, NULL, 0), 0);
    assert_int_equal(p.context_window_resolved, 360448 - 4096);
}

static void test_windows_aligned_or_model_capped(void **state) {
    (void)state;
    for (int64_t total = 40 * GiB; total <= 256 * GiB; total += 3 * GiB) {
        struct llmem_plan_params params = ref_params(total);
        struct llmem_plan p = compute(&params);
        assert_true(p.model_fits);
        if (p.machine_bound) {
            assert_int_equal(p.context_window_resolved % 4096, 0);
            assert_true(p.context_window_resolved <= p.context_raw);
            assert_true(p.context_window_resolved + 4096 > p.context_raw);
        } else {
            assert_int_equal(p.context_window_resolved, 262144);
        }
    }
    /* A model maximum that is not a multiple of 4096 is used as is. */
    struct llmem_plan_params params = ref_params(512 * GiB);
    params.model_max_context = 40960 + 100;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.context_window_resolved, 41060);
}

static void test_overcommit(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    params.requested_context = 262144;
    struct llmem_plan p = compute(&params);
    assert_true(p.overcommitted);
    assert_false(p.model_fits);
    assert_int_equal(p.context_window_resolved, 262144);
    assert_int_equal(p.kv_reserve_bytes, 262144LL * 65536);
    assert_true(has_note(&p, "requested context 262144 exceeds the machine fit 199062"));
    assert_true(has_note(&p, "KV at the full window needs 16.0G"));
    char line[512];
    llmem_plan_describe(&p, line, sizeof(line));
    assert_non_null(strstr(line, "context 262144 (OVERCOMMITTED)"));
    assert_null(strstr(line, "DOES NOT FIT"));

    /* A request that fits wins over the fit, even when smaller. */
    params.requested_context = 8192;
    p = compute(&params);
    assert_false(p.overcommitted);
    assert_true(p.model_fits);
    assert_int_equal(p.context_window_resolved, 8192);
    assert_int_equal(p.kv_reserve_bytes, 8192LL * 65536);
    assert_steady_state_fits(&p);

    /* A request above the model's maximum is capped to it, and says so. */
    params.total_bytes = 512 * GiB;
    params.requested_context = 1000000;
    p = compute(&params);
    assert_int_equal(p.context_window_resolved, 262144);
    assert_false(p.overcommitted);
    assert_true(has_note(&p, "above the model's maximum 262144"));
}

static void test_small_context_models(void **state) {
    (void)state;
    /* pycoder: 6 layers × 2 KV heads × 64 × 2 × 2 = 3072 B/token, 2048 max context. */
    struct llmem_plan_params params = {0};
    params.total_bytes = 24 * GiB;
    params.weights_bytes = 11546624;
    params.kv_bytes_per_token = 3072;
    params.model_max_context = 2048;
    struct llmem_plan p = compute(&params);
    assert_true(p.model_fits);
    assert_int_equal(p.context_window_resolved, 2048);
    assert_false(p.machine_bound);

    /* On a tiny budget: the minimum is the model's 2048, not 4096. */
    params.memory_budget_bytes = 64 * LLMEM_MIB;
    p = compute(&params);
    /* usable = min(64M, max(min(8G, 57.6M), 48M)) = 57.6M; kv budget = usable − weights −
     * usable/8 − usable/16 */
    assert_int_equal(p.usable_bytes, 60397977);
    int64_t budget = 60397977 - 11546624 - 60397977 / 8 - 60397977 / 16;
    assert_int_equal(p.kv_budget_bytes, budget);
    assert_int_equal(p.context_raw, budget / 3072);
    assert_true(p.model_fits);
    assert_int_equal(p.context_window_resolved, 2048);

    /* An explicit context on a budget too small for 2048: fits at 1024. */
    params.memory_budget_bytes = 20 * LLMEM_MIB;
    params.requested_context = 1024;
    p = compute(&params);
    assert_true(p.context_raw < 2048);
    assert_true(p.context_raw >= 1024);
    assert_true(p.model_fits);
    assert_int_equal(p.context_window_resolved, 1024);
    assert_steady_state_fits(&p);
    /* and without the request it does not fit */
    params.requested_context = 0;
    p = compute(&params);
    assert_false(p.model_fits);
    assert_int_equal(p.context_window_resolved, 2048);
    /* below 4096 the raw fit is used unaligned */
    params.memory_budget_bytes = 30 * LLMEM_MIB;
    params.model_max_context = 8192;
    p = compute(&params);
    assert_true(p.context_raw < 4096);
    assert_int_equal(p.context_window_fit, p.context_raw);
}

static void test_model_does_not_fit(void **state) {
    (void)state;
    /* A 70B model (141 GB of bf16) on a 64G machine. */
    struct llmem_plan_params params = ref_params(64 * GiB);
    params.weights_bytes = 141107412992LL;
    params.kv_bytes_per_token = 327680;
    params.model_max_context = 131072;
    struct llmem_plan p = compute(&params);
    assert_false(p.model_fits);
    assert_false(p.overcommitted);
    assert_int_equal(p.context_window_resolved, 4096);
    assert_int_equal(p.kv_budget_bytes, 0);
    assert_int_equal(p.context_raw, 0);
    assert_true(has_note(&p, "MODEL DOES NOT FIT"));
    assert_true(has_note(&p, "fewer bits per weight or a smaller model"));
    char line[512];
    llmem_plan_describe(&p, line, sizeof(line));
    assert_non_null(strstr(line, "— MODEL DOES NOT FIT"));
    /* A model whose maximum is below 4096 reports its maximum. */
    params.model_max_context = 2048;
    p = compute(&params);
    assert_int_equal(p.context_window_resolved, 2048);
    assert_false(p.model_fits);
}

/* ---- KV formats ------------------------------------------------------------------------------ */

static void test_kv_format_bytes(void **state) {
    (void)state;
    const int64_t expect[LLMEM_KV_FORMAT_COUNT] = {
        [LLMEM_KV_FORMAT_F16] = 65536,  [LLMEM_KV_FORMAT_BF16] = 65536,
        [LLMEM_KV_FORMAT_F32] = 131072, [LLMEM_KV_FORMAT_Q8] = 34816,
        [LLMEM_KV_FORMAT_Q4] = 20480,   [LLMEM_KV_FORMAT_TQ] = 25600,
    };
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        assert_int_equal(llmem_kv_bytes_per_token_effective(65536, (enum llmem_kv_format)f),
                         expect[f]);
        enum llmem_kv_format parsed;
        assert_int_equal(
            llmem_kv_format_parse(llmem_kv_format_name((enum llmem_kv_format)f), &parsed),
            LLMEM_OK);
        assert_int_equal(parsed, f);
        /* The plan carries the same number and prices the reserve with it. */
        struct llmem_plan_params params = ref_params(48 * GiB);
        params.kv_format = (enum llmem_kv_format)f;
        struct llmem_plan p = compute(&params);
        assert_int_equal(p.kv_bytes_per_token_effective, expect[f]);
        assert_int_equal(p.kv_reserve_bytes, p.context_window_resolved * expect[f]);
    }
    /* The ratios from the layouts of §4.4: per 32 elements of K and of V. */
    assert_int_equal(llmem_kv_format_info(LLMEM_KV_FORMAT_Q8)->key_group_bytes, 34);
    assert_int_equal(llmem_kv_format_info(LLMEM_KV_FORMAT_Q4)->value_group_bytes, 20);
    assert_int_equal(llmem_kv_format_info(LLMEM_KV_FORMAT_TQ)->key_group_bytes, 36);
    assert_int_equal(llmem_kv_format_info(LLMEM_KV_FORMAT_TQ)->value_group_bytes, 14);
    /* Not a multiple of the group: rounded up, never under-planned. */
    assert_int_equal(llmem_kv_bytes_per_token_effective(100, LLMEM_KV_FORMAT_Q8), 54);
    enum llmem_kv_format f;
    assert_int_equal(llmem_kv_format_parse("q5", &f), LLMEM_EINVAL);
    assert_int_equal(llmem_kv_format_parse("Q8", &f), LLMEM_OK);
}

/* ---- §2.3 runtime functions ------------------------------------------------------------------ */

static void test_bank_dynamic_ceiling(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    struct llmem_plan p = compute(&params);
    /* idle: nothing live → the idle maximum */
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, 0, 0), p.bank_idle_max_bytes);
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, -5, 0), p.bank_idle_max_bytes);
    /* yielding: live KV takes bytes from the bank one for one */
    int64_t ws = 4 * GiB;
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, ws, 0), p.bank_idle_max_bytes - ws);
    /* an observed reserve above the plan's transients also takes from the bank */
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, ws, 5 * GiB),
                     p.bank_idle_max_bytes - ws - 2 * GiB);
    /* a smaller observed reserve does not give back more than the plan */
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, ws, 1 * GiB), p.bank_idle_max_bytes - ws);
    /* floor: a full window live → never below the bank floor */
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, p.kv_reserve_bytes, 0),
                     p.bank_steady_bytes);
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, 100 * GiB, 0), p.bank_floor_bytes);
    /* on a big machine the cap binds when idle */
    params = ref_params(512 * GiB);
    p = compute(&params);
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, 0, 0), 48 * GiB);
}

/* The runtime baseline (what the process holds outside the allocator) is a commitment: it comes
 * off what KV and the bank get, byte for byte, enters the footprint, and the allocator's limit is
 * the process's allocation limit less it; 0 leaves SPEC §2.4's numbers as they are. */
static void test_runtime_baseline(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    struct llmem_plan base = compute(&params);
    assert_int_equal(base.runtime_baseline_bytes, 0);
    assert_int_equal(base.allocator_limit_bytes, base.allocation_limit_bytes);
    const int64_t b = 512 * MiB;
    params.runtime_baseline_bytes = b;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.runtime_baseline_bytes, b);
    assert_int_equal(p.usable_bytes, base.usable_bytes);
    assert_int_equal(p.kv_budget_bytes, base.kv_budget_bytes - b);
    assert_int_equal(p.bank_idle_max_bytes, base.bank_idle_max_bytes - b);
    assert_int_equal(p.footprint_bytes - p.kv_reserve_bytes,
                     base.footprint_bytes - base.kv_reserve_bytes + b);
    assert_int_equal(p.allocation_limit_bytes, base.allocation_limit_bytes);
    assert_int_equal(p.allocator_limit_bytes, p.allocation_limit_bytes - b);
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, 0, 0), p.bank_idle_max_bytes);
    assert_int_equal(llmem_plan_bank_dynamic_ceiling(&p, 4 * GiB, 0),
                     llmem_plan_bank_dynamic_ceiling(&base, 4 * GiB, 0) - b);
    assert_steady_state_fits(&p);

    /* a baseline the budget cannot hold: the model does not fit, and the note says how much of
     * the need is the baseline */
    params = ref_params(48 * GiB);
    params.memory_budget_bytes = 24 * GiB;
    params.runtime_baseline_bytes = 3 * GiB;
    p = compute(&params);
    assert_false(p.model_fits);
    assert_true(has_note(&p, "of it the runtime baseline"));
    assert_true(llmem_plan_limits_check(&p, NULL, 0) & LLMEM_PLAN_BREAKS_FOOTPRINT);
    params.runtime_baseline_bytes = -1;
    assert_int_equal(llmem_plan_compute(&params, &p), LLMEM_EINVAL);
}

static void test_transient_reserve(void **state) {
    (void)state;
    int64_t floor = 3 * GiB, play = 100 * GiB;
    /* no spike → the floor */
    assert_int_equal(llmem_plan_transient_reserve(10 * GiB, 10 * GiB, play, floor), floor);
    assert_int_equal(llmem_plan_transient_reserve(5 * GiB, 10 * GiB, play, floor), floor);
    /* a spike between floor and cap is kept */
    assert_int_equal(llmem_plan_transient_reserve(15 * GiB, 10 * GiB, play, floor), 5 * GiB);
    /* capped at 16 GiB */
    assert_int_equal(llmem_plan_transient_reserve(60 * GiB, 10 * GiB, play, floor), 16 * GiB);
    /* capped at play / 2 when that is lower */
    assert_int_equal(llmem_plan_transient_reserve(60 * GiB, 10 * GiB, 20 * GiB, floor), 10 * GiB);
    /* play / 2 below the floor: the floor wins */
    assert_int_equal(llmem_plan_transient_reserve(60 * GiB, 10 * GiB, 2 * GiB, floor), floor);
}

/* ---- geometry and catalog -------------------------------------------------------------------- */

static void test_catalog(void **state) {
    (void)state;
    assert_true(llmem_catalog_count() >= 15);
    for (size_t i = 0; i < llmem_catalog_count(); i++) {
        const struct llmem_model_geometry *g = llmem_catalog_get(i);
        assert_int_equal(llmem_geometry_param_count(g), g->n_params);
        assert_int_equal(g->weights_bytes, 2 * g->n_params);
        assert_int_equal(g->n_heads % g->n_kv_heads, 0);
        assert_ptr_equal(llmem_catalog_find(g->name), g);
    }
    assert_null(llmem_catalog_get(llmem_catalog_count()));
    assert_null(llmem_catalog_find("no-such-model"));
    /* Parameter counts as published by the model authors. */
    const struct {
        const char *name;
        int64_t params;
    } published[] = {
        {"llama-3.2-1b", 1235814400LL},   {"llama-3.2-3b", 3212749824LL},
        {"llama-3.1-8b", 8030261248LL},   {"llama-3.1-70b", 70553706496LL},
        {"qwen2.5-0.5b", 494032768LL},    {"qwen2.5-7b", 7615616512LL},
        {"qwen2.5-72b", 72706203648LL},   {"mistral-7b-v0.3", 7248023552LL},
        {"tinyllama-1.1b", 1100048384LL}, {"qwen3-8b", 8190735360LL},
        {"qwen3-30b-a3b", 30532122624LL}, {"qwen3-235b-a22b", 235093634560LL},
        {"mixtral-8x7b", 46702792704LL},
    };
    for (size_t i = 0; i < sizeof(published) / sizeof(published[0]); i++) {
        const struct llmem_model_geometry *g = llmem_catalog_find(published[i].name);
        assert_non_null(g);
        assert_int_equal(g->n_params, published[i].params);
    }
    const struct llmem_model_geometry *g = llmem_catalog_find("LLAMA-3.1-8B");
    assert_non_null(g);
    assert_int_equal(llmem_geometry_kv_bytes_per_token(g), 32 * 2 * 8 * 128 * 2);
}

/* Mixtures of experts: what a token reads, as the model cards give it (Qwen3-30B-A3B: 3.3B
 * activated; Qwen3-235B-A22B: 22B; Mixtral-8x7B: 12.9B), and the bytes of it. */
static void test_moe_geometry(void **state) {
    (void)state;
    const struct {
        const char *name;
        int64_t active;
    } moe[] = {{"qwen3-30b-a3b", 3353032704LL},
               {"qwen3-235b-a22b", 22190763520LL},
               {"mixtral-8x7b", 12879925248LL}};
    for (size_t i = 0; i < sizeof(moe) / sizeof(moe[0]); i++) {
        const struct llmem_model_geometry *g = llmem_catalog_find(moe[i].name);
        assert_non_null(g);
        assert_int_equal(llmem_geometry_active_param_count(g), moe[i].active);
        /* bf16 at 2 bytes a parameter: the active bytes are exactly twice the active parameters */
        assert_int_equal(llmem_geometry_active_bytes(g), 2 * moe[i].active);
        struct llmem_model_geometry priced = *g; /* without expert_bytes: priced by parameters */
        priced.expert_bytes = 0;
        assert_int_equal(llmem_geometry_active_bytes(&priced), 2 * moe[i].active);
    }
    const struct llmem_model_geometry *dense = llmem_catalog_find("llama-3.1-8b");
    assert_int_equal(llmem_geometry_active_param_count(dense), dense->n_params);
    assert_int_equal(llmem_geometry_active_bytes(dense), dense->weights_bytes);

    /* the workspace: no dense gate/up (every layer has experts), the router's logits, and the
     * experts' parts (plan/moe_work.h: ids, probs, order, slot, offsets, x, gate, up) */
    const struct llmem_model_geometry *g = llmem_catalog_find("qwen3-30b-a3b");
    int64_t T = 512, per_token = 2 * 2048 + 3 * 4096 + 2 * 512 + 2;
    int64_t parts = 512 * 32 * (128 + 2);
    int64_t pairs = T * 8;                         /* (token, expert) pairs */
    int64_t moe_bytes = 4 * T * 128 +                /* the router's logits */
                        4 * 4 * pairs + 576 +        /* 129 int32 offsets rounded up to 64 bytes */
                        4 * pairs * 2048 + 2 * 4 * pairs * 768;
    assert_int_equal(llmem_geometry_workspace_bytes(g, T, 1),
                     4 * (T * per_token + parts + 151936) + moe_bytes);
}

/* Tensor parallelism: one device's part of Llama 3.1 70B over 2, 4 and 8 (its 8 KV heads one a
 * device at 8), and of Qwen3-30B-A3B over 8 (4 KV heads: each held by two devices); the parts'
 * parameters add up to the whole but for what every device holds (norms, routers, repeated KV
 * heads); degrees and shapes that do not split are refused with the reason. */
static void test_tensor_rank(void **state) {
    (void)state;
    const struct llmem_model_geometry *g = llmem_catalog_find("llama-3.1-70b");
    struct llmem_model_geometry r;
    char why[200];
    assert_int_equal(llmem_geometry_tensor_rank(g, 1, &r, why, sizeof(why)), LLMEM_OK);
    assert_memory_equal(&r, g, sizeof(r));
    const int64_t whole = llmem_geometry_param_count(g);
    const int64_t norms = g->n_layers * 2 * g->hidden_size + g->hidden_size;
    for (int n = 2; n <= 8; n *= 2) {
        assert_int_equal(llmem_geometry_tensor_rank(g, n, &r, why, sizeof(why)), LLMEM_OK);
        assert_int_equal(r.n_heads, 64 / n);
        assert_int_equal(r.n_kv_heads, 8 / n);
        assert_int_equal(r.intermediate_size, 28672 / n);
        assert_int_equal(r.vocab_size, 128256 / n);
        assert_int_equal(n * (r.n_params - norms), whole - norms);
        assert_int_equal(r.weights_bytes,
                         (int64_t)((__int128)g->weights_bytes * r.n_params / whole));
        assert_int_equal(llmem_geometry_kv_bytes_per_token(&r),
                         llmem_geometry_kv_bytes_per_token(g) / n);
    }
    const struct llmem_model_geometry *m = llmem_catalog_find("qwen3-30b-a3b");
    assert_int_equal(llmem_geometry_tensor_rank(m, 8, &r, why, sizeof(why)), LLMEM_OK);
    assert_int_equal(r.n_kv_heads, 1); /* 4 KV heads over 8 devices: each twice */
    assert_int_equal(r.expert_intermediate, 768 / 8);
    assert_int_equal(r.expert_bytes, llmem_geometry_expert_bytes(m) / 8);
    assert_true(r.weights_bytes > m->weights_bytes / 8 && r.weights_bytes < m->weights_bytes / 7);

    assert_int_equal(llmem_geometry_tensor_rank(g, 3, &r, why, sizeof(why)), LLMEM_EINVAL);
    assert_non_null(strstr(why, "1, 2, 4 or 8"));
    struct llmem_model_geometry odd = *g;
    odd.n_kv_heads = 6, odd.n_heads = 48;
    assert_int_equal(llmem_geometry_tensor_rank(&odd, 4, &r, why, sizeof(why)), LLMEM_EINVAL);
    assert_non_null(strstr(why, "6 KV heads"));
    odd = *g;
    odd.intermediate_size = 1002;
    assert_int_equal(llmem_geometry_tensor_rank(&odd, 8, &r, why, sizeof(why)), LLMEM_EINVAL);
    assert_non_null(strstr(why, "1002 MLP columns"));
}

/* A device plan for g: its weights, KV and workspace, a total of `total`, a budget. */
static struct llmem_plan_params device_params(const struct llmem_model_geometry *g, int64_t total,
                                              int64_t budget) {
    return (struct llmem_plan_params){
        .target = LLMEM_PLAN_CUDA,
        .total_bytes = total,
        .weights_bytes = g->weights_bytes,
        .kv_bytes_per_token = llmem_geometry_kv_bytes_per_token(g),
        .model_max_context = g->max_context,
        .memory_budget_bytes = budget,
        .computed_workspace_bytes = llmem_geometry_workspace_bytes(g, 512, 1),
    };
}

/* Expert placement: every layer on a device that holds the model; under a budget the fewest host
 * layers with which the plan fits (one fewer does not); as forced (clamped to the MoE layers);
 * every layer, and no fit, when nothing fits; nothing placed on a host plan or a dense model. */
static void test_place_experts(void **state) {
    (void)state;
    const struct llmem_model_geometry *g = llmem_catalog_find("qwen3-30b-a3b");
    struct llmem_expert_placement e;
    struct llmem_plan_params p = device_params(g, 140 * GiB, 0);
    assert_int_equal(llmem_plan_place_experts(&p, g, -1, &e), LLMEM_OK);
    assert_int_equal(e.moe_layers, 48);
    assert_int_equal(e.host_layers, 0);
    assert_int_equal(e.layer_bytes, g->expert_bytes / 48);
    assert_int_equal(p.weights_bytes, g->weights_bytes);
    assert_int_equal(e.device_read_bytes, llmem_geometry_active_bytes(g));
    assert_int_equal(e.host_read_bytes, 0);

    p = device_params(g, 140 * GiB, 40 * GiB); /* the weights are 61G */
    assert_int_equal(llmem_plan_place_experts(&p, g, -1, &e), LLMEM_OK);
    assert_true(e.host_layers > 0 && e.host_layers < 48 && !e.forced);
    assert_int_equal(p.weights_bytes, g->weights_bytes - e.host_layers * e.layer_bytes);
    assert_int_equal(e.device_weights_bytes, p.weights_bytes);
    assert_int_equal(e.host_bytes, e.host_layers * e.layer_bytes);
    assert_int_equal(e.host_read_bytes, e.host_layers * (e.layer_bytes / 128 * 8));
    assert_int_equal(e.device_read_bytes + e.host_read_bytes, llmem_geometry_active_bytes(g));
    struct llmem_plan plan = compute(&p);
    assert_true(plan.model_fits && !plan.overcommitted);
    p.weights_bytes += e.layer_bytes; /* one host layer fewer */
    plan = compute(&p);
    assert_false(plan.model_fits && !plan.overcommitted);
    char line[400];
    llmem_plan_describe_experts(&e, line, sizeof(line));
    printf("  40G: %s\n", line);
    assert_non_null(strstr(line, "the fewest with which the model fits"));

    p = device_params(g, 140 * GiB, 40 * GiB);
    assert_int_equal(llmem_plan_place_experts(&p, g, 5, &e), LLMEM_OK);
    assert_true(e.forced && e.host_layers == 5);
    assert_int_equal(p.weights_bytes, g->weights_bytes - 5 * e.layer_bytes);
    p = device_params(g, 140 * GiB, 0);
    assert_int_equal(llmem_plan_place_experts(&p, g, 1000, &e), LLMEM_OK);
    assert_int_equal(e.host_layers, 48);
    p = device_params(g, 140 * GiB, 2 * GiB); /* not even the dense part fits */
    assert_int_equal(llmem_plan_place_experts(&p, g, -1, &e), LLMEM_OK);
    assert_int_equal(e.host_layers, 48);
    assert_false(compute(&p).model_fits);

    p = device_params(g, 140 * GiB, 40 * GiB);
    p.target = LLMEM_PLAN_HOST; /* the experts stay mapped on a host */
    assert_int_equal(llmem_plan_place_experts(&p, g, -1, &e), LLMEM_OK);
    assert_int_equal(e.moe_layers, 0);
    assert_int_equal(p.weights_bytes, g->weights_bytes);
    const struct llmem_model_geometry *dense = llmem_catalog_find("llama-3.1-8b");
    p = device_params(dense, 140 * GiB, 10 * GiB);
    assert_int_equal(llmem_plan_place_experts(&p, dense, 3, &e), LLMEM_OK);
    assert_int_equal(e.moe_layers, 0);
    assert_int_equal(p.weights_bytes, dense->weights_bytes);
}

static void test_workspace(void **state) {
    (void)state;
    const struct llmem_model_geometry *g = llmem_catalog_find("llama-3.1-8b");
    int64_t per_token = 2 * 4096 + 3 * 4096 + 2 * 1024 + 2 * 14336 + 2;
    int64_t parts = 512 * 32 * (128 + 2);
    assert_int_equal(llmem_geometry_workspace_bytes(g, 512, 1),
                     4 * (512 * per_token + parts + 128256));
    assert_int_equal(llmem_geometry_workspace_bytes(g, 0, 0),
                     4 * (512 * per_token + parts + 128256));
    assert_int_equal(llmem_geometry_workspace_bytes(g, 2048, 16),
                     4 * (2048 * per_token + parts + 16 * 128256));
    /* A large workspace raises the transients above min(3G, usable/8). */
    struct llmem_plan_params params = ref_params(48 * GiB);
    params.computed_workspace_bytes = 5 * GiB;
    struct llmem_plan p = compute(&params);
    assert_int_equal(p.runtime_transients_bytes, 5 * GiB);
    assert_steady_state_fits(&p);
}

static void test_plan_json(void **state) {
    (void)state;
    struct llmem_plan_params params = ref_params(48 * GiB);
    struct llmem_plan p = compute(&params);
    char *json = llmem_plan_to_json(&p, 0);
    assert_non_null(json);
    assert_non_null(strstr(json, "\"bank_idle_max_bytes\":14119530400"));
    assert_non_null(strstr(json, "\"context_window_resolved\":196608"));
    assert_non_null(strstr(json, "\"usable_source\":\"formula\""));
    assert_non_null(strstr(json, "\"notes\":[\""));
    free(json);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_48g),
        cmocka_unit_test(test_reference_48g_q8_fits_full_window),
        cmocka_unit_test(test_reference_128g),
        cmocka_unit_test(test_envelope_sizes),
        cmocka_unit_test(test_budget_override),
        cmocka_unit_test(test_memory_limit_override),
        cmocka_unit_test(test_util_override),
        cmocka_unit_test(test_limits_check),
        cmocka_unit_test(test_invalid_params),
        cmocka_unit_test(test_unavailable),
        cmocka_unit_test(test_cgroup_ceiling_below_75_percent),
        cmocka_unit_test(test_util_band_empty_seed_trap),
        cmocka_unit_test(test_fit_monotonic_in_memory),
        cmocka_unit_test(test_steady_state_fits_sweep),
        cmocka_unit_test(test_fit_inside_exact_budget),
        cmocka_unit_test(test_windows_aligned_or_model_capped),
        cmocka_unit_test(test_overcommit),
        cmocka_unit_test(test_small_context_models),
        cmocka_unit_test(test_model_does_not_fit),
        cmocka_unit_test(test_kv_format_bytes),
        cmocka_unit_test(test_bank_dynamic_ceiling),
        cmocka_unit_test(test_runtime_baseline),
        cmocka_unit_test(test_transient_reserve),
        cmocka_unit_test(test_catalog),
        cmocka_unit_test(test_moe_geometry),
        cmocka_unit_test(test_tensor_rank),
        cmocka_unit_test(test_place_experts),
        cmocka_unit_test(test_workspace),
        cmocka_unit_test(test_plan_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
