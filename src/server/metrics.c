/*
 * server/metrics.c — GET /metrics (Prometheus text exposition 0.0.4) and GET /health (one JSON
 * object), both from one snapshot of the engine's metrics, so the numbers of one document agree
 * with each other.
 *
 * Names start with llmem_; counters end in _total, sizes in _bytes, durations in _seconds;
 * histograms have cumulative _bucket{le=…} lines, _sum and _count.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "plan/plan_json.h"
#include "server/server_int.h"

static void metric(struct srv_buf *b, const char *name, const char *type, const char *help,
                   int64_t value) {
    llmem_srv_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %" PRId64 "\n", name, help, name, type,
                         name, value);
}

static void header(struct srv_buf *b, const char *name, const char *type, const char *help) {
    llmem_srv_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void histogram(struct srv_buf *b, const char *name, const char *help,
                      const struct llmem_histogram *h) {
    header(b, name, "histogram", help);
    for (int i = 0; i < LLMEM_HIST_BUCKETS; i++)
        llmem_srv_buf_printf(b, "%s_bucket{le=\"%g\"} %" PRId64 "\n", name, h->bounds[i],
                             h->counts[i]);
    llmem_srv_buf_printf(b,
                         "%s_bucket{le=\"+Inf\"} %" PRId64 "\n%s_sum %.9g\n%s_count %" PRId64 "\n",
                         name, h->count, name, h->sum, name, h->count);
}

char *llmem_srv_render_metrics(const struct llmem_engine_metrics *m, const struct srv_counters *c) {
    struct srv_buf b = {0};
    metric(&b, "llmem_mem_active_bytes", "gauge",
           "Bytes the allocator has handed out and not taken back.", m->mem_active);
    metric(&b, "llmem_mem_peak_bytes", "gauge", "The allocator's highest active bytes.",
           m->mem_peak);
    metric(&b, "llmem_mem_cache_bytes", "gauge", "Freed buffers the allocator keeps for reuse.",
           m->mem_cache);
    metric(&b, "llmem_mem_limit_bytes", "gauge",
           "The allocator's memory limit (active + cache never exceed it).", m->mem_limit);
    if (m->n_devices > 0) { /* a model split over devices: each one's allocator */
        const struct {
            const char *name, *help;
            size_t at;
        } per[] = {{"llmem_device_mem_active_bytes", "Bytes a device's allocator has handed out.",
                    offsetof(struct llmem_engine_device_mem, active)},
                   {"llmem_device_mem_peak_bytes", "A device's allocator's highest active bytes.",
                    offsetof(struct llmem_engine_device_mem, peak)},
                   {"llmem_device_mem_limit_bytes", "A device's allocator's memory limit.",
                    offsetof(struct llmem_engine_device_mem, limit)}};
        for (size_t i = 0; i < sizeof(per) / sizeof(per[0]); i++) {
            header(&b, per[i].name, "gauge", per[i].help);
            for (int d = 0; d < m->n_devices; d++)
                llmem_srv_buf_printf(&b, "%s{device=\"%d\"} %" PRId64 "\n", per[i].name,
                                     m->devices[d].device,
                                     *(const int64_t *)((const char *)&m->devices[d] + per[i].at));
        }
    }
    metric(&b, "llmem_kv_blocks_used", "gauge",
           "KV blocks holding tokens (of live requests or of the session bank).",
           m->kv_blocks_used);
    metric(&b, "llmem_kv_blocks_free", "gauge", "KV blocks free in the pool.", m->kv_blocks_free);
    metric(&b, "llmem_kv_block_bytes", "gauge", "Bytes of one KV block (all layers).",
           m->kv_block_bytes);
    metric(&b, "llmem_bank_bytes", "gauge", "KV bytes the session bank holds.", m->bank.ram.bytes);
    metric(&b, "llmem_bank_blocks", "gauge", "KV blocks the session bank holds.",
           m->bank.ram.blocks);
    metric(&b, "llmem_bank_hits_total", "counter",
           "KV blocks handed from the session bank to new requests (prefill skipped).",
           m->bank.ram.hit_blocks);
    metric(&b, "llmem_bank_lookups_total", "counter", "Prompt lookups in the session bank.",
           m->bank.ram.lookups);
    metric(&b, "llmem_bank_evicted_blocks_total", "counter",
           "KV blocks evicted from the session bank.", m->bank.ram.evicted_blocks);
    metric(&b, "llmem_bank_reused_tokens_total", "counter",
           "Prompt tokens taken from the session bank's RAM tier instead of prefilled.",
           m->bank.reused_ram_tokens);
    metric(&b, "llmem_spill_reused_tokens_total", "counter",
           "Prompt tokens loaded from the spill store on disk instead of prefilled.",
           m->bank.reused_disk_tokens);
    metric(&b, "llmem_spill_bytes", "gauge", "Bytes of the spill store's directory.",
           m->bank.spill.bytes);
    metric(&b, "llmem_spill_written_bytes_total", "counter",
           "Bytes this process wrote to the spill store.", m->bank.spill.write_bytes);
    metric(&b, "llmem_spill_read_bytes_total", "counter",
           "Bytes this process read from the spill store.", m->bank.spill.read_bytes);

    header(&b, "llmem_guard_actions_total", "counter",
           "Actions of the pressure guard (warning: bank halved and cache released; critical: "
           "bank emptied, admissions stopped).");
    llmem_srv_buf_printf(&b,
                         "llmem_guard_actions_total{level=\"warning\"} %" PRId64
                         "\nllmem_guard_actions_total{level=\"critical\"} %" PRId64 "\n",
                         m->bank.guard_warnings, m->bank.guard_criticals);
    metric(&b, "llmem_guard_level", "gauge",
           "The pressure guard's last reading: 0 clear, 1 warning, 2 critical.",
           (int64_t)m->guard_level);
    metric(&b, "llmem_guard_refusing", "gauge",
           "1 while a critical memory pressure stops admissions.", m->refusing);

    header(&b, "llmem_requests_total", "counter",
           "Requests by outcome: ok, cancelled, refused (507: memory), failed (engine error), "
           "rejected (503: queue full), invalid (4xx before the engine).");
    llmem_srv_buf_printf(&b,
                         "llmem_requests_total{outcome=\"ok\"} %" PRId64
                         "\nllmem_requests_total{outcome=\"cancelled\"} %" PRId64
                         "\nllmem_requests_total{outcome=\"refused\"} %" PRId64
                         "\nllmem_requests_total{outcome=\"failed\"} %" PRId64
                         "\nllmem_requests_total{outcome=\"rejected\"} %" PRId64
                         "\nllmem_requests_total{outcome=\"invalid\"} %" PRId64 "\n",
                         m->requests_ok, m->requests_cancelled, m->requests_refused,
                         m->requests_failed, c->rejected, c->invalid);
    metric(&b, "llmem_client_disconnects_total", "counter",
           "Clients that went away before their request ended (the request was cancelled).",
           c->disconnected);
    metric(&b, "llmem_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
           m->prompt_tokens);
    metric(&b, "llmem_prompt_tokens_reused_total", "counter",
           "Prompt tokens taken from the session bank instead of prefilled.", m->reused_tokens);
    metric(&b, "llmem_generation_tokens_total", "counter", "Tokens generated.",
           m->generated_tokens);
    metric(&b, "llmem_requests_running", "gauge", "Requests in the running batch.", m->running);
    metric(&b, "llmem_requests_waiting", "gauge", "Requests waiting for admission.", m->waiting);
    metric(&b, "llmem_preemptions_total", "counter",
           "Requests preempted when KV blocks ran out (their blocks banked; resumed later).",
           m->preemptions);
    metric(&b, "llmem_scheduler_steps_total", "counter", "Forward passes of the scheduler.",
           m->steps);
    metric(&b, "llmem_scheduler_ahead_steps_total", "counter",
           "Greedy decode steps queued on the device before the step ahead of them had finished.",
           m->ahead_steps);
    metric(&b, "llmem_scheduler_masked_steps_total", "counter",
           "Steps on a device with grammars' token masks: made while it computed a replayed "
           "decode step, before the pass otherwise.",
           m->masked_steps);
    metric(&b, "llmem_scheduler_masks_late_total", "counter",
           "Of those, the steps whose masks were ready only after the device had finished.",
           m->masks_late);
    header(&b, "llmem_scheduler_step_seconds_total", "counter",
           "Time in scheduler steps (admission, the forward pass, sampling, the bank).");
    llmem_srv_buf_printf(&b, "llmem_scheduler_step_seconds_total %.9g\n", m->step_seconds);
    header(&b, "llmem_forward_seconds_total", "counter",
           "Time of the scheduler steps in forward passes (on a device, until its results).");
    llmem_srv_buf_printf(&b, "llmem_forward_seconds_total %.9g\n", m->forward_seconds);
    histogram(&b, "llmem_ttft_seconds", "Time from a request's arrival to its first token.",
              &m->ttft);
    histogram(&b, "llmem_inter_token_seconds", "Time between a request's consecutive tokens.",
              &m->inter_token);
    if (b.failed) {
        llmem_srv_buf_free(&b);
        return NULL;
    }
    return b.data;
}

static const char *guard_name(enum llmem_guard_level l) {
    return l == LLMEM_GUARD_CRITICAL ? "critical" : l == LLMEM_GUARD_WARNING ? "warning" : "clear";
}

char *llmem_srv_render_health(const struct srv_health *h, const struct llmem_engine_metrics *m,
                              const struct srv_counters *c) {
    const struct llmem_plan *p = h->plan;
    cJSON *o = cJSON_CreateObject();
    cJSON *plan = llmem_plan_json(p);
    int bad = o == NULL || plan == NULL;
    if (!bad) {
        cJSON_AddItemToObject(o, "plan", plan);
        plan = NULL;
    }
    cJSON_Delete(plan);
    bad = bad || llmem_json_add_string(o, "status", m->refusing ? "refusing" : "ok") ||
          llmem_json_add_string(o, "model", h->model) ||
          llmem_json_add_string(o, "chat_template", h->chat_template);

    /* the limits as `llmem plan` computes them (with a budget: against the simulated machine),
     * and the allocator's limits as applied */
    int64_t ceiling = p->budget_bytes > 0 && p->budget_bytes < p->ceiling_bytes ? p->budget_bytes
                                                                                : p->ceiling_bytes;
    cJSON *l = bad ? NULL : cJSON_AddObjectToObject(o, "limits");
    bad = bad || l == NULL ||
          llmem_json_add_int(l, "allocation_limit_bytes", p->allocation_limit_bytes) ||
          llmem_json_add_int(l, "trip_bytes", p->trip_bytes) ||
          llmem_json_add_int(l, "ceiling_bytes", ceiling) ||
          llmem_json_add_int(l, "footprint_bytes", p->footprint_bytes) ||
          llmem_json_add_int(l, "runtime_baseline_bytes", p->runtime_baseline_bytes) ||
          llmem_json_add_double(l, "util", p->util) ||
          llmem_json_add_int(l, "memory_limit_bytes", h->mem->memory_limit_bytes) ||
          llmem_json_add_int(l, "cache_limit_bytes", h->mem->cache_limit_bytes) ||
          llmem_json_add_int(l, "context", p->context_window_resolved) ||
          llmem_json_add_string(l, "applied", h->limits_line);

    cJSON *mem = bad ? NULL : cJSON_AddObjectToObject(o, "memory");
    bad = bad || mem == NULL || llmem_json_add_int(mem, "active_bytes", h->mem->active_bytes) ||
          llmem_json_add_int(mem, "peak_bytes", h->mem->peak_bytes) ||
          llmem_json_add_int(mem, "cache_bytes", h->mem->cache_bytes) ||
          llmem_json_add_int(mem, "limit_bytes", h->mem->memory_limit_bytes) ||
          llmem_json_add_int(mem, "resident_bytes", h->resident_bytes) ||
          llmem_json_add_int(mem, "resident_peak_bytes", h->resident_peak_bytes);
    cJSON *devs = bad || m->n_devices == 0 ? NULL : cJSON_AddArrayToObject(mem, "devices");
    bad = bad || (m->n_devices > 0 && devs == NULL);
    for (int d = 0; !bad && d < m->n_devices; d++) { /* a split model's, each one's allocator */
        cJSON *dev = cJSON_CreateObject();
        bad = dev == NULL || !cJSON_AddItemToArray(devs, dev) ||
              llmem_json_add_int(dev, "device", m->devices[d].device) ||
              llmem_json_add_int(dev, "active_bytes", m->devices[d].active) ||
              llmem_json_add_int(dev, "peak_bytes", m->devices[d].peak) ||
              llmem_json_add_int(dev, "limit_bytes", m->devices[d].limit);
    }

    cJSON *kv = bad ? NULL : cJSON_AddObjectToObject(o, "kv");
    bad = bad || kv == NULL || llmem_json_add_string(kv, "format", h->kv_format) ||
          llmem_json_add_string(kv, "layout", h->kv_layout) ||
          llmem_json_add_int(kv, "block_bytes", m->kv_block_bytes) ||
          llmem_json_add_int(kv, "blocks_used", m->kv_blocks_used) ||
          llmem_json_add_int(kv, "blocks_free", m->kv_blocks_free);

    cJSON *bank = bad ? NULL : cJSON_AddObjectToObject(o, "bank");
    bad = bad || bank == NULL || llmem_json_add_int(bank, "bytes", m->bank.ram.bytes) ||
          llmem_json_add_int(bank, "blocks", m->bank.ram.blocks) ||
          llmem_json_add_int(bank, "hit_blocks", m->bank.ram.hit_blocks) ||
          llmem_json_add_int(bank, "lookups", m->bank.ram.lookups) ||
          llmem_json_add_int(bank, "evicted_blocks", m->bank.ram.evicted_blocks);

    cJSON *g = bad ? NULL : cJSON_AddObjectToObject(o, "guard");
    bad = bad || g == NULL || llmem_json_add_string(g, "state", guard_name(m->guard_level)) ||
          llmem_json_add_bool(g, "refusing", m->refusing) ||
          llmem_json_add_int(g, "warnings", m->bank.guard_warnings) ||
          llmem_json_add_int(g, "criticals", m->bank.guard_criticals) ||
          llmem_json_add_int(g, "deferred", m->bank.guard_deferred) ||
          llmem_json_add_int(g, "suppressed", m->bank.guard_suppressed);

    cJSON *r = bad ? NULL : cJSON_AddObjectToObject(o, "requests");
    bad = bad || r == NULL || llmem_json_add_int(r, "running", m->running) ||
          llmem_json_add_int(r, "waiting", m->waiting) ||
          llmem_json_add_int(r, "ok", m->requests_ok) ||
          llmem_json_add_int(r, "cancelled", m->requests_cancelled) ||
          llmem_json_add_int(r, "refused", m->requests_refused) ||
          llmem_json_add_int(r, "failed", m->requests_failed) ||
          llmem_json_add_int(r, "rejected", c->rejected) ||
          llmem_json_add_int(r, "invalid", c->invalid) ||
          llmem_json_add_int(r, "preemptions", m->preemptions);

    char *text = bad ? NULL : llmem_json_print(o, 1);
    cJSON_Delete(o);
    return text;
}
