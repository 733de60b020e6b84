/*
 * quant/quant.h — the block formats of quantized weights: ggml's types as GGUF files number them
 * (ggml/src/ggml-common.h of llama.cpp is where the layouts are written down), their block sizes,
 * and which of them llmem reads.
 *
 * A tensor of type t holds its rows as runs of blocks: `block_elems` values in `block_bytes`
 * bytes each (F32/F16/BF16: one value a block). A row's length must be a multiple of
 * block_elems. Pure data and arithmetic: no allocation, no I/O.
 *
 * The scalar reference of every type llmem reads (dequant.c, quantize.c): rows to f32 and back,
 * bit-exact with ggml's C reference (ggml/src/ggml-quants.c and the scalar conversions of
 * ggml-impl.h), tested against ggml's own output in tests/data/quant. The f16 and bf16 conversions
 * here are ggml's. kv/codec.c and backend/cpu/ have their own (they were there first, in layers
 * above this one, so they could call these instead): they agree with these on every value but
 * NaNs — checked over all 2^32 floats and all 2^16 halves — kv/codec.c's f32 → f16 keeping a
 * NaN's payload where ggml writes 0x7e00, backend/cpu's f16 → f32 leaving a signalling NaN
 * signalling where ggml's makes it quiet.
 */
#ifndef LLMEM_QUANT_H
#define LLMEM_QUANT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ggml's type ids (the numbers in a GGUF tensor info). Gaps are ids ggml has retired. */
enum llmem_qtype {
    LLMEM_QTYPE_F32 = 0,
    LLMEM_QTYPE_F16 = 1,
    LLMEM_QTYPE_Q4_0 = 2,
    LLMEM_QTYPE_Q4_1 = 3,
    LLMEM_QTYPE_Q5_0 = 6,
    LLMEM_QTYPE_Q5_1 = 7,
    LLMEM_QTYPE_Q8_0 = 8,
    LLMEM_QTYPE_Q8_1 = 9,
    LLMEM_QTYPE_Q2_K = 10,
    LLMEM_QTYPE_Q3_K = 11,
    LLMEM_QTYPE_Q4_K = 12,
    LLMEM_QTYPE_Q5_K = 13,
    LLMEM_QTYPE_Q6_K = 14,
    LLMEM_QTYPE_Q8_K = 15,
    LLMEM_QTYPE_IQ2_XXS = 16,
    LLMEM_QTYPE_IQ2_XS = 17,
    LLMEM_QTYPE_IQ3_XXS = 18,
    LLMEM_QTYPE_IQ1_S = 19,
    LLMEM_QTYPE_IQ4_NL = 20,
    LLMEM_QTYPE_IQ3_S = 21,
    LLMEM_QTYPE_IQ2_S = 22,
    LLMEM_QTYPE_IQ4_XS = 23,
    LLMEM_QTYPE_I8 = 24,
    LLMEM_QTYPE_I16 = 25,
    LLMEM_QTYPE_I32 = 26,
    LLMEM_QTYPE_I64 = 27,
    LLMEM_QTYPE_F64 = 28,
    LLMEM_QTYPE_IQ1_M = 29,
    LLMEM_QTYPE_BF16 = 30,
    LLMEM_QTYPE_TQ1_0 = 34,
    LLMEM_QTYPE_TQ2_0 = 35,
    LLMEM_QTYPE_MXFP4 = 39,
    LLMEM_QTYPE_COUNT = 40 /* one past the largest id this table knows */
};

/* MLX's affine formats (mlx-lm's `convert -q`): not ggml types, so their ids lie above every ggml
 * id, from LLMEM_QTYPE_MLX_FIRST: one id for each bits (4, 8) × group size (32, 64, 128) × dtype
 * of the scales and biases (LLMEM_QTYPE_F32, _F16, _BF16). A matrix [rows, cols] of such a type
 * is three tensors: its codes, cols × bits / 32 little-endian uint32 words a row, value k of a
 * word in bits [k·bits, (k+1)·bits); and the scales and biases, [rows, cols / group] each. The
 * codes' row is what llmem_qtype_bytes counts (a "block" is one group's codes: group × bits / 8
 * bytes); the scales and biases travel beside it (llmem_quant_dequantize_mlx_row). */
#define LLMEM_QTYPE_MLX_FIRST 1024
#define LLMEM_QTYPE_MLX_COUNT 18

/* The MLX type of these parameters (scale_type: LLMEM_QTYPE_F32, _F16 or _BF16), or −1 when MLX
 * has no such affine format llmem reads (bits other than 4 and 8, a group other than 32, 64 and
 * 128). */
int llmem_qtype_mlx(int bits, int group_size, int scale_type);
/* 1 and the parameters when type is an MLX type (any pointer may be NULL); else 0. */
int llmem_qtype_mlx_params(int type, int *bits, int *group_size, int *scale_type);

/* The super-block of the K types: 256 values. */
#define LLMEM_QK_K 256

struct llmem_qtype_info {
    const char *name;    /* ggml's name: "f32", "q4_0", "q4_K", ... */
    int64_t block_elems; /* values a block holds */
    int64_t block_bytes; /* bytes a block takes */
    int readable;        /* 1: llmem reads weights of this type */
};

/* The type's row of the table; NULL for an id that is neither a ggml type (a retired or unknown
 * one) nor an MLX type (a GGUF reader checks the id is below LLMEM_QTYPE_COUNT). */
const struct llmem_qtype_info *llmem_qtype_info(int type);
/* ggml's name of the type, or "unknown". */
const char *llmem_qtype_name(int type);
/* Bytes of n values of type t: n / block_elems × block_bytes. −1 when t is unknown, n is negative
 * or not a multiple of the block, or the product overflows. */
int64_t llmem_qtype_bytes(int type, int64_t n);

/* ---- conversions (ggml-impl.h's scalar ones, bit for bit) ----------------------------------- */

/* f16 → f32, exact (ggml_compute_fp16_to_fp32: a signalling NaN comes back quiet). */
float llmem_quant_f16_to_f32(uint16_t h);
/* f32 → f16, to nearest even; overflow to infinity, any NaN to 0x7e00 with its sign
 * (ggml_compute_fp32_to_fp16, the GGML_FP32_TO_FP16 of ggml's quantizers). */
uint16_t llmem_quant_f32_to_f16(float x);
/* bf16 → f32, exact. */
float llmem_quant_bf16_to_f32(uint16_t b);
/* f32 → bf16, to nearest even; a NaN keeps its top bits and is made quiet
 * (ggml_compute_fp32_to_bf16). */
uint16_t llmem_quant_f32_to_bf16(float x);

/* ---- rows ---------------------------------------------------------------------------------- */

/* n values of type `type` at src (n / block_elems blocks, any alignment) into dst[n] as f32.
 * Every readable type: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * bit-exact with ggml's dequantize_row_* (and GGML_FP16_TO_FP32 / GGML_BF16_TO_FP32; F32 is a
 * copy). LLMEM_EUNSUPPORTED for a type llmem does not read (Q8_K, the IQ types, ...), LLMEM_EINVAL
 * for an unknown id or n negative or not a multiple of the block. Not logged: the caller names
 * the tensor (llmem_qtype_name names the type). */
int llmem_quant_dequantize_row(int type, const void *src, float *dst, int64_t n);

/* n values of an MLX type (n / group groups): codes at `codes` (n × bits / 32 uint32 words, any
 * alignment), the groups' scales and biases at `scales` and `biases` (n / group values each, of
 * the type's scale dtype), into dst[n] as MLX's mx.dequantize computes them on the CPU
 * (mlx/fast.cpp affine_dequantize: `multiply(w, scales)` then `add(…, biases)`, two operations of
 * the scales' dtype, each computed in f32 and rounded to that dtype): v = R(R(q · scale) + bias), R
 * the rounding to nearest even of the scale dtype (none for f32), no fused multiply-add.
 * LLMEM_EINVAL when type is not an MLX type or n is negative or not a multiple of the group. Not
 * logged. */
int llmem_quant_dequantize_mlx_row(int type, const void *codes, const void *scales,
                                   const void *biases, float *dst, int64_t n);

/* n f32 values at src into n / block_elems blocks of type `type` at dst (any alignment), as ggml's
 * reference quantizers write them, byte for byte:
 *   Q4_0 Q4_1 Q5_0 Q5_1 Q8_0   quantize_row_*_ref (what llama-quantize writes for them)
 *   Q2_K Q3_K Q4_K Q5_K Q6_K   quantize_row_*_ref, the form without an importance matrix (what
 *                              llama-quantize writes for them without --imatrix)
 *   Q8_K                       quantize_row_q8_K_ref (activations for the K-type dot products)
 *   F16 BF16 F32               GGML_FP32_TO_FP16, GGML_FP32_TO_BF16, a copy
 * Block by block, so a row quantized in pieces of whole blocks gives the same bytes. Inputs that
 * overflow a scale or make ggml convert an infinite or NaN float to an integer (all-denormal
 * blocks, NaNs) give the bytes ggml gives on x86-64. Same errors as llmem_quant_dequantize_row
 * (LLMEM_EUNSUPPORTED also for a type it cannot write); not logged. */
int llmem_quant_quantize_row(int type, const float *src, void *dst, int64_t n);

#ifdef __cplusplus
}
#endif

#endif
