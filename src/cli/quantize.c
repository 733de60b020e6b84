/*
 * cli/quantize.c — `llmem quantize MODEL_DIR OUT.gguf --type T`: a Hugging Face model directory
 * into a GGUF file that llmem and llama.cpp run (model/convert.c does the work; this parses the
 * options, draws the progress bar and decides the exit code).
 */
#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "llmem/status.h"
#include "model/gguf.h"

static const char quantize_usage[] =
    "usage: llmem quantize MODEL_DIR OUT.gguf --type TYPE [--name NAME] [--threads N]\n"
    "                      [--load-format F]\n"
    "\n"
    "Writes the Hugging Face model in MODEL_DIR (config.json, bf16/f16/f32 safetensors,\n"
    "tokenizer.json; llama incl. Llama 3 rope scaling, mistral, qwen2, qwen3, and the\n"
    "mixtures qwen3_moe and mixtral) as a GGUF file\n"
    "that llmem and llama.cpp load, quantized as llama-quantize quantizes (no importance matrix).\n"
    "Tensors are converted a chunk of rows at a time: memory stays far below the model's size.\n"
    "\n"
    "  --type TYPE    q8_0, q4_0, q4_k_m, q5_k_m, q6_k (llama-quantize's mixes and fallbacks),\n"
    "                 f16 or bf16 (1-D tensors stay f32 in every type)\n"
    "  --name NAME    general.name (default: the directory's name)\n"
    "  --threads N    quantizing threads (default: the online CPUs; the file is the same)\n"
    "  --load-format F  auto (default): the directory's safetensors; dummy: config.json and\n"
    "                 the tokenizer alone, the weights the seeded random bf16 that llmem run\n"
    "                 --load-format dummy makes (a quantized file of a shape nobody has)\n"
    "\n"
    "Exit status: 0 when the file is written, 1 on errors (nothing is left at OUT.gguf), 2 on\n"
    "usage errors.\n";

enum { OPT_TYPE = 256, OPT_NAME, OPT_THREADS, OPT_LOAD_FORMAT, OPT_HELP };

static const struct option quantize_options[] = {
    {"type", required_argument, NULL, OPT_TYPE},
    {"name", required_argument, NULL, OPT_NAME},
    {"threads", required_argument, NULL, OPT_THREADS},
    {"load-format", required_argument, NULL, OPT_LOAD_FORMAT},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

static void progress(void *arg, int64_t done, int64_t total) {
    cli_progress((const char *)arg, done, total);
}

int cli_quantize(int argc, char **argv) {
    const char *type_name = NULL, *name = NULL;
    int64_t threads = 0;
    int dummy = 0;
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":ht:", quantize_options, NULL)) != -1) {
        switch (c) {
        case 't':
        case OPT_TYPE: type_name = optarg; break;
        case OPT_NAME: name = optarg; break;
        case OPT_THREADS:
            if (cli_parse_int("--threads", optarg, 1, 1024, &threads) != CLI_OK)
                return CLI_USAGE;
            break;
        case OPT_LOAD_FORMAT:
            if (strcmp(optarg, "auto") != 0 && strcmp(optarg, "dummy") != 0)
                return cli_usage_error("quantize", "--load-format: '%s' is not auto or dummy",
                                       optarg);
            dummy = strcmp(optarg, "dummy") == 0;
            break;
        case 'h':
        case OPT_HELP: fputs(quantize_usage, stdout); return CLI_OK;
        case ':': return cli_usage_error("quantize", "%s needs a value", argv[optind - 1]);
        default: return cli_usage_error("quantize", "unknown option '%s'", argv[optind - 1]);
        }
    }
    if (argc - optind != 2) {
        fputs(quantize_usage, stderr);
        return CLI_USAGE;
    }
    const char *dir = argv[optind], *out = argv[optind + 1];
    if (type_name == NULL)
        return cli_usage_error("quantize", "--type is required (q8_0, q4_0, q4_k_m, q5_k_m, "
                                           "q6_k, f16, bf16)");
    int ftype = llmem_gguf_ftype_parse(type_name);
    if (ftype < 0)
        return cli_usage_error("quantize",
                               "--type '%s' is not one of q8_0, q4_0, q4_k_m, "
                               "q5_k_m, q6_k, f16, bf16",
                               type_name);
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "%s quantize: %s is not a model directory\n", cli_program, dir);
        return CLI_FAIL;
    }
    char label[64];
    snprintf(label, sizeof(label), "quantize %s", llmem_gguf_ftype_name(ftype));
    int st = llmem_gguf_convert(dir, out, ftype, name, (int)threads, dummy, progress, label);
    cli_progress_done();
    if (st != LLMEM_OK) /* the library's line has said why; nothing is left at OUT */
        return CLI_FAIL;
    fprintf(stderr, "wrote %s (%s)\n", out, llmem_gguf_ftype_name(ftype));
    return CLI_OK;
}
