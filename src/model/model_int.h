/*
 * model/model_int.h — functions shared by the files of model/: the model directory check, and
 * building a tensor table file by file (safetensors.c parses one file's header; model_dir.c
 * gathers the shards of a model directory).
 */
#ifndef LLMEM_MODEL_MODEL_INT_H
#define LLMEM_MODEL_MODEL_INT_H

#include "llmem/model.h"

/* LLMEM_OK when dir is an existing directory; else LLMEM_ENOENT (missing) or LLMEM_EINVAL (not a
 * directory), logged as from `func` with the path. */
int llmem_model_dir_check(const char *dir, const char *func);

/* An empty table (NULL on out of memory, logged). Free with llmem_safetensors_free. */
struct llmem_safetensors *llmem_st_table_new(const char *func);

/* Reads one file's header and appends the file and its tensors to the table, checking each tensor,
 * that no name repeats and that no two tensors overlap in this file. `func` names the public entry
 * point in the error line. On failure the table stays valid (free it). */
int llmem_st_table_add_file(struct llmem_safetensors *st, const char *path, const char *func);

/* Sorts the tensors by name, rejects a name found in two files, and sums the element and byte
 * counts. */
int llmem_st_table_finish(struct llmem_safetensors *st, const char *func);

#endif
