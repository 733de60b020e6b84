/*
 * llmem/config.h — a model's config.json read into numbers: its geometry (what `llmem plan` hands
 * to the planner) and the full configuration the forward pass runs on (SPEC §2.5, §5).
 *
 * Every function returns an `enum llmem_status`; a failure is logged once (one line naming the
 * file and the field) and leaves the outputs untouched.
 */
#ifndef LLMEM_CONFIG_H
#define LLMEM_CONFIG_H

#include <stdint.h>

#include "llmem/api.h"
#include "llmem/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills *geom from MODEL_DIR/config.json alone (n_params and weights_bytes stay 0). Families:
 * llama, mistral, qwen2, qwen3 (by model_type, else by architectures), also nested under
 * `text_config`. head_dim falls back to hidden_size / num_attention_heads, num_key_value_heads to
 * num_attention_heads; sliding_window counts when use_sliding_window is true, when layer_types has
 * "sliding_attention", or (mistral) whenever it is set; rope_theta / rope_scaling /
 * rope_parameters are checked for type. name is the directory's base name, source the path.
 * LLMEM_ENOENT for a missing directory or config.json, LLMEM_EFORMAT for a missing, mistyped or
 * out-of-range field, LLMEM_EUNSUPPORTED for another architecture. */
LLMEM_API int llmem_model_geometry_load_config(const char *model_dir,
                                               struct llmem_model_geometry *geom);

/* llmem_model_geometry_load_config, then the safetensors headers (llmem_safetensors_load_dir):
 * n_params = Σ elements, weights_bytes = Σ tensor bytes. A checkpoint that has
 * model.embed_tokens.weight but no lm_head.weight is recorded as tied whatever the config says
 * (logged as a warning)..
 *
 * For these functions and llmem_model_config_load, the path may also name a GGUF file (a regular
 * file ending in .gguf, or starting with the GGUF magic): its header alone is read — metadata and
 * tensor infos, never the tensor data — and the geometry and configuration come from its
 * metadata (architectures llama, qwen2, qwen3; the table of keys is in src/model/gguf_config.c),
 * n_params and weights_bytes from its tensors, exactly as stored. */
LLMEM_API int llmem_model_geometry_load(const char *model_dir, struct llmem_model_geometry *geom);
/* The geometry of the model llmem_model_load makes with LLMEM_MODEL_LOAD_DUMMY (llmem/model.h):
 * config.json's, with the parameters of a checkpoint of it (llmem_geometry_param_count) at two
 * bytes each, unquantized. */
LLMEM_API int llmem_model_geometry_load_dummy(const char *model_dir,
                                              struct llmem_model_geometry *geom);

#define LLMEM_MAX_EOS 8

/* One entry of an MLX config's `quantization` object beside group_size and bits: the module at
 * that path (mlx-lm's nn.quantize class_predicate) quantized with its own parameters, or not. */
struct llmem_model_quant_override {
    char module[192]; /* "model.layers.0.mlp.down_proj" */
    int bits;         /* 4 or 8; 0: the entry is false (the module is not quantized) */
    int group_size;   /* 32, 64 or 128 */
};

struct llmem_model_config {
    struct llmem_model_geometry geom;
    double rms_norm_eps; /* 1e-6 when absent */
    char hidden_act[16]; /* "silu" (the only one supported) */
    double rope_theta;   /* 10000 when absent */
    char rope_type[24];  /* "default", "linear", "llama3"; others are refused at load */
    double rope_factor;  /* linear, llama3 */
    double rope_low_freq_factor, rope_high_freq_factor; /* llama3 */
    int64_t rope_original_max_context;                  /* llama3 */
    int rope_freqs;         /* GGUF: the file carries rope_freqs.weight, per-pair divisors of the
                             * inverse frequencies (Llama 3's scaling, precomputed); 0 otherwise */
    int rope_interleaved;   /* GGUF llama: Q/K rows permuted for RoPE on interleaved pairs (ggml's
                             * NORM rope); 0: halves rotated (Hugging Face, Qwen in GGUF) */
    uint8_t *layer_sliding; /* (n_layers) 1 where the layer attends within geom.sliding_window */
    uint8_t *layer_moe;     /* (n_layers) 1 where the layer's MLP is geom.n_experts experts; NULL
                             * for a dense model */
    int moe_norm_topk;      /* the top k experts' probabilities renormalized to sum to 1 */
    int32_t bos_id;         /* config.json's; −1 when absent */
    /* MLX quantization (config.json's `quantization`, mode affine): the default bits (0: the
     * config has none) and group size; a module without an entry is quantized when its `.scales`
     * tensor is in the files, as mlx-lm loads it */
    int quant_bits, quant_group_size;
    struct llmem_model_quant_override *quant_overrides; /* (n_quant_overrides) */
    int n_quant_overrides;
    int32_t eos_ids[LLMEM_MAX_EOS];
    int n_eos;
};

/* Reads MODEL_DIR/config.json as llmem_model_geometry_load_config does, plus the RoPE numbers,
 * rms_norm_eps, hidden_act, bos/eos ids and which layers slide. Free with
 * llmem_model_config_free. */
LLMEM_API int llmem_model_config_load(const char *model_dir, struct llmem_model_config *cfg);
LLMEM_API void llmem_model_config_free(struct llmem_model_config *cfg);

#ifdef __cplusplus
}
#endif

#endif
