/*
 * quant/types.c — the table of ggml's block types (quant/quant.h): sizes as ggml-common.h lays
 * the blocks out, the K types in super-blocks of LLMEM_QK_K values.
 */
#include "quant/quant.h"

#define QK LLMEM_QK_K

static const struct llmem_qtype_info table[LLMEM_QTYPE_COUNT] = {
    [LLMEM_QTYPE_F32] = {"f32", 1, 4, 1},
    [LLMEM_QTYPE_F16] = {"f16", 1, 2, 1},
    [LLMEM_QTYPE_Q4_0] = {"q4_0", 32, 2 + 16, 1},
    [LLMEM_QTYPE_Q4_1] = {"q4_1", 32, 2 + 2 + 16, 1},
    [LLMEM_QTYPE_Q5_0] = {"q5_0", 32, 2 + 4 + 16, 1},
    [LLMEM_QTYPE_Q5_1] = {"q5_1", 32, 2 + 2 + 4 + 16, 1},
    [LLMEM_QTYPE_Q8_0] = {"q8_0", 32, 2 + 32, 1},
    [LLMEM_QTYPE_Q8_1] = {"q8_1", 32, 4 + 4 + 32, 0},
    [LLMEM_QTYPE_Q2_K] = {"q2_K", QK, 2 + 2 + QK / 16 + QK / 4, 1},
    [LLMEM_QTYPE_Q3_K] = {"q3_K", QK, 2 + QK / 4 + QK / 8 + 12, 1},
    [LLMEM_QTYPE_Q4_K] = {"q4_K", QK, 2 + 2 + QK / 2 + 12, 1},
    [LLMEM_QTYPE_Q5_K] = {"q5_K", QK, 2 + 2 + QK / 2 + QK / 8 + 12, 1},
    [LLMEM_QTYPE_Q6_K] = {"q6_K", QK, 2 + QK / 2 + QK / 4 + QK / 16, 1},
    [LLMEM_QTYPE_Q8_K] = {"q8_K", QK, 4 + QK + QK / 8, 0},
    [LLMEM_QTYPE_IQ2_XXS] = {"iq2_xxs", QK, 2 + QK / 4, 0},
    [LLMEM_QTYPE_IQ2_XS] = {"iq2_xs", QK, 2 + QK / 4 + QK / 32, 0},
    [LLMEM_QTYPE_IQ3_XXS] = {"iq3_xxs", QK, 2 + QK / 4 + QK / 8, 0},
    [LLMEM_QTYPE_IQ1_S] = {"iq1_s", QK, 2 + QK / 8 + QK / 16, 0},
    [LLMEM_QTYPE_IQ4_NL] = {"iq4_nl", 32, 2 + 16, 0},
    [LLMEM_QTYPE_IQ3_S] = {"iq3_s", QK, 2 + QK / 4 + QK / 8 + QK / 32 + 4, 0},
    [LLMEM_QTYPE_IQ2_S] = {"iq2_s", QK, 2 + QK / 4 + QK / 16, 0},
    [LLMEM_QTYPE_IQ4_XS] = {"iq4_xs", QK, 2 + 2 + QK / 2 + QK / 64, 0},
    [LLMEM_QTYPE_I8] = {"i8", 1, 1, 0},
    [LLMEM_QTYPE_I16] = {"i16", 1, 2, 0},
    [LLMEM_QTYPE_I32] = {"i32", 1, 4, 0},
    [LLMEM_QTYPE_I64] = {"i64", 1, 8, 0},
    [LLMEM_QTYPE_F64] = {"f64", 1, 8, 0},
    [LLMEM_QTYPE_IQ1_M] = {"iq1_m", QK, QK / 8 + QK / 16 + QK / 32, 0},
    [LLMEM_QTYPE_BF16] = {"bf16", 1, 2, 1},
    [LLMEM_QTYPE_TQ1_0] = {"tq1_0", QK, 2 + 4 * 13, 0},
    [LLMEM_QTYPE_TQ2_0] = {"tq2_0", QK, 2 + 64, 0},
    [LLMEM_QTYPE_MXFP4] = {"mxfp4", 32, 1 + 16, 0},
};

/* MLX's affine types: index ((bits == 8) · 3 + group index) · 3 + scale index. */
#define MLX(b, g, s)                                                                               \
    { "mlx_q" #b "_g" #g "_" #s, (g), (g) * (b) / 8, 1 }
static const struct llmem_qtype_info mlx_table[LLMEM_QTYPE_MLX_COUNT] = {
    MLX(4, 32, f32),  MLX(4, 32, f16),  MLX(4, 32, bf16),  MLX(4, 64, f32),   MLX(4, 64, f16),
    MLX(4, 64, bf16), MLX(4, 128, f32), MLX(4, 128, f16),  MLX(4, 128, bf16), MLX(8, 32, f32),
    MLX(8, 32, f16),  MLX(8, 32, bf16), MLX(8, 64, f32),   MLX(8, 64, f16),   MLX(8, 64, bf16),
    MLX(8, 128, f32), MLX(8, 128, f16), MLX(8, 128, bf16),
};
#undef MLX

int llmem_qtype_mlx(int bits, int group_size, int scale_type) {
    int b = bits == 4 ? 0 : bits == 8 ? 1 : -1;
    int g = group_size == 32 ? 0 : group_size == 64 ? 1 : group_size == 128 ? 2 : -1;
    int s = scale_type == LLMEM_QTYPE_F32    ? 0
            : scale_type == LLMEM_QTYPE_F16  ? 1
            : scale_type == LLMEM_QTYPE_BF16 ? 2
                                             : -1;
    if (b < 0 || g < 0 || s < 0)
        return -1;
    return LLMEM_QTYPE_MLX_FIRST + (b * 3 + g) * 3 + s;
}

int llmem_qtype_mlx_params(int type, int *bits, int *group_size, int *scale_type) {
    if (type < LLMEM_QTYPE_MLX_FIRST || type >= LLMEM_QTYPE_MLX_FIRST + LLMEM_QTYPE_MLX_COUNT)
        return 0;
    int i = type - LLMEM_QTYPE_MLX_FIRST;
    static const int scale[3] = {LLMEM_QTYPE_F32, LLMEM_QTYPE_F16, LLMEM_QTYPE_BF16};
    if (bits != NULL)
        *bits = i / 9 == 0 ? 4 : 8;
    if (group_size != NULL)
        *group_size = 32 << (i / 3 % 3);
    if (scale_type != NULL)
        *scale_type = scale[i % 3];
    return 1;
}

const struct llmem_qtype_info *llmem_qtype_info(int type) {
    if (llmem_qtype_mlx_params(type, NULL, NULL, NULL))
        return &mlx_table[type - LLMEM_QTYPE_MLX_FIRST];
    if (type < 0 || type >= LLMEM_QTYPE_COUNT || table[type].name == NULL)
        return NULL;
    return &table[type];
}

const char *llmem_qtype_name(int type) {
    const struct llmem_qtype_info *t = llmem_qtype_info(type);
    return t != NULL ? t->name : "unknown";
}

int64_t llmem_qtype_bytes(int type, int64_t n) {
    const struct llmem_qtype_info *t = llmem_qtype_info(type);
    if (t == NULL || n < 0 || n % t->block_elems != 0)
        return -1;
    int64_t blocks = n / t->block_elems;
    if (blocks > INT64_MAX / t->block_bytes)
        return -1;
    return blocks * t->block_bytes;
}
