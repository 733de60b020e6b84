/*
 * core/size_int.h — the size parser of llmem/size.h without its log line, for callers that
 * report a bad size in their own words (the options table names the variable).
 */
#ifndef LLMEM_CORE_SIZE_INT_H
#define LLMEM_CORE_SIZE_INT_H

#include <stdint.h>

/* llmem_size_parse, logging nothing: LLMEM_OK, LLMEM_EINVAL or LLMEM_ERANGE. */
int llmem_size_parse_quiet(const char *text, int64_t *bytes);

#endif
