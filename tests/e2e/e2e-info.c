/*
 * tests/e2e/e2e-info.c — `llmem info`: --json is exactly one JSON object with the probe's keys
 * (at the top level and under "host") and a device list; the human form works; bad options are
 * usage errors.
 */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#include "core/json.h"
#include "llmem/status.h"

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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json),
        cmocka_unit_test(test_human),
        cmocka_unit_test(test_usage_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
