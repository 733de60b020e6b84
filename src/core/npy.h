/*
 * core/npy.h — NumPy .npy files of float32 (version 1.0, little-endian '<f4', C order): the format
 * reference logits are exchanged in (`llmem logits --out`, the parity tests).
 */
#ifndef LLMEM_CORE_NPY_H
#define LLMEM_CORE_NPY_H

#include <stdint.h>

/* Writes data [rows, cols] to path (replaced). LLMEM_EIO (logged) on failure. */
int llmem_npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols);

/* Reads a 1-D or 2-D '<f4' C-order array: *data malloc'ed, *rows and *cols (1-D: rows 1).
 * LLMEM_ENOENT, LLMEM_EFORMAT (logged: another dtype, Fortran order, a bad header, a short file),
 * LLMEM_ENOMEM. */
int llmem_npy_read_f32(const char *path, float **data, int64_t *rows, int64_t *cols);

#endif
