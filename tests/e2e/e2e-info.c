/*
 * tests/e2e/e2e-info.c — `llmem info`: --json is exactly one JSON object with the probe's keys
 * (at the top level and under "host") and a device list; the human form works; bad options are
 * usage errors; the LLMEM_* variables set are listed, a malformed one fails, and --options lists
 * every one of them, each also in the README's table.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#include "core/file.h"
#include "core/json.h"
#include "core/options.h"
#include "llmem/backend.h"
#include "llmem/status.h"
#include "llmem/sys.h"

/* A size key: a non-negative integer, null (unknown) or "unlimited" (for limits). */
static int64_t size_value(const cJSON *obj, const char *key, int may_be_unlimited) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    assert_non_null(item);
    if (cJSON_IsNull(item))
        return -1;
    if (cJSON_IsString(item)) {
        assert_true(may_be_unlimited);
        assert_string_equal(item->valuestring, "unlimited");
        return -2;
    }
    int64_t v = -1;
    assert_int_equal(llmem_json_int(item, &v), LLMEM_OK);
    assert_true(v >= 0);
    return v;
}

static void check_host_keys(const cJSON *obj) {
    int64_t ram = size_value(obj, "memory_size", 0);
    int64_t ceiling = size_value(obj, "max_recommended_working_set_size", 0);
    int64_t available = size_value(obj, "available", 0);
    size_value(obj, "max_buffer_length", 0);
    size_value(obj, "cgroup_limit", 1);
    size_value(obj, "wired_limit", 1);
    assert_true(ram > 0); /* sysconf always knows the RAM on Linux */
    if (ceiling >= 0)
        assert_true(ceiling > 0 && ceiling <= ram);
    if (available >= 0)
        assert_true(available <= ram);
    int64_t v;
    assert_int_equal(llmem_json_get_int(obj, "cgroup_version", &v), LLMEM_OK);
    assert_true(v >= 0 && v <= 2);
    const char *s;
    assert_int_equal(llmem_json_get_string(obj, "ceiling_source", &s), LLMEM_OK);
}

static void test_json(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("info", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);

    check_host_keys(root);
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(root, "host");
    assert_true(cJSON_IsObject(host));
    check_host_keys(host);
    const char *keys[] = {"memory_size", "max_recommended_working_set_size", "available",
                          "cgroup_limit", "wired_limit"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        assert_true(cJSON_Compare(cJSON_GetObjectItemCaseSensitive(root, keys[i]),
                                  cJSON_GetObjectItemCaseSensitive(host, keys[i]), 1));

    const char *kernels = NULL;
    assert_int_equal(llmem_json_get_string(root, "attention_kernels", &kernels), LLMEM_OK);
    assert_true(strcmp(kernels, "avx512") == 0 || strcmp(kernels, "avx2") == 0 ||
                strcmp(kernels, "scalar") == 0);
    /* bf16 weights at fast precision: AMX tiles or AVX512-BF16 where the CPU has them, else the
     * f32 kernels */
    const char *bf16 = NULL;
    assert_int_equal(llmem_json_get_string(root, "bf16_matmul_kernels", &bf16), LLMEM_OK);
    const uint32_t f = llmem_sys_isa_features(), want = LLMEM_ISA_AVX512F | LLMEM_ISA_AVX512BW |
                                                        LLMEM_ISA_AVX512VL | LLMEM_ISA_AVX512_BF16;
    const int amx = (f & want) == want && (f & LLMEM_ISA_AMX_BF16) != 0;
    assert_int_equal(strcmp(bf16, "amx_bf16") == 0, amx);
    assert_int_equal(strcmp(bf16, "avx512_bf16") == 0, (f & want) == want && !amx);

    /* NCCL only in a CUDA build: what --tensor-parallel over devices needs */
    const cJSON *cuda = cJSON_GetObjectItemCaseSensitive(root, "cuda_built");
    const cJSON *nccl = cJSON_GetObjectItemCaseSensitive(root, "nccl_built");
    assert_true(cJSON_IsBool(cuda) && cJSON_IsBool(nccl));
    assert_int_equal(cJSON_IsTrue(nccl), llmem_backend_nccl_available());
    assert_true(cJSON_IsTrue(cuda) || !cJSON_IsTrue(nccl));

    const cJSON *devices = cJSON_GetObjectItemCaseSensitive(root, "devices");
    assert_true(cJSON_IsArray(devices));
    const cJSON *dev;
    cJSON_ArrayForEach(dev, devices) {
        assert_true(cJSON_IsObject(dev));
        assert_true(size_value(dev, "memory_size", 0) > 0);
        int64_t ceiling = size_value(dev, "max_recommended_working_set_size", 0);
        assert_int_equal(ceiling, size_value(dev, "memory_size", 0));
        int64_t avail = size_value(dev, "available", 0);
        assert_true(avail <= ceiling);
    }
    cJSON_Delete(root);
    tu_run_free(&run);
}

static void test_human(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("info", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, "host: "));
    assert_non_null(strstr(run.out, "ceiling"));
    assert_non_null(strstr(run.out, "RLIMIT_MEMLOCK"));
    assert_non_null(strstr(run.out, "kernels (bf16 weights, fast precision: "));
    assert_non_null(strstr(run.out, "cuda"));
    tu_run_free(&run);

    run = tu_llmem("info", "--help", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, "--json"));
    tu_run_free(&run);
}

static void test_usage_errors(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("info", "--bogus", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_string_equal(run.out, "");
    assert_non_null(strstr(run.err, "--bogus"));
    tu_run_free(&run);

    run = tu_llmem("info", "extra", NULL);
    assert_int_equal(run.exit_code, 2);
    tu_run_free(&run);
}

/* ---- options ------------------------------------------------------------------------------ */

static void test_options_set(void **state) {
    (void)state;
    for (int i = 0; i < LLMEM_OPT_COUNT; i++) /* whatever the caller's environment holds */
        unsetenv(llmem_option_info((enum llmem_option)i)->name);
    struct tu_run run = tu_llmem("info", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, "options: no LLMEM_* variable set"));
    tu_run_free(&run);

    setenv("LLMEM_DECODE_AHEAD", "0", 1);
    setenv("LLMEM_KV_FORMAT", "q8", 1);
    run = tu_llmem("info", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, "options:\n"));
    assert_non_null(strstr(run.out, "  LLMEM_KV_FORMAT=q8\n"));
    assert_non_null(strstr(run.out, "  LLMEM_DECODE_AHEAD=0\n"));
    tu_run_free(&run);
    run = tu_llmem("info", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    const cJSON *options = cJSON_GetObjectItemCaseSensitive(root, "options");
    assert_true(cJSON_IsObject(options));
    assert_int_equal(cJSON_GetArraySize(options), 2);
    const char *s = NULL;
    assert_int_equal(llmem_json_get_string(options, "LLMEM_DECODE_AHEAD", &s), LLMEM_OK);
    assert_string_equal(s, "0");
    cJSON_Delete(root);
    tu_run_free(&run);

    /* a malformed value is shown, with what is accepted, and info fails with the library's line */
    setenv("LLMEM_DECODE_AHEAD", "abc", 1);
    run = tu_llmem("info", NULL);
    assert_int_equal(run.exit_code, 1);
    assert_non_null(strstr(run.out, "LLMEM_DECODE_AHEAD=abc (not accepted: expected 0 or 1"));
    assert_non_null(strstr(run.err, "LLMEM_DECODE_AHEAD='abc' is not accepted: expected 0 or 1"));
    tu_run_free(&run);
    run = tu_llmem("info", "--json", NULL);
    assert_int_equal(run.exit_code, 1);
    root = tu_json_stdout(&run); /* still the whole object */
    cJSON_Delete(root);
    tu_run_free(&run);
    unsetenv("LLMEM_DECODE_AHEAD");
    unsetenv("LLMEM_KV_FORMAT");

    /* the CLI's own: a malformed LLMEM_VERBOSE fails every command */
    setenv("LLMEM_VERBOSE", "loud", 1);
    run = tu_llmem("info", NULL);
    assert_int_equal(run.exit_code, 1);
    assert_string_equal(run.out, "");
    assert_non_null(strstr(run.err, "LLMEM_VERBOSE='loud' is not accepted"));
    tu_run_free(&run);
    unsetenv("LLMEM_VERBOSE");
}

static void test_options_all(void **state) {
    (void)state;
    char *readme = NULL;
    size_t readme_len = 0;
    assert_int_equal(llmem_file_read(LLMEM_SOURCE_DIR "/README.md", 1 << 20, &readme, &readme_len),
                     LLMEM_OK);
    setenv("LLMEM_CUDA_ATTN_FUSE", "8", 1);
    struct tu_run run = tu_llmem("info", "--options", NULL);
    assert_int_equal(run.exit_code, 0);
    struct tu_run js = tu_llmem("info", "--options", "--json", NULL);
    assert_int_equal(js.exit_code, 0);
    unsetenv("LLMEM_CUDA_ATTN_FUSE");
    cJSON *root = tu_json_stdout(&js);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "options");
    assert_true(cJSON_IsArray(list));
    assert_int_equal(cJSON_GetArraySize(list), LLMEM_OPT_COUNT);
    for (int i = 0; i < LLMEM_OPT_COUNT; i++) {
        const struct llmem_option_info *o = llmem_option_info((enum llmem_option)i);
        /* the text: name, type and doc */
        char head[128];
        snprintf(head, sizeof(head), "%s (%s, ", o->name, llmem_option_type_name(o->type));
        assert_non_null(strstr(run.out, head));
        assert_non_null(strstr(run.out, o->doc));
        /* the README's table has a row for it */
        char row[128];
        snprintf(row, sizeof(row), "| `%s` |", o->name);
        if (strstr(readme, row) == NULL)
            fail_msg("README.md has no row for %s", o->name);
        /* the JSON: the same fields, the value where set */
        const cJSON *item = cJSON_GetArrayItem(list, i);
        const char *s = NULL;
        assert_int_equal(llmem_json_get_string(item, "name", &s), LLMEM_OK);
        assert_string_equal(s, o->name);
        assert_int_equal(llmem_json_get_string(item, "type", &s), LLMEM_OK);
        assert_string_equal(s, llmem_option_type_name(o->type));
        assert_int_equal(llmem_json_get_string(item, "doc", &s), LLMEM_OK);
        assert_string_equal(s, o->doc);
        const cJSON *def = cJSON_GetObjectItemCaseSensitive(item, "default");
        if (o->def != NULL)
            assert_string_equal(cJSON_GetStringValue(def), o->def);
        else
            assert_true(cJSON_IsNull(def));
        const cJSON *value = cJSON_GetObjectItemCaseSensitive(item, "value");
        if (i == LLMEM_OPT_CUDA_ATTN_FUSE)
            assert_string_equal(cJSON_GetStringValue(value), "8");
        else
            assert_true(cJSON_IsNull(value));
    }
    assert_non_null(strstr(run.out, "LLMEM_CUDA_ATTN_FUSE (int, default 16; set to 8)"));
    cJSON_Delete(root);
    tu_run_free(&js);
    tu_run_free(&run);
    free(readme);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json),         cmocka_unit_test(test_human),
        cmocka_unit_test(test_usage_errors), cmocka_unit_test(test_options_set),
        cmocka_unit_test(test_options_all),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
