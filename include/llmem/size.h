/*
 * llmem/size.h — the one size parser and formatter.
 *
 * Sizes are binary: K = 2^10, M = 2^20, G = 2^30, T = 2^40 (case-insensitive, an optional
 * trailing "B" or "iB" is accepted: "48G", "48GiB", "512m", "1.5T", "4096"). A fraction needs a
 * suffix and is rounded down to a whole byte. Negative numbers, junk, empty strings and values
 * above INT64_MAX are rejected with a clear message.
 */
#ifndef LLMEM_SIZE_H
#define LLMEM_SIZE_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Parses text into *bytes. On failure returns LLMEM_EINVAL (junk) or LLMEM_ERANGE (overflow),
 * logs why, and leaves *bytes untouched. */
LLMEM_API int llmem_size_parse(const char *text, int64_t *bytes);

/* Formats bytes for people: "48G" when a whole number of GiB, else one decimal in the largest
 * unit that keeps it ≥ 1 ("36.5G", "512.0M", "900B"). Negative values get a leading '-'.
 * Returns buf. A buffer of LLMEM_SIZE_STR_MAX bytes always suffices. */
#define LLMEM_SIZE_STR_MAX 32
LLMEM_API char *llmem_size_format(int64_t bytes, char *buf, size_t buf_size);

/* Always one decimal, in GiB from 1 GiB up ("19.9G", "36.0G"), else in the largest unit that
 * keeps it ≥ 1 ("11.0M", "900B"): the form of the plan's describe line and tables. */
LLMEM_API char *llmem_size_format_short(int64_t bytes, char *buf, size_t buf_size);

#ifdef __cplusplus
}
#endif

#endif
