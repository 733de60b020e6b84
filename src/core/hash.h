/*
 * core/hash.h — the one hash function of the project: 64-bit XXH3 with a seed.
 */
#ifndef LLMEM_CORE_HASH_H
#define LLMEM_CORE_HASH_H

#include <stddef.h>
#include <stdint.h>

/* XXH3-64 of n bytes at p; the same input and seed give the same value on every run. */
uint64_t llmem_hash64(const void *p, size_t n, uint64_t seed);

#endif
