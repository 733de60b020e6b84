/*
 * core/json.h — the one JSON helper, on top of cJSON.
 *
 * Reading: parse a file or buffer with a clear error (file name and byte offset), then typed
 * lookups that check the JSON type and the integer range. Lookups do not log: a missing key is
 * often normal, and the caller knows which file and field to name.
 * Writing: integers are written exactly (64-bit, never through a double).
 */
#ifndef LLMEM_CORE_JSON_H
#define LLMEM_CORE_JSON_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

/* Parses len bytes of text holding exactly one JSON document (trailing whitespace allowed);
 * `what` names the document in the error ("config.json"). */
int llmem_json_parse(const char *text, size_t len, const char *what, cJSON **out);
/* The same without logging: the reason goes to msg (for input that is someone else's mistake,
 * such as a client's request body). */
int llmem_json_parse_msg(const char *text, size_t len, const char *what, cJSON **out, char *msg,
                         size_t msg_size);
/* Reads and parses a file of at most max_bytes. LLMEM_ENOENT when missing. */
int llmem_json_parse_file(const char *path, int64_t max_bytes, cJSON **out);

/* Typed lookups: LLMEM_ENOENT when the key is absent or null, LLMEM_EFORMAT on a wrong type,
 * LLMEM_ERANGE for a non-integer or one not strictly within ±2^53. Nothing is logged. */
int llmem_json_get_int(const cJSON *obj, const char *key, int64_t *out);
int llmem_json_get_double(const cJSON *obj, const char *key, double *out);
int llmem_json_get_bool(const cJSON *obj, const char *key, int *out);
int llmem_json_get_string(const cJSON *obj, const char *key, const char **out);
/* An item (not a key) as an exact integer; same statuses as llmem_json_get_int. */
int llmem_json_int(const cJSON *item, int64_t *out);

/* Builders: return 0, or LLMEM_ENOMEM (logged). Integers and doubles are added as raw number
 * text (exact), so read them back only after printing and parsing again. */
int llmem_json_add_int(cJSON *obj, const char *key, int64_t value);
int llmem_json_add_double(cJSON *obj, const char *key, double value);
int llmem_json_add_string(cJSON *obj, const char *key, const char *value);
int llmem_json_add_bool(cJSON *obj, const char *key, int value);
int llmem_json_add_null(cJSON *obj, const char *key);

/* Prints to a malloc'ed string (free with free()); NULL on out of memory (logged). */
char *llmem_json_print(const cJSON *item, int pretty);

#endif
