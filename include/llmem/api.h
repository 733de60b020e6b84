/*
 * llmem/api.h — LLMEM_API, the mark of a function that libllmem exports.
 *
 * The library is built with hidden visibility: only functions declared with LLMEM_API in
 * include/llmem/ leave libllmem.so. Internal functions are named llmem_<module>_… too (declared
 * in headers under src/), so that the static libllmem.a cannot clash with a program's symbols.
 */
#ifndef LLMEM_API_H
#define LLMEM_API_H

#if defined(__GNUC__) || defined(__clang__)
#define LLMEM_API __attribute__((visibility("default")))
#else
#define LLMEM_API
#endif

#endif
