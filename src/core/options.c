/*
 * core/options.c — the table of LLMEM_* environment variables, read once, and the cache directory
 * (see core/options.h). This is the only file that reads the environment.
 *
 * Each variable is read on the first call that asks for any option (pthread_once) and parsed
 * then: its text is kept (for `llmem info`) with its state — unset (the default, if any, taken),
 * well formed (the value kept), or malformed (reported by every getter that asks for it). A
 * value longer than any accepted one is malformed. Nothing is logged while reading: the getter
 * that meets a malformed value logs the line, so it is the failing call's own.
 */
#include "core/options.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/log.h"
#include "core/size_int.h"
#include "llmem/status.h"

/* ---- the table ------------------------------------------------------------------------------ */

static const char *const kv_layouts[] = {"paged", "contiguous", "blocks", "ragged", NULL};
static const char *const kv_formats[] = {"f16", "bf16", "f32", "q8", "q4", "tq", NULL};

#define BOOL(def)        LLMEM_OPTION_BOOL, def, 0, 1, NULL
#define INT(def, lo, hi) LLMEM_OPTION_INT, def, lo, hi, NULL
#define ENUM(choices)    LLMEM_OPTION_ENUM, NULL, 0, 0, choices

static const struct llmem_option_info table[LLMEM_OPT_COUNT] = {
    [LLMEM_OPT_VERBOSE] = {"LLMEM_VERBOSE", BOOL("0"),
                           "llmem logs info and debug lines to stderr too, not only errors and "
                           "warnings"},
    [LLMEM_OPT_KV_LAYOUT] = {"LLMEM_KV_LAYOUT", ENUM(kv_layouts),
                             "llmem_kv_config_from_env: the KV layout (unset: the config's, "
                             "paged by default)"},
    [LLMEM_OPT_KV_FORMAT] = {"LLMEM_KV_FORMAT", ENUM(kv_formats),
                             "llmem_kv_config_from_env: the KV storage format (unset: the "
                             "config's, f16 by default)"},
    [LLMEM_OPT_KV_BLOCK_SIZE] = {"LLMEM_KV_BLOCK_SIZE", INT(NULL, 1, (int64_t)1 << 20),
                                 "llmem_kv_config_from_env: tokens per KV block (unset: the "
                                 "config's; 16 paged, 1024 for the blocks layout)"},
    [LLMEM_OPT_KV_NUM_BLOCKS] = {"LLMEM_KV_NUM_BLOCKS", INT(NULL, 1, (int64_t)1 << 40),
                                 "llmem_kv_config_from_env: KV blocks in the pool (unset: the "
                                 "config's, 1024 by default)"},
    [LLMEM_OPT_KV_DYNAMIC] = {"LLMEM_KV_DYNAMIC", BOOL(NULL),
                              "llmem_kv_config_from_env: a paged pool grows when it runs out "
                              "(unset: the config's, 1 by default)"},
    [LLMEM_OPT_SAMPLE_ON_DEVICE] = {"LLMEM_SAMPLE_ON_DEVICE", BOOL("1"),
                                    "sample from the top k of each logits row found on the "
                                    "device where it can (0: whole rows copied to the host)"},
    [LLMEM_OPT_DECODE_AHEAD] = {"LLMEM_DECODE_AHEAD", BOOL("1"),
                                "queue a greedy decode step behind the one in flight, its "
                                "tokens fed on the device"},
    [LLMEM_OPT_CUDA_GRAPHS] = {"LLMEM_CUDA_GRAPHS", BOOL("1"),
                               "record the CUDA backend's decode steps as graphs and replay them"},
    [LLMEM_OPT_SPLIT_ONE_DEVICE] = {"LLMEM_SPLIT_ONE_DEVICE", BOOL("0"),
                                    "--tensor-parallel with --backend cuda: every rank on "
                                    "--device, their sums made there without NCCL (a split's "
                                    "path on one GPU, to check it)"},
    [LLMEM_OPT_CUDA_PROFILE] = {"LLMEM_CUDA_PROFILE", BOOL("0"),
                                "time every CUDA operation on its own (no graphs) and log the "
                                "totals at info level"},
    [LLMEM_OPT_CUDA_ATTN_STAGES] = {"LLMEM_CUDA_ATTN_STAGES", INT("3", 2, 8),
                                    "stages per ring of the CUDA decode attention for bf16, f16 "
                                    "and q8 (2, 3, 4, 6, 8; others round down)"},
    [LLMEM_OPT_CUDA_ATTN_BF16_STAGES] = {"LLMEM_CUDA_ATTN_BF16_STAGES", INT(NULL, 2, 8),
                                         "LLMEM_CUDA_ATTN_STAGES for bf16 caches alone (unset: "
                                         "LLMEM_CUDA_ATTN_STAGES)"},
    [LLMEM_OPT_CUDA_ATTN_F16_STAGES] = {"LLMEM_CUDA_ATTN_F16_STAGES", INT(NULL, 2, 8),
                                        "LLMEM_CUDA_ATTN_STAGES for f16 caches alone (unset: "
                                        "LLMEM_CUDA_ATTN_STAGES)"},
    [LLMEM_OPT_CUDA_ATTN_Q8_STAGES] = {"LLMEM_CUDA_ATTN_Q8_STAGES", INT(NULL, 2, 8),
                                       "LLMEM_CUDA_ATTN_STAGES for q8 caches alone (unset: "
                                       "LLMEM_CUDA_ATTN_STAGES)"},
    [LLMEM_OPT_CUDA_ATTN_CTAS] = {"LLMEM_CUDA_ATTN_CTAS", INT(NULL, 0, 4),
                                  "the most CTAs an SM of the CUDA decode attention for bf16, f16 "
                                  "and q8, 0: as many as fit (unset: 2 for q8, 1 otherwise)"},
    [LLMEM_OPT_CUDA_ATTN_BF16_CTAS] = {"LLMEM_CUDA_ATTN_BF16_CTAS", INT(NULL, 0, 4),
                                       "LLMEM_CUDA_ATTN_CTAS for bf16 caches alone (unset: "
                                       "LLMEM_CUDA_ATTN_CTAS, else 1)"},
    [LLMEM_OPT_CUDA_ATTN_F16_CTAS] = {"LLMEM_CUDA_ATTN_F16_CTAS", INT(NULL, 0, 4),
                                      "LLMEM_CUDA_ATTN_CTAS for f16 caches alone (unset: "
                                      "LLMEM_CUDA_ATTN_CTAS, else 1)"},
    [LLMEM_OPT_CUDA_ATTN_Q8_CTAS] = {"LLMEM_CUDA_ATTN_Q8_CTAS", INT(NULL, 0, 4),
                                     "LLMEM_CUDA_ATTN_CTAS for q8 caches alone (unset: "
                                     "LLMEM_CUDA_ATTN_CTAS, else 2); not 2 also keeps q8 from "
                                     "taking three when a split fills one wave"},
    [LLMEM_OPT_CUDA_ATTN_FUSE] = {"LLMEM_CUDA_ATTN_FUSE", INT("16", 0, 256),
                                  "the CUDA attention merges its splits inside the kernel when the "
                                  "merging warp reads at most this many rows of 128 floats (0: "
                                  "always a second kernel)"},
    [LLMEM_OPT_CUDA_ATTN_MERGE_DIMS] = {"LLMEM_CUDA_ATTN_MERGE_DIMS", INT("0", 0, 128),
                                        "dims a CTA of the CUDA merge kernel takes, 32, 64 or 128 "
                                        "(others: the fewest that keep it to four CTAs an SM)"},
    [LLMEM_OPT_CUDA_ATTN_SERIAL_FROM] = {"LLMEM_CUDA_ATTN_SERIAL_FROM",
                                         INT("4096", 0, (int64_t)1 << 30),
                                         "splits of this many tokens or more launch the CUDA "
                                         "attention in stream order, not as a programmatic "
                                         "dependent (0: never)"},
    [LLMEM_OPT_CUDA_PREFILL_FROM] = {"LLMEM_CUDA_PREFILL_FROM", INT("32", 0, (int64_t)1 << 30),
                                     "at fast precision, a sequence's chunk of this many queries "
                                     "or more takes the CUDA prefill attention (0: never)"},
    [LLMEM_OPT_CUDA_PREFILL_MBLOCKS] = {"LLMEM_CUDA_PREFILL_MBLOCKS", INT("0", 0, 2),
                                        "blocks of 16 (query, head) rows a warp of the CUDA "
                                        "prefill attention takes, 1 or 2 (0: chosen per call)"},
    [LLMEM_OPT_CUDA_PREFILL_WGMMA] = {"LLMEM_CUDA_PREFILL_WGMMA", BOOL("1"),
                                      "the CUDA prefill attention on Hopper's warpgroup products "
                                      "(wgmma) where the device and shape allow (0: mma.sync "
                                      "everywhere)"},
};

#undef BOOL
#undef INT
#undef ENUM

const struct llmem_option_info *llmem_option_info(enum llmem_option id) {
    return (unsigned)id < LLMEM_OPT_COUNT ? &table[id] : NULL;
}

const char *llmem_option_type_name(enum llmem_option_type type) {
    switch (type) {
    case LLMEM_OPTION_BOOL: return "bool";
    case LLMEM_OPTION_INT: return "int";
    case LLMEM_OPTION_SIZE: return "size";
    case LLMEM_OPTION_ENUM: return "enum";
    default: return "unknown";
    }
}

/* ---- parsing -------------------------------------------------------------------------------- */

static int parse_bool(const char *s, int64_t *out) {
    static const char *const words[][2] = {
        {"0", "1"}, {"false", "true"}, {"no", "yes"}, {"off", "on"}};
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++)
        for (int v = 0; v < 2; v++)
            if (strcasecmp(s, words[i][v]) == 0) {
                *out = v;
                return LLMEM_OK;
            }
    return LLMEM_EINVAL;
}

static int parse_int(const char *s, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0)
        return LLMEM_EINVAL;
    *out = v;
    return LLMEM_OK;
}

int llmem_option_parse(const struct llmem_option_info *info, const char *text, int64_t *out) {
    if (info == NULL || text == NULL)
        return LLMEM_EINVAL;
    int64_t v = 0;
    switch (info->type) {
    case LLMEM_OPTION_BOOL:
        if (parse_bool(text, &v) != LLMEM_OK)
            return LLMEM_EINVAL;
        break;
    case LLMEM_OPTION_INT:
    case LLMEM_OPTION_SIZE:
        if ((info->type == LLMEM_OPTION_INT ? parse_int(text, &v)
                                            : llmem_size_parse_quiet(text, &v)) != LLMEM_OK ||
            v < info->min || v > info->max)
            return LLMEM_EINVAL;
        break;
    case LLMEM_OPTION_ENUM:
        for (v = 0; info->choices[v] != NULL; v++)
            if (strcasecmp(text, info->choices[v]) == 0)
                break;
        if (info->choices[v] == NULL)
            return LLMEM_EINVAL;
        break;
    default: return LLMEM_EINVAL;
    }
    *out = v;
    return LLMEM_OK;
}

void llmem_option_accepted(const struct llmem_option_info *info, char *buf, size_t size) {
    if (size == 0)
        return;
    buf[0] = '\0';
    switch (info->type) {
    case LLMEM_OPTION_BOOL: snprintf(buf, size, "0 or 1 (also false/true, no/yes, off/on)"); break;
    case LLMEM_OPTION_INT:
        snprintf(buf, size, "an integer in [%" PRId64 ", %" PRId64 "]", info->min, info->max);
        break;
    case LLMEM_OPTION_SIZE:
        snprintf(buf, size, "a size (bytes, or with K, M, G, T) in [%" PRId64 ", %" PRId64 "]",
                 info->min, info->max);
        break;
    case LLMEM_OPTION_ENUM: {
        size_t n = (size_t)snprintf(buf, size, "one of");
        for (int i = 0; info->choices[i] != NULL && n < size; i++)
            n += (size_t)snprintf(buf + n, size - n, "%s %s", i > 0 ? "," : "", info->choices[i]);
        break;
    }
    }
}

/* ---- the values, read once ------------------------------------------------------------------ */

#define TEXT_MAX 64 /* longer than any accepted value */

enum state { UNSET, DEFAULTED, GOOD, MALFORMED };

static struct value {
    enum state state;
    int64_t value;       /* DEFAULTED and GOOD */
    char text[TEXT_MAX]; /* GOOD and MALFORMED: as read, */
    int cut;             /* … cut short when it did not fit (then MALFORMED) */
} values[LLMEM_OPT_COUNT];

static pthread_once_t read_once = PTHREAD_ONCE_INIT;

static void assign(enum llmem_option id, const char *text) {
    const struct llmem_option_info *o = &table[id];
    struct value *v = &values[id];
    memset(v, 0, sizeof(*v));
    if (text == NULL || *text == '\0') {
        v->state = UNSET;
        if (o->def != NULL) {
            /* the table's defaults are spelled as values: a failure here is the table's */
            int parsed = llmem_option_parse(o, o->def, &v->value) == LLMEM_OK;
            LLMEM_ASSERT(parsed);
            v->state = DEFAULTED;
        }
        return;
    }
    v->cut = strlen(text) >= sizeof(v->text);
    snprintf(v->text, sizeof(v->text), "%s", text);
    v->state = !v->cut && llmem_option_parse(o, text, &v->value) == LLMEM_OK ? GOOD : MALFORMED;
}

static void read_environment(void) {
    for (int i = 0; i < LLMEM_OPT_COUNT; i++)
        assign((enum llmem_option)i, getenv(table[i].name));
}

static const struct value *value_of(enum llmem_option id) {
    LLMEM_ASSERT((unsigned)id < LLMEM_OPT_COUNT);
    pthread_once(&read_once, read_environment);
    return &values[id];
}

void llmem_option_set(enum llmem_option id, const char *text) {
    value_of(id);
    assign(id, text);
}

const char *llmem_option_text(enum llmem_option id) {
    const struct value *v = value_of(id);
    return v->state == GOOD || v->state == MALFORMED ? v->text : NULL;
}

/* The value of `id` (of type `type`) into *out when it has one; LLMEM_EINVAL, logged as `func`,
 * when it is malformed. */
static int get(enum llmem_option id, enum llmem_option_type type, const char *func, int64_t *out) {
    const struct value *v = value_of(id);
    const struct llmem_option_info *o = &table[id];
    LLMEM_ASSERT(o->type == type);
    if (v->state == MALFORMED) {
        char accepted[160];
        llmem_option_accepted(o, accepted, sizeof(accepted));
        LLMEM_ERROR_AS(func, "%s='%s%s' is not accepted: expected %s", o->name, v->text,
                       v->cut ? "…" : "", accepted);
        return LLMEM_EINVAL;
    }
    if (v->state != UNSET)
        *out = v->value;
    return LLMEM_OK;
}

int llmem_option_bool(enum llmem_option id, int *out) {
    int64_t v = -1;
    int status = get(id, LLMEM_OPTION_BOOL, __func__, &v);
    if (status == LLMEM_OK && v >= 0)
        *out = (int)v;
    return status;
}

int llmem_option_int(enum llmem_option id, int64_t *out) {
    return get(id, LLMEM_OPTION_INT, __func__, out);
}

int llmem_option_size(enum llmem_option id, int64_t *out) {
    return get(id, LLMEM_OPTION_SIZE, __func__, out);
}

int llmem_option_enum(enum llmem_option id, const char **out) {
    int64_t v = -1;
    int status = get(id, LLMEM_OPTION_ENUM, __func__, &v);
    if (status == LLMEM_OK && v >= 0)
        *out = table[id].choices[v];
    return status;
}

int llmem_option_check(enum llmem_option id) {
    const struct llmem_option_info *o = llmem_option_info(id);
    LLMEM_ASSERT(o != NULL);
    int64_t v;
    return o != NULL ? get(id, o->type, __func__, &v) : LLMEM_EINVAL;
}

/* ---- the cache directory -------------------------------------------------------------------- */

int llmem_cache_dir(const char *sub, char *buf, size_t size) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    const char *sep = sub != NULL ? "/" : "", *tail = sub != NULL ? sub : "";
    int n;
    if (xdg != NULL && xdg[0] == '/')
        n = snprintf(buf, size, "%s/llmem%s%s", xdg, sep, tail);
    else if (home != NULL && home[0] == '/')
        n = snprintf(buf, size, "%s/.cache/llmem%s%s", home, sep, tail);
    else
        return LLMEM_ENOENT;
    return n >= 0 && (size_t)n < size ? LLMEM_OK : LLMEM_ERANGE;
}

const char *llmem_tmp_dir(void) {
    const char *t = getenv("TMPDIR");
    return t != NULL && t[0] != '\0' ? t : "/tmp";
}
