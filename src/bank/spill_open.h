/*
 * bank/spill_open.h — the spill store opened as a cache, for the engine.
 */
#ifndef LLMEM_BANK_SPILL_OPEN_H
#define LLMEM_BANK_SPILL_OPEN_H

#include <stddef.h>

#include "llmem/spill.h"

/* As llmem_spill_open, but a failure to open the store is not logged: its reason goes into why
 * (one line naming the path), for a caller that runs without the store and says so once. */
int llmem_spill_open_cache(const struct llmem_spill_config *c, struct llmem_spill **out, char *why,
                           size_t why_size);

#endif
