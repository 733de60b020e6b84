/*
 * model/gguf_write.c — a GGUF file (version 3, ggml's docs/gguf.md) written as a stream: the
 * metadata and the tensor infos are collected in memory (they are small: a tokenizer's strings
 * at most), then written with the header in one go; the tensor data follows tensor by tensor, in
 * the order the infos were added, each piece as the caller produces it, so that no more than the
 * caller's chunk of a tensor is ever in memory.
 *
 * Layout: "GGUF", u32 version 3, u64 tensor count, u64 key/value count, the key/values, the
 * tensor infos (name, n_dims, ne innermost first, ggml type, offset from the data section), zero
 * padding to the alignment (32), then each tensor's bytes padded with zeros to the alignment.
 * The file is written under OUT.part and renamed to OUT by a successful close, so a failed or
 * interrupted write never leaves a file that looks complete.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "llmem/size.h"
#include "llmem/status.h"
#include "llmem/sys.h"
#include "model/gguf.h"
#include "quant/quant.h"

/* ---- a growable byte buffer ----------------------------------------------------------------- */

struct wbuf {
    uint8_t *p;
    size_t n, cap;
};

static int wbuf_add(struct wbuf *b, const void *p, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n)
            cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (q == NULL)
            return LLMEM_ENOMEM;
        b->p = q;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, p, n);
    b->n += n;
    return LLMEM_OK;
}

static int wbuf_u32(struct wbuf *b, uint32_t v) {
    return wbuf_add(b, &v, 4);
}
static int wbuf_u64(struct wbuf *b, uint64_t v) {
    return wbuf_add(b, &v, 8);
}
static int wbuf_str(struct wbuf *b, const char *s, size_t n) {
    int st = wbuf_u64(b, n);
    return st != LLMEM_OK ? st : wbuf_add(b, s, n);
}

/* ---- the writer ----------------------------------------------------------------------------- */

struct wtensor {
    char *name;
    int type;
    int n_dims;
    int64_t dims[LLMEM_GGUF_MAX_DIMS];
    int64_t n_bytes;
    uint64_t offset;
};

struct llmem_gguf_writer {
    char *path, *part; /* the file, and the name it has until closed */
    FILE *f;
    struct wbuf kv; /* the key/values as they go into the file */
    uint64_t n_kv;
    struct wtensor *tensors; /* (n_tensors) */
    int64_t n_tensors, cap_tensors;
    uint64_t data_bytes; /* the data section's size so far (infos added) */
    int started;         /* header written; only data from now on */
    int64_t cur;         /* the tensor whose bytes are being written */
    int64_t cur_done;    /* its bytes written so far */
    int failed;          /* a write failed: everything after is refused */
};

#define FUNC_OPEN "llmem_gguf_writer_open"

int llmem_gguf_writer_open(const char *path, struct llmem_gguf_writer **out) {
    *out = NULL;
    struct llmem_gguf_writer *w = calloc(1, sizeof(*w));
    size_t n = strlen(path);
    if (w == NULL || (w->path = strdup(path)) == NULL || (w->part = malloc(n + 6)) == NULL) {
        LLMEM_ERROR_AS(FUNC_OPEN, "out of memory");
        llmem_gguf_writer_free(w);
        return LLMEM_ENOMEM;
    }
    snprintf(w->part, n + 6, "%s.part", path);
    w->f = fopen(w->part, "wb");
    if (w->f == NULL) {
        LLMEM_ERROR_AS(FUNC_OPEN, "%s: %s", w->part, strerror(errno));
        llmem_gguf_writer_free(w);
        return LLMEM_EIO;
    }
    setvbuf(w->f, NULL, _IOFBF, 1 << 20);
    *out = w;
    return LLMEM_OK;
}

void llmem_gguf_writer_free(struct llmem_gguf_writer *w) {
    if (w == NULL)
        return;
    if (w->f != NULL) { /* not closed: the partial file goes */
        fclose(w->f);
        unlink(w->part);
    }
    for (int64_t i = 0; i < w->n_tensors; i++)
        free(w->tensors[i].name);
    free(w->tensors);
    free(w->kv.p);
    free(w->path);
    free(w->part);
    free(w);
}

static int check_key(struct llmem_gguf_writer *w, const char *func, const char *key) {
    LLMEM_ASSERT(!w->started);
    size_t n = strlen(key);
    if (n == 0 || n > LLMEM_GGUF_MAX_NAME) {
        LLMEM_ERROR_AS(func, "%s: key '%.64s' is empty or too long", w->path, key);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

static int kv_head(struct llmem_gguf_writer *w, const char *func, const char *key, uint32_t type) {
    int st = check_key(w, func, key);
    if (st == LLMEM_OK && ((st = wbuf_str(&w->kv, key, strlen(key))) != LLMEM_OK ||
                           (st = wbuf_u32(&w->kv, type)) != LLMEM_OK))
        LLMEM_ERROR_AS(func, "out of memory");
    if (st == LLMEM_OK)
        w->n_kv++;
    return st;
}

/* The size of one element of a scalar type; 0 for strings and arrays. */
static size_t scalar_size(int type) {
    switch (type) {
    case LLMEM_GGUF_U8:
    case LLMEM_GGUF_I8:
    case LLMEM_GGUF_BOOL: return 1;
    case LLMEM_GGUF_U16:
    case LLMEM_GGUF_I16: return 2;
    case LLMEM_GGUF_U32:
    case LLMEM_GGUF_I32:
    case LLMEM_GGUF_F32: return 4;
    case LLMEM_GGUF_U64:
    case LLMEM_GGUF_I64:
    case LLMEM_GGUF_F64: return 8;
    default: return 0;
    }
}

int llmem_gguf_writer_add_scalar(struct llmem_gguf_writer *w, const char *key, int type,
                                 const void *value) {
    const char *func = "llmem_gguf_writer_add_scalar";
    size_t size = scalar_size(type);
    LLMEM_ASSERT(size > 0);
    int st = kv_head(w, func, key, (uint32_t)type);
    if (st == LLMEM_OK && (st = wbuf_add(&w->kv, value, size)) != LLMEM_OK)
        LLMEM_ERROR_AS(func, "out of memory");
    return st;
}

int llmem_gguf_writer_add_u32(struct llmem_gguf_writer *w, const char *key, uint32_t v) {
    return llmem_gguf_writer_add_scalar(w, key, LLMEM_GGUF_U32, &v);
}
int llmem_gguf_writer_add_i32(struct llmem_gguf_writer *w, const char *key, int32_t v) {
    return llmem_gguf_writer_add_scalar(w, key, LLMEM_GGUF_I32, &v);
}
int llmem_gguf_writer_add_f32(struct llmem_gguf_writer *w, const char *key, float v) {
    return llmem_gguf_writer_add_scalar(w, key, LLMEM_GGUF_F32, &v);
}
int llmem_gguf_writer_add_bool(struct llmem_gguf_writer *w, const char *key, int v) {
    uint8_t b = v != 0;
    return llmem_gguf_writer_add_scalar(w, key, LLMEM_GGUF_BOOL, &b);
}

int llmem_gguf_writer_add_str(struct llmem_gguf_writer *w, const char *key, const char *s,
                              size_t len) {
    const char *func = "llmem_gguf_writer_add_str";
    int st = kv_head(w, func, key, LLMEM_GGUF_STRING);
    if (st == LLMEM_OK && (st = wbuf_str(&w->kv, s, len)) != LLMEM_OK)
        LLMEM_ERROR_AS(func, "out of memory");
    return st;
}

int llmem_gguf_writer_add_array(struct llmem_gguf_writer *w, const char *key, int elem_type,
                                const void *data, uint64_t n) {
    const char *func = "llmem_gguf_writer_add_array";
    size_t size = scalar_size(elem_type);
    LLMEM_ASSERT(size > 0);
    int st = kv_head(w, func, key, LLMEM_GGUF_ARRAY);
    if (st == LLMEM_OK &&
        ((st = wbuf_u32(&w->kv, (uint32_t)elem_type)) != LLMEM_OK ||
         (st = wbuf_u64(&w->kv, n)) != LLMEM_OK || (st = wbuf_add(&w->kv, data, size * n))))
        LLMEM_ERROR_AS(func, "out of memory");
    return st;
}

int llmem_gguf_writer_add_str_array(struct llmem_gguf_writer *w, const char *key,
                                    const struct llmem_gguf_str *strs, uint64_t n) {
    const char *func = "llmem_gguf_writer_add_str_array";
    int st = kv_head(w, func, key, LLMEM_GGUF_ARRAY);
    if (st == LLMEM_OK && ((st = wbuf_u32(&w->kv, LLMEM_GGUF_STRING)) != LLMEM_OK ||
                           (st = wbuf_u64(&w->kv, n)) != LLMEM_OK))
        LLMEM_ERROR_AS(func, "out of memory");
    for (uint64_t i = 0; st == LLMEM_OK && i < n; i++)
        if ((st = wbuf_str(&w->kv, strs[i].ptr, strs[i].len)) != LLMEM_OK)
            LLMEM_ERROR_AS(func, "out of memory");
    return st;
}

static uint64_t align_up(uint64_t x) {
    const uint64_t a = LLMEM_GGUF_DEFAULT_ALIGNMENT;
    return (x + a - 1) / a * a;
}

int llmem_gguf_writer_add_tensor(struct llmem_gguf_writer *w, const char *name, int type,
                                 int n_dims, const int64_t *dims) {
    const char *func = "llmem_gguf_writer_add_tensor";
    LLMEM_ASSERT(!w->started && n_dims >= 1 && n_dims <= LLMEM_GGUF_MAX_DIMS);
    int64_t n = 1;
    for (int i = 0; i < n_dims; i++) {
        LLMEM_ASSERT(dims[i] > 0);
        n *= dims[i];
    }
    int64_t bytes = llmem_qtype_bytes(type, n);
    const struct llmem_qtype_info *info = llmem_qtype_info(type);
    if (bytes < 0 || info == NULL || dims[0] % info->block_elems != 0) {
        LLMEM_ERROR_AS(func,
                       "%s: tensor '%s': row length %" PRId64 " is not a whole number of %s "
                       "blocks",
                       w->path, name, dims[0], llmem_qtype_name(type));
        return LLMEM_EINVAL;
    }
    if (w->n_tensors == w->cap_tensors) {
        int64_t cap = w->cap_tensors ? 2 * w->cap_tensors : 64;
        struct wtensor *t = realloc(w->tensors, (size_t)cap * sizeof(*t));
        if (t == NULL) {
            LLMEM_ERROR_AS(func, "out of memory");
            return LLMEM_ENOMEM;
        }
        w->tensors = t;
        w->cap_tensors = cap;
    }
    struct wtensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof(*t));
    if ((t->name = strdup(name)) == NULL) {
        LLMEM_ERROR_AS(func, "out of memory");
        return LLMEM_ENOMEM;
    }
    t->type = type;
    t->n_dims = n_dims;
    memcpy(t->dims, dims, (size_t)n_dims * sizeof(*dims));
    t->n_bytes = bytes;
    t->offset = w->data_bytes;
    w->data_bytes = align_up(w->data_bytes + (uint64_t)bytes);
    w->n_tensors++;
    return LLMEM_OK;
}

static int put(struct llmem_gguf_writer *w, const char *func, const void *p, size_t n) {
    if (n && fwrite(p, 1, n, w->f) != n) {
        LLMEM_ERROR_AS(func, "%s: write failed: %s", w->part, strerror(errno));
        w->failed = 1;
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}

static int pad(struct llmem_gguf_writer *w, const char *func, uint64_t n) {
    static const uint8_t zeros[LLMEM_GGUF_DEFAULT_ALIGNMENT];
    return put(w, func, zeros, (size_t)(align_up(n) - n));
}

/* The header, key/values and tensor infos, then the padding before the data. */
static int start(struct llmem_gguf_writer *w, const char *func) {
    struct wbuf h = {0};
    uint32_t magic = LLMEM_GGUF_MAGIC;
    int st = wbuf_add(&h, &magic, 4);
    if (st == LLMEM_OK)
        st = wbuf_u32(&h, 3);
    if (st == LLMEM_OK)
        st = wbuf_u64(&h, (uint64_t)w->n_tensors);
    if (st == LLMEM_OK)
        st = wbuf_u64(&h, w->n_kv);
    if (st == LLMEM_OK)
        st = wbuf_add(&h, w->kv.p, w->kv.n);
    for (int64_t i = 0; st == LLMEM_OK && i < w->n_tensors; i++) {
        const struct wtensor *t = &w->tensors[i];
        if ((st = wbuf_str(&h, t->name, strlen(t->name))) == LLMEM_OK &&
            (st = wbuf_u32(&h, (uint32_t)t->n_dims)) == LLMEM_OK &&
            (st = wbuf_add(&h, t->dims, (size_t)t->n_dims * 8)) == LLMEM_OK &&
            (st = wbuf_u32(&h, (uint32_t)t->type)) == LLMEM_OK)
            st = wbuf_u64(&h, t->offset);
    }
    if (st != LLMEM_OK) {
        LLMEM_ERROR_AS(func, "out of memory");
        free(h.p);
        return st;
    }
    /* the whole file's size is known now: refused before its first byte where it cannot fit */
    const uint64_t whole = align_up(h.n) + w->data_bytes;
    const int64_t free_bytes = llmem_sys_disk_free(w->part);
    if (free_bytes != LLMEM_SYS_UNKNOWN && whole > (uint64_t)free_bytes) {
        char need[32], have[32];
        LLMEM_ERROR_AS(func, "%s: the file needs %s but its file system has %s free", w->path,
                       llmem_size_format((int64_t)whole, need, sizeof(need)),
                       llmem_size_format(free_bytes, have, sizeof(have)));
        free(h.p);
        w->failed = 1;
        return LLMEM_EIO;
    }
    st = put(w, func, h.p, h.n);
    if (st == LLMEM_OK)
        st = pad(w, func, h.n);
    free(h.p);
    w->started = 1;
    return st;
}

int llmem_gguf_writer_write(struct llmem_gguf_writer *w, const void *data, size_t n) {
    const char *func = "llmem_gguf_writer_write";
    if (w->failed)
        return LLMEM_EIO;
    int st;
    if (!w->started && (st = start(w, func)) != LLMEM_OK)
        return st;
    const uint8_t *p = data;
    while (n > 0) {
        LLMEM_ASSERT(w->cur < w->n_tensors); /* more bytes than the tensors declared */
        const struct wtensor *t = &w->tensors[w->cur];
        size_t take = (size_t)(t->n_bytes - w->cur_done);
        if (take > n)
            take = n;
        if ((st = put(w, func, p, take)) != LLMEM_OK)
            return st;
        p += take;
        n -= take;
        w->cur_done += (int64_t)take;
        if (w->cur_done == t->n_bytes) {
            if ((st = pad(w, func, (uint64_t)t->n_bytes)) != LLMEM_OK)
                return st;
            w->cur++;
            w->cur_done = 0;
        }
    }
    return LLMEM_OK;
}

int llmem_gguf_writer_close(struct llmem_gguf_writer *w) {
    const char *func = "llmem_gguf_writer_close";
    int st = w->failed ? LLMEM_EIO : LLMEM_OK;
    if (st == LLMEM_OK && !w->started)
        st = start(w, func);
    if (st == LLMEM_OK && w->cur != w->n_tensors) {
        LLMEM_ERROR_AS(func, "%s: tensor '%s' is missing %" PRId64 " of its bytes", w->path,
                       w->tensors[w->cur].name, w->tensors[w->cur].n_bytes - w->cur_done);
        st = LLMEM_EINVAL;
    }
    if (st == LLMEM_OK && (fflush(w->f) != 0 || fsync(fileno(w->f)) != 0)) {
        LLMEM_ERROR_AS(func, "%s: write failed: %s", w->part, strerror(errno));
        st = LLMEM_EIO;
    }
    if (st != LLMEM_OK)
        return st; /* llmem_gguf_writer_free removes the partial file */
    FILE *f = w->f;
    w->f = NULL;
    if (fclose(f) != 0) {
        LLMEM_ERROR_AS(func, "%s: write failed: %s", w->part, strerror(errno));
        unlink(w->part);
        return LLMEM_EIO;
    }
    if (rename(w->part, w->path) != 0) {
        LLMEM_ERROR_AS(func, "%s: cannot rename to %s: %s", w->part, w->path, strerror(errno));
        unlink(w->part);
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}
