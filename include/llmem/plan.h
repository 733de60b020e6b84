/*
 * llmem/plan.h — the memory plan: pure arithmetic over a machine and a model (SPEC §2, §3.1).
 *
 * Given how much memory there is and what a model needs, the plan says, before anything is
 * loaded, what is committed (weights, the KV reserve of one full window, runtime transients),
 * what is reclaimable cache (the session bank), how much context fits, and the three limits of
 * the engine: the allocation limit, the trip (soft valve on resident memory) and the ceiling.
 *
 * Everything here is signed 64-bit integer arithmetic (doubles only for the util fraction and
 * the util band): no allocation, no I/O, no backend calls; every function is deterministic and
 * tested with integers alone. Reading a model directory into a geometry is model/'s job, probing
 * the machine is sys/'s.
 */
#ifndef LLMEM_PLAN_H
#define LLMEM_PLAN_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLMEM_GIB ((int64_t)1 << 30)
#define LLMEM_MIB ((int64_t)1 << 20)

/* ---------------------------------------------------------------------------------------------
 * KV storage formats (SPEC §4.4) and their exact byte ratios
 * ------------------------------------------------------------------------------------------- */

enum llmem_kv_format {
    LLMEM_KV_FORMAT_F16 = 0, /* the default */
    LLMEM_KV_FORMAT_BF16,
    LLMEM_KV_FORMAT_F32,
    LLMEM_KV_FORMAT_Q8,
    LLMEM_KV_FORMAT_Q4,
    LLMEM_KV_FORMAT_TQ,
    LLMEM_KV_FORMAT_COUNT
};

/* Bytes that one group of 32 key elements and one group of 32 value elements take in a format:
 *   f32 128 + 128, f16/bf16 64 + 64, q8 34 + 34 (int8 + f16 scale), q4 20 + 20 (4-bit + f16 scale
 *   + f16 min), tq 36 + 14 (keys 8-bit + f16 scale + f16 zero; values 3-bit + f16 scale).
 * This table is the source of truth that kv/ codecs are tested against. */
struct llmem_kv_format_info {
    const char *name;          /* "f16", "q8", ... */
    int64_t key_group_bytes;   /* per 32 key elements */
    int64_t value_group_bytes; /* per 32 value elements */
};
LLMEM_API const struct llmem_kv_format_info *llmem_kv_format_info(enum llmem_kv_format format);
LLMEM_API const char *llmem_kv_format_name(enum llmem_kv_format format);
/* "f16" → LLMEM_KV_FORMAT_F16 ...; LLMEM_EINVAL (logged, listing the names) when unknown. */
LLMEM_API int llmem_kv_format_parse(const char *name, enum llmem_kv_format *format);
/* kv_bytes_per_token (at 2 bytes per element) scaled to the format:
 * kv × (key_group + value_group) / 128, exact when head_dim is a multiple of 32, else rounded up.
 * At 65,536: f32 131,072, f16/bf16 65,536, q8 34,816, q4 20,480, tq 25,600. */
LLMEM_API int64_t llmem_kv_bytes_per_token_effective(int64_t kv_bytes_per_token,
                                                     enum llmem_kv_format format);

/* ---------------------------------------------------------------------------------------------
 * Model geometry (filled by model/ from config.json + safetensors headers, or by the catalog)
 * ------------------------------------------------------------------------------------------- */

struct llmem_model_geometry {
    char name[128];   /* catalog name or model directory name */
    char arch[32];    /* "llama", "mistral", "qwen2", "qwen3" */
    char source[96];  /* where the numbers come from (Hugging Face id or a path) */
    int64_t n_layers; /* num_hidden_layers */
    int64_t hidden_size;
    int64_t n_heads;    /* num_attention_heads */
    int64_t n_kv_heads; /* num_key_value_heads */
    int64_t head_dim;
    int64_t intermediate_size;
    int64_t vocab_size;
    int64_t max_context;    /* max_position_embeddings */
    int64_t sliding_window; /* tokens; 0 when every layer attends to the full context */
    int tied_embeddings;    /* lm_head shares the embedding matrix */
    int attention_bias;     /* q/k/v projections have a bias (Qwen2) */
    int qk_norm;            /* per-head RMSNorm of q and k (Qwen3) */
    int64_t n_params;       /* parameters as stored */
    int64_t weights_bytes;  /* bytes of all tensors as stored */
    int quantized;          /* matrices stored in quantized blocks (GGUF block types, MLX groups) */
    /* Mixture of experts (0 experts: every layer's MLP is dense). n_moe_layers of the layers hold
     * n_experts SwiGLU MLPs of expert_intermediate columns and a router (n_experts × hidden); a
     * token runs the n_experts_used its router picks. The other layers' MLP is dense
     * (intermediate_size). */
    int64_t n_experts;
    int64_t n_experts_used;
    int64_t expert_intermediate;
    int64_t n_moe_layers;
    int64_t expert_bytes; /* bytes of all experts' matrices as stored; 0: priced from the rest */
};

/* Σ over attention layers of 2 (K and V) × n_kv_heads × head_dim × 2 bytes. */
LLMEM_API int64_t llmem_geometry_kv_bytes_per_token(const struct llmem_model_geometry *g);
/* Parameters of a dense Llama-family decoder with this geometry: embeddings, per layer the q/k/v/o
 * projections (+ biases with attention_bias, + 2 × head_dim with qk_norm), the SwiGLU MLP and two
 * RMSNorms, the final norm, and lm_head unless tied. */
LLMEM_API int64_t llmem_geometry_param_count(const struct llmem_model_geometry *g);
/* The parameters a token reads: llmem_geometry_param_count with only n_experts_used experts per
 * MoE layer (the router counts whole); the embeddings count whole too. */
LLMEM_API int64_t llmem_geometry_active_param_count(const struct llmem_model_geometry *g);
/* The bytes of all experts' matrices (expert_bytes, or priced from weights_bytes by parameters);
 * 0 for a dense model. */
LLMEM_API int64_t llmem_geometry_expert_bytes(const struct llmem_model_geometry *g);
/* The bytes of weights a decode step reads: weights_bytes less the experts a token does not run,
 * expert_bytes × (n_experts − n_experts_used) / n_experts (expert_bytes 0: the experts' share of
 * weights_bytes by parameters). weights_bytes for a dense model. */
LLMEM_API int64_t llmem_geometry_active_bytes(const struct llmem_model_geometry *g);
/* The engine's scratch need for its largest step, f32 activations (SPEC §2.2 computed_workspace),
 * T = max_batch_tokens, S = max_sequences, exactly the buffers the engine allocates:
 *   4 × [ T × (2·hidden + 3·n_heads·head_dim + 2·n_kv_heads·head_dim + 2·intermediate + 2)
 *         + LLMEM_ATTN_PARTITION_ROWS × n_heads × (head_dim + 2)  +  S × vocab ]
 * (residual and block input/output; q, its attention output and attention's scaled copy of it;
 * k, v; gate and up; positions; the partial states of partitioned attention, whose queries the
 * engine batches so that queries × partitions stays within LLMEM_ATTN_PARTITION_ROWS; one logits
 * row per sequence). */
#define LLMEM_ATTN_PARTITION_ROWS 512
LLMEM_API int64_t llmem_geometry_workspace_bytes(const struct llmem_model_geometry *g,
                                                 int64_t max_batch_tokens, int64_t max_sequences);

/* The geometry one device holds when tensor parallelism spreads the model over n of them (1, 2,
 * 4 or 8): the query heads, the MLP's and the experts' columns and the vocabulary (embeddings and
 * LM head) split n ways, the KV heads too (one on each device, n / n_kv_heads devices holding the
 * same one, when n exceeds them), norms and routers whole; weights_bytes and n_params the
 * device's share by parameters. LLMEM_EINVAL with the reason in why (not logged) when the model
 * does not split over n. */
LLMEM_API int llmem_geometry_tensor_rank(const struct llmem_model_geometry *g, int n,
                                         struct llmem_model_geometry *rank, char *why,
                                         size_t why_size);

/* The built-in catalog of popular architectures (numbers as published in their configs). */
LLMEM_API size_t llmem_catalog_count(void);
LLMEM_API const struct llmem_model_geometry *llmem_catalog_get(size_t index);
/* Case-insensitive lookup by name; NULL when unknown (not logged). */
LLMEM_API const struct llmem_model_geometry *llmem_catalog_find(const char *name);

/* ---------------------------------------------------------------------------------------------
 * The plan
 * ------------------------------------------------------------------------------------------- */

enum llmem_plan_target { LLMEM_PLAN_HOST = 0, LLMEM_PLAN_CUDA };

enum llmem_usable_source {
    LLMEM_USABLE_FORMULA = 0, /* the 75 % rule */
    LLMEM_USABLE_BUDGET,      /* the 75 % rule applied to --budget */
    LLMEM_USABLE_UTIL,        /* --util × ceiling */
    LLMEM_USABLE_MEMORY_LIMIT /* --memory-limit */
};
LLMEM_API const char *llmem_usable_source_name(enum llmem_usable_source source);

struct llmem_plan_params {
    enum llmem_plan_target target;
    int64_t total_bytes;        /* required: min(RAM, cgroup limit), or device memory */
    int64_t ceiling_bytes;      /* 0: equals total */
    int64_t weights_bytes;      /* required */
    int64_t kv_bytes_per_token; /* required: at 2 bytes per element */
    enum llmem_kv_format kv_format;
    int64_t aux_bytes_per_token;
    int64_t prefill_transient_bytes_per_token;
    int64_t model_max_context;        /* 0: the model sets no limit */
    int64_t requested_context;        /* 0: the plan picks the fit */
    int64_t memory_budget_bytes;      /* 0: none (--budget) */
    int64_t memory_limit_bytes;       /* 0: none (--memory-limit) */
    double util;                      /* 0: none (--util), else in (0, 1] */
    int64_t max_sequences;            /* 0: 1 */
    int64_t max_batch_tokens;         /* 0: 512 */
    int64_t computed_workspace_bytes; /* from llmem_geometry_workspace_bytes; 0 without geometry */
    /* what the process holds outside the allocator (code, libraries, tokenizer, thread stacks,
     * parse and HTTP buffers), measured at start (llmem_engine_runtime_baseline); 0: none */
    int64_t runtime_baseline_bytes;
};

/* The verdict of a plan whose model does not fit (its describe line, its note, llmem plan). */
#define LLMEM_PLAN_NO_FIT    "MODEL DOES NOT FIT"
#define LLMEM_PLAN_MAX_NOTES 12
#define LLMEM_PLAN_NOTE_MAX  400

struct llmem_plan {
    int available;
    const char *unavailable_reason; /* static string; "" when available */
    enum llmem_plan_target target;

    /* envelope (§2.2 step 1) */
    int64_t total_bytes;
    int64_t ceiling_bytes;
    int64_t budget_bytes;   /* 0 when none */
    int64_t planning_bytes; /* min(total, ceiling, budget) */
    int64_t usable_bytes;   /* the engine budget */
    enum llmem_usable_source usable_source;

    /* commitments and caches (steps 2–3) */
    int64_t weights_bytes;
    int64_t kv_bytes_per_token;
    int64_t kv_bytes_per_token_effective;
    enum llmem_kv_format kv_format;
    int64_t aux_bytes_per_token;
    int64_t prefill_transient_bytes_per_token;
    int64_t per_token_bytes; /* kv_eff + aux + prefill_transient */
    int64_t computed_workspace_bytes;
    int64_t runtime_transients_bytes;
    int64_t runtime_baseline_bytes; /* committed outside the allocator */
    int64_t bank_floor_bytes;
    int64_t bank_cap_bytes;

    /* context (steps 4–5) */
    int64_t kv_budget_bytes;
    int64_t context_raw;             /* kv_budget / per_token */
    int64_t model_max_context;       /* 0: none */
    int64_t requested_context;       /* 0: none */
    int64_t context_window_fit;      /* what the machine fits, capped at the model's maximum */
    int64_t context_window_resolved; /* the window the engine runs with */
    int model_fits;
    int machine_bound; /* the machine, not the model, limits the window */
    int overcommitted; /* an explicit context above the machine fit */
    int64_t kv_reserve_bytes;
    int64_t pool_tokens;
    int64_t max_full_window_sequences;
    int64_t max_sequences;
    int64_t max_batch_tokens;

    /* bank (step 6) */
    int64_t bank_idle_max_bytes;
    int64_t bank_steady_bytes;
    int64_t headroom_bytes;

    /* limits and the util band (§3.1); with a budget, "ceiling" and "total" below mean
     * min(ceiling, budget) and min(total, budget): the budget simulates a smaller machine */
    double util;                    /* the applied fraction: usable / ceiling */
    double util_requested;          /* --util as given; 0 when none */
    int64_t allocation_limit_bytes; /* the process's: util × ceiling */
    int64_t allocator_limit_bytes;  /* the allocator's share: allocation limit − baseline */
    int64_t trip_bytes;
    int64_t footprint_bytes; /* weights + baseline + transients + kv_reserve + bank_floor */
    double band_low;         /* footprint / ceiling */
    double band_high;        /* ceiling / total − 0.05 */
    int band_empty;
    int util_in_band;
    int trip_above_ceiling;

    int n_notes;
    char notes[LLMEM_PLAN_MAX_NOTES][LLMEM_PLAN_NOTE_MAX];
    int verdict_note; /* the note that says why the model does not fit, or −1 */
};

/* Where a mixture's experts live when the model runs on a device (SPEC §2.2, "experts"): the
 * dense part and the experts of all MoE layers but the first host_layers on the device; the
 * experts of the first host_layers MoE layers stay in host memory, and a step computes those
 * layers' experts on the CPU. Each layer on the host takes its experts' bytes off the device's
 * weights and adds a round trip of the layer's activations to a step. */
struct llmem_expert_placement {
    int64_t moe_layers;           /* the model's MoE layers; 0: nothing to place */
    int64_t host_layers;          /* of them, those whose experts stay on the host */
    int forced;                   /* host_layers as asked (--experts-on-host), not chosen */
    int64_t layer_bytes;          /* one MoE layer's experts, all of them */
    int64_t device_weights_bytes; /* what the device holds: weights − host_layers × layer_bytes */
    int64_t host_bytes;           /* host_layers × layer_bytes */
    int64_t device_read_bytes;    /* a decode token's weight reads on the device */
    int64_t host_read_bytes;      /* … and on the host: its experts in the host layers */
};

/* Places g's experts for params (weights_bytes all of g's): experts_on_host < 0 chooses the
 * fewest host layers with which the plan fits (a decode token reads the host's memory more slowly
 * than the device's, so fewer is faster; every layer when none fits, and the plan says so), else
 * takes experts_on_host (at most the MoE layers). params->weights_bytes becomes the device's share.
 * A host plan, or a dense model: nothing moves (moe_layers 0 for a dense model). LLMEM_EINVAL
 * (logged) as llmem_plan_compute. */
LLMEM_API int llmem_plan_place_experts(struct llmem_plan_params *params,
                                       const struct llmem_model_geometry *g,
                                       int64_t experts_on_host,
                                       struct llmem_expert_placement *out);

/* One line for a placement with MoE layers (into buf, always NUL-terminated; returns buf): where
 * the experts are and what a decode token reads on each side. */
LLMEM_API char *llmem_plan_describe_experts(const struct llmem_expert_placement *placement,
                                            char *buf, size_t buf_size);

/* Computes the plan. Returns LLMEM_OK also for an unavailable plan (plan->available == 0 with
 * its reason); LLMEM_EINVAL (logged) for parameters that are out of their domain (negative
 * sizes or contexts, util outside (0, 1], an unknown format). */
LLMEM_API int llmem_plan_compute(const struct llmem_plan_params *params, struct llmem_plan *plan);

/* The one-line summary of §2.3 into buf (always NUL-terminated); returns buf. */
LLMEM_API char *llmem_plan_describe(const struct llmem_plan *plan, char *buf, size_t buf_size);

/* The bank's byte budget at a live KV working set (§2.3):
 * max(bank_floor, min(bank_idle_max, usable − weights − baseline − max(transients,
 *                                    observed_reserve) − max(0, working_set)));
 * bank_cap for an unavailable plan. */
LLMEM_API int64_t llmem_plan_bank_dynamic_ceiling(const struct llmem_plan *plan,
                                                  int64_t working_set_bytes,
                                                  int64_t observed_reserve_bytes);

/* The effective ceiling of the limits (§3.1): min(ceiling, budget) with a budget. */
LLMEM_API int64_t llmem_plan_limits_ceiling(const struct llmem_plan *plan);

/* Checks the invariant footprint < allocation limit < trip < ceiling (§3.1). Returns 0 when it
 * holds; otherwise a bit set of the inequalities that break (LLMEM_PLAN_BREAKS_*) and, in buf,
 * each broken one with its numbers, e.g. "trip 24.7G < ceiling 23.5G does not hold". An
 * unavailable plan holds trivially. */
enum {
    LLMEM_PLAN_BREAKS_FOOTPRINT = 1, /* footprint < allocation limit */
    LLMEM_PLAN_BREAKS_LIMIT = 2,     /* allocation limit < trip */
    LLMEM_PLAN_BREAKS_TRIP = 4,      /* trip < ceiling */
};
LLMEM_API int llmem_plan_limits_check(const struct llmem_plan *plan, char *buf, size_t buf_size);

/* The transient reserve from observed allocator numbers (§2.3), play = usable − weights:
 * max(floor, min(min(16 GiB, max(floor, play / 2)), max(0, peak − active))). */
LLMEM_API int64_t llmem_plan_transient_reserve(int64_t peak, int64_t active, int64_t play,
                                               int64_t floor);

/* The plan as one JSON object (every field above, notes as an array, describe as a string),
 * malloc'ed; free with free(). NULL on out of memory (logged). */
LLMEM_API char *llmem_plan_to_json(const struct llmem_plan *plan, int pretty);

#ifdef __cplusplus
}
#endif

#endif
