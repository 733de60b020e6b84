/*
 * engine/engine.c — a model opened inside its memory plan, its pressure guard, and the session bank
 * around a request (the requests themselves are scheduled by the scheduler it owns: sched.h).
 *
 * Open: geometry (headers only) → machine probe → plan → refuse if it does not fit → allocator with
 * the plan's limits → weights, tokenizer, backend, KV cache, forward pass. The paged KV pool is the
 * plan's reserve (one window per sequence), allocated at open; the allocator's memory limit bounds
 * everything together.
 *
 * A request starts from the longest banked prefix of its tokens (the RAM tier, then the spill
 * store); when it ends (or is preempted) its full blocks are banked, and its chunks not on disk yet
 * are queued for the spill store's writer thread. The scheduler is the engine's own object: it
 * reaches the bank and the guard only through the operations table at the end of this file.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#include <time.h>

#include "backend/ops.h"
#include "bank/spill_open.h"
#include "core/clock.h"
#include "core/log.h"
#include "core/options.h"
#include "llmem/model.h"
#include "llmem/pool.h"
#include "llmem/bank.h"
#include "llmem/engine.h"
#include "llmem/size.h"
#include "llmem/spill.h"
#include "llmem/sys.h"
#include "llmem/tokenizer.h"
#include "engine/engine_int.h"
#include "model/forward_split.h"

/* The default prefill chunk: the tokens of one forward pass at most (SPEC §2.1); more on a device
 * where the plan's transient reserve holds it (default_batch_tokens). */
#define PREFILL_CHUNK 512
#define ENGINE_MAX_THREADS 4096               /* n_threads */
#define ENGINE_MAX_COUNT   ((int64_t)1 << 30) /* max_batch_tokens, max_sequences */
#define ENGINE_MAX_BYTES   ((int64_t)1 << 50) /* runtime_reserve_bytes */
/* The runtime baseline beyond the resident memory measured at open: code and library pages that
 * the first steps touch later, and the stack each worker thread touches in the kernels. */
#define BASELINE_GROWTH     ((int64_t)2 << 20)
#define BASELINE_PER_THREAD ((int64_t)256 << 10)

void llmem_engine_config_default(struct llmem_engine_config *c) {
    memset(c, 0, sizeof(*c));
    c->kv_layout = LLMEM_KV_LAYOUT_PAGED;
    c->kv_format = LLMEM_KV_FORMAT_F16;
    c->max_batch_tokens = 0; /* PREFILL_CHUNK, more on a device (default_batch_tokens) */
    c->max_sequences = 1;
    c->runtime_baseline_bytes = LLMEM_ENGINE_BASELINE_MEASURE;
    c->experts_on_host = -1;
}

/* ---- open ----------------------------------------------------------------------------------- */

/* The plan's inputs for a forward pass of max_batch_tokens tokens, a device's experts placed
 * (into *placement when not NULL). */
static struct llmem_plan_params plan_params(const struct llmem_engine_config *c,
                                            const struct llmem_model_geometry *g,
                                            int64_t total_bytes, int64_t ceiling_bytes, int threads,
                                            int64_t max_batch_tokens,
                                            struct llmem_expert_placement *placement) {
    const int cuda = c->backend == LLMEM_BACKEND_CUDA;
    /* a split model: one device's share (llmem_geometry_tensor_rank), on the host every rank's */
    const int ranks = c->tensor_parallel > 1 ? c->tensor_parallel : 1;
    struct llmem_model_geometry share;
    char why[200];
    if (ranks > 1 && llmem_geometry_tensor_rank(g, ranks, &share, why, sizeof(why)) == LLMEM_OK)
        g = &share;
    const int64_t copies = cuda ? 1 : ranks;
    const int64_t widest =
        g->intermediate_size > g->hidden_size ? g->intermediate_size : g->hidden_size;
    struct llmem_plan_params p = {
        .target = cuda ? LLMEM_PLAN_CUDA : LLMEM_PLAN_HOST,
        .total_bytes = total_bytes,
        .ceiling_bytes = ceiling_bytes,
        .weights_bytes = copies * g->weights_bytes,
        .kv_bytes_per_token = copies * llmem_geometry_kv_bytes_per_token(g),
        .kv_format = c->kv_format,
        .model_max_context = g->max_context,
        .requested_context = c->context,
        .memory_budget_bytes = c->budget_bytes,
        .memory_limit_bytes = c->memory_limit_bytes,
        .util = c->util,
        .max_sequences = c->max_sequences,
        .max_batch_tokens = max_batch_tokens,
        /* the forward pass's buffers and the backend's fixed GEMM scratch */
        .computed_workspace_bytes =
            copies * llmem_geometry_workspace_bytes(g, max_batch_tokens, c->max_sequences) +
            (cuda ? llmem_backend_cuda_scratch_bytes(c->precision, max_batch_tokens, widest,
                                                     g->quantized)
                  : copies * llmem_backend_cpu_scratch_bytes(threads)),
    };
    struct llmem_expert_placement placed;
    if (llmem_plan_place_experts(&p, g, ranks > 1 ? 0 : c->experts_on_host, &placed) != LLMEM_OK)
        placed = (struct llmem_expert_placement){.device_weights_bytes = p.weights_bytes};
    if (placement != NULL)
        *placement = placed;
    return p;
}

/* The default prefill chunk (max_batch_tokens 0): PREFILL_CHUNK tokens (SPEC §2.1), and on a
 * device the largest of 8192, 4096, 2048 and 1024 whose workspace fits within the transient
 * reserve that the plan commits for PREFILL_CHUNK anyway (min(3 GiB, usable / 8) where the
 * workspace is smaller): a GPU prefills a batch of prompts several times faster in one large step
 * than in many small ones, at no cost to the plan. */
static int64_t default_batch_tokens(const struct llmem_engine_config *c,
                                    const struct llmem_model_geometry *g, int64_t total_bytes,
                                    int64_t ceiling_bytes, int threads) {
    if (c->backend != LLMEM_BACKEND_CUDA)
        return PREFILL_CHUNK;
    struct llmem_plan_params p =
        plan_params(c, g, total_bytes, ceiling_bytes, threads, PREFILL_CHUNK, NULL);
    struct llmem_plan base, plan;
    if (llmem_plan_compute(&p, &base) != LLMEM_OK)
        return PREFILL_CHUNK;
    for (int64_t tokens = 8192; tokens > PREFILL_CHUNK; tokens /= 2) {
        p = plan_params(c, g, total_bytes, ceiling_bytes, threads, tokens, NULL);
        if (llmem_plan_compute(&p, &plan) == LLMEM_OK && plan.model_fits && !plan.overcommitted &&
            plan.runtime_transients_bytes == base.runtime_transients_bytes)
            return tokens;
    }
    return PREFILL_CHUNK;
}

int64_t llmem_engine_runtime_baseline(const struct llmem_engine_config *c, int64_t vocab,
                                      int threads) {
    if (c->runtime_baseline_bytes >= 0)
        return c->runtime_baseline_bytes + c->runtime_reserve_bytes;
    struct llmem_sys_resident r;
    llmem_sys_resident_read(&r);
    int64_t now = r.current_bytes > 0 ? r.current_bytes : 0;
    /* (and the walkers that split one mask's walk over the threads: sched.c) */
    const int64_t grammars =
        vocab > 0
            ? (c->max_sequences > 0 ? c->max_sequences : 1) * llmem_grammar_request_bytes(vocab) +
                  (threads > 1 ? llmem_grammar_walkers_bytes(threads) : 0)
            : 0;
    return now + BASELINE_GROWTH + (int64_t)threads * BASELINE_PER_THREAD + grammars +
           c->runtime_reserve_bytes;
}

void llmem_engine_plan_params(const struct llmem_engine_config *c,
                              const struct llmem_model_geometry *g, int64_t total_bytes,
                              int64_t ceiling_bytes, int threads, struct llmem_plan_params *out,
                              struct llmem_expert_placement *placement) {
    const int64_t chunk = c->max_batch_tokens > 0
                              ? c->max_batch_tokens
                              : default_batch_tokens(c, g, total_bytes, ceiling_bytes, threads);
    *out = plan_params(c, g, total_bytes, ceiling_bytes, threads, chunk, placement);
}

static int plan_model(struct llmem_engine *e, const struct llmem_model_geometry *g, int threads) {
    struct llmem_device_info host, machine;
    int status = llmem_sys_probe_host(&host);
    if (status != LLMEM_OK)
        return status;
    e->ram_bytes = host.memory_size;
    const struct llmem_engine_config *c = &e->cfg;
    machine = host;
    if (c->backend == LLMEM_BACKEND_CUDA &&
        (status = llmem_backend_device_info(c->device, &machine)) != LLMEM_OK)
        return status;
    const int64_t total = machine.max_recommended_working_set_size;
    struct llmem_plan_params p;
    llmem_engine_plan_params(c, g, total, total, threads, &p, &e->placement);
    if (c->backend != LLMEM_BACKEND_CUDA) /* a device's plan: its memory, not the host's */
        p.runtime_baseline_bytes = llmem_engine_runtime_baseline(c, g->vocab_size, threads);
    if (e->cfg.max_batch_tokens <= 0) {
        e->cfg.max_batch_tokens = p.max_batch_tokens;
        if (p.max_batch_tokens > PREFILL_CHUNK)
            LLMEM_INFO("prefill chunk: %" PRId64 " tokens (within the plan's transient reserve; "
                       "--max-batch-tokens sets it)",
                       p.max_batch_tokens);
    }
    if ((status = llmem_plan_compute(&p, &e->plan)) != LLMEM_OK)
        return status;
    char line[512];
    llmem_plan_describe(&e->plan, line, sizeof(line));
    if (!e->plan.model_fits || e->plan.overcommitted) {
        /* one line says why; the plan's other notes follow as information */
        const int v = e->plan.verdict_note;
        const char *why = v >= 0 && v < e->plan.n_notes ? e->plan.notes[v] : "";
        if (strncmp(why, LLMEM_PLAN_NO_FIT ": ", strlen(LLMEM_PLAN_NO_FIT) + 2) == 0)
            why += strlen(LLMEM_PLAN_NO_FIT) + 2; /* (the line ends with the verdict) */
        LLMEM_ERROR_AS("llmem_engine_open", "%s: refused before loading: %s%s%s", c->model_dir,
                       line, *why ? ": " : "", why);
        for (int i = 0; i < e->plan.n_notes; i++)
            if (i != v)
                llmem_log_line(LLMEM_LOG_INFO, "llmem_engine_open", "%s", e->plan.notes[i]);
        return LLMEM_ENOMEM;
    }
    /* §3.1: an allocation limit or a trip at or above the ceiling leaves the guard no room to
     * shed cache before the hard limit; a util outside its band otherwise is only warned of */
    char why[256];
    if (llmem_plan_limits_check(&e->plan, why, sizeof(why)) != 0) {
        const int64_t ceiling = llmem_plan_limits_ceiling(&e->plan);
        if (e->plan.allocation_limit_bytes >= ceiling || e->plan.trip_bytes >= ceiling) {
            LLMEM_ERROR_AS("llmem_engine_open",
                           "%s: refused before loading: the limits are unsafe: %s; lower --util"
                           " or --memory-limit",
                           c->model_dir, why);
            return LLMEM_ENOMEM;
        }
        llmem_log_line(LLMEM_LOG_WARN, "llmem_engine_open",
                       "util %.3f is outside its band (%.3f, %.3f): %s", e->plan.util,
                       e->plan.band_low, e->plan.band_high, why);
    }
    if (c->context > e->plan.context_window_resolved)
        llmem_log_line(LLMEM_LOG_WARN, "llmem_engine_open",
                       "requested context %" PRId64 " is above the model's maximum; using %" PRId64,
                       c->context, e->plan.context_window_resolved);
    LLMEM_INFO("plan: %s", line);
    if (e->placement.host_layers > 0)
        LLMEM_INFO("experts: the first %" PRId64 " of %" PRId64 " MoE layers' experts on the host "
                   "(%" PRId64 " bytes), run on the CPU",
                   e->placement.host_layers, e->placement.moe_layers, e->placement.host_bytes);
    return LLMEM_OK;
}

static int open_kv(struct llmem_engine *e) {
    const struct llmem_model_geometry *g = &llmem_model_get_config(e->model)->geom;
    struct llmem_kv_config kc;
    llmem_kv_config_default(&kc);
    kc.layout = e->cfg.kv_layout;
    kc.format = e->cfg.kv_format;
    kc.n_layers = e->n_ranks * (int)g->n_layers; /* a split's ranks one after another */
    kc.n_kv_heads = (int)g->n_kv_heads;          /* (a share's) */
    kc.head_dim = (int)g->head_dim;
    kc.max_sequences = (int)e->cfg.max_sequences;
    kc.n_threads = e->cfg.n_threads;
    kc.pool = e->pool;
    kc.device = e->cfg.backend == LLMEM_BACKEND_CUDA ? e->be : NULL;
    if (kc.device != NULL && e->n_ranks > 1) /* each rank's heads on its device */
        kc.n_ranks = e->n_ranks, kc.rank_devices = e->ranks, kc.rank_mems = e->rank_mem;
    if (kc.layout == LLMEM_KV_LAYOUT_PAGED) {
        /* The pool the plan commits, allocated now: one window per sequence, within the pool
         * tokens the plan leaves for KV. Large buffers are mapped lazily, so pages become
         * resident as tokens arrive, but the bytes are accounted (and limited) from the start
         * and a growing pool never needs old + new at once. */
        if (kc.block_size <= 0)
            kc.block_size = 16;
        int64_t window_blocks =
            (e->plan.context_window_resolved + kc.block_size - 1) / kc.block_size;
        int64_t pool_blocks = e->plan.pool_tokens / kc.block_size;
        int64_t blocks = window_blocks * e->cfg.max_sequences;
        if (pool_blocks < blocks)
            blocks = pool_blocks > window_blocks ? pool_blocks : window_blocks;
        kc.num_blocks = blocks;
        kc.max_blocks = blocks;
        kc.dynamic = 0;
    }
    return llmem_kv_create(&kc, e->mem, &e->kv);
}

/* The digest cache of the bank's identity: $XDG_CACHE_HOME/llmem/digests, else
 * ~/.cache/llmem/digests (directories created); NULL when neither can be made (the weights are
 * then digested at every open). */
static char *digest_cache_path(void) {
    char dir[4096];
    if (llmem_cache_dir(NULL, dir, sizeof(dir)) != LLMEM_OK)
        return NULL;
    char *slash = strrchr(dir, '/');
    *slash = '\0';
    mkdir(dir, 0700); /* the parent (…/.cache) may not exist yet */
    *slash = '/';
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        LLMEM_WARN("%s: %s; the model's digest is not cached", dir, strerror(errno));
        return NULL;
    }
    char *path = malloc(strlen(dir) + sizeof("/digests"));
    if (path != NULL)
        sprintf(path, "%s/digests", dir);
    return path;
}

/* The load of a model and its copies to devices (or ranks) on one progress bar: part `part` of
 * `parts` equal parts (the read, then each copy). */
struct phase {
    llmem_progress_fn fn;
    void *arg;
    int64_t part, parts;
};

static void phase_progress(void *p, int64_t done, int64_t total) {
    const struct phase *ph = p;
    if (ph->fn != NULL && total > 0)
        ph->fn(ph->arg, ph->part * 1000 + done * 1000 / total, ph->parts * 1000);
}

/* copied: the model read only to be copied to devices (or ranks), where a dummy model's values
 * are made a matrix at a time instead (the host never holds them all) */
static int load_flags(const struct llmem_engine_config *c, int copied) {
    return (c->no_mmap ? LLMEM_MODEL_LOAD_NO_MMAP : 0) |
           (c->load_dummy ? LLMEM_MODEL_LOAD_DUMMY : 0) |
           (c->load_dummy && copied ? LLMEM_MODEL_LOAD_DUMMY_DEFERRED : 0);
}

static int open_bank(struct llmem_engine *e) {
    struct llmem_bank_identity id;
    char *cache = digest_cache_path();
    /* KV computed at one precision is not served to a run at the other (fast rounds activations
     * of 16-bit weights to bf16 and quantizes them for quantized ones): the precision salts the
     * model's identity */
    char salt[64]; /* and a split model's blocks hold its ranks' heads, layer by layer */
    const int at = snprintf(salt, sizeof(salt), "precision=%s",
                            e->cfg.precision == LLMEM_PRECISION_F32 ? "f32" : "fast");
    if (e->n_ranks > 1)
        snprintf(salt + at, sizeof(salt) - (size_t)at, ";ranks=%d", e->n_ranks);
    int status =
        llmem_bank_identity(e->cfg.model_dir, e->cfg.kv_format, e->cfg.kv_layout, salt, cache, &id);
    free(cache);
    if (status == LLMEM_OK)
        status = llmem_bank_create(e->kv, id.root, &e->bank);
    if (status != LLMEM_OK || e->cfg.no_spill)
        return status;
    memcpy(e->root, id.root, 32);
    struct llmem_spill_config sc;
    llmem_spill_config_default(&sc);
    sc.dir = e->cfg.bank_dir;
    sc.max_bytes = e->cfg.spill_max_bytes;
    sc.ram_bytes = e->ram_bytes > 0 ? e->ram_bytes : 0;
    sc.mem = e->host_mem;
    if (e->cfg.backend == LLMEM_BACKEND_CUDA) {
        /* pinned staging: the blocks' copies to it run on the device's copy queue, waited for
         * by the writer. Pinning and unpinning take milliseconds (and unpinning waits for the
         * device), so what the queue holds at most stays pinned between writes. */
        struct llmem_mem_config pc = {
            .ops = llmem_backend_cuda_pinned_memory(),
            .cache_limit_bytes = sc.queue_bytes > 0 ? sc.queue_bytes : LLMEM_SPILL_QUEUE_BYTES};
        if (pc.ops != NULL && llmem_mem_create(&pc, &e->staging_mem) == LLMEM_OK)
            sc.mem = e->staging_mem;
    }
    sc.free_probe = e->hooks.spill_free_probe;
    sc.free_probe_arg = e->hooks.spill_free_probe_arg;
    /* the disk tier is a cache: a store that cannot be used, given or default, is left out */
    char why[1024];
    status = llmem_spill_open_cache(&sc, &e->spill, why, sizeof(why));
    if (status != LLMEM_OK) {
        LLMEM_WARN("%s; the session bank runs without its spill tier",
                   why[0] != '\0' ? why : llmem_status_str(status));
        e->spill = NULL;
        status = LLMEM_OK;
    }
    return status;
}

/* Whether the model splits as configured: over 2, 4 or 8 ranks its shapes allow, with every
 * expert on the devices, and on devices that exist. */
static int check_split(const struct llmem_engine_config *c, const struct llmem_model_geometry *g) {
    struct llmem_model_geometry share;
    char why[200];
    const int n = c->tensor_parallel;
    if (llmem_geometry_tensor_rank(g, n, &share, why, sizeof(why)) != LLMEM_OK) {
        LLMEM_ERROR_AS("llmem_engine_open", "--tensor-parallel %d: %s: %s", n, c->model_dir, why);
        return LLMEM_EINVAL;
    }
    if (c->experts_on_host > 0) {
        LLMEM_ERROR_AS("llmem_engine_open",
                       "--tensor-parallel %d: a split model keeps its experts on the devices "
                       "(--experts-on-host %" PRId64 ")",
                       n, c->experts_on_host);
        return LLMEM_EINVAL;
    }
    int devices = 0, one = 0;
    llmem_backend_device_count(&devices);
    int status = llmem_option_bool(LLMEM_OPT_SPLIT_ONE_DEVICE, &one);
    if (status != LLMEM_OK)
        return status;
    if (c->backend == LLMEM_BACKEND_CUDA && c->device + (one ? 1 : n) > devices) {
        LLMEM_ERROR_AS("llmem_engine_open",
                       "--tensor-parallel %d from device %d: this machine has %d device%s", n,
                       c->device, devices, devices == 1 ? "" : "s");
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

/* A model split over cfg.tensor_parallel ranks: read once into host memory of its own, each
 * rank's share copied into its rank's memory (on the CPU the plan's memory, every share, and a
 * CPU backend a rank on the engine's pool; on devices each its own, planned alike), the read copy
 * dropped, and the group that sums over the ranks. */
static int open_split(struct llmem_engine *e, llmem_progress_fn progress, void *progress_arg) {
    const struct llmem_engine_config *c = &e->cfg;
    const int n = e->n_ranks, cuda = c->backend == LLMEM_BACKEND_CUDA;
    int one = 0; /* every rank on c->device (checked: check_split) */
    llmem_option_bool(LLMEM_OPT_SPLIT_ONE_DEVICE, &one);
    struct llmem_mem *read_mem = NULL;
    struct llmem_model *host_model = NULL;
    struct llmem_mem_config hc = {.cache_limit_bytes = -1};
    int status = llmem_mem_create(&hc, &read_mem);
    for (int r = 0; status == LLMEM_OK && r < n; r++) {
        if (!cuda) { /* a CPU backend a rank (its thread's), all on the engine's pool */
            e->rank_mem[r] = e->mem;
            status = llmem_backend_cpu_create_shared(e->pool, e->mem, &e->rank_be[r]);
            if (status != LLMEM_OK)
                break;
            llmem_backend_cpu_set_precision(e->rank_be[r], c->precision);
            e->ranks[r] = e->rank_be[r];
            if (r == 0) /* (closed as be) */
                e->be = e->rank_be[0];
            continue;
        }
        const int device = one ? c->device : c->device + r;
        e->rank_device[r] = device;
        struct llmem_mem_config dc = {.ops = llmem_backend_cuda_memory(device),
                                      .memory_limit_bytes = e->plan.allocator_limit_bytes,
                                      .cache_limit_bytes = -1,
                                      .usable_bytes = e->plan.usable_bytes};
        if (r == 0)
            e->rank_mem[0] = e->mem;
        else if (dc.ops == NULL) {
            LLMEM_ERROR_AS("llmem_engine_open", "--tensor-parallel %d: no CUDA device %d", n,
                           device);
            status = LLMEM_EINVAL;
            break;
        } else if ((status = llmem_mem_create(&dc, &e->rank_mem[r])) != LLMEM_OK)
            break;
        status = llmem_backend_cuda_create(device, c->precision, e->rank_mem[r], &e->rank_be[r]);
        e->ranks[r] = e->rank_be[r];
        if (r == 0) /* (closed as be) */
            e->be = e->rank_be[0];
    }
    if (status == LLMEM_OK)
        status = cuda ? llmem_backend_cuda_group_create(n, e->ranks, &e->group)
                      : llmem_backend_host_group_create(n, e->ranks, &e->group);
    struct phase ph = {progress, progress_arg, 0, 1 + n}; /* the read, then each rank's copy */
    if (status == LLMEM_OK)
        status = llmem_model_load(c->model_dir, read_mem, load_flags(c, 1), phase_progress, &ph,
                                  &host_model);
    for (int r = 0; status == LLMEM_OK && r < n; r++) {
        ph.part = 1 + r;
        status = llmem_model_to_device(host_model, e->ranks[r], e->rank_mem[r], 0, r, n,
                                       phase_progress, &ph, &e->shares[r]);
    }
    llmem_model_free(host_model);
    llmem_mem_destroy(read_mem);
    e->host_mem = e->mem;
    if (cuda && status == LLMEM_OK) { /* the sampler's logits in host memory of their own */
        e->host_mem = NULL;
        status = llmem_mem_create(&hc, &e->host_mem);
    }
    e->model = e->shares[0];
    return status;
}

static int open_sched(struct llmem_engine *e);

/* LLMEM_EINVAL (one line naming the field) for a configuration no run could have. */
static int check_config(const struct llmem_engine_config *c, struct llmem_engine **out) {
    const char *bad =
        c == NULL                                                             ? "config"
        : out == NULL                                                         ? "out"
        : c->model_dir == NULL || c->model_dir[0] == '\0'                     ? "config->model_dir"
        : (unsigned)c->kv_layout >= LLMEM_KV_LAYOUT_COUNT                     ? "config->kv_layout"
        : (unsigned)c->kv_format >= LLMEM_KV_FORMAT_COUNT                     ? "config->kv_format"
        : c->backend != LLMEM_BACKEND_CPU && c->backend != LLMEM_BACKEND_CUDA ? "config->backend"
        : c->precision != LLMEM_PRECISION_FAST && c->precision != LLMEM_PRECISION_F32
            ? "config->precision"
        : c->context < 0                    ? "config->context"
        : c->budget_bytes < 0               ? "config->budget_bytes"
        : c->memory_limit_bytes < 0         ? "config->memory_limit_bytes"
        : !(c->util >= 0 && c->util <= 1)   ? "config->util"
        : c->n_threads > ENGINE_MAX_THREADS ? "config->n_threads"
        : c->max_batch_tokens < 0 || c->max_batch_tokens > ENGINE_MAX_COUNT
            ? "config->max_batch_tokens"
        : c->max_sequences < 0 || c->max_sequences > ENGINE_MAX_COUNT ? "config->max_sequences"
        : c->bank_max_bytes < 0                                       ? "config->bank_max_bytes"
        : c->spill_max_bytes < 0                                      ? "config->spill_max_bytes"
        : c->experts_on_host < -1                                     ? "config->experts_on_host"
        : c->tensor_parallel < 0                                      ? "config->tensor_parallel"
        : c->runtime_baseline_bytes < LLMEM_ENGINE_BASELINE_MEASURE
            ? "config->runtime_baseline_bytes"
        : c->runtime_reserve_bytes < 0 || c->runtime_reserve_bytes > ENGINE_MAX_BYTES
            ? "config->runtime_reserve_bytes"
            : NULL;
    if (bad == NULL)
        return LLMEM_OK;
    LLMEM_ERROR_AS("llmem_engine_open", "%s is NULL or out of its range (llmem/engine.h)", bad);
    return LLMEM_EINVAL;
}

int llmem_engine_open_hooked(const struct llmem_engine_config *config,
                             const struct llmem_engine_hooks *hooks, llmem_progress_fn progress,
                             void *progress_arg, struct llmem_engine **out) {
    int status = check_config(config, out);
    if (status != LLMEM_OK)
        return status;
    struct llmem_engine *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        LLMEM_ERROR_AS("llmem_engine_open", "out of memory");
        return LLMEM_ENOMEM;
    }
    e->cfg = *config;
    if (hooks != NULL)
        e->hooks = *hooks;
    llmem_guard_init(&e->guard);
    e->pressure_at = -1;
    if (e->cfg.max_sequences <= 0)
        e->cfg.max_sequences = 1;
    /* the config, the tokenizer and the threads first: the runtime baseline the plan commits is
     * what the process holds with them and without the model */
    struct llmem_model_geometry g;
    if (e->cfg.load_dummy)
        e->cfg.no_bank = 1;
    status = config->load_dummy ? llmem_model_geometry_load_dummy(config->model_dir, &g)
                                : llmem_model_geometry_load(config->model_dir, &g);
    e->n_ranks = config->tensor_parallel > 1 ? config->tensor_parallel : 1;
    if (status == LLMEM_OK && e->n_ranks > 1 && (status = check_split(config, &g)) != LLMEM_OK)
        goto fail;
    if (status != LLMEM_OK || (status = llmem_pool_create(config->n_threads, &e->pool)) ||
        (status = llmem_tokenizer_load(config->model_dir, &e->tok)) != LLMEM_OK ||
        (status = llmem_grammar_vocab_create(e->tok, &e->gvocab)) != LLMEM_OK ||
        (status = plan_model(e, &g, llmem_pool_threads(e->pool))) != LLMEM_OK)
        goto fail;

    struct llmem_mem_config mc = {.ops = config->backend == LLMEM_BACKEND_CUDA
                                             ? llmem_backend_cuda_memory(config->device)
                                             : NULL,
                                  .memory_limit_bytes = e->plan.allocator_limit_bytes,
                                  .cache_limit_bytes = -1,
                                  .usable_bytes = e->plan.usable_bytes};
    if ((status = llmem_mem_create(&mc, &e->mem)) != LLMEM_OK)
        goto fail;
    if (e->n_ranks > 1) {
        if ((status = open_split(e, progress, progress_arg)) != LLMEM_OK)
            goto fail;
    } else if (config->backend == LLMEM_BACKEND_CUDA) {
        /* the model read on the host, copied to the device, and the host copy dropped */
        struct phase ph = {progress, progress_arg, 0, 2};
        struct llmem_mem_config hc = {.cache_limit_bytes = -1};
        struct llmem_model *host_model = NULL;
        if ((status = llmem_mem_create(&hc, &e->host_mem)) != LLMEM_OK ||
            (status = llmem_backend_cuda_create(config->device, config->precision, e->mem,
                                                &e->be)) != LLMEM_OK ||
            (status = llmem_model_load(config->model_dir, e->host_mem,
                                       load_flags(config, e->placement.host_layers == 0),
                                       phase_progress, &ph, &host_model)) != LLMEM_OK)
            goto fail;
        const int64_t on_host = e->placement.host_layers;
        ph.part = 1;
        status = llmem_model_to_device(host_model, e->be, e->mem, on_host, 0, 1, phase_progress,
                                       &ph, &e->model);
        if (status == LLMEM_OK && on_host > 0) /* the host layers' experts stay in host_model */
            e->host_model = host_model, host_model = NULL;
        llmem_model_free(host_model);
        if (status != LLMEM_OK ||
            (on_host > 0 && (status = llmem_backend_cpu_create_shared(e->pool, e->host_mem,
                                                                      &e->host_be)) != LLMEM_OK))
            goto fail;
        if (on_host > 0)
            llmem_backend_cpu_set_precision(e->host_be, config->precision);
    } else {
        e->host_mem = e->mem;
        if ((status = llmem_model_load(config->model_dir, e->mem, load_flags(config, 0), progress,
                                       progress_arg, &e->model)) != LLMEM_OK ||
            (status = llmem_backend_cpu_create_shared(e->pool, e->mem, &e->be)) != LLMEM_OK)
            goto fail;
        llmem_backend_cpu_set_precision(e->be, config->precision);
    }
    /* a checkpoint's rows past its tokenizer's ids (padding: no token spells them) never scored */
    if (e->n_ranks == 1 && (status = llmem_model_limit_vocab(
                                e->model, llmem_tokenizer_vocab_size(e->tok))) != LLMEM_OK)
        goto fail;
    if ((status = open_kv(e)) != LLMEM_OK)
        goto fail;
    status = e->n_ranks > 1
                 ? llmem_forward_create_split(e->shares, &e->group, e->kv, e->cfg.max_batch_tokens,
                                              &e->fwd)
                 : llmem_forward_create(e->model, e->be, e->kv, e->cfg.max_batch_tokens, &e->fwd);
    if (status != LLMEM_OK ||
        (e->host_be != NULL && (status = llmem_forward_set_host(e->fwd, e->host_be)) != LLMEM_OK))
        goto fail;
    if (e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED && !e->cfg.no_bank &&
        (status = open_bank(e)) != LLMEM_OK)
        goto fail;
    const struct llmem_model_config *mcfg = llmem_model_get_config(e->model);
    e->vocab = mcfg->geom.vocab_size;
    if (llmem_tokenizer_vocab_size(e->tok) > e->vocab) {
        LLMEM_ERROR_AS("llmem_engine_open",
                       "%s: the tokenizer has %d tokens but the model only %" PRId64,
                       config->model_dir, llmem_tokenizer_vocab_size(e->tok), e->vocab);
        status = LLMEM_EFORMAT;
        goto fail;
    }
    if ((status = llmem_option_bool(LLMEM_OPT_SAMPLE_ON_DEVICE, &e->top_on_device)) != LLMEM_OK ||
        (status = llmem_option_bool(LLMEM_OPT_DECODE_AHEAD, &e->decode_ahead)) != LLMEM_OK ||
        (status = open_sched(e)) != LLMEM_OK)
        goto fail;
    *out = e;
    return LLMEM_OK;
fail:
    llmem_engine_close(e);
    return status;
}

int llmem_engine_open(const struct llmem_engine_config *config, llmem_progress_fn progress,
                      void *progress_arg, struct llmem_engine **out) {
    return llmem_engine_open_hooked(config, NULL, progress, progress_arg, out);
}

void llmem_engine_close(struct llmem_engine *e) {
    if (e == NULL)
        return;
    llmem_sched_free(e->sched);  /* stops serving: no step runs past here */
    llmem_spill_close(e->spill); /* flushes pending writes (their staging memory) */
    llmem_mem_destroy(e->staging_mem);
    llmem_forward_free(e->fwd);
    llmem_bank_destroy(e->bank);
    llmem_kv_destroy(e->kv);
    llmem_model_free(e->model);
    for (int r = 1; r < e->n_ranks; r++) /* (shares[0] is model) */
        llmem_model_free(e->shares[r]);
    llmem_model_free(e->host_model); /* after the device's copy, which refers to it */
    llmem_backend_destroy(e->host_be);
    if (e->group.n > 1 && e->cfg.backend == LLMEM_BACKEND_CUDA)
        llmem_backend_cuda_group_free(&e->group);
    else if (e->group.n > 1)
        llmem_backend_host_group_free(&e->group);
    for (int r = 1; r < e->n_ranks; r++) { /* (rank_be[0] is be; on the CPU every rank's mem) */
        llmem_backend_destroy(e->rank_be[r]);
        if (e->rank_mem[r] != e->mem)
            llmem_mem_destroy(e->rank_mem[r]);
    }
    llmem_backend_destroy(e->be); /* after what lives in its memory */
    llmem_pool_destroy(e->pool);
    llmem_grammar_vocab_free(e->gvocab);
    llmem_tokenizer_free(e->tok);
    if (e->host_mem != e->mem)
        llmem_mem_destroy(e->host_mem);
    llmem_mem_destroy(e->mem);
    free(e);
}

const struct llmem_expert_placement *llmem_engine_expert_placement(const struct llmem_engine *e) {
    return &e->placement;
}

const struct llmem_plan *llmem_engine_plan(const struct llmem_engine *e) {
    return &e->plan;
}
const struct llmem_engine_config *llmem_engine_get_config(const struct llmem_engine *e) {
    return &e->cfg;
}
struct llmem_mem *llmem_engine_mem(struct llmem_engine *e) {
    return e->mem;
}
struct llmem_kv *llmem_engine_kv(struct llmem_engine *e) {
    return e->kv;
}
struct llmem_model *llmem_engine_model(struct llmem_engine *e) {
    return e->model;
}
struct llmem_pool *llmem_engine_pool(struct llmem_engine *e) {
    return e->pool;
}
struct llmem_forward *llmem_engine_forward(struct llmem_engine *e) {
    return e->fwd;
}
struct llmem_backend *llmem_engine_backend(struct llmem_engine *e) {
    return e->be;
}
const struct llmem_tokenizer *llmem_engine_tokenizer(const struct llmem_engine *e) {
    return e->tok;
}

void llmem_engine_limits_line(const struct llmem_engine *e, char *buf, size_t size) {
    const struct llmem_plan *p = &e->plan;
    char limit[32], ceiling[32], alloc[32], baseline[32], trip[32], cache[32];
    struct llmem_mem_stats st;
    llmem_mem_stats(e->mem, &st);
    snprintf(buf, size,
             "memory limit %s (util %.2f × %s: the allocator %s, the runtime baseline %s), "
             "trip %s, cache limit %s, KV %s %s, context %" PRId64,
             llmem_size_format_short(p->allocation_limit_bytes, limit, sizeof(limit)), p->util,
             llmem_size_format_short(p->planning_bytes, ceiling, sizeof(ceiling)),
             llmem_size_format_short(st.memory_limit_bytes, alloc, sizeof(alloc)),
             llmem_size_format_short(p->runtime_baseline_bytes, baseline, sizeof(baseline)),
             llmem_size_format_short(p->trip_bytes, trip, sizeof(trip)),
             llmem_size_format_short(st.cache_limit_bytes, cache, sizeof(cache)),
             llmem_kv_format_name(e->cfg.kv_format), llmem_kv_layout_name(e->cfg.kv_layout),
             p->context_window_resolved);
}

/* ---- the pressure guard ------------------------------------------------------------------------
 */

static void guard_reading(struct llmem_engine *e, struct llmem_guard_reading *r) {
    struct llmem_mem_stats st;
    llmem_mem_stats(e->mem, &st);
    double now = llmem_clock_s();
    if (e->pressure_at < 0 || now - e->pressure_at >= 0.05) { /* /proc at most 20 times a second */
        llmem_sys_pressure_read(&e->pressure);
        e->pressure_at = now;
    }
    *r = (struct llmem_guard_reading){
        .allocator_bytes = st.active_bytes + st.cache_bytes,
        .allocation_limit = st.memory_limit_bytes,
        /* the plan's trip and ceiling are the device's with --backend cuda: no host RSS rule */
        .resident_bytes = e->cfg.backend == LLMEM_BACKEND_CUDA ? -1 : e->pressure.resident_bytes,
        .trip_bytes = e->plan.trip_bytes,
        .ceiling_bytes = e->plan.planning_bytes,
        .psi_some = e->pressure.psi_some_avg10,
        .psi_full = e->pressure.psi_full_avg10,
        .cgroup_high = e->pressure.cgroup_high,
        .cgroup_max = e->pressure.cgroup_max,
        .cgroup_oom = e->pressure.cgroup_oom,
    };
    if (e->hooks.guard_source != NULL)
        e->hooks.guard_source(e->hooks.guard_source_arg, r);
    llmem_guard_events(&e->guard, r);
}

/* Reads the signals and acts (SPEC §6.4): a warning halves the bank and releases the allocator's
 * cache; a critical empties the bank, releases the cache, keeps it empty and stops admissions
 * until it clears. */
static void guard_check(struct llmem_engine *e, int mid_step) {
    struct llmem_guard_reading r;
    guard_reading(e, &r);
    const char *why = NULL;
    enum llmem_guard_level level = llmem_guard_classify(&r, &why);
    if (level < LLMEM_GUARD_CRITICAL && e->refusing) {
        e->refusing = 0;
        llmem_mem_set_cache_limit(e->mem, e->cache_limit_saved);
        LLMEM_WARN("guard: the critical memory pressure has cleared; admitting requests again");
    }
    enum llmem_guard_level act = llmem_guard_decide(&e->guard, &r, llmem_clock_s(), mid_step);
    if (act == LLMEM_GUARD_CLEAR)
        return;
    struct llmem_bank_stats bs = {0};
    if (e->bank != NULL) {
        llmem_bank_stats(e->bank, &bs);
        llmem_bank_trim(e->bank, act == LLMEM_GUARD_CRITICAL ? 0 : bs.bytes / 2);
    }
    /* while critical, nothing freed is cached (a spill write finishing later, a step's scratch) */
    if (act == LLMEM_GUARD_CRITICAL && !e->refusing)
        e->cache_limit_saved = llmem_mem_set_cache_limit(e->mem, 0);
    int64_t cache = llmem_mem_cache_size(e->mem);
    llmem_mem_clear_cache(e->mem);
    /* the pages of free KV blocks go back too, or the resident memory would never fall */
    int64_t pages = llmem_kv_release_free(e->kv);
    if (act == LLMEM_GUARD_CRITICAL)
        e->refusing = 1;
    char b1[32], b2[32], b3[32], b4[32];
    LLMEM_WARN("guard: %s (%s): session bank %s → %s, allocator cache %s and free KV pages %s "
               "released%s",
               act == LLMEM_GUARD_CRITICAL ? "critical" : "warning", why,
               llmem_size_format_short(bs.bytes, b1, sizeof(b1)),
               llmem_size_format_short(act == LLMEM_GUARD_CRITICAL ? 0 : bs.bytes - bs.bytes / 2,
                                       b2, sizeof(b2)),
               llmem_size_format_short(cache, b3, sizeof(b3)),
               llmem_size_format_short(pages, b4, sizeof(b4)),
               act == LLMEM_GUARD_CRITICAL ? "; no new requests until it clears" : "");
}

const struct llmem_guard *llmem_engine_guard(const struct llmem_engine *e) {
    return &e->guard;
}

/* ---- the bank around a request ----------------------------------------------------------------
 */

/* Evicts banked blocks (least recently used first) until `blocks` KV blocks are free or the bank
 * is empty; returns the free blocks. */
static int64_t evict_until_free(struct llmem_engine *e, int64_t blocks) {
    const int64_t block_bytes = llmem_kv_block_bytes(e->kv);
    struct llmem_bank_stats st = {0};
    if (e->bank != NULL)
        llmem_bank_stats(e->bank, &st);
    while (blocks > llmem_kv_blocks_free(e->kv) && st.blocks > 0) {
        llmem_bank_trim(e->bank, st.bytes - block_bytes);
        llmem_bank_stats(e->bank, &st);
    }
    return llmem_kv_blocks_free(e->kv);
}

static int64_t room_for_load(void *arg, int64_t blocks) {
    return evict_until_free(arg, blocks);
}

/* The RAM tier's blocks, then the spill store's from where RAM stops. Blocks loaded from disk are
 * banked too. While they load, the RAM blocks are held so that the room made for the loads never
 * takes them. */
static int start_sequence(void *ctx, const int32_t *tokens, int64_t n, int *seq,
                          int64_t *reused_ram, int64_t *reused_disk) {
    struct llmem_engine *e = ctx;
    *reused_ram = *reused_disk = 0;
    if (e->bank == NULL)
        return llmem_kv_seq_new(e->kv, seq);
    const int64_t bs = llmem_kv_block_size(e->kv);
    int64_t max_blocks = (n - 1) / bs;
    int64_t *ids = malloc((size_t)(max_blocks > 0 ? max_blocks : 1) * sizeof(int64_t));
    if (ids == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    int64_t got = llmem_bank_lookup(e->bank, tokens, n, max_blocks, ids), n_disk = 0;
    int status;
    if (e->spill != NULL && got < max_blocks && llmem_spill_owned(e->spill)) {
        for (int64_t k = 0; k < got; k++)
            llmem_kv_block_hold(e->kv, ids[k]);
        n_disk = llmem_spill_load(e->spill, e->kv, e->root, tokens, n, got, max_blocks, ids + got,
                                  room_for_load, e);
        status = llmem_kv_seq_new_from_blocks(e->kv, ids, got + n_disk, seq);
        if (status == LLMEM_OK && n_disk > 0)
            llmem_bank_insert(e->bank, *seq, tokens, (got + n_disk) * bs);
        for (int64_t k = 0; k < got + n_disk; k++)
            llmem_kv_block_release(e->kv, ids[k]);
    } else {
        status = llmem_kv_seq_new_from_blocks(e->kv, ids, got, seq);
    }
    free(ids);
    if (status == LLMEM_OK) {
        *reused_ram = got * bs;
        *reused_disk = n_disk * bs;
    }
    return status;
}

/* The bank's budget with `working_set` bytes of KV in flight: the plan's dynamic ceiling
 * (SPEC §2.3), and --bank-max. */
static int64_t bank_cap(const struct llmem_engine *e, int64_t working_set) {
    int64_t cap = llmem_plan_bank_dynamic_ceiling(&e->plan, working_set, 0);
    if (e->cfg.bank_max_bytes > 0 && e->cfg.bank_max_bytes < cap)
        cap = e->cfg.bank_max_bytes;
    return cap;
}

static void bank_budget(void *ctx, int64_t blocks) {
    struct llmem_engine *e = ctx;
    if (e->bank != NULL)
        llmem_bank_trim(e->bank, bank_cap(e, blocks * llmem_kv_block_bytes(e->kv)));
}

static int64_t make_room(void *ctx, int seq, int64_t end, int64_t extra) {
    struct llmem_engine *e = ctx;
    if (e->cfg.kv_layout != LLMEM_KV_LAYOUT_PAGED)
        return 0;
    const int64_t bs = llmem_kv_block_size(e->kv);
    int64_t need = (end + bs - 1) / bs - (llmem_kv_seq_length(e->kv, seq) + bs - 1) / bs;
    evict_until_free(e, need + extra);
    return need;
}

/* Banks the full blocks of seq, whose KV holds tokens[0, n), and queues the chunks of them not on
 * disk yet for the spill store's writer (a copy of their bytes: it never reads the KV pool). */
static void bank_sequence(void *ctx, int seq, const int32_t *tokens, int64_t n) {
    struct llmem_engine *e = ctx;
    if (e->bank == NULL)
        return;
    llmem_bank_insert(e->bank, seq, tokens, n);
    if (e->spill != NULL && !e->refusing) { /* no staging copies under critical pressure */
        const int64_t bs = llmem_kv_block_size(e->kv);
        const int64_t *blocks = NULL;
        llmem_kv_seq_blocks(e->kv, seq, &blocks);
        int64_t full = llmem_kv_seq_length(e->kv, seq) / bs;
        if (full > n / bs)
            full = n / bs;
        llmem_spill_submit(e->spill, e->kv, e->root, tokens, blocks, full);
    }
}

static int64_t release_caches(void *ctx) {
    struct llmem_engine *e = ctx;
    struct llmem_bank_stats bs = {0};
    if (e->bank != NULL) {
        llmem_bank_stats(e->bank, &bs);
        llmem_bank_trim(e->bank, 0);
    }
    int64_t cache = llmem_mem_cache_size(e->mem);
    llmem_mem_clear_cache(e->mem);
    llmem_kv_release_free(e->kv); /* resident memory, not the plan's: not counted in the return */
    if (e->staging_mem != NULL)   /* pinned host memory: the same */
        llmem_mem_clear_cache(e->staging_mem);
    return bs.bytes + cache;
}

struct llmem_bank *llmem_engine_bank(struct llmem_engine *e) {
    return e->bank;
}

struct llmem_spill *llmem_engine_spill(struct llmem_engine *e) {
    return e->spill;
}

void llmem_engine_bank_stats(struct llmem_engine *e, struct llmem_engine_bank_stats *st) {
    memset(st, 0, sizeof(*st));
    if (e->bank != NULL)
        llmem_bank_stats(e->bank, &st->ram);
    if (e->spill != NULL) {
        llmem_spill_stats(e->spill, &st->spill);
        st->spill_on = 1;
    }
    llmem_sched_reused_tokens(e->sched, &st->reused_ram_tokens, &st->reused_disk_tokens);
    st->guard_warnings = e->guard.warnings;
    st->guard_criticals = e->guard.criticals;
    st->guard_deferred = e->guard.deferred;
    st->guard_suppressed = e->guard.suppressed;
}

/* ---- the scheduler --------------------------------------------------------------------------- */

static int64_t banked_blocks(void *ctx) {
    struct llmem_engine *e = ctx;
    struct llmem_bank_stats bs = {0};
    if (e->bank != NULL)
        llmem_bank_stats(e->bank, &bs);
    return bs.blocks;
}

static void shed_bank(void *ctx) {
    struct llmem_engine *e = ctx;
    struct llmem_bank_stats bs = {0};
    if (e->bank != NULL) {
        llmem_bank_stats(e->bank, &bs);
        llmem_bank_trim(e->bank, bs.bytes / 2);
    }
}

static int sched_guard_check(void *ctx, int mid_step) {
    struct llmem_engine *e = ctx;
    guard_check(e, mid_step);
    return e->refusing;
}

static void sched_metrics(void *ctx, struct llmem_engine_metrics *m) {
    struct llmem_engine *e = ctx;
    llmem_engine_bank_stats(e, &m->bank);
    struct llmem_mem_stats st;
    llmem_mem_stats(e->mem, &st);
    m->mem_active = st.active_bytes, m->mem_peak = st.peak_bytes, m->mem_cache = st.cache_bytes;
    m->mem_limit = st.memory_limit_bytes;
    m->guard_level = e->guard.prev;
    m->n_devices = 0;
    for (int r = 0; e->cfg.backend == LLMEM_BACKEND_CUDA && e->n_ranks > 1 && r < e->n_ranks; r++) {
        llmem_mem_stats(e->rank_mem[r], &st);
        m->devices[m->n_devices].device = e->rank_device[r];
        m->devices[m->n_devices].active = st.active_bytes;
        m->devices[m->n_devices].peak = st.peak_bytes;
        m->devices[m->n_devices++].limit = st.memory_limit_bytes;
    }
}

static const struct llmem_sched_ops SCHED_OPS = {
    .start_sequence = start_sequence,
    .bank_sequence = bank_sequence,
    .make_room = make_room,
    .banked_blocks = banked_blocks,
    .bank_budget = bank_budget,
    .shed_bank = shed_bank,
    .guard_check = sched_guard_check,
    .release_caches = release_caches,
    .metrics = sched_metrics,
};

/* The scheduler over the engine's KV cache and forward pass, its logits in host memory. */
static int open_sched(struct llmem_engine *e) {
    const struct llmem_model_config *mcfg = llmem_model_get_config(e->model);
    struct llmem_sched_config sc = {
        .ops = SCHED_OPS,
        .ctx = e,
        .kv = e->kv,
        .fwd = e->fwd,
        .tok = e->tok,
        .gvocab = e->gvocab,
        .pool = e->pool,
        .mem = e->host_mem,
        .max_sequences = e->cfg.max_sequences,
        .max_batch_tokens = e->cfg.max_batch_tokens,
        .context = e->plan.context_window_resolved,
        .vocab = e->vocab,
        .paged = e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED,
        .top_on_device = e->top_on_device,
        .decode_ahead = e->decode_ahead,
    };
    for (int i = 0; i < mcfg->n_eos; i++)
        sc.eos[sc.n_eos++] = mcfg->eos_ids[i];
    if (llmem_tokenizer_eos(e->tok) >= 0)
        sc.eos[sc.n_eos++] = llmem_tokenizer_eos(e->tok);
    return llmem_sched_create(&sc, &e->sched);
}

int llmem_engine_generate(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                          const struct llmem_generate_params *p, llmem_token_fn on_token, void *arg,
                          struct llmem_generate_result *result) {
    return llmem_sched_generate(e->sched, prompt, n_prompt, p, on_token, arg, result);
}

int llmem_engine_serve_start(struct llmem_engine *e, const struct llmem_serve_config *config) {
    return llmem_sched_serve_start(e->sched, config);
}

void llmem_engine_serve_stop(struct llmem_engine *e) {
    llmem_sched_serve_stop(e->sched);
}

int llmem_engine_submit(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                        const struct llmem_generate_params *params,
                        const struct llmem_request_events *events, uint64_t *id) {
    return llmem_sched_submit(e->sched, prompt, n_prompt, params, events, id);
}

void llmem_engine_cancel(struct llmem_engine *e, uint64_t id) {
    llmem_sched_cancel(e->sched, id);
}

int64_t llmem_engine_clear_cache(struct llmem_engine *e) {
    return llmem_sched_clear_cache(e->sched);
}

void llmem_engine_metrics(struct llmem_engine *e, struct llmem_engine_metrics *m) {
    llmem_sched_metrics(e->sched, m);
}
