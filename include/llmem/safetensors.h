/*
 * llmem/safetensors.h — the safetensors tensor table of a file or a model directory (SPEC §2.5).
 *
 * Every tensor's name, dtype, shape and byte range, read from the headers of a single
 * `model.safetensors` or of the shards listed by `model.safetensors.index.json`. Only the 8-byte
 * length prefix and the JSON header of each file are read, never the tensor data; the loader maps
 * the data later using these offsets. Hostile files are expected: sizes, offsets and element counts
 * are all checked before use; a failure is logged once, naming the file and the tensor or field,
 * and leaves the outputs untouched.
 */
#ifndef LLMEM_SAFETENSORS_H
#define LLMEM_SAFETENSORS_H

#include <stdint.h>

#include "llmem/api.h"
#include "llmem/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLMEM_ST_MAX_DIMS 8
/* Header lengths above this are refused (the reference implementation's limit is 100 MB). */
#define LLMEM_ST_MAX_HEADER_BYTES ((int64_t)100 << 20)

struct llmem_st_tensor {
    char *name; /* owned by the table */
    enum llmem_dtype dtype;
    int n_dims;
    int64_t shape[LLMEM_ST_MAX_DIMS]; /* (n_dims), outermost first; the rest 0 */
    int64_t n_elements;               /* product of shape; 1 for a scalar */
    int64_t n_bytes;                  /* n_elements × dtype size = offset_end − offset_begin */
    int64_t offset_begin;             /* data_offsets[0], relative to the file's data section */
    int64_t offset_end;               /* data_offsets[1] */
    int file_index;                   /* into llmem_safetensors.files */
};

struct llmem_st_file {
    char *path;
    int64_t file_bytes;   /* the file's size when its header was read */
    int64_t header_bytes; /* the JSON header's length (the value of the 8-byte prefix) */
    int64_t data_offset;  /* 8 + header_bytes: where offset 0 of the data section lies */
};

/* The tensors of one file or of one model directory. A tensor's bytes are at file position
 * files[t->file_index].data_offset + t->offset_begin, for t->n_bytes bytes. Guarantees after a
 * successful load: names are unique; every dtype is known; every byte range lies inside its
 * file's data section, matches the shape, and overlaps no other tensor's range in that file. */
struct llmem_safetensors {
    int n_files;
    struct llmem_st_file *files; /* (n_files) */
    int n_tensors;
    struct llmem_st_tensor *tensors; /* (n_tensors), sorted by name (strcmp) */
    int64_t n_elements;              /* Σ n_elements: the parameters as stored */
    int64_t n_bytes;                 /* Σ n_bytes: the weights as stored */
};

/* Reads the header of one .safetensors file (8-byte little-endian length, then the JSON header;
 * `__metadata__` is checked to be an object of strings and skipped). LLMEM_ENOENT when the file
 * is missing, LLMEM_EFORMAT for a malformed or inconsistent header, LLMEM_EIO, LLMEM_ENOMEM. */
LLMEM_API int llmem_safetensors_load(const char *path, struct llmem_safetensors **out);

/* Reads the tensor table of a model directory: `model.safetensors` when present, else the shards
 * named by `model.safetensors.index.json` (each shard read once; every tensor of the weight map
 * must be in the shard it names; a tensor in two shards is an error). LLMEM_ENOENT when the
 * directory, both files or a listed shard is missing; otherwise as llmem_safetensors_load. */
LLMEM_API int llmem_safetensors_load_dir(const char *model_dir, struct llmem_safetensors **out);

/* NULL is a no-op. */
LLMEM_API void llmem_safetensors_free(struct llmem_safetensors *st);

/* The tensor with this name (binary search), or NULL. Not logged. */
LLMEM_API const struct llmem_st_tensor *llmem_safetensors_find(const struct llmem_safetensors *st,
                                                               const char *name);

#ifdef __cplusplus
}
#endif

#endif
