/*
 * llmem/model.h — a model directory loaded for inference: config, weights mapped in place, every
 * tensor bound and checked; and its copy in a device's memory.
 */
#ifndef LLMEM_MODEL_H
#define LLMEM_MODEL_H

#include <stdint.h>

#include "llmem/api.h"
#include "llmem/backend.h"
#include "llmem/config.h"
#include "llmem/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

struct llmem_mem;
struct llmem_model;

/* Progress of long work: done of total units (bytes for a load). */
typedef void (*llmem_progress_fn)(void *arg, int64_t done, int64_t total);

/* Loads a model directory: config.json in full, the safetensors files memory-mapped and used in
 * place (tracked by mem under the tag weights, read in with progress reported), every tensor of
 * the architecture bound and checked against the config. With LLMEM_MODEL_LOAD_NO_MMAP the files
 * are read into anonymous memory instead, on transparent huge pages where the kernel offers them
 * (fewer TLB misses when every decode step streams all weights; the bytes are the same, but not
 * reclaimable as page cache). progress may be NULL. LLMEM_ENOENT (missing directory, file or
 * tensor), LLMEM_EFORMAT (a malformed file, a shape that disagrees with the config),
 * LLMEM_EUNSUPPORTED (an architecture, dtype, rope type or activation llmem does not run),
 * LLMEM_ENOMEM (the memory limit), LLMEM_EIO — each logged once, naming the file and tensor. */
#define LLMEM_MODEL_LOAD_NO_MMAP 1
/* With LLMEM_MODEL_LOAD_DUMMY the directory needs only config.json: the weights are made in
 * memory as a bf16 checkpoint of that configuration would hold them, seeded random (the same on
 * every load; norm weights 1, biases 0), for benchmarks of shapes without files. The geometry is
 * llmem_model_geometry_load_dummy's. */
#define LLMEM_MODEL_LOAD_DUMMY 2
/* With LLMEM_MODEL_LOAD_DUMMY too: the matrices' values are not made in host memory at all;
 * llmem_model_to_device makes each one's (or each share's) as it copies it, a matrix at a time,
 * so that the host never holds the model (norms and biases are made at load). Such a model runs
 * only as that copy: llmem_forward_create refuses it. */
#define LLMEM_MODEL_LOAD_DUMMY_DEFERRED 4
LLMEM_API int llmem_model_load(const char *model_dir, struct llmem_mem *mem, int flags,
                               llmem_progress_fn progress, void *progress_arg,
                               struct llmem_model **out);
/* NULL is a no-op. */
LLMEM_API void llmem_model_free(struct llmem_model *model);
/* A copy of a loaded model in the memory of a device backend (llmem/backend.h): every matrix and
 * vector allocated from mem (tag weights) and copied through the backend, progress per layer,
 * except the experts of the first experts_on_host MoE layers, which the copy takes from the
 * original where they are (the forward pass runs them on a host backend: llmem_forward_set_host);
 * the original must then outlive the copy, else it can be freed. The copy runs the forward pass
 * on that backend. LLMEM_ENOMEM or the backend's failure (logged); nothing is left allocated on
 * failure.
 * With ranks > 1 (2, 4 or 8; experts_on_host 0) the copy is rank's share of the model split over
 * `ranks` backends (tensor parallelism, llmem_geometry_tensor_rank): its query heads (rows of q,
 * columns of o), its KV heads (rows of k and v), its columns of the MLP and of each expert (rows
 * of gate and up, columns of down), its rows of the vocabulary (embeddings and LM head); norms and
 * routers whole. LLMEM_EINVAL (logged) where the model does not split so, LLMEM_EUNSUPPORTED
 * (logged) where a share's columns would cut a quantized block. */
struct llmem_backend;
LLMEM_API int llmem_model_to_device(const struct llmem_model *model,
                                    const struct llmem_backend *backend, struct llmem_mem *mem,
                                    int64_t experts_on_host, int rank, int ranks,
                                    llmem_progress_fn progress, void *progress_arg,
                                    struct llmem_model **out);
/* The configuration; geom.n_params and geom.weights_bytes are those of the files. */
LLMEM_API const struct llmem_model_config *llmem_model_get_config(const struct llmem_model *model);
/* Ends the logits at n ids (n ≥ the vocabulary: no change): the LM head's first n rows, and
 * geom.vocab_size n. For a checkpoint whose vocabulary is padded past its tokenizer's tokens
 * (Qwen2.5's 151,936 rows for 151,665 tokens), so that an id no token spells is never scored nor
 * drawn; the embeddings keep every row. Before llmem_forward_create. LLMEM_EINVAL (logged) for n
 * < 1 or a share of a split model (its rows are a part of the vocabulary). */
LLMEM_API int llmem_model_limit_vocab(struct llmem_model *model, int64_t n);

#ifdef __cplusplus
}
#endif

#endif
