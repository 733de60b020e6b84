/*
 * llmem/dtype.h — element types of stored tensors, with their names and sizes.
 *
 * One enum for every file format llmem reads (the safetensors spellings), so that the readers and
 * the loader share it.
 */
#ifndef LLMEM_DTYPE_H
#define LLMEM_DTYPE_H

#include <stdint.h>

#include "llmem/api.h"

#ifdef __cplusplus
extern "C" {
#endif

enum llmem_dtype {
    LLMEM_DTYPE_F32 = 0,
    LLMEM_DTYPE_F16,
    LLMEM_DTYPE_BF16,
    LLMEM_DTYPE_F64,
    LLMEM_DTYPE_F8_E4M3,
    LLMEM_DTYPE_F8_E5M2,
    LLMEM_DTYPE_I8,
    LLMEM_DTYPE_U8,
    LLMEM_DTYPE_I16,
    LLMEM_DTYPE_U16,
    LLMEM_DTYPE_I32,
    LLMEM_DTYPE_U32,
    LLMEM_DTYPE_I64,
    LLMEM_DTYPE_U64,
    LLMEM_DTYPE_BOOL,
    LLMEM_DTYPE_COUNT
};

/* The safetensors spelling ("BF16"); "?" for a value out of range. */
LLMEM_API const char *llmem_dtype_name(enum llmem_dtype dtype);
/* Bytes per element (BF16 2, F32 4, BOOL 1 ...); 0 for a value out of range. */
LLMEM_API int64_t llmem_dtype_size(enum llmem_dtype dtype);
/* "BF16" → LLMEM_DTYPE_BF16 (exact, case-sensitive, as safetensors writes it); LLMEM_ENOENT when
 * unknown. Not logged: the caller names the file and tensor. */
LLMEM_API int llmem_dtype_parse(const char *name, enum llmem_dtype *dtype);

#ifdef __cplusplus
}
#endif

#endif
