/*
 * plan/kv_format.c — the KV storage formats and their exact byte ratios (SPEC §2.1, §4.4).
 *
 * A format is described by the bytes one group of 32 key elements and one group of 32 value
 * elements take; the ratio against f16 (64 + 64 bytes per pair of groups) is exact whenever
 * head_dim is a multiple of 32, which every supported model satisfies.
 */
#include <stdint.h>
#include <strings.h>

#include "core/log.h"
#include "llmem/plan.h"

static const struct llmem_kv_format_info formats[LLMEM_KV_FORMAT_COUNT] = {
    [LLMEM_KV_FORMAT_F16] = {"f16", 64, 64},
    [LLMEM_KV_FORMAT_BF16] = {"bf16", 64, 64},
    [LLMEM_KV_FORMAT_F32] = {"f32", 128, 128},
    [LLMEM_KV_FORMAT_Q8] = {"q8", 34, 34}, /* 32 int8 codes + f16 scale */
    [LLMEM_KV_FORMAT_Q4] = {"q4", 20, 20}, /* 16 bytes of nibbles + f16 scale + f16 min */
    [LLMEM_KV_FORMAT_TQ] = {"tq", 36, 14}, /* K: int8 + f16 scale + zero; V: 12 B 3-bit + f16 */
};

/* f16 bytes of one key group plus one value group: the denominator of every ratio. */
#define F16_PAIR_BYTES 128

const struct llmem_kv_format_info *llmem_kv_format_info(enum llmem_kv_format format) {
    if ((unsigned)format >= LLMEM_KV_FORMAT_COUNT)
        return NULL;
    return &formats[format];
}

const char *llmem_kv_format_name(enum llmem_kv_format format) {
    const struct llmem_kv_format_info *info = llmem_kv_format_info(format);
    return info != NULL ? info->name : "unknown";
}

int llmem_kv_format_parse(const char *name, enum llmem_kv_format *format) {
    for (int i = 0; i < LLMEM_KV_FORMAT_COUNT; i++) {
        if (name != NULL && strcasecmp(name, formats[i].name) == 0) {
            *format = (enum llmem_kv_format)i;
            return LLMEM_OK;
        }
    }
    LLMEM_ERROR("unknown KV format '%s' (formats: f16, bf16, f32, q8, q4, tq)",
                name != NULL ? name : "");
    return LLMEM_EINVAL;
}

int64_t llmem_kv_bytes_per_token_effective(int64_t kv_bytes_per_token,
                                           enum llmem_kv_format format) {
    const struct llmem_kv_format_info *info = llmem_kv_format_info(format);
    if (info == NULL || kv_bytes_per_token <= 0)
        return 0;
    __int128 num = (__int128)kv_bytes_per_token * (info->key_group_bytes + info->value_group_bytes);
    __int128 q = (num + F16_PAIR_BYTES - 1) / F16_PAIR_BYTES; /* round up: never under-plan */
    return q > INT64_MAX ? INT64_MAX : (int64_t)q;
}
