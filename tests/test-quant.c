/*
 * tests/test-quant.c — the block formats of quantized weights: the table of ggml's types against
 * the sizes gguf-py's GGML_QUANT_SIZES gives, and the byte arithmetic of rows.
 */
#include <stdint.h>

#include "quant/quant.h"
#include "testutil.h"

static void test_table(void **state) {
    (void)state;
    /* (type, values a block, bytes a block) as gguf-py's constants.py lists them */
    const int64_t want[][3] = {
        {LLMEM_QTYPE_F32, 1, 4},      {LLMEM_QTYPE_F16, 1, 2},        {LLMEM_QTYPE_BF16, 1, 2},
        {LLMEM_QTYPE_Q4_0, 32, 18},   {LLMEM_QTYPE_Q4_1, 32, 20},     {LLMEM_QTYPE_Q5_0, 32, 22},
        {LLMEM_QTYPE_Q5_1, 32, 24},   {LLMEM_QTYPE_Q8_0, 32, 34},     {LLMEM_QTYPE_Q8_1, 32, 40},
        {LLMEM_QTYPE_Q2_K, 256, 84},  {LLMEM_QTYPE_Q3_K, 256, 110},   {LLMEM_QTYPE_Q4_K, 256, 144},
        {LLMEM_QTYPE_Q5_K, 256, 176}, {LLMEM_QTYPE_Q6_K, 256, 210},   {LLMEM_QTYPE_Q8_K, 256, 292},
        {LLMEM_QTYPE_IQ4_NL, 32, 18}, {LLMEM_QTYPE_IQ4_XS, 256, 136}, {LLMEM_QTYPE_MXFP4, 32, 17},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        const struct llmem_qtype_info *t = llmem_qtype_info((int)want[i][0]);
        assert_non_null(t);
        assert_int_equal(t->block_elems, want[i][1]);
        assert_int_equal(t->block_bytes, want[i][2]);
    }
    /* what llmem reads: the float types, the legacy ones and the K types */
    const int readable[] = {LLMEM_QTYPE_F32,  LLMEM_QTYPE_F16,  LLMEM_QTYPE_BF16, LLMEM_QTYPE_Q8_0,
                            LLMEM_QTYPE_Q4_0, LLMEM_QTYPE_Q4_1, LLMEM_QTYPE_Q5_0, LLMEM_QTYPE_Q5_1,
                            LLMEM_QTYPE_Q2_K, LLMEM_QTYPE_Q3_K, LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q5_K,
                            LLMEM_QTYPE_Q6_K};
    int n = 0;
    for (int t = 0; t < LLMEM_QTYPE_COUNT; t++)
        n += llmem_qtype_info(t) != NULL && llmem_qtype_info(t)->readable;
    assert_int_equal(n, (int)(sizeof(readable) / sizeof(readable[0])));
    for (size_t i = 0; i < sizeof(readable) / sizeof(readable[0]); i++)
        assert_true(llmem_qtype_info(readable[i])->readable);
    /* retired and unknown ids */
    assert_null(llmem_qtype_info(4));
    assert_null(llmem_qtype_info(31));
    assert_null(llmem_qtype_info(-1));
    assert_null(llmem_qtype_info(LLMEM_QTYPE_COUNT));
    assert_string_equal(llmem_qtype_name(5), "unknown");
    assert_string_equal(llmem_qtype_name(LLMEM_QTYPE_Q4_K), "q4_K");
}

static void test_bytes(void **state) {
    (void)state;
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q4_K, 4096), 16 * 144);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q8_0, 64), 68);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_F16, 3), 6);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q8_0, 0), 0);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q4_K, 100), -1); /* not whole blocks */
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q8_0, -32), -1);
    assert_int_equal(llmem_qtype_bytes(4, 32), -1);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_F32, INT64_MAX / 2), -1); /* overflows */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
