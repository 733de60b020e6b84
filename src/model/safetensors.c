/*
 * model/safetensors.c — the safetensors header parser: one file's header → a tensor table.
 *
 * A .safetensors file is an 8-byte little-endian length N, N bytes of JSON — an object mapping
 * each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
 * "__metadata__" object of strings — then the data section, to which the offsets are relative.
 *
 * Guarantees, for any input file:
 *  - only the 8-byte prefix and the header are read (pread), never the data; N is checked against
 *    the 100 MiB limit and the file size before anything is allocated for it;
 *  - element counts and byte sizes are computed with overflow checks;
 *  - a table comes back only when every tensor has a known dtype, at most 8 non-negative
 *    dimensions, a byte range inside the data section whose length matches shape × dtype, no
 *    overlap with another tensor of the file, and a unique name; otherwise exactly one error line
 *    names the file and the tensor.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "core/json.h"
#include "core/log.h"
#include "model/model_int.h"
#include "llmem/dtype.h"
#include "llmem/safetensors.h"

/* ---- dtypes --------------------------------------------------------------------------------- */

static const struct {
    const char *name;
    int64_t size;
} dtypes[LLMEM_DTYPE_COUNT] = {
    [LLMEM_DTYPE_F32] = {"F32", 4},         [LLMEM_DTYPE_F16] = {"F16", 2},
    [LLMEM_DTYPE_BF16] = {"BF16", 2},       [LLMEM_DTYPE_F64] = {"F64", 8},
    [LLMEM_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [LLMEM_DTYPE_F8_E5M2] = {"F8_E5M2", 1},
    [LLMEM_DTYPE_I8] = {"I8", 1},           [LLMEM_DTYPE_U8] = {"U8", 1},
    [LLMEM_DTYPE_I16] = {"I16", 2},         [LLMEM_DTYPE_U16] = {"U16", 2},
    [LLMEM_DTYPE_I32] = {"I32", 4},         [LLMEM_DTYPE_U32] = {"U32", 4},
    [LLMEM_DTYPE_I64] = {"I64", 8},         [LLMEM_DTYPE_U64] = {"U64", 8},
    [LLMEM_DTYPE_BOOL] = {"BOOL", 1},
};

const char *llmem_dtype_name(enum llmem_dtype dtype) {
    return (unsigned)dtype < LLMEM_DTYPE_COUNT ? dtypes[dtype].name : "?";
}

int64_t llmem_dtype_size(enum llmem_dtype dtype) {
    return (unsigned)dtype < LLMEM_DTYPE_COUNT ? dtypes[dtype].size : 0;
}

int llmem_dtype_parse(const char *name, enum llmem_dtype *dtype) {
    for (int i = 0; i < LLMEM_DTYPE_COUNT; i++) {
        if (strcmp(name, dtypes[i].name) == 0) {
            *dtype = (enum llmem_dtype)i;
            return LLMEM_OK;
        }
    }
    return LLMEM_ENOENT;
}

/* ---- the table ------------------------------------------------------------------------------ */

struct llmem_safetensors *llmem_st_table_new(const char *func) {
    struct llmem_safetensors *st = calloc(1, sizeof(*st));
    if (st == NULL)
        LLMEM_ERROR_AS(func, "out of memory");
    return st;
}

void llmem_safetensors_free(struct llmem_safetensors *st) {
    if (st == NULL)
        return;
    for (int i = 0; i < st->n_tensors; i++)
        free(st->tensors[i].name);
    for (int i = 0; i < st->n_files; i++)
        free(st->files[i].path);
    free(st->tensors);
    free(st->files);
    free(st);
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const struct llmem_st_tensor *)a)->name,
                  ((const struct llmem_st_tensor *)b)->name);
}

const struct llmem_st_tensor *llmem_safetensors_find(const struct llmem_safetensors *st,
                                                     const char *name) {
    if (st == NULL || st->n_tensors == 0)
        return NULL;
    struct llmem_st_tensor key = {.name = (char *)name};
    return bsearch(&key, st->tensors, (size_t)st->n_tensors, sizeof(*st->tensors), cmp_tensor_name);
}

/* ---- one tensor entry ----------------------------------------------------------------------- */

static void format_shape(char *buf, size_t size, const int64_t *shape, int n_dims) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n_dims && used < size; i++) {
        int n = snprintf(buf + used, size - used, "%s%" PRId64, i ? ", " : "", shape[i]);
        if (n < 0)
            break;
        used += (size_t)n;
    }
}

/* Parses the entry `item` (named `name`) of the file at `path` into *t. */
static int parse_tensor(const cJSON *item, const char *name, const char *path, int64_t data_bytes,
                        const char *func, struct llmem_st_tensor *t) {
    if (!cJSON_IsObject(item)) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': entry is not an object", path, name);
        return LLMEM_EFORMAT;
    }

    const char *dtype_name = NULL;
    int status = llmem_json_get_string(item, "dtype", &dtype_name);
    if (status == LLMEM_ENOENT) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': missing 'dtype'", path, name);
        return LLMEM_EFORMAT;
    }
    if (status != LLMEM_OK) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': 'dtype' is not a string", path, name);
        return LLMEM_EFORMAT;
    }
    if (llmem_dtype_parse(dtype_name, &t->dtype) != LLMEM_OK) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': unknown dtype '%.40s'", path, name, dtype_name);
        return LLMEM_EFORMAT;
    }

    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    if (shape == NULL) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': missing 'shape'", path, name);
        return LLMEM_EFORMAT;
    }
    if (!cJSON_IsArray(shape)) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': 'shape' is not an array", path, name);
        return LLMEM_EFORMAT;
    }
    int n_dims = cJSON_GetArraySize(shape);
    if (n_dims > LLMEM_ST_MAX_DIMS) {
        LLMEM_ERROR_AS(func,
                       "%s: tensor '%.200s': shape has %d dimensions, at most %d are supported",
                       path, name, n_dims, LLMEM_ST_MAX_DIMS);
        return LLMEM_EFORMAT;
    }
    t->n_dims = n_dims;
    int64_t n_elements = 1;
    int overflow = 0;
    int dim = 0;
    const cJSON *d = NULL;
    cJSON_ArrayForEach(d, shape) {
        int64_t v = 0;
        if (llmem_json_int(d, &v) != LLMEM_OK || v < 0) {
            LLMEM_ERROR_AS(func, "%s: tensor '%.200s': shape[%d] is not a non-negative integer",
                           path, name, dim);
            return LLMEM_EFORMAT;
        }
        t->shape[dim++] = v;
        if (__builtin_mul_overflow(n_elements, v, &n_elements))
            overflow = 1; /* a later 0 does not make the shape sane */
    }
    char shape_text[8 * 22];
    format_shape(shape_text, sizeof(shape_text), t->shape, n_dims);
    int64_t n_bytes = 0;
    if (overflow || __builtin_mul_overflow(n_elements, llmem_dtype_size(t->dtype), &n_bytes)) {
        LLMEM_ERROR_AS(func,
                       "%s: tensor '%.200s': shape [%s] is too large (its size overflows 64 bits)",
                       path, name, shape_text);
        return LLMEM_EFORMAT;
    }
    t->n_elements = n_elements;
    t->n_bytes = n_bytes;

    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (offsets == NULL) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': missing 'data_offsets'", path, name);
        return LLMEM_EFORMAT;
    }
    int64_t begin = 0, end = 0;
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2 ||
        llmem_json_int(cJSON_GetArrayItem(offsets, 0), &begin) != LLMEM_OK ||
        llmem_json_int(cJSON_GetArrayItem(offsets, 1), &end) != LLMEM_OK || begin < 0 || end < 0) {
        LLMEM_ERROR_AS(func, "%s: tensor '%.200s': 'data_offsets' is not two non-negative integers",
                       path, name);
        return LLMEM_EFORMAT;
    }
    if (begin > end) {
        LLMEM_ERROR_AS(func,
                       "%s: tensor '%.200s': data_offsets [%" PRId64 ", %" PRId64
                       "] begin after they "
                       "end",
                       path, name, begin, end);
        return LLMEM_EFORMAT;
    }
    if (end > data_bytes) {
        LLMEM_ERROR_AS(func,
                       "%s: tensor '%.200s': data_offsets [%" PRId64 ", %" PRId64
                       "] run past the end "
                       "of the data section (%" PRId64 " bytes)",
                       path, name, begin, end, data_bytes);
        return LLMEM_EFORMAT;
    }
    if (end - begin != n_bytes) {
        LLMEM_ERROR_AS(func,
                       "%s: tensor '%.200s': data_offsets [%" PRId64 ", %" PRId64 "] hold %" PRId64
                       " bytes but %s [%s] is %" PRId64 " bytes (size mismatch)",
                       path, name, begin, end, end - begin, dtypes[t->dtype].name, shape_text,
                       n_bytes);
        return LLMEM_EFORMAT;
    }
    t->offset_begin = begin;
    t->offset_end = end;
    return LLMEM_OK;
}

static int check_metadata(const cJSON *meta, const char *path, const char *func) {
    if (!cJSON_IsObject(meta)) {
        LLMEM_ERROR_AS(func, "%s: '__metadata__' is not an object", path);
        return LLMEM_EFORMAT;
    }
    const cJSON *kv = NULL;
    cJSON_ArrayForEach(kv, meta) {
        if (!cJSON_IsString(kv)) {
            LLMEM_ERROR_AS(func, "%s: '__metadata__' entry '%.200s' is not a string", path,
                           kv->string != NULL ? kv->string : "");
            return LLMEM_EFORMAT;
        }
    }
    return LLMEM_OK;
}

static int cmp_tensor_begin(const void *a, const void *b) {
    const struct llmem_st_tensor *x = *(const struct llmem_st_tensor *const *)a;
    const struct llmem_st_tensor *y = *(const struct llmem_st_tensor *const *)b;
    if (x->offset_begin != y->offset_begin)
        return x->offset_begin < y->offset_begin ? -1 : 1;
    return x->offset_end < y->offset_end ? -1 : x->offset_end > y->offset_end;
}

/* No two non-empty tensors among tensors[0..n) share a byte. */
static int check_overlap(struct llmem_st_tensor *tensors, int n, const char *path,
                         const char *func) {
    if (n < 2)
        return LLMEM_OK;
    struct llmem_st_tensor **order = malloc((size_t)n * sizeof(*order));
    if (order == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory", path);
        return LLMEM_ENOMEM;
    }
    int n_order = 0;
    for (int i = 0; i < n; i++)
        if (tensors[i].n_bytes > 0)
            order[n_order++] = &tensors[i];
    qsort(order, (size_t)n_order, sizeof(*order), cmp_tensor_begin);
    int status = LLMEM_OK;
    for (int i = 1; i < n_order; i++) {
        const struct llmem_st_tensor *p = order[i - 1], *q = order[i];
        if (q->offset_begin < p->offset_end) {
            LLMEM_ERROR_AS(func,
                           "%s: tensors '%.200s' [%" PRId64 ", %" PRId64 ") and '%.200s' [%" PRId64
                           ", %" PRId64 ") overlap",
                           path, p->name, p->offset_begin, p->offset_end, q->name, q->offset_begin,
                           q->offset_end);
            status = LLMEM_EFORMAT;
            break;
        }
    }
    free(order);
    return status;
}

/* No name appears twice among tensors[0..n) (sorts them by name). */
static int check_names(struct llmem_st_tensor *tensors, int n, const char *path, const char *func) {
    if (n > 1)
        qsort(tensors, (size_t)n, sizeof(*tensors), cmp_tensor_name);
    for (int i = 1; i < n; i++) {
        if (strcmp(tensors[i - 1].name, tensors[i].name) == 0) {
            LLMEM_ERROR_AS(func, "%s: tensor '%.200s' appears twice (duplicate name)", path,
                           tensors[i].name);
            return LLMEM_EFORMAT;
        }
    }
    return LLMEM_OK;
}

/* ---- one file ------------------------------------------------------------------------------- */

/* Opens the file and reads its 8-byte prefix and header into a malloc'ed buffer. */
static int read_header(const char *path, const char *func, struct llmem_st_file *file,
                       char **header) {
    int fd;
    int status = llmem_file_open_regular(path, func, &fd);
    if (status != LLMEM_OK)
        return status;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        LLMEM_ERROR_AS(func, "%s: %s", path, strerror(errno));
        status = LLMEM_EIO;
        goto out_close;
    }
    int64_t file_bytes = (int64_t)st.st_size;
    if (file_bytes < 8) {
        LLMEM_ERROR_AS(func,
                       "%s: file is %" PRId64
                       " bytes, too short for a safetensors file (truncated: "
                       "no 8-byte header length)",
                       path, file_bytes);
        status = LLMEM_EFORMAT;
        goto out_close;
    }
    unsigned char prefix[8];
    status = llmem_file_pread(fd, path, prefix, sizeof(prefix), 0);
    if (status != LLMEM_OK)
        goto out_close;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | prefix[i];
    if (n == 0) {
        LLMEM_ERROR_AS(func, "%s: header length is 0", path);
        status = LLMEM_EFORMAT;
        goto out_close;
    }
    if (n > (uint64_t)LLMEM_ST_MAX_HEADER_BYTES) {
        LLMEM_ERROR_AS(func, "%s: header length %" PRIu64 " exceeds the limit of %" PRId64 " bytes",
                       path, n, LLMEM_ST_MAX_HEADER_BYTES);
        status = LLMEM_EFORMAT;
        goto out_close;
    }
    if (n > (uint64_t)(file_bytes - 8)) {
        LLMEM_ERROR_AS(func,
                       "%s: header length %" PRIu64 " runs past the end of the file (%" PRId64
                       " bytes; truncated?)",
                       path, n, file_bytes);
        status = LLMEM_EFORMAT;
        goto out_close;
    }
    char *buf = malloc((size_t)n);
    if (buf == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory for a %" PRIu64 "-byte header", path, n);
        status = LLMEM_ENOMEM;
        goto out_close;
    }
    status = llmem_file_pread(fd, path, buf, (size_t)n, 8);
    if (status != LLMEM_OK) {
        free(buf);
        goto out_close;
    }
    file->file_bytes = file_bytes;
    file->header_bytes = (int64_t)n;
    file->data_offset = 8 + (int64_t)n;
    *header = buf;
out_close:
    close(fd);
    return status;
}

int llmem_st_table_add_file(struct llmem_safetensors *st, const char *path, const char *func) {
    struct llmem_st_file file = {0};
    char *text = NULL;
    int status = read_header(path, func, &file, &text);
    if (status != LLMEM_OK)
        return status;
    cJSON *root = NULL;
    status = llmem_json_parse(text, (size_t)file.header_bytes, path, &root);
    free(text);
    if (status != LLMEM_OK)
        return status;
    if (!cJSON_IsObject(root)) {
        LLMEM_ERROR_AS(func, "%s: header is not a JSON object", path);
        status = LLMEM_EFORMAT;
        goto out_json;
    }

    /* Room for the file and for every entry of the header (one may be __metadata__). */
    int n_entries = cJSON_GetArraySize(root);
    if (st->n_files == INT_MAX || n_entries > INT_MAX - st->n_tensors) {
        LLMEM_ERROR_AS(func, "%s: too many tensors", path);
        status = LLMEM_ERANGE;
        goto out_json;
    }
    struct llmem_st_file *files = realloc(st->files, (size_t)(st->n_files + 1) * sizeof(*files));
    if (files == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory", path);
        status = LLMEM_ENOMEM;
        goto out_json;
    }
    st->files = files;
    /* (+ 1: never a zero-byte allocation, so tensors is never NULL past this point) */
    struct llmem_st_tensor *tensors =
        realloc(st->tensors, ((size_t)st->n_tensors + (size_t)n_entries + 1) * sizeof(*tensors));
    if (tensors == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory for %d tensors", path, n_entries);
        status = LLMEM_ENOMEM;
        goto out_json;
    }
    st->tensors = tensors;
    file.path = strdup(path);
    if (file.path == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory", path);
        status = LLMEM_ENOMEM;
        goto out_json;
    }
    int file_index = st->n_files;
    st->files[st->n_files++] = file;

    int first = st->n_tensors;
    const int64_t data_bytes = file.file_bytes - file.data_offset;
    const cJSON *item = NULL;
    cJSON_ArrayForEach(item, root) {
        const char *name = item->string != NULL ? item->string : "";
        if (strcmp(name, "__metadata__") == 0) {
            status = check_metadata(item, path, func);
            if (status != LLMEM_OK)
                goto out_json;
            continue;
        }
        struct llmem_st_tensor t = {.file_index = file_index};
        status = parse_tensor(item, name, path, data_bytes, func, &t);
        if (status != LLMEM_OK)
            goto out_json;
        t.name = strdup(name);
        if (t.name == NULL) {
            LLMEM_ERROR_AS(func, "%s: out of memory", path);
            status = LLMEM_ENOMEM;
            goto out_json;
        }
        st->tensors[st->n_tensors++] = t;
    }
    status = check_names(st->tensors + first, st->n_tensors - first, path, func);
    if (status == LLMEM_OK)
        status = check_overlap(st->tensors + first, st->n_tensors - first, path, func);
out_json:
    cJSON_Delete(root);
    return status;
}

int llmem_st_table_finish(struct llmem_safetensors *st, const char *func) {
    if (st->n_tensors > 1)
        qsort(st->tensors, (size_t)st->n_tensors, sizeof(*st->tensors), cmp_tensor_name);
    int64_t n_elements = 0, n_bytes = 0;
    for (int i = 0; i < st->n_tensors; i++) {
        const struct llmem_st_tensor *t = &st->tensors[i];
        if (i > 0 && strcmp(t[-1].name, t->name) == 0) {
            /* Names within one file were checked as it was added: this is across files. */
            LLMEM_ERROR_AS(func, "tensor '%.200s' appears twice (duplicate name): in %s and in %s",
                           t->name, st->files[t[-1].file_index].path,
                           st->files[t->file_index].path);
            return LLMEM_EFORMAT;
        }
        if (__builtin_add_overflow(n_elements, t->n_elements, &n_elements) ||
            __builtin_add_overflow(n_bytes, t->n_bytes, &n_bytes)) {
            LLMEM_ERROR_AS(func, "%s: the tensors' total size overflows 64 bits",
                           st->files[t->file_index].path);
            return LLMEM_EFORMAT;
        }
    }
    st->n_elements = n_elements;
    st->n_bytes = n_bytes;
    return LLMEM_OK;
}

int llmem_safetensors_load(const char *path, struct llmem_safetensors **out) {
    static const char func[] = "llmem_safetensors_load";
    struct llmem_safetensors *st = llmem_st_table_new(func);
    if (st == NULL)
        return LLMEM_ENOMEM;
    int status = llmem_st_table_add_file(st, path, func);
    if (status == LLMEM_OK)
        status = llmem_st_table_finish(st, func);
    if (status != LLMEM_OK) {
        llmem_safetensors_free(st);
        return status;
    }
    *out = st;
    return LLMEM_OK;
}
