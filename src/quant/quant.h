/*
 * quant/quant.h — the block formats of quantized weights: ggml's types as GGUF files number them
 * (ggml/src/ggml-common.h of llama.cpp is where the layouts are written down), their block sizes,
 * and which of them llmem reads.
 *
 * A tensor of type t holds its rows as runs of blocks: `block_elems` values in `block_bytes`
 * bytes each (F32/F16/BF16: one value a block). A row's length must be a multiple of
 * block_elems. Pure data and arithmetic: no allocation, no I/O.
 */
#ifndef LLMEM_QUANT_H
#define LLMEM_QUANT_H

#include <stddef.h>
#include <stdint.h>

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

/* The super-block of the K types: 256 values. */
#define LLMEM_QK_K 256

struct llmem_qtype_info {
    const char *name;    /* ggml's name: "f32", "q4_0", "q4_K", ... */
    int64_t block_elems; /* values a block holds */
    int64_t block_bytes; /* bytes a block takes */
    int readable;        /* 1: llmem reads weights of this type */
};

/* The type's row of the table; NULL for an id that is not a ggml type (a retired or unknown
 * one). */
const struct llmem_qtype_info *llmem_qtype_info(int type);
/* ggml's name of the type, or "unknown". */
const char *llmem_qtype_name(int type);
/* Bytes of n values of type t: n / block_elems × block_bytes. −1 when t is unknown, n is negative
 * or not a multiple of the block, or the product overflows. */
int64_t llmem_qtype_bytes(int type, int64_t n);

#endif
