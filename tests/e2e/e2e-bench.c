/*
 * tests/e2e/e2e-bench.c — `llmem bench mem` through the built binary: the table and the JSON
 * shape (one object, one entry per pattern with its three throughputs). Speed is not asserted
 * here: numbers go to docs/BENCHMARKS.md.
 */
#include <string.h>

#include "core/json.h"
#include "testutil.h"

static void test_bench_mem_json(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("bench", "mem", "--steps", "3", "--reps", "1", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    const cJSON *patterns = cJSON_GetObjectItemCaseSensitive(root, "patterns");
    assert_int_equal(cJSON_GetArraySize(patterns), 2);
    const char *names[2] = {"inference", "random"};
    for (int i = 0; i < 2; i++) {
        const cJSON *p = cJSON_GetArrayItem(patterns, i);
        const char *name = NULL;
        assert_int_equal(llmem_json_get_string(p, "name", &name), 0);
        assert_string_equal(name, names[i]);
        const char *keys[] = {"llmem_ops_per_s", "malloc_ops_per_s", "mmap_ops_per_s"};
        for (int k = 0; k < 3; k++) {
            double v = 0;
            assert_int_equal(llmem_json_get_double(p, keys[k], &v), 0);
            assert_true(v > 0);
        }
    }
    cJSON_Delete(root);
    tu_run_free(&run);
}

static void test_bench_usage(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("bench", "nothing", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "unknown benchmark"));
    tu_run_free(&run);
    run = tu_llmem("bench", "mem", "--reps", "0", NULL);
    assert_int_equal(run.exit_code, 2);
    tu_run_free(&run);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_mem_json),
        cmocka_unit_test(test_bench_usage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
