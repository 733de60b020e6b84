/*
 * cli/engine_opts.c — the model, plan and KV options of every command that opens an engine
 * (`run`, `chat`, `logits`, `serve`, and `llmem-bench serve`): one table, one parser, one help
 * text, and the opening with the plan line and the limits applied on stderr.
 */
#include <stdio.h>
#include <string.h>

#include "cli/common.h"
#include "llmem/engine.h"

const char cli_engine_help[] =
    "model, plan and KV options:\n"
    "  --context N          the context window (default: what the plan fits, up to the model's)\n"
    "  --budget SIZE        plan as if the machine had SIZE of memory (e.g. 2G)\n"
    "  --memory-limit SIZE  the engine budget, exactly\n"
    "  --util U             the engine budget as a fraction of the ceiling (0 < U ≤ 1)\n"
    "  --kv-layout L        paged (default), contiguous, blocks, ragged\n"
    "  --kv-format F        f16 (default), bf16, f32, q8, q4, tq\n"
    "  --threads N          CPU threads (default: the online CPUs)\n"
    "  --max-batch-tokens N the prefill chunk (default 512; with --backend cuda up to 8192,\n"
    "                       as large as the plan's transient reserve holds)\n"
    "  --bank-max SIZE      the session bank's RAM cap (default: the plan's; 0: no bank)\n"
    "  --bank-dir DIR       the bank's spill store on disk (default:\n"
    "                       $XDG_CACHE_HOME/llmem/bank, else ~/.cache/llmem/bank)\n"
    "  --spill-max SIZE     the spill store's size cap (default by RAM: 16G up to 16G, 24G up\n"
    "                       to 32G, 32G up to 64G, 100G above; at most a quarter of the disk;\n"
    "                       0: no spill store)\n"
    "  --no-spill           keep the session bank in RAM only\n"
    "  --no-mmap            read the weights into memory (huge pages) instead of mapping\n"
    "                       the files: faster decode, not reclaimable as page cache\n"
    "  --load-format F      auto (default): the model's files; dummy: seeded random bf16\n"
    "                       weights made in memory from MODEL's config.json alone (for\n"
    "                       benchmarks of shapes without files; no session bank)\n"
    "  --backend B          cpu (default) or cuda: the whole forward pass, the weights and the\n"
    "                       KV cache (paged; f16, bf16, f32 or q8) on a GPU, planned for its\n"
    "                       memory\n"
    "  --device N           the CUDA device (default 0)\n"
    "  --experts-on-host N  with --backend cuda, a mixture of experts: the first N MoE layers'\n"
    "                       experts stay in host memory and run on the CPU (default: the\n"
    "                       fewest with which the plan fits the device)\n"
    "  --tensor-parallel N  the model split over N ranks (2, 4, 8: query and KV heads, MLP and\n"
    "                       experts' columns, vocabulary): with --backend cuda over the devices\n"
    "                       from --device on, NCCL between them, each planned for its share;\n"
    "                       on the CPU the ranks taking turns on its threads (the split's\n"
    "                       results, to check it)\n"
    "  --precision P        fast (default) or f32. fast: bf16/f16 tensor cores for a GPU's\n"
    "                       prefill (f32 accumulation; quantized weights dequantized to f16),\n"
    "                       and Q8_0, Q4_0, Q4_K, Q5_K and Q6_K weights by 8-bit integer dot\n"
    "                       products (activations quantized per block; on a GPU in decode),\n"
    "                       and on a CPU with AVX512-BF16 bf16 weights by bf16 dot products\n"
    "                       (activations rounded to bf16, but for the down projections,\n"
    "                       routers and LM head). f32: f32 throughout, weights widened exactly\n";

int cli_engine_option(int opt, const char *arg, struct llmem_engine_config *c) {
    int64_t v = 0;
    int rc = CLI_OK;
    switch (opt) {
    case CLI_OPT_KV_LAYOUT:
        return llmem_kv_layout_parse(arg, &c->kv_layout) == LLMEM_OK ? CLI_OK : CLI_USAGE;
    case CLI_OPT_KV_FORMAT:
        return llmem_kv_format_parse(arg, &c->kv_format) == LLMEM_OK ? CLI_OK : CLI_USAGE;
    case CLI_OPT_CONTEXT: return cli_parse_int("--context", arg, 2, (int64_t)1 << 40, &c->context);
    case CLI_OPT_BUDGET: return cli_parse_positive_size("--budget", arg, &c->budget_bytes);
    case CLI_OPT_MEMORY_LIMIT:
        return cli_parse_positive_size("--memory-limit", arg, &c->memory_limit_bytes);
    case CLI_OPT_UTIL: return cli_parse_double("--util", arg, 0.0, 1.0, &c->util);
    case CLI_OPT_THREADS:
        rc = cli_parse_int("--threads", arg, 1, 1024, &v);
        c->n_threads = (int)v;
        return rc;
    case CLI_OPT_MAX_BATCH_TOKENS:
        return cli_parse_int("--max-batch-tokens", arg, 1, 1 << 20, &c->max_batch_tokens);
    case CLI_OPT_NO_MMAP: c->no_mmap = 1; return CLI_OK;
    case CLI_OPT_LOAD_FORMAT:
        if (strcmp(arg, "auto") != 0 && strcmp(arg, "dummy") != 0) {
            fprintf(stderr, "%s: --load-format: '%s' is not auto or dummy\n", cli_program, arg);
            return CLI_USAGE;
        }
        c->load_dummy = strcmp(arg, "dummy") == 0;
        return CLI_OK;
    case CLI_OPT_BANK_MAX:
        rc = cli_parse_size("--bank-max", arg, &c->bank_max_bytes);
        c->no_bank = rc == CLI_OK && c->bank_max_bytes == 0;
        return rc;
    case CLI_OPT_BANK_DIR:
        if (arg[0] == '\0') {
            fprintf(stderr, "%s: --bank-dir needs a directory\n", cli_program);
            return CLI_USAGE;
        }
        c->bank_dir = arg;
        return CLI_OK;
    case CLI_OPT_SPILL_MAX:
        rc = cli_parse_size("--spill-max", arg, &c->spill_max_bytes);
        c->no_spill = rc == CLI_OK && c->spill_max_bytes == 0;
        return rc;
    case CLI_OPT_NO_SPILL: c->no_spill = 1; return CLI_OK;
    case CLI_OPT_BACKEND:
        return llmem_backend_kind_parse(arg, &c->backend) == LLMEM_OK ? CLI_OK : CLI_USAGE;
    case CLI_OPT_DEVICE:
        rc = cli_parse_int("--device", arg, 0, 1024, &v);
        c->device = (int)v;
        return rc;
    case CLI_OPT_EXPERTS_ON_HOST:
        return cli_parse_int("--experts-on-host", arg, 0, 1 << 20, &c->experts_on_host);
    case CLI_OPT_TENSOR_PARALLEL:
        rc = cli_parse_int("--tensor-parallel", arg, 1, 8, &v);
        if (rc == CLI_OK && v != 1 && v != 2 && v != 4 && v != 8) {
            fprintf(stderr, "%s: --tensor-parallel: %lld ranks; llmem splits over 1, 2, 4 or 8\n",
                    cli_program, (long long)v);
            return CLI_USAGE;
        }
        c->tensor_parallel = (int)v;
        return rc;
    case CLI_OPT_PRECISION:
        return llmem_backend_precision_parse(arg, &c->precision) == LLMEM_OK ? CLI_OK : CLI_USAGE;
    default: return -1;
    }
}

static void load_progress(void *arg, int64_t done, int64_t total) {
    (void)arg;
    cli_progress("loading", done, total);
}

int cli_engine_open(const char *cmd, const char *model, struct llmem_engine_config *c,
                    int print_limits, struct llmem_engine **e) {
    c->model_dir = model;
    int status = llmem_engine_open(c, load_progress, NULL, e);
    cli_progress_done();
    if (status != LLMEM_OK) {
        fprintf(stderr, "%s %s: cannot run %s (%s)\n", cli_program, cmd, model,
                llmem_status_name(status));
        return status == LLMEM_ENOMEM ? CLI_NOFIT : CLI_FAIL;
    }
    char line[512];
    llmem_plan_describe(llmem_engine_plan(*e), line, sizeof(line));
    fprintf(stderr, "%s: %s\n", cli_program, line);
    const struct llmem_expert_placement *placed = llmem_engine_expert_placement(*e);
    if (placed->moe_layers > 0)
        fprintf(stderr, "%s: experts: %s\n", cli_program,
                llmem_plan_describe_experts(placed, line, sizeof(line)));
    if (print_limits) {
        llmem_engine_limits_line(*e, line, sizeof(line));
        fprintf(stderr, "%s: limits applied: %s\n", cli_program, line);
    }
    return CLI_OK;
}
