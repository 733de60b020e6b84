/*
 * tests/e2e/e2e-serve-node.c — the official OpenAI Node client (tests/e2e/node, `openai` pinned
 * in package-lock.json) against `llmem serve models/pycoder --chat-template chatml`: models,
 * completions and chat, streaming and not, 16 concurrent clients equal to single requests, an
 * aborted stream that frees its KV, structured outputs and tool calls validated by ajv, and bad
 * requests raised as the client's typed errors; the structured outputs also against a second
 * server of the same model with seeded random weights (`--load-format dummy`).
 *
 * Skipped (ctest code 77) when node or npm is missing, or when the client cannot be installed
 * (`npm ci` runs only when node_modules is absent).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "testutil.h"

#define PYCODER  LLMEM_SOURCE_DIR "/models/pycoder"
#define NODE_DIR LLMEM_SOURCE_DIR "/tests/e2e/node"

static int have(const char *program) {
    struct tu_run r = tu_exec(program, NULL, 1, (const char *[]){"--version"});
    int ok = r.exit_code == 0;
    tu_run_free(&r);
    return ok;
}

static void test_openai_node_client(void **state) {
    (void)state;
    /* what `llmem run` generates greedily for the script's prompt */
    struct tu_run run = tu_llmem("run", PYCODER, "-p", "def fibonacci(n):\n", "-n", "32",
                                 "--ignore-eos", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *out = tu_json_stdout(&run);
    const char *expected = cJSON_GetStringValue(cJSON_GetObjectItem(out, "text"));
    assert_non_null(expected);

    const char *args[] = {PYCODER, "--chat-template", "chatml", "--threads", "2"};
    const char *random_args[] = {PYCODER,   "--load-format", "dummy", "--chat-template",
                                 "chatml", "--threads",     "1"};
    /* tiny-mistral-swa with Mistral v3's control tokens and v0.3's template with tools */
    char *mistral_dir = tu_mkdtemp();
    tu_copy_into(LLMEM_TEST_DATA "/models/tiny-mistral-swa/config.json", mistral_dir);
    tu_copy_into(LLMEM_TEST_DATA "/models/tiny-mistral-swa/model.safetensors", mistral_dir);
    tu_copy_into(LLMEM_TEST_DATA "/tok/tok-mistral-tools/tokenizer.json", mistral_dir);
    tu_copy_into(LLMEM_TEST_DATA "/tok/tok-mistral-tools/tokenizer_config.json", mistral_dir);
    const char *mistral_args[] = {mistral_dir, "--threads", "1"};
    struct tu_server s, random, mistral;
    tu_serve_start(&s, 5, args);
    tu_serve_start(&random, 7, random_args);
    tu_serve_start(&mistral, 3, mistral_args);
    struct tu_run r = tu_exec(
        "node", NULL, 5,
        (const char *[]){NODE_DIR "/serve.test.mjs", s.url, expected, random.url, mistral.url});
    printf("%s%s", r.out, r.err);
    int node_rc = r.exit_code;
    tu_run_free(&r);
    assert_int_equal(tu_serve_stop(&mistral), 0);
    assert_int_equal(tu_serve_stop(&random), 0);
    assert_int_equal(tu_serve_stop(&s), 0);
    tu_rmtree(mistral_dir);
    free(mistral_dir);
    cJSON_Delete(out);
    tu_run_free(&run);
    assert_int_equal(node_rc, 0);
}

int main(void) {
    if (!have("node") || !have("npm")) {
        printf("e2e-serve-node: node or npm is not installed; skipped\n");
        return 77;
    }
    struct stat st;
    if (stat(NODE_DIR "/node_modules/openai/package.json", &st) != 0) {
        struct tu_run r = tu_exec("npm", NULL, 6,
                                  (const char *[]){"ci", "--prefix", NODE_DIR, "--no-audit",
                                                   "--no-fund", "--loglevel=error"});
        int ok = r.exit_code == 0;
        if (!ok)
            printf("e2e-serve-node: npm ci failed; skipped:\n%s%s\n", r.out, r.err);
        tu_run_free(&r);
        if (!ok)
            return 77;
    }

    const struct CMUnitTest tests[] = {cmocka_unit_test(test_openai_node_client)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
