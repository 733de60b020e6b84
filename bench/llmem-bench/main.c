/*
 * bench/llmem-bench/main.c — `llmem-bench <benchmark> [options]`: dispatch, help, and the median
 * every benchmark uses.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli/common.h"

static const char usage[] =
    "llmem-bench — llmem's benchmarks, against the machine's limits measured in the same run\n"
    "\n"
    "usage: llmem-bench mem|kv|attn|matmul|qmatmul|decode|bank|serve|grammar [options]\n"
    "\n"
    "benchmarks:\n"
    "  mem           the caching allocator against malloc and mmap\n"
    "  kv            attention over the KV caches against the memory bandwidth, the accuracy\n"
    "                of each KV format, and the cost of appending\n"
    "  attn          paged decode attention on a GPU (--backend cuda) against its copy bandwidth\n"
    "  matmul        the CPU matmul against the memory bandwidth and the FMA peak\n"
    "  qmatmul       a backend's matmul with quantized weights on an 8B layer's matrices\n"
    "  decode MODEL  prefill and decode speed of a model against the memory bandwidth\n"
    "  bank MODEL    time to first token cold, from the session bank's RAM tier, as a chat turn,\n"
    "                from its spill store\n"
    "  serve MODEL   throughput and time to first token of the HTTP server under concurrent\n"
    "                clients, and the gain of prefix reuse\n"
    "  grammar MODEL the time constrained decoding's masks take on a model's vocabulary\n"
    "\n"
    "Run `llmem-bench <benchmark> --help` for the options of a benchmark.\n";

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
    static const struct {
        const char *name;
        int (*run)(int, char **);
    } benchmarks[] = {
        {"mem", bench_mem},       {"kv", bench_kv},           {"attn", bench_attn},
        {"matmul", bench_matmul}, {"qmatmul", bench_qmatmul}, {"decode", bench_decode},
        {"bank", bench_bank},     {"serve", bench_serve},     {"grammar", bench_grammar},
    };
    cli_program = "llmem-bench";
    if (cli_log_from_options() != CLI_OK)
        return CLI_FAIL;
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_USAGE : CLI_OK;
    }
    for (size_t i = 0; i < sizeof(benchmarks) / sizeof(benchmarks[0]); i++)
        if (strcmp(argv[1], benchmarks[i].name) == 0)
            return benchmarks[i].run(argc - 1, argv + 1);
    return cli_usage_error(
        "",
        "unknown benchmark '%s' (benchmarks: mem, kv, attn, matmul, qmatmul, decode, bank, "
        "serve)",
        argv[1]);
}
