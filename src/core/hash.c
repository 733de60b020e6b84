/*
 * core/hash.c — llmem_hash64 over xxHash's XXH3 (see core/hash.h).
 */
#include "core/hash.h"

#include <xxhash.h>

uint64_t llmem_hash64(const void *p, size_t n, uint64_t seed) {
    return (uint64_t)XXH3_64bits_withSeed(p, n, (XXH64_hash_t)seed);
}
