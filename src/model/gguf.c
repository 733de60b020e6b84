/*
 * model/gguf.c — the GGUF container: a file's bytes → validated key/values and tensor infos
 * (model/gguf.h).
 *
 * Layout (little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv key/values (a string
 * key, a u32 type, the value: a scalar, a string — u64 length then the bytes — or an array — u32
 * element type, u64 count, the elements); n_tensors tensor infos (a string name, u32 n_dims, n_dims
 * u64 dims innermost first, u32 ggml type, u64 offset); padding to general.alignment (default 32);
 * the data section, to which the offsets are relative.
 *
 * Guarantees, for any input: every read is bounds-checked against the bytes there are before it
 * is made; the counts are bounded by the bytes left before anything is allocated for them (a key
 * takes at least 13 bytes, a tensor info 32, an array element its size or 8 for a string), so the
 * allocations are at most a small multiple of the file; element counts and byte sizes are
 * computed with overflow checks (llmem_qtype_bytes). Nothing is trusted that was not checked:
 * a parsed file has unique keys and tensor names, no nested arrays, booleans of 0 or 1, known
 * tensor types with whole blocks per row, and aligned, non-overlapping tensors inside the data
 * section. Any other input gives exactly one error line naming the file and the key or tensor.
 * The reader assumes a little-endian host (as ggml does); a big-endian file is refused by its
 * version.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "core/log.h"
#include "model/gguf.h"
#include "quant/quant.h"

/* ---- value types ---------------------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t size; /* 0: variable (string, array) */
} types[LLMEM_GGUF_TYPE_COUNT] = {
    [LLMEM_GGUF_U8] = {"u8", 1},         [LLMEM_GGUF_I8] = {"i8", 1},
    [LLMEM_GGUF_U16] = {"u16", 2},       [LLMEM_GGUF_I16] = {"i16", 2},
    [LLMEM_GGUF_U32] = {"u32", 4},       [LLMEM_GGUF_I32] = {"i32", 4},
    [LLMEM_GGUF_F32] = {"f32", 4},       [LLMEM_GGUF_BOOL] = {"bool", 1},
    [LLMEM_GGUF_STRING] = {"string", 0}, [LLMEM_GGUF_ARRAY] = {"array", 0},
    [LLMEM_GGUF_U64] = {"u64", 8},       [LLMEM_GGUF_I64] = {"i64", 8},
    [LLMEM_GGUF_F64] = {"f64", 8},
};

const char *llmem_gguf_type_name(int type) {
    return type >= 0 && type < LLMEM_GGUF_TYPE_COUNT ? types[type].name : "unknown";
}

static int is_int_type(int t) {
    return t == LLMEM_GGUF_U8 || t == LLMEM_GGUF_I8 || t == LLMEM_GGUF_U16 || t == LLMEM_GGUF_I16 ||
           t == LLMEM_GGUF_U32 || t == LLMEM_GGUF_I32 || t == LLMEM_GGUF_U64 || t == LLMEM_GGUF_I64;
}

/* The integer at p of type t, widened: *neg set for a negative value (in *mag as −value). */
static void read_int(const uint8_t *p, int t, uint64_t *mag, int *neg) {
    int64_t s = 0;
    uint64_t u = 0;
    int is_signed = 1;
    switch (t) {
    case LLMEM_GGUF_U8: u = p[0], is_signed = 0; break;
    case LLMEM_GGUF_I8: s = (int8_t)p[0]; break;
    case LLMEM_GGUF_U16: {
        uint16_t v;
        memcpy(&v, p, 2);
        u = v, is_signed = 0;
        break;
    }
    case LLMEM_GGUF_I16: {
        int16_t v;
        memcpy(&v, p, 2);
        s = v;
        break;
    }
    case LLMEM_GGUF_U32: {
        uint32_t v;
        memcpy(&v, p, 4);
        u = v, is_signed = 0;
        break;
    }
    case LLMEM_GGUF_I32: {
        int32_t v;
        memcpy(&v, p, 4);
        s = v;
        break;
    }
    case LLMEM_GGUF_U64: memcpy(&u, p, 8), is_signed = 0; break;
    default: memcpy(&s, p, 8); break; /* I64 */
    }
    if (!is_signed) {
        *mag = u, *neg = 0;
    } else if (s < 0) {
        *mag = (uint64_t)0 - (uint64_t)s, *neg = 1;
    } else {
        *mag = (uint64_t)s, *neg = 0;
    }
}

/* ---- the parser ----------------------------------------------------------------------------- */

struct parser {
    struct llmem_gguf *g;
    const char *func; /* the public function, for messages */
    uint64_t pos;
};

#define PERR(p, ...) LLMEM_ERROR_AS((p)->func, __VA_ARGS__)

static uint64_t left(const struct parser *p) {
    return (uint64_t)p->g->size - p->pos;
}

/* Reads n bytes into out (when not NULL); 0 when there are fewer left. */
static int take(struct parser *p, void *out, uint64_t n) {
    if (left(p) < n)
        return 0;
    if (out != NULL)
        memcpy(out, p->g->base + p->pos, (size_t)n);
    p->pos += n;
    return 1;
}

/* A string: its length, then that many bytes (which must be there). */
static int take_str(struct parser *p, struct llmem_gguf_str *s) {
    uint64_t len;
    if (!take(p, &len, 8) || left(p) < len)
        return 0;
    s->ptr = (const char *)p->g->base + p->pos;
    s->len = len;
    p->pos += len;
    return 1;
}

/* A NUL-terminated copy of a key or tensor name. `what` is "key" or "tensor". */
static int copy_name(struct parser *p, const struct llmem_gguf_str *s, const char *what,
                     int64_t index, char **out) {
    const char *path = p->g->path;
    if (s->len == 0) {
        PERR(p, "%s: %s #%" PRId64 " has an empty name", path, what, index);
        return LLMEM_EFORMAT;
    }
    if (s->len > LLMEM_GGUF_MAX_NAME) {
        PERR(p, "%s: %s #%" PRId64 ": name of %" PRIu64 " bytes (at most %d)", path, what, index,
             s->len, LLMEM_GGUF_MAX_NAME);
        return LLMEM_EFORMAT;
    }
    for (uint64_t i = 0; i < s->len; i++) {
        unsigned char ch = (unsigned char)s->ptr[i];
        if (ch < 0x20 || ch == 0x7f) {
            PERR(p, "%s: %s #%" PRId64 ": name '%.*s' holds the control character 0x%02x", path,
                 what, index, (int)i, s->ptr, ch);
            return LLMEM_EFORMAT;
        }
    }
    *out = malloc((size_t)s->len + 1);
    if (*out == NULL) {
        PERR(p, "%s: out of memory", path);
        return LLMEM_ENOMEM;
    }
    memcpy(*out, s->ptr, (size_t)s->len);
    (*out)[s->len] = '\0';
    return LLMEM_OK;
}

static int check_bools(struct parser *p, const struct llmem_gguf_kv *kv, const uint8_t *v,
                       uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        if (v[i] > 1) {
            PERR(p, "%s: key '%s': bool value %u is not 0 or 1", p->g->path, kv->key, v[i]);
            return LLMEM_EFORMAT;
        }
    }
    return LLMEM_OK;
}

static int parse_kv(struct parser *p, int64_t index, struct llmem_gguf_kv *kv) {
    const char *path = p->g->path;
    struct llmem_gguf_str key;
    if (!take_str(p, &key)) {
        PERR(p, "%s: key #%" PRId64 ": its name runs past the end of the file (%zu bytes)", path,
             index, p->g->size);
        return LLMEM_EFORMAT;
    }
    int status = copy_name(p, &key, "key", index, &kv->key);
    if (status != LLMEM_OK)
        return status;
    uint32_t type;
    if (!take(p, &type, 4)) {
        PERR(p, "%s: key '%s': its type runs past the end of the file", path, kv->key);
        return LLMEM_EFORMAT;
    }
    if (type >= LLMEM_GGUF_TYPE_COUNT) {
        PERR(p, "%s: key '%s': unknown value type %" PRIu32, path, kv->key, type);
        return LLMEM_EFORMAT;
    }
    kv->type = (enum llmem_gguf_type)type;
    kv->elem_type = kv->type;
    kv->n = 1;
    kv->value = p->g->base + p->pos;
    if (type == LLMEM_GGUF_STRING) {
        struct llmem_gguf_str s;
        if (!take_str(p, &s)) {
            PERR(p, "%s: key '%s': the string runs past the end of the file", path, kv->key);
            return LLMEM_EFORMAT;
        }
        return LLMEM_OK;
    }
    if (type != LLMEM_GGUF_ARRAY) {
        if (!take(p, NULL, types[type].size)) {
            PERR(p, "%s: key '%s': the %s value runs past the end of the file", path, kv->key,
                 types[type].name);
            return LLMEM_EFORMAT;
        }
        return type == LLMEM_GGUF_BOOL ? check_bools(p, kv, kv->value, 1) : LLMEM_OK;
    }

    /* an array */
    uint32_t elem;
    uint64_t n;
    if (!take(p, &elem, 4) || !take(p, &n, 8)) {
        PERR(p, "%s: key '%s': the array's header runs past the end of the file", path, kv->key);
        return LLMEM_EFORMAT;
    }
    if (elem == LLMEM_GGUF_ARRAY) {
        PERR(p, "%s: key '%s': arrays of arrays are not supported", path, kv->key);
        return LLMEM_EFORMAT;
    }
    if (elem >= LLMEM_GGUF_TYPE_COUNT) {
        PERR(p, "%s: key '%s': array of unknown element type %" PRIu32, path, kv->key, elem);
        return LLMEM_EFORMAT;
    }
    kv->elem_type = (enum llmem_gguf_type)elem;
    kv->n = n;
    kv->value = p->g->base + p->pos;
    if (elem != LLMEM_GGUF_STRING) {
        if (n > left(p) / types[elem].size) {
            PERR(p, "%s: key '%s': %" PRIu64 " elements of %s run past the end of the file", path,
                 kv->key, n, types[elem].name);
            return LLMEM_EFORMAT;
        }
        p->pos += n * types[elem].size;
        return elem == LLMEM_GGUF_BOOL ? check_bools(p, kv, kv->value, n) : LLMEM_OK;
    }
    if (n > left(p) / 8) { /* each string takes its 8-byte length at least */
        PERR(p, "%s: key '%s': %" PRIu64 " strings run past the end of the file", path, kv->key, n);
        return LLMEM_EFORMAT;
    }
    kv->str_offsets = malloc(n > 0 ? (size_t)n * sizeof(uint64_t) : 1);
    if (kv->str_offsets == NULL) {
        PERR(p, "%s: key '%s': out of memory for %" PRIu64 " strings", path, kv->key, n);
        return LLMEM_ENOMEM;
    }
    uint64_t start = p->pos;
    for (uint64_t i = 0; i < n; i++) {
        kv->str_offsets[i] = p->pos - start;
        struct llmem_gguf_str s;
        if (!take_str(p, &s)) {
            PERR(p, "%s: key '%s': string %" PRIu64 " of %" PRIu64 " runs past the end of the file",
                 path, kv->key, i, n);
            return LLMEM_EFORMAT;
        }
    }
    return LLMEM_OK;
}

static int parse_tensor(struct parser *p, int64_t index, struct llmem_gguf_tensor *t) {
    const char *path = p->g->path;
    struct llmem_gguf_str name;
    if (!take_str(p, &name)) {
        PERR(p, "%s: tensor #%" PRId64 ": its name runs past the end of the file (%zu bytes)", path,
             index, p->g->size);
        return LLMEM_EFORMAT;
    }
    int status = copy_name(p, &name, "tensor", index, &t->name);
    if (status != LLMEM_OK)
        return status;
    uint32_t n_dims;
    if (!take(p, &n_dims, 4)) {
        PERR(p, "%s: tensor '%s': its info runs past the end of the file", path, t->name);
        return LLMEM_EFORMAT;
    }
    if (n_dims < 1 || n_dims > LLMEM_GGUF_MAX_DIMS) {
        PERR(p, "%s: tensor '%s': %" PRIu32 " dimensions (1 to %d)", path, t->name, n_dims,
             LLMEM_GGUF_MAX_DIMS);
        return LLMEM_EFORMAT;
    }
    t->n_dims = (int)n_dims;
    int64_t n = 1;
    for (int i = 0; i < LLMEM_GGUF_MAX_DIMS; i++)
        t->dims[i] = 1;
    for (int i = 0; i < t->n_dims; i++) {
        uint64_t d;
        if (!take(p, &d, 8)) {
            PERR(p, "%s: tensor '%s': its info runs past the end of the file", path, t->name);
            return LLMEM_EFORMAT;
        }
        if (d == 0 || d > (uint64_t)INT64_MAX) {
            PERR(p, "%s: tensor '%s': dimension %d is %" PRIu64 " (must be positive)", path,
                 t->name, i, d);
            return LLMEM_EFORMAT;
        }
        t->dims[i] = (int64_t)d;
        if (__builtin_mul_overflow(n, (int64_t)d, &n)) {
            PERR(p, "%s: tensor '%s': the element count overflows", path, t->name);
            return LLMEM_EFORMAT;
        }
    }
    uint32_t type;
    uint64_t offset;
    if (!take(p, &type, 4) || !take(p, &offset, 8)) {
        PERR(p, "%s: tensor '%s': its info runs past the end of the file", path, t->name);
        return LLMEM_EFORMAT;
    }
    const struct llmem_qtype_info *info = llmem_qtype_info((int)type);
    if (type >= LLMEM_QTYPE_COUNT || info == NULL) { /* ggml ids only, not MLX's */
        PERR(p, "%s: tensor '%s': unknown ggml type %" PRIu32, path, t->name, type);
        return LLMEM_EFORMAT;
    }
    t->type = (int)type;
    if (t->dims[0] % info->block_elems != 0) {
        PERR(p,
             "%s: tensor '%s': row length %" PRId64 " is not a multiple of the %s block (%" PRId64
             ")",
             path, t->name, t->dims[0], info->name, info->block_elems);
        return LLMEM_EFORMAT;
    }
    t->n_elements = n;
    t->n_bytes = llmem_qtype_bytes(t->type, n);
    if (t->n_bytes < 0) {
        PERR(p, "%s: tensor '%s': the byte size of %" PRId64 " %s values overflows", path, t->name,
             n, info->name);
        return LLMEM_EFORMAT;
    }
    t->offset = offset;
    return LLMEM_OK;
}

static int cmp_kv(const void *a, const void *b) {
    return strcmp((*(struct llmem_gguf_kv *const *)a)->key,
                  (*(struct llmem_gguf_kv *const *)b)->key);
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp((*(struct llmem_gguf_tensor *const *)a)->name,
                  (*(struct llmem_gguf_tensor *const *)b)->name);
}

static int cmp_offset(const void *a, const void *b) {
    uint64_t x = (*(struct llmem_gguf_tensor *const *)a)->offset;
    uint64_t y = (*(struct llmem_gguf_tensor *const *)b)->offset;
    return x < y ? -1 : x > y;
}

/* general.alignment: an integer power of two (u32 as the spec writes it). */
static int parse_alignment(struct parser *p) {
    struct llmem_gguf *g = p->g;
    g->alignment = LLMEM_GGUF_DEFAULT_ALIGNMENT;
    const struct llmem_gguf_kv *kv = llmem_gguf_find_key(g, "general.alignment");
    if (kv == NULL)
        return LLMEM_OK;
    uint64_t mag = 0;
    int neg = 0;
    if (kv->type != LLMEM_GGUF_ARRAY && is_int_type(kv->type))
        read_int(kv->value, kv->type, &mag, &neg);
    if (kv->type == LLMEM_GGUF_ARRAY || !is_int_type(kv->type)) {
        PERR(p, "%s: key 'general.alignment' has type %s, expected u32", g->path,
             llmem_gguf_type_name(kv->type));
        return LLMEM_EFORMAT;
    }
    if (neg || mag == 0 || mag > ((uint64_t)1 << 30) || (mag & (mag - 1)) != 0) {
        PERR(p, "%s: key 'general.alignment': %s%" PRIu64 " is not a power of two up to 2^30",
             g->path, neg ? "-" : "", mag);
        return LLMEM_EFORMAT;
    }
    g->alignment = (uint32_t)mag;
    return LLMEM_OK;
}

/* The data section and every tensor's place in it. */
static int place_tensors(struct parser *p) {
    struct llmem_gguf *g = p->g;
    uint64_t a = g->alignment;
    uint64_t start = (p->pos + a - 1) / a * a;
    g->data_offset = start;
    if (g->n_tensors == 0)
        return LLMEM_OK;
    if (start > g->size) {
        PERR(p, "%s: the data section (at %" PRIu64 ") starts past the end of the file (%zu bytes)",
             g->path, start, g->size);
        return LLMEM_EFORMAT;
    }
    uint64_t data_bytes = g->size - start;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct llmem_gguf_tensor *t = &g->tensors[i];
        if (t->offset % a != 0) {
            PERR(p,
                 "%s: tensor '%s': offset %" PRIu64 " is not a multiple of the alignment (%" PRIu64
                 ")",
                 g->path, t->name, t->offset, a);
            return LLMEM_EFORMAT;
        }
        if (t->offset > data_bytes || (uint64_t)t->n_bytes > data_bytes - t->offset) {
            PERR(p,
                 "%s: tensor '%s': bytes [%" PRIu64 ", +%" PRId64 ") lie past the end of the "
                 "data section (%" PRIu64 " bytes)",
                 g->path, t->name, t->offset, t->n_bytes, data_bytes);
            return LLMEM_EFORMAT;
        }
        t->data = g->base + start + t->offset;
    }
    /* No two tensors overlap: sorted by offset, each starts at or after the previous end. */
    struct llmem_gguf_tensor **by_offset = malloc((size_t)g->n_tensors * sizeof(*by_offset));
    if (by_offset == NULL) {
        PERR(p, "%s: out of memory", g->path);
        return LLMEM_ENOMEM;
    }
    for (int64_t i = 0; i < g->n_tensors; i++)
        by_offset[i] = &g->tensors[i];
    qsort(by_offset, (size_t)g->n_tensors, sizeof(*by_offset), cmp_offset);
    int status = LLMEM_OK;
    for (int64_t i = 1; i < g->n_tensors; i++) {
        const struct llmem_gguf_tensor *prev = by_offset[i - 1], *t = by_offset[i];
        if (t->offset < prev->offset + (uint64_t)prev->n_bytes) {
            PERR(p, "%s: tensor '%s' overlaps tensor '%s'", g->path, t->name, prev->name);
            status = LLMEM_EFORMAT;
            break;
        }
    }
    free(by_offset);
    /* Disjoint ranges inside the file: Σ bytes ≤ the file, Σ elements ≤ 8 × that (no type packs
     * more than 8 values a byte): the sums cannot overflow. */
    for (int64_t i = 0; status == LLMEM_OK && i < g->n_tensors; i++) {
        g->n_elements += g->tensors[i].n_elements;
        g->n_bytes += g->tensors[i].n_bytes;
    }
    return status;
}

static int parse(struct parser *p) {
    struct llmem_gguf *g = p->g;
    uint32_t magic, version;
    uint64_t n_tensors, n_kv;
    if (!take(p, &magic, 4)) {
        PERR(p, "%s: not a GGUF file (%zu bytes, shorter than the magic)", g->path, g->size);
        return LLMEM_EFORMAT;
    }
    if (magic != LLMEM_GGUF_MAGIC) {
        PERR(p, "%s: not a GGUF file (bad magic)", g->path);
        return LLMEM_EFORMAT;
    }
    if (!take(p, &version, 4)) {
        PERR(p, "%s: the header runs past the end of the file", g->path);
        return LLMEM_EFORMAT;
    }
    if (version != 2 && version != 3) {
        PERR(p, "%s: GGUF version %" PRIu32 " is not supported (2 and 3 are)%s", g->path, version,
             version > 0xFFFF ? "; a big-endian file?" : "");
        return LLMEM_EFORMAT;
    }
    g->version = version;
    if (!take(p, &n_tensors, 8) || !take(p, &n_kv, 8)) {
        PERR(p, "%s: the header runs past the end of the file", g->path);
        return LLMEM_EFORMAT;
    }
    /* A key/value takes at least 8 + 1 + 4 + 1 = 14 bytes (a one-byte name, a u8), a tensor info
     * 8 + 1 + 4 + 8 + 4 + 8 = 33: bounding the counts by the bytes left bounds the allocations. */
    if (n_kv > left(p) / 14) {
        PERR(p, "%s: %" PRIu64 " key/values cannot fit in the %" PRIu64 " bytes left", g->path,
             n_kv, left(p));
        return LLMEM_EFORMAT;
    }
    if (n_tensors > left(p) / 33) {
        PERR(p, "%s: %" PRIu64 " tensor infos cannot fit in the %" PRIu64 " bytes left", g->path,
             n_tensors, left(p));
        return LLMEM_EFORMAT;
    }
    g->kv = calloc(n_kv > 0 ? (size_t)n_kv : 1, sizeof(*g->kv));
    g->kv_sorted = malloc((n_kv > 0 ? (size_t)n_kv : 1) * sizeof(*g->kv_sorted));
    g->tensors = calloc(n_tensors > 0 ? (size_t)n_tensors : 1, sizeof(*g->tensors));
    g->tensors_sorted =
        malloc((n_tensors > 0 ? (size_t)n_tensors : 1) * sizeof(*g->tensors_sorted));
    if (g->kv == NULL || g->kv_sorted == NULL || g->tensors == NULL || g->tensors_sorted == NULL) {
        PERR(p, "%s: out of memory", g->path);
        return LLMEM_ENOMEM;
    }

    for (uint64_t i = 0; i < n_kv; i++) {
        g->n_kv = (int64_t)i + 1; /* so that free releases what parse_kv allocated */
        int status = parse_kv(p, (int64_t)i, &g->kv[i]);
        if (status != LLMEM_OK)
            return status;
        g->kv_sorted[i] = &g->kv[i];
    }
    qsort(g->kv_sorted, (size_t)g->n_kv, sizeof(*g->kv_sorted), cmp_kv);
    for (int64_t i = 1; i < g->n_kv; i++) {
        if (strcmp(g->kv_sorted[i - 1]->key, g->kv_sorted[i]->key) == 0) {
            PERR(p, "%s: key '%s' appears twice", g->path, g->kv_sorted[i]->key);
            return LLMEM_EFORMAT;
        }
    }
    int status = parse_alignment(p);
    if (status != LLMEM_OK)
        return status;

    for (uint64_t i = 0; i < n_tensors; i++) {
        g->n_tensors = (int64_t)i + 1;
        status = parse_tensor(p, (int64_t)i, &g->tensors[i]);
        if (status != LLMEM_OK)
            return status;
        g->tensors_sorted[i] = &g->tensors[i];
    }
    qsort(g->tensors_sorted, (size_t)g->n_tensors, sizeof(*g->tensors_sorted), cmp_tensor);
    for (int64_t i = 1; i < g->n_tensors; i++) {
        if (strcmp(g->tensors_sorted[i - 1]->name, g->tensors_sorted[i]->name) == 0) {
            PERR(p, "%s: tensor '%s' appears twice", g->path, g->tensors_sorted[i]->name);
            return LLMEM_EFORMAT;
        }
    }
    return place_tensors(p);
}

/* ---- opening and freeing -------------------------------------------------------------------- */

static struct llmem_gguf *gguf_new(const char *name, const char *func) {
    struct llmem_gguf *g = calloc(1, sizeof(*g));
    if (g != NULL)
        g->path = strdup(name != NULL ? name : "<buffer>");
    if (g == NULL || g->path == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory", name != NULL ? name : "<buffer>");
        free(g);
        return NULL;
    }
    return g;
}

static int parse_into(struct llmem_gguf *g, const char *func, struct llmem_gguf **out) {
    struct parser p = {.g = g, .func = func, .pos = 0};
    int status = parse(&p);
    if (status != LLMEM_OK) {
        llmem_gguf_free(g);
        return status;
    }
    *out = g;
    return LLMEM_OK;
}

int llmem_gguf_parse(const void *data, size_t size, const char *name, struct llmem_gguf **out) {
    struct llmem_gguf *g = gguf_new(name, __func__);
    if (g == NULL)
        return LLMEM_ENOMEM;
    static const uint8_t empty[1];
    g->base = data != NULL ? data : empty;
    g->size = data != NULL ? size : 0;
    return parse_into(g, __func__, out);
}

int llmem_gguf_open(const char *path, struct llmem_gguf **out) {
    int fd = -1;
    int status = llmem_file_open_regular(path, __func__, &fd);
    if (status != LLMEM_OK)
        return status;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        LLMEM_ERROR("%s: %s", path, strerror(errno));
        close(fd);
        return LLMEM_EIO;
    }
    if (st.st_size < 24) {
        LLMEM_ERROR("%s: not a GGUF file (%lld bytes, shorter than its header)", path,
                    (long long)st.st_size);
        close(fd);
        return LLMEM_EFORMAT;
    }
    void *base = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (base == MAP_FAILED) {
        LLMEM_ERROR("%s: mmap: %s", path, strerror(err));
        return err == ENOMEM ? LLMEM_ENOMEM : LLMEM_EIO;
    }
    struct llmem_gguf *g = gguf_new(path, __func__);
    if (g == NULL) {
        munmap(base, (size_t)st.st_size);
        return LLMEM_ENOMEM;
    }
    g->base = base;
    g->size = (size_t)st.st_size;
    g->mapped = 1;
    return parse_into(g, __func__, out);
}

void llmem_gguf_free(struct llmem_gguf *g) {
    if (g == NULL)
        return;
    for (int64_t i = 0; i < g->n_kv; i++) {
        free(g->kv[i].key);
        free(g->kv[i].str_offsets);
    }
    for (int64_t i = 0; i < g->n_tensors; i++)
        free(g->tensors[i].name);
    free(g->kv);
    free(g->kv_sorted);
    free(g->tensors);
    free(g->tensors_sorted);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    free(g->path);
    free(g);
}

int llmem_gguf_is_gguf(const char *path) {
    size_t len = strlen(path);
    struct stat st;
    int exists = stat(path, &st) == 0;
    if (exists && S_ISDIR(st.st_mode))
        return 0;
    if (len >= 5 && strcmp(path + len - 5, ".gguf") == 0)
        return 1;
    if (!exists || !S_ISREG(st.st_mode))
        return 0;
    int fd = -1;
    char why[128];
    if (llmem_file_open_regular_at(AT_FDCWD, path, &fd, why, sizeof(why)) != LLMEM_OK)
        return 0;
    uint32_t magic = 0;
    ssize_t n = pread(fd, &magic, 4, 0);
    close(fd);
    return n == 4 && magic == LLMEM_GGUF_MAGIC;
}

/* ---- metadata ------------------------------------------------------------------------------- */

const struct llmem_gguf_kv *llmem_gguf_find_key(const struct llmem_gguf *g, const char *key) {
    if (g == NULL || g->n_kv == 0)
        return NULL;
    struct llmem_gguf_kv probe = {.key = (char *)key};
    struct llmem_gguf_kv *pp = &probe;
    struct llmem_gguf_kv **hit =
        bsearch(&pp, g->kv_sorted, (size_t)g->n_kv, sizeof(*g->kv_sorted), cmp_kv);
    return hit != NULL ? *hit : NULL;
}

/* The kv for a typed getter: NULL (status ENOENT) when absent. */
static const struct llmem_gguf_kv *getter_kv(const struct llmem_gguf *g, const char *key,
                                             int *status) {
    const struct llmem_gguf_kv *kv = llmem_gguf_find_key(g, key);
    *status = kv != NULL ? LLMEM_OK : LLMEM_ENOENT;
    return kv;
}

static int wrong_type(const struct llmem_gguf *g, const struct llmem_gguf_kv *kv,
                      const char *expected, const char *func) {
    if (kv->type == LLMEM_GGUF_ARRAY)
        LLMEM_ERROR_AS(func, "%s: key '%s' has type array of %s, expected %s", g->path, kv->key,
                       llmem_gguf_type_name(kv->elem_type), expected);
    else
        LLMEM_ERROR_AS(func, "%s: key '%s' has type %s, expected %s", g->path, kv->key,
                       llmem_gguf_type_name(kv->type), expected);
    return LLMEM_EFORMAT;
}

/* An integer key in [min, max] (min ≤ 0 ≤ max): *out as a signed or unsigned 64-bit value. */
static int get_int(const struct llmem_gguf *g, const char *key, int64_t min, uint64_t max,
                   const char *expected, uint64_t *mag, int *neg, const char *func) {
    int status;
    const struct llmem_gguf_kv *kv = getter_kv(g, key, &status);
    if (kv == NULL)
        return status;
    if (kv->type == LLMEM_GGUF_ARRAY || !is_int_type(kv->type))
        return wrong_type(g, kv, expected, func);
    read_int(kv->value, kv->type, mag, neg);
    if ((*neg && *mag > (uint64_t)0 - (uint64_t)min) || (!*neg && *mag > max)) {
        LLMEM_ERROR_AS(func, "%s: key '%s': %s%" PRIu64 " (type %s) is out of range for %s",
                       g->path, key, *neg ? "-" : "", *mag, llmem_gguf_type_name(kv->type),
                       expected);
        return LLMEM_EFORMAT;
    }
    return LLMEM_OK;
}

int llmem_gguf_get_u32(const struct llmem_gguf *g, const char *key, uint32_t *out) {
    uint64_t mag;
    int neg;
    int status = get_int(g, key, 0, UINT32_MAX, "u32", &mag, &neg, __func__);
    if (status == LLMEM_OK)
        *out = (uint32_t)mag;
    return status;
}

int llmem_gguf_get_i32(const struct llmem_gguf *g, const char *key, int32_t *out) {
    uint64_t mag;
    int neg;
    int status = get_int(g, key, INT32_MIN, INT32_MAX, "i32", &mag, &neg, __func__);
    if (status == LLMEM_OK)
        *out = neg ? (int32_t)(-(int64_t)mag) : (int32_t)mag;
    return status;
}

int llmem_gguf_get_u64(const struct llmem_gguf *g, const char *key, uint64_t *out) {
    uint64_t mag;
    int neg;
    int status = get_int(g, key, 0, UINT64_MAX, "u64", &mag, &neg, __func__);
    if (status == LLMEM_OK)
        *out = mag;
    return status;
}

static int get_float(const struct llmem_gguf *g, const char *key, double *out, const char *func) {
    int status;
    const struct llmem_gguf_kv *kv = getter_kv(g, key, &status);
    if (kv == NULL)
        return status;
    if (kv->type == LLMEM_GGUF_F32) {
        float f;
        memcpy(&f, kv->value, 4);
        *out = f;
    } else if (kv->type == LLMEM_GGUF_F64) {
        memcpy(out, kv->value, 8);
    } else {
        return wrong_type(g, kv, "f32 or f64", func);
    }
    return LLMEM_OK;
}

int llmem_gguf_get_f32(const struct llmem_gguf *g, const char *key, float *out) {
    double v;
    int status = get_float(g, key, &v, __func__);
    if (status == LLMEM_OK)
        *out = (float)v;
    return status;
}

int llmem_gguf_get_f64(const struct llmem_gguf *g, const char *key, double *out) {
    return get_float(g, key, out, __func__);
}

int llmem_gguf_get_bool(const struct llmem_gguf *g, const char *key, int *out) {
    int status;
    const struct llmem_gguf_kv *kv = getter_kv(g, key, &status);
    if (kv == NULL)
        return status;
    if (kv->type != LLMEM_GGUF_BOOL)
        return wrong_type(g, kv, "bool", __func__);
    *out = kv->value[0];
    return LLMEM_OK;
}

static struct llmem_gguf_str str_at(const uint8_t *p) {
    struct llmem_gguf_str s;
    memcpy(&s.len, p, 8);
    s.ptr = (const char *)p + 8;
    return s;
}

int llmem_gguf_get_string(const struct llmem_gguf *g, const char *key, struct llmem_gguf_str *out) {
    int status;
    const struct llmem_gguf_kv *kv = getter_kv(g, key, &status);
    if (kv == NULL)
        return status;
    if (kv->type != LLMEM_GGUF_STRING)
        return wrong_type(g, kv, "string", __func__);
    *out = str_at(kv->value);
    return LLMEM_OK;
}

int llmem_gguf_get_array(const struct llmem_gguf *g, const char *key, int elem_type,
                         const struct llmem_gguf_kv **out) {
    int status;
    const struct llmem_gguf_kv *kv = getter_kv(g, key, &status);
    if (kv == NULL)
        return status;
    if (kv->type != LLMEM_GGUF_ARRAY || (elem_type >= 0 && (int)kv->elem_type != elem_type)) {
        char want[32];
        snprintf(want, sizeof(want), "array of %s",
                 elem_type >= 0 ? llmem_gguf_type_name(elem_type) : "any");
        return wrong_type(g, kv, want, __func__);
    }
    *out = kv;
    return LLMEM_OK;
}

struct llmem_gguf_str llmem_gguf_array_str(const struct llmem_gguf_kv *kv, uint64_t i) {
    LLMEM_ASSERT(kv->type == LLMEM_GGUF_ARRAY && kv->elem_type == LLMEM_GGUF_STRING && i < kv->n);
    return str_at(kv->value + kv->str_offsets[i]);
}

int llmem_gguf_array_int(const struct llmem_gguf_kv *kv, uint64_t i, int64_t *out) {
    LLMEM_ASSERT(kv->type == LLMEM_GGUF_ARRAY && is_int_type(kv->elem_type) && i < kv->n);
    uint64_t mag;
    int neg;
    read_int(kv->value + i * types[kv->elem_type].size, kv->elem_type, &mag, &neg);
    if (!neg && mag > (uint64_t)INT64_MAX)
        return LLMEM_ERANGE;
    *out = neg ? (int64_t)((uint64_t)0 - mag) : (int64_t)mag;
    return LLMEM_OK;
}

double llmem_gguf_array_float(const struct llmem_gguf_kv *kv, uint64_t i) {
    LLMEM_ASSERT(kv->type == LLMEM_GGUF_ARRAY && i < kv->n &&
                 (kv->elem_type == LLMEM_GGUF_F32 || kv->elem_type == LLMEM_GGUF_F64));
    if (kv->elem_type == LLMEM_GGUF_F32) {
        float f;
        memcpy(&f, kv->value + i * 4, 4);
        return f;
    }
    double d;
    memcpy(&d, kv->value + i * 8, 8);
    return d;
}

/* ---- tensors -------------------------------------------------------------------------------- */

const struct llmem_gguf_tensor *llmem_gguf_find_tensor(const struct llmem_gguf *g,
                                                       const char *name) {
    if (g == NULL || g->n_tensors == 0)
        return NULL;
    struct llmem_gguf_tensor probe = {.name = (char *)name};
    struct llmem_gguf_tensor *pp = &probe;
    struct llmem_gguf_tensor **hit = bsearch(&pp, g->tensors_sorted, (size_t)g->n_tensors,
                                             sizeof(*g->tensors_sorted), cmp_tensor);
    return hit != NULL ? *hit : NULL;
}
