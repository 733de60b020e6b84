/*
 * core/json.c — the one JSON helper (see core/json.h). cJSON stores numbers as doubles, so
 * integer reads check that the value is integral and within ±2^53 (exactly representable), and
 * integer writes go through a raw "%lld" item so 64-bit values are never rounded.
 */
#include "core/json.h"

#include <ctype.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/file.h"
#include "core/hash.h"
#include "core/log.h"

#define JSON_EXACT_LIMIT 9007199254740992.0 /* 2^53 */

/* Whether the object's members hold a key twice (the first such key into *dup): small objects
 * pairwise, large ones through an open-addressing table of the keys. LLMEM_ENOMEM when the table
 * cannot be made. */
static int object_duplicate(const cJSON *obj, const char **dup) {
    size_t n = 0;
    for (const cJSON *c = obj->child; c != NULL; c = c->next)
        n++;
    if (n <= 16) {
        for (const cJSON *a = obj->child; a != NULL; a = a->next)
            for (const cJSON *b = a->next; b != NULL; b = b->next)
                if (strcmp(a->string, b->string) == 0) {
                    *dup = a->string;
                    return LLMEM_OK;
                }
        return LLMEM_OK;
    }
    size_t size = 64;
    while (size < 2 * n)
        size *= 2;
    const char **slots = calloc(size, sizeof(*slots));
    if (slots == NULL)
        return LLMEM_ENOMEM;
    for (const cJSON *c = obj->child; c != NULL && *dup == NULL; c = c->next) {
        size_t i = (size_t)llmem_hash64(c->string, strlen(c->string), 0) & (size - 1);
        for (; slots[i] != NULL; i = (i + 1) & (size - 1))
            if (strcmp(slots[i], c->string) == 0) {
                *dup = c->string;
                break;
            }
        slots[i] = c->string;
    }
    free(slots);
    return LLMEM_OK;
}

/* The first key held twice by one object of the tree (cJSON keeps both; Python's json and
 * serde keep the last), into *dup. Nesting is bounded by cJSON's limit. */
static int find_duplicate(const cJSON *item, const char **dup) {
    int status = LLMEM_OK;
    if (cJSON_IsObject(item))
        status = object_duplicate(item, dup);
    for (const cJSON *c = item->child; c != NULL && status == LLMEM_OK && *dup == NULL; c = c->next)
        if (c->child != NULL)
            status = find_duplicate(c, dup);
    return status;
}

int llmem_json_parse_msg(const char *text, size_t len, const char *what, cJSON **out, char *msg,
                         size_t msg_size) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (root == NULL) {
        size_t at = (end != NULL && end >= text) ? (size_t)(end - text) : 0;
        snprintf(msg, msg_size, "%s: invalid JSON at byte %zu of %zu", what, at, len);
        return LLMEM_EFORMAT;
    }
    /* One document: only whitespace (or the terminator, as the last byte) may follow it. */
    for (const char *p = end; p != NULL && p < text + len; p++) {
        if (!isspace((unsigned char)*p) && !(*p == '\0' && p == text + len - 1)) {
            snprintf(msg, msg_size,
                     "%s: unexpected text after the JSON document at byte %zu of %zu", what,
                     (size_t)(p - text), len);
            cJSON_Delete(root);
            return LLMEM_EFORMAT;
        }
    }
    /* a key given twice would read as its first value here and as its last in the programs
     * that wrote the file or the request: refused rather than read either way */
    const char *dup = NULL;
    if (find_duplicate(root, &dup) != LLMEM_OK || dup != NULL) {
        if (dup != NULL)
            snprintf(msg, msg_size, "%s: the key \"%.200s\" appears twice in one object", what,
                     dup);
        else
            snprintf(msg, msg_size, "%s: out of memory checking the keys", what);
        cJSON_Delete(root);
        return dup != NULL ? LLMEM_EFORMAT : LLMEM_ENOMEM;
    }
    *out = root;
    return LLMEM_OK;
}

int llmem_json_parse(const char *text, size_t len, const char *what, cJSON **out) {
    char msg[512];
    int status = llmem_json_parse_msg(text, len, what, out, msg, sizeof(msg));
    if (status != LLMEM_OK)
        LLMEM_ERROR("%s", msg);
    return status;
}

int llmem_json_parse_file(const char *path, int64_t max_bytes, cJSON **out) {
    char *text = NULL;
    size_t len = 0;
    int status = llmem_file_read(path, max_bytes, &text, &len);
    if (status != LLMEM_OK)
        return status;
    status = llmem_json_parse(text, len, path, out);
    free(text);
    return status;
}

int llmem_json_int(const cJSON *item, int64_t *out) {
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_ENOENT;
    if (!cJSON_IsNumber(item))
        return LLMEM_EFORMAT;
    double d = item->valuedouble;
    /* Strictly below 2^53: from there on, distinct integers in the text read as the same double. */
    if (!isfinite(d) || d != floor(d) || fabs(d) >= JSON_EXACT_LIMIT)
        return LLMEM_ERANGE;
    *out = (int64_t)d;
    return LLMEM_OK;
}

int llmem_json_get_int(const cJSON *obj, const char *key, int64_t *out) {
    return llmem_json_int(cJSON_GetObjectItemCaseSensitive(obj, key), out);
}

int llmem_json_get_double(const cJSON *obj, const char *key, double *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_ENOENT;
    if (!cJSON_IsNumber(item))
        return LLMEM_EFORMAT;
    *out = item->valuedouble;
    return LLMEM_OK;
}

int llmem_json_get_bool(const cJSON *obj, const char *key, int *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_ENOENT;
    if (!cJSON_IsBool(item))
        return LLMEM_EFORMAT;
    *out = cJSON_IsTrue(item);
    return LLMEM_OK;
}

int llmem_json_get_string(const cJSON *obj, const char *key, const char **out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_ENOENT;
    if (!cJSON_IsString(item))
        return LLMEM_EFORMAT;
    *out = item->valuestring;
    return LLMEM_OK;
}

static int added(const cJSON *item, const char *key) {
    if (item != NULL)
        return LLMEM_OK;
    LLMEM_ERROR("out of memory adding '%s'", key);
    return LLMEM_ENOMEM;
}

int llmem_json_add_int(cJSON *obj, const char *key, int64_t value) {
    char num[24];
    snprintf(num, sizeof(num), "%" PRId64, value);
    return added(cJSON_AddRawToObject(obj, key, num), key);
}

int llmem_json_add_double(cJSON *obj, const char *key, double value) {
    if (!isfinite(value))
        return added(cJSON_AddNullToObject(obj, key), key);
    char num[40];
    snprintf(num, sizeof(num), "%.17g", value);
    /* Shortest form that reads back the same double, for tidy output. */
    for (int prec = 1; prec < 17; prec++) {
        char shorter[40];
        snprintf(shorter, sizeof(shorter), "%.*g", prec, value);
        if (strtod(shorter, NULL) == value) {
            snprintf(num, sizeof(num), "%s", shorter);
            break;
        }
    }
    return added(cJSON_AddRawToObject(obj, key, num), key);
}

int llmem_json_add_string(cJSON *obj, const char *key, const char *value) {
    return added(cJSON_AddStringToObject(obj, key, value), key);
}

int llmem_json_add_bool(cJSON *obj, const char *key, int value) {
    return added(cJSON_AddBoolToObject(obj, key, value), key);
}

int llmem_json_add_null(cJSON *obj, const char *key) {
    return added(cJSON_AddNullToObject(obj, key), key);
}

char *llmem_json_print(const cJSON *item, int pretty) {
    char *s = pretty ? cJSON_Print(item) : cJSON_PrintUnformatted(item);
    if (s == NULL)
        LLMEM_ERROR("out of memory printing JSON");
    return s;
}
