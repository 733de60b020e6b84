/*
 * cli/main.c — `llmem <command> [options]`: dispatch and help. The benchmarks are `llmem-bench`.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

static const char usage[] =
    "llmem — an LLM inference runtime whose memory is planned, not discovered\n"
    "\n"
    "usage: llmem <command> [options]\n"
    "\n"
    "commands:\n"
    "  info              this machine: RAM, cgroup limit, available memory, ceiling,\n"
    "                    RLIMIT_MEMLOCK, CPU and ISA features (and CUDA devices)\n"
    "  plan MODEL        the memory plan for a model directory or a catalog name\n"
    "                    (`llmem plan --list` shows the catalog)\n"
    "  run MODEL -p TEXT generate text (streams to stdout; --json, --stats)\n"
    "  chat MODEL        an interactive conversation with the model's chat template\n"
    "  serve MODEL       an OpenAI-compatible HTTP server (completions, chat, SSE,\n"
    "                    /health, /metrics)\n"
    "  tokenize MODEL    the token ids of --text TEXT\n"
    "  logits MODEL      teacher-forced logits of --ids, to a .npy file\n"
    "  quantize DIR OUT  a Hugging Face model directory to a GGUF file (--type q8_0,\n"
    "                    q4_0, q4_k_m, q5_k_m, q6_k, f16, bf16)\n"
    "  gc                reconcile the session bank's spill store on disk (--bank-dir,\n"
    "                    --json): drop bad rows, remove orphans, hold it to its cap\n"
    "\n"
    "Run `llmem <command> --help` for the options of a command. The benchmarks are a program\n"
    "of their own: `llmem-bench --help`.\n";

static int dispatch(int argc, char **argv) {
    if (cli_log_from_options() != CLI_OK)
        return CLI_FAIL;
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_USAGE : CLI_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("llmem 0.1.0\n");
        return CLI_OK;
    }
    if (strcmp(argv[1], "info") == 0)
        return cli_info(argc - 1, argv + 1);
    if (strcmp(argv[1], "plan") == 0)
        return cli_plan(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench") == 0) {
        fprintf(stderr,
                "llmem: the benchmarks are a program of their own: llmem-bench <mem|kv|attn|"
                "matmul|decode|bank|serve> (see llmem-bench --help)\n");
        return CLI_USAGE;
    }
    if (strcmp(argv[1], "gc") == 0)
        return cli_gc(argc - 1, argv + 1);
    if (strcmp(argv[1], "quantize") == 0)
        return cli_quantize(argc - 1, argv + 1);
    if (strcmp(argv[1], "serve") == 0)
        return cli_serve(argc - 1, argv + 1);
    static const char *const run_commands[] = {"run", "chat", "tokenize", "logits"};
    for (size_t i = 0; i < sizeof(run_commands) / sizeof(run_commands[0]); i++)
        if (strcmp(argv[1], run_commands[i]) == 0)
            return cli_run(argc - 1, argv + 1);
    fprintf(stderr, "llmem: unknown command '%s'\n\n%s", argv[1], usage);
    return CLI_USAGE;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LEAK_CHECK_AT_EXIT 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define LEAK_CHECK_AT_EXIT 1
#endif
#endif

int main(int argc, char **argv) {
    const int rc = dispatch(argc, argv);
#ifndef LEAK_CHECK_AT_EXIT
    /* Everything is closed and freed by now: the libraries' destructors have nothing to release
     * that the exit does not, and CUDA's would page tens of megabytes of its libraries in on
     * the way out, past the plan's resident memory. (A sanitizer build checks for leaks at
     * exit, so it exits the ordinary way.) */
    fflush(NULL);
    _exit(rc);
#endif
    return rc;
}
