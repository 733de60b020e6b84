/*
 * engine/engine.c — a model opened inside its memory plan, and the generation loop.
 *
 * Open: geometry (headers only) → machine probe → plan → refuse if it does not fit → allocator with
 * the plan's limits → weights, tokenizer, backend, KV cache, forward pass. The paged KV pool is the
 * plan's reserve (one window per sequence), allocated at open; the allocator's memory limit bounds
 * everything together.
 *
 * Generate: the longest banked prefix of the prompt (RAM tier, then the spill store), prefill of
 * the rest in chunks (logits of the last token only), then decode token by token. Text is
 * streamed through the detokenizer; a stop string ends generation and is cut from the text, and
 * text that might be the start of a stop string is held back until it is not. At the end the
 * sequence's full blocks are banked, and its chunks not on disk yet are queued for the spill
 * store's writer thread (a copy of their bytes: the writer never reads the KV pool).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#include <time.h>

#include "backend/ops.h"
#include "core/log.h"
#include "core/pool.h"
#include "llmem/bank.h"
#include "llmem/engine.h"
#include "llmem/size.h"
#include "llmem/spill.h"
#include "llmem/sys.h"
#include "llmem/tokenizer.h"

struct llmem_engine {
    struct llmem_engine_config cfg;
    struct llmem_plan plan;
    struct llmem_mem *mem;
    struct llmem_model *model;
    struct llmem_tokenizer *tok;
    struct llmem_pool *pool; /* the threads every kernel runs on */
    struct llmem_backend *be;
    struct llmem_kv *kv;
    struct llmem_bank *bank;   /* the RAM tier of the session bank (paged layout), or NULL */
    struct llmem_spill *spill; /* the bank's spill store, or NULL */
    uint8_t root[32];          /* the bank's chain root: the model's identity */
    int64_t ram_bytes;         /* this machine's RAM (for the spill store's default cap) */
    int64_t reused_ram_tokens, reused_disk_tokens;
    struct llmem_guard guard;
    struct llmem_sys_pressure pressure; /* the last read of /proc, and when */
    double pressure_at;
    int refusing; /* a critical is in effect: no new request is admitted */
    struct llmem_forward *fwd;
    float *logits; /* (max_sequences, vocab) tag scratch */
    int64_t vocab;
    int32_t eos[LLMEM_MAX_EOS + 1];
    int n_eos;
};

void llmem_engine_config_default(struct llmem_engine_config *c) {
    memset(c, 0, sizeof(*c));
    c->kv_layout = LLMEM_KV_LAYOUT_PAGED;
    c->kv_format = LLMEM_KV_FORMAT_F16;
    c->max_batch_tokens = 512;
    c->max_sequences = 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- open ----------------------------------------------------------------------------------- */

static int plan_model(struct llmem_engine *e, const struct llmem_model_geometry *g, int threads) {
    struct llmem_device_info host;
    int status = llmem_sys_probe_host(&host);
    if (status != LLMEM_OK)
        return status;
    e->ram_bytes = host.memory_size;
    const struct llmem_engine_config *c = &e->cfg;
    struct llmem_plan_params p = {
        .target = LLMEM_PLAN_HOST,
        .total_bytes = host.max_recommended_working_set_size,
        .ceiling_bytes = host.max_recommended_working_set_size,
        .weights_bytes = g->weights_bytes,
        .kv_bytes_per_token = llmem_geometry_kv_bytes_per_token(g),
        .kv_format = c->kv_format,
        .model_max_context = g->max_context,
        .requested_context = c->context,
        .memory_budget_bytes = c->budget_bytes,
        .memory_limit_bytes = c->memory_limit_bytes,
        .util = c->util,
        .max_sequences = c->max_sequences,
        .max_batch_tokens = c->max_batch_tokens,
        /* the forward pass's buffers and the backend's fixed GEMM scratch */
        .computed_workspace_bytes =
            llmem_geometry_workspace_bytes(g, c->max_batch_tokens, c->max_sequences) +
            llmem_backend_cpu_scratch_bytes(threads),
    };
    if ((status = llmem_plan_compute(&p, &e->plan)) != LLMEM_OK)
        return status;
    char line[512];
    llmem_plan_describe(&e->plan, line, sizeof(line));
    if (!e->plan.model_fits || e->plan.overcommitted) {
        LLMEM_ERROR_AS("llmem_engine_open", "%s: refused before loading: %s", c->model_dir, line);
        for (int i = 0; i < e->plan.n_notes; i++)
            LLMEM_ERROR_AS("llmem_engine_open", "%s", e->plan.notes[i]);
        return LLMEM_ENOMEM;
    }
    LLMEM_INFO("plan: %s", line);
    return LLMEM_OK;
}

static int open_kv(struct llmem_engine *e) {
    const struct llmem_model_geometry *g = &llmem_model_get_config(e->model)->geom;
    struct llmem_kv_config kc;
    llmem_kv_config_default(&kc);
    kc.layout = e->cfg.kv_layout;
    kc.format = e->cfg.kv_format;
    kc.n_layers = (int)g->n_layers;
    kc.n_kv_heads = (int)g->n_kv_heads;
    kc.head_dim = (int)g->head_dim;
    kc.max_sequences = (int)e->cfg.max_sequences;
    kc.n_threads = e->cfg.n_threads;
    kc.pool = e->pool;
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
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[4096];
    if (xdg != NULL && *xdg == '/')
        snprintf(dir, sizeof(dir), "%s/llmem", xdg);
    else if (home != NULL && *home == '/')
        snprintf(dir, sizeof(dir), "%s/.cache/llmem", home);
    else
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

static int open_bank(struct llmem_engine *e) {
    struct llmem_bank_identity id;
    char *cache = digest_cache_path();
    int status =
        llmem_bank_identity(e->cfg.model_dir, e->cfg.kv_format, e->cfg.kv_layout, NULL, cache, &id);
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
    sc.mem = e->mem;
    sc.free_probe = e->cfg.spill_free_probe;
    sc.free_probe_arg = e->cfg.spill_free_probe_arg;
    status = llmem_spill_open(&sc, &e->spill);
    if (status != LLMEM_OK && e->cfg.bank_dir == NULL) {
        LLMEM_WARN("the session bank runs without its spill tier");
        status = LLMEM_OK;
    }
    return status;
}

int llmem_engine_open(const struct llmem_engine_config *config, llmem_progress_fn progress,
                      void *progress_arg, struct llmem_engine **out) {
    struct llmem_engine *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    e->cfg = *config;
    llmem_guard_init(&e->guard);
    e->pressure_at = -1;
    if (e->cfg.max_batch_tokens <= 0)
        e->cfg.max_batch_tokens = 512;
    if (e->cfg.max_sequences <= 0)
        e->cfg.max_sequences = 1;
    struct llmem_model_geometry g;
    int status = llmem_model_geometry_load(config->model_dir, &g);
    if (status != LLMEM_OK || (status = llmem_pool_create(config->n_threads, &e->pool)) ||
        (status = plan_model(e, &g, llmem_pool_threads(e->pool))) != LLMEM_OK)
        goto fail;

    struct llmem_mem_config mc = {.memory_limit_bytes = e->plan.allocation_limit_bytes,
                                  .cache_limit_bytes = -1,
                                  .usable_bytes = e->plan.usable_bytes};
    if ((status = llmem_mem_create(&mc, &e->mem)) != LLMEM_OK ||
        (status = llmem_tokenizer_load(config->model_dir, &e->tok)) != LLMEM_OK ||
        (status = llmem_model_load(config->model_dir, e->mem,
                                   config->no_mmap ? LLMEM_MODEL_LOAD_NO_MMAP : 0, progress,
                                   progress_arg, &e->model)) != LLMEM_OK ||
        (status = llmem_backend_cpu_create_shared(e->pool, e->mem, &e->be)) != LLMEM_OK ||
        (status = open_kv(e)) != LLMEM_OK ||
        (status = llmem_forward_create(e->model, e->be, e->kv, e->cfg.max_batch_tokens, &e->fwd)) !=
            LLMEM_OK)
        goto fail;
    if (e->cfg.kv_layout == LLMEM_KV_LAYOUT_PAGED && !e->cfg.no_bank &&
        (status = open_bank(e)) != LLMEM_OK)
        goto fail;
    const struct llmem_model_config *mcfg = llmem_model_get_config(e->model);
    e->vocab = mcfg->geom.vocab_size;
    if (llmem_tokenizer_vocab_size(e->tok) > e->vocab) {
        LLMEM_ERROR("%s: the tokenizer has %d tokens but the model only %" PRId64,
                    config->model_dir, llmem_tokenizer_vocab_size(e->tok), e->vocab);
        status = LLMEM_EFORMAT;
        goto fail;
    }
    e->logits = llmem_mem_alloc(e->mem, (size_t)(e->cfg.max_sequences * e->vocab) * sizeof(float),
                                LLMEM_TAG_SCRATCH);
    if (e->logits == NULL) {
        status = LLMEM_ENOMEM;
        goto fail;
    }
    for (int i = 0; i < mcfg->n_eos; i++)
        e->eos[e->n_eos++] = mcfg->eos_ids[i];
    if (llmem_tokenizer_eos(e->tok) >= 0)
        e->eos[e->n_eos++] = llmem_tokenizer_eos(e->tok);
    *out = e;
    return LLMEM_OK;
fail:
    llmem_engine_close(e);
    return status;
}

void llmem_engine_close(struct llmem_engine *e) {
    if (e == NULL)
        return;
    llmem_spill_close(e->spill); /* flushes pending writes (staging memory from e->mem) */
    if (e->mem != NULL)
        llmem_mem_free(e->mem, e->logits);
    llmem_forward_free(e->fwd);
    llmem_bank_destroy(e->bank);
    llmem_kv_destroy(e->kv);
    llmem_backend_destroy(e->be);
    llmem_pool_destroy(e->pool);
    llmem_tokenizer_free(e->tok);
    llmem_model_free(e->model);
    llmem_mem_destroy(e->mem);
    free(e);
}

const struct llmem_plan *llmem_engine_plan(const struct llmem_engine *e) {
    return &e->plan;
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
const struct llmem_tokenizer *llmem_engine_tokenizer(const struct llmem_engine *e) {
    return e->tok;
}

void llmem_engine_limits_line(const struct llmem_engine *e, char *buf, size_t size) {
    const struct llmem_plan *p = &e->plan;
    char limit[32], ceiling[32], trip[32], cache[32];
    struct llmem_mem_stats st;
    llmem_mem_stats(e->mem, &st);
    snprintf(buf, size,
             "memory limit %s (util %.2f × %s), trip %s, cache limit %s, KV %s %s, "
             "context %" PRId64,
             llmem_size_format_short(st.memory_limit_bytes, limit, sizeof(limit)), p->util,
             llmem_size_format_short(p->planning_bytes, ceiling, sizeof(ceiling)),
             llmem_size_format_short(p->trip_bytes, trip, sizeof(trip)),
             llmem_size_format_short(st.cache_limit_bytes, cache, sizeof(cache)),
             llmem_kv_format_name(e->cfg.kv_format), llmem_kv_layout_name(e->cfg.kv_layout),
             p->context_window_resolved);
}

/* ---- generation ----------------------------------------------------------------------------- */

void llmem_generate_params_default(struct llmem_generate_params *p) {
    memset(p, 0, sizeof(*p));
    llmem_sampling_default(&p->sampling);
}

void llmem_generate_result_free(struct llmem_generate_result *r) {
    if (r == NULL)
        return;
    free(r->ids);
    free(r->text);
    memset(r, 0, sizeof(*r));
}

/* The generated text, and how much of it has been handed to the caller. */
struct stream {
    char *text;
    size_t len, cap, emitted;
};

static int stream_append(struct stream *s, const char *piece) {
    size_t n = strlen(piece);
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 256;
        while (cap < s->len + n + 1)
            cap *= 2;
        char *t = realloc(s->text, cap);
        if (t == NULL)
            return LLMEM_ENOMEM;
        s->text = t;
        s->cap = cap;
    }
    memcpy(s->text + s->len, piece, n + 1);
    s->len += n;
    return LLMEM_OK;
}

/* Where a stop string starts in the text (searching only where a new one can be), or −1; and
 * through *safe how much of the text can be emitted without splitting a possible stop string. */
static int64_t find_stop(const struct stream *s, const struct llmem_generate_params *p,
                         size_t *safe) {
    *safe = s->len;
    for (int i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        if (n == 0)
            continue;
        size_t from = s->emitted;
        const char *hit = NULL;
        for (const char *q = s->text + from; (q = strstr(q, p->stop[i])) != NULL; q++) {
            hit = q;
            break;
        }
        if (hit != NULL)
            return hit - s->text;
        /* the longest tail of the text that begins the stop string */
        for (size_t k = n - 1; k > 0; k--) {
            if (k <= s->len - s->emitted && memcmp(s->text + s->len - k, p->stop[i], k) == 0) {
                if (s->len - k < *safe)
                    *safe = s->len - k;
                break;
            }
        }
    }
    return -1;
}

static int is_stop_id(const struct llmem_engine *e, const struct llmem_generate_params *p,
                      int32_t id) {
    for (int i = 0; !p->ignore_eos && i < e->n_eos; i++)
        if (e->eos[i] == id)
            return 1;
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] == id)
            return 1;
    return 0;
}

/* ---- the pressure guard ------------------------------------------------------------------------
 */

static void guard_reading(struct llmem_engine *e, struct llmem_guard_reading *r) {
    struct llmem_mem_stats st;
    llmem_mem_stats(e->mem, &st);
    double now = now_s();
    if (e->pressure_at < 0 || now - e->pressure_at >= 0.05) { /* /proc at most 20 times a second */
        llmem_sys_pressure_read(&e->pressure);
        e->pressure_at = now;
    }
    *r = (struct llmem_guard_reading){
        .allocator_bytes = st.active_bytes + st.cache_bytes,
        .allocation_limit = st.memory_limit_bytes,
        .resident_bytes = e->pressure.resident_bytes,
        .trip_bytes = e->plan.trip_bytes,
        .ceiling_bytes = e->plan.planning_bytes,
        .psi_some = e->pressure.psi_some_avg10,
        .psi_full = e->pressure.psi_full_avg10,
        .cgroup_high = e->pressure.cgroup_high,
        .cgroup_max = e->pressure.cgroup_max,
        .cgroup_oom = e->pressure.cgroup_oom,
    };
    if (e->cfg.guard_source != NULL)
        e->cfg.guard_source(e->cfg.guard_source_arg, r);
    llmem_guard_events(&e->guard, r);
}

/* Reads the signals and acts (SPEC §6.4): a warning halves the bank and releases the allocator's
 * cache; a critical empties the bank, releases the cache and stops admissions until it clears. */
static void guard_check(struct llmem_engine *e, int mid_step) {
    struct llmem_guard_reading r;
    guard_reading(e, &r);
    const char *why = NULL;
    enum llmem_guard_level level = llmem_guard_classify(&r, &why);
    if (level < LLMEM_GUARD_CRITICAL && e->refusing) {
        e->refusing = 0;
        LLMEM_WARN("guard: the critical memory pressure has cleared; admitting requests again");
    }
    enum llmem_guard_level act = llmem_guard_decide(&e->guard, &r, now_s(), mid_step);
    if (act == LLMEM_GUARD_CLEAR)
        return;
    struct llmem_bank_stats bs = {0};
    if (e->bank != NULL) {
        llmem_bank_stats(e->bank, &bs);
        llmem_bank_trim(e->bank, act == LLMEM_GUARD_CRITICAL ? 0 : bs.bytes / 2);
    }
    int64_t cache = llmem_mem_cache_size(e->mem);
    llmem_mem_clear_cache(e->mem);
    if (act == LLMEM_GUARD_CRITICAL)
        e->refusing = 1;
    char b1[32], b2[32];
    LLMEM_WARN("guard: %s (%s): session bank %s → %s, allocator cache %s released%s",
               act == LLMEM_GUARD_CRITICAL ? "critical" : "warning", why,
               llmem_size_format_short(bs.bytes, b1, sizeof(b1)),
               llmem_size_format_short(act == LLMEM_GUARD_CRITICAL ? 0 : bs.bytes - bs.bytes / 2,
                                       b2, sizeof(b2)),
               llmem_size_format_short(cache, b1, sizeof(b1)),
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

/* A sequence for the prompt, starting from the banked blocks that begin it (at least its last
 * token is left to prefill, for its logits): the RAM tier's, then the spill store's from where
 * RAM stops. Blocks loaded from disk are banked too. While they load, the RAM blocks are held so
 * that the room made for the loads never takes them. */
static int start_sequence(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt, int *seq,
                          int64_t *reused_ram, int64_t *reused_disk) {
    *reused_ram = *reused_disk = 0;
    if (e->bank == NULL)
        return llmem_kv_seq_new(e->kv, seq);
    const int64_t bs = llmem_kv_block_size(e->kv);
    int64_t max_blocks = (n_prompt - 1) / bs;
    int64_t *ids = malloc((size_t)(max_blocks > 0 ? max_blocks : 1) * sizeof(int64_t));
    if (ids == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    int64_t n = llmem_bank_lookup(e->bank, prompt, n_prompt, max_blocks, ids), n_disk = 0;
    int status;
    if (e->spill != NULL && n < max_blocks && llmem_spill_owned(e->spill)) {
        for (int64_t k = 0; k < n; k++)
            llmem_kv_block_hold(e->kv, ids[k]);
        n_disk = llmem_spill_load(e->spill, e->kv, e->root, prompt, n_prompt, n, max_blocks,
                                  ids + n, room_for_load, e);
        status = llmem_kv_seq_new_from_blocks(e->kv, ids, n + n_disk, seq);
        if (status == LLMEM_OK && n_disk > 0)
            llmem_bank_insert(e->bank, *seq, prompt, (n + n_disk) * bs);
        for (int64_t k = 0; k < n + n_disk; k++)
            llmem_kv_block_release(e->kv, ids[k]);
    } else {
        status = llmem_kv_seq_new_from_blocks(e->kv, ids, n, seq);
    }
    free(ids);
    if (status == LLMEM_OK) {
        *reused_ram = n * bs;
        *reused_disk = n_disk * bs;
        e->reused_ram_tokens += n * bs;
        e->reused_disk_tokens += n_disk * bs;
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

/* The blocks seq still lacks to hold tokens [0, end), after evicting banked blocks (least
 * recently used first) while the pool has fewer free blocks than that: the bank yields to the
 * work in flight. Paged layout. */
static int64_t make_room(struct llmem_engine *e, int seq, int64_t end) {
    const int64_t bs = llmem_kv_block_size(e->kv);
    int64_t need = (end + bs - 1) / bs - (llmem_kv_seq_length(e->kv, seq) + bs - 1) / bs;
    evict_until_free(e, need);
    return need;
}

/* Runs n tokens at pos on seq, first evicting banked blocks (least recently used) while the pool
 * has fewer free blocks than the step needs: the bank yields to the work in flight. */
static int step(struct llmem_engine *e, int seq, const int32_t *tokens, int64_t pos, int64_t n) {
    guard_check(e, 1);
    if (e->bank != NULL) {
        /* the bank's budget at this working set (SPEC §2.3), then room for the step */
        const int64_t bs = llmem_kv_block_size(e->kv), len = llmem_kv_seq_length(e->kv, seq);
        int64_t blocks = ((pos + n > len ? pos + n : len) + bs - 1) / bs;
        llmem_bank_trim(e->bank, bank_cap(e, blocks * llmem_kv_block_bytes(e->kv)));
        make_room(e, seq, pos + n);
    }
    struct llmem_batch_seq b = {.seq = seq, .pos = pos, .n_tokens = n};
    return llmem_forward_run(e->fwd, tokens, &b, 1, e->logits);
}

/* Banks a finished sequence's full blocks (prompt, then the generated tokens whose KV was
 * written) and queues the chunks of them that are not on disk yet for the spill store, then holds
 * the bank to its budget with no request in flight. A bank that cannot take them only loses the
 * reuse (logged). */
static void bank_sequence(struct llmem_engine *e, int seq, const int32_t *prompt, int64_t n_prompt,
                          const int32_t *ids, int64_t n_ids) {
    if (e->bank == NULL)
        return;
    int32_t *all = malloc((size_t)(n_prompt + n_ids) * sizeof(int32_t));
    if (all == NULL)
        return;
    memcpy(all, prompt, (size_t)n_prompt * sizeof(int32_t));
    memcpy(all + n_prompt, ids, (size_t)n_ids * sizeof(int32_t));
    llmem_bank_insert(e->bank, seq, all, n_prompt + n_ids);
    if (e->spill != NULL && !e->refusing) { /* no staging copies under critical pressure */
        const int64_t bs = llmem_kv_block_size(e->kv);
        const int64_t *blocks = NULL;
        llmem_kv_seq_blocks(e->kv, seq, &blocks);
        int64_t full = llmem_kv_seq_length(e->kv, seq) / bs;
        if (full > (n_prompt + n_ids) / bs)
            full = (n_prompt + n_ids) / bs;
        llmem_spill_submit(e->spill, e->kv, e->root, all, blocks, full);
    }
    free(all);
    llmem_bank_trim(e->bank, bank_cap(e, 0));
}

/* Admission (SPEC §6.5): the request's whole footprint in KV blocks must be free, or become free
 * by evicting banked blocks, before anything is written; otherwise it is refused now rather than
 * failing half-way. The prefix the sequence took from the bank is already pinned by it. */
static int admit(struct llmem_engine *e, int seq, int64_t tokens) {
    guard_check(e, 0);
    if (e->refusing) {
        LLMEM_ERROR("refused: the machine is under critical memory pressure; no new request is "
                    "admitted until it clears");
        return LLMEM_ENOMEM;
    }
    if (e->cfg.kv_layout != LLMEM_KV_LAYOUT_PAGED)
        return LLMEM_OK;
    int64_t need = make_room(e, seq, tokens);
    if (need > llmem_kv_blocks_free(e->kv)) {
        char b1[32], b2[32];
        LLMEM_ERROR("refused before prefill: the request needs %" PRId64
                    " more KV blocks (%s) but %" PRId64
                    " are free (%s) after emptying the session bank; shorten the prompt or -n, "
                    "or quantize the KV (--kv-format q8)",
                    need, llmem_size_format_short(need * llmem_kv_block_bytes(e->kv), b1, 32),
                    llmem_kv_blocks_free(e->kv),
                    llmem_size_format_short(
                        llmem_kv_blocks_free(e->kv) * llmem_kv_block_bytes(e->kv), b2, 32));
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
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
    st->reused_ram_tokens = e->reused_ram_tokens;
    st->reused_disk_tokens = e->reused_disk_tokens;
    st->guard_warnings = e->guard.warnings;
    st->guard_criticals = e->guard.criticals;
    st->guard_deferred = e->guard.deferred;
    st->guard_suppressed = e->guard.suppressed;
}

int llmem_engine_generate(struct llmem_engine *e, const int32_t *prompt, int64_t n_prompt,
                          const struct llmem_generate_params *p, llmem_token_fn on_token, void *arg,
                          struct llmem_generate_result *r) {
    memset(r, 0, sizeof(*r));
    const double t_in = now_s();
    const int64_t context = e->plan.context_window_resolved;
    if (n_prompt <= 0 || n_prompt >= context) {
        LLMEM_ERROR("the prompt has %" PRId64 " tokens; it must have 1 to %" PRId64
                    " (the context window is %" PRId64 ")",
                    n_prompt, context - 1, context);
        return LLMEM_EINVAL;
    }
    int64_t max_tokens = context - n_prompt;
    if (p->max_tokens > 0 && p->max_tokens < max_tokens)
        max_tokens = p->max_tokens;
    struct llmem_sampler *sampler = NULL;
    struct llmem_detok *detok = NULL;
    struct stream s = {0};
    int seq = -1;
    int status = llmem_sampler_create(&p->sampling, e->vocab, &sampler);
    int64_t reused_ram = 0, reused_disk = 0;
    if (status != LLMEM_OK || (status = llmem_detok_create(e->tok, 1, &detok)) != LLMEM_OK ||
        (status = start_sequence(e, prompt, n_prompt, &seq, &reused_ram, &reused_disk)) != LLMEM_OK)
        goto out;
    const int64_t reused = reused_ram + reused_disk;
    if ((status = admit(e, seq, n_prompt + max_tokens)) != LLMEM_OK)
        goto out;
    r->ids = malloc((size_t)max_tokens * sizeof(int32_t));
    if (r->ids == NULL) {
        LLMEM_ERROR("out of memory");
        status = LLMEM_ENOMEM;
        goto out;
    }
    r->prompt_tokens = n_prompt;
    r->reused_tokens = reused;
    r->reused_ram_tokens = reused_ram;
    r->reused_disk_tokens = reused_disk;
    r->finish_reason = "length";
    int stop_string = 0;

    /* Prefill. */
    double t0 = now_s();
    const int64_t chunk = e->cfg.max_batch_tokens;
    for (int64_t pos = reused; pos < n_prompt; pos += chunk) {
        int64_t n = n_prompt - pos < chunk ? n_prompt - pos : chunk;
        if ((status = step(e, seq, prompt + pos, pos, n)) != LLMEM_OK)
            goto out;
        if (p->prefill_progress != NULL)
            p->prefill_progress(p->progress_arg, pos + n, n_prompt);
    }
    double t1 = now_s();
    r->prefill_s = t1 - t0;

    /* Decode. */
    for (int64_t i = 0; i < max_tokens; i++) {
        int32_t id = llmem_sampler_sample(sampler, e->logits);
        if (i == 0)
            r->ttft_ms = (now_s() - t_in) * 1e3;
        if (is_stop_id(e, p, id)) {
            r->finish_reason = "stop";
            break;
        }
        r->ids[r->n_ids++] = id;
        char *piece = NULL;
        if ((status = llmem_detok_push(detok, id, &piece)) != LLMEM_OK)
            goto out;
        status = stream_append(&s, piece);
        free(piece);
        if (status != LLMEM_OK)
            goto out;
        size_t safe = 0;
        int64_t stop_at = find_stop(&s, p, &safe);
        if (stop_at >= 0) {
            s.len = (size_t)stop_at;
            s.text[s.len] = '\0';
            safe = s.len;
            r->finish_reason = "stop";
            stop_string = 1;
        }
        int cancel = 0;
        if (on_token != NULL)
            cancel = on_token(arg, id, s.text + s.emitted, safe - s.emitted);
        s.emitted = safe;
        if (stop_at >= 0)
            break;
        if (cancel) {
            r->finish_reason = "cancelled";
            break;
        }
        if (i + 1 == max_tokens)
            break;
        if ((status = step(e, seq, &id, n_prompt + i, 1)) != LLMEM_OK)
            goto out;
        r->decode_tokens++;
    }
    r->decode_s = now_s() - t1;
    if (!stop_string) { /* flush what was held back: an incomplete character, a stop prefix */
        char *rest = NULL;
        if ((status = llmem_detok_finish(detok, &rest)) == LLMEM_OK) {
            status = stream_append(&s, rest);
            free(rest);
        }
        if (status != LLMEM_OK)
            goto out;
        if (on_token != NULL && s.emitted < s.len)
            on_token(arg, -1, s.text + s.emitted, s.len - s.emitted);
        s.emitted = s.len;
    }
    if (s.text == NULL && (status = stream_append(&s, "")) != LLMEM_OK)
        goto out;
    r->text = s.text;
    r->text_len = s.len;
    s.text = NULL;
    bank_sequence(e, seq, prompt, n_prompt, r->ids, r->n_ids);
out:
    if (seq >= 0)
        llmem_kv_seq_free(e->kv, seq);
    free(s.text);
    llmem_detok_free(detok);
    llmem_sampler_free(sampler);
    if (status != LLMEM_OK) {
        if (status == LLMEM_ENOMEM)
            LLMEM_ERROR("the request ends: out of memory after %" PRId64 " tokens", r->n_ids);
        llmem_generate_result_free(r);
    }
    return status;
}
