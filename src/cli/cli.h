/*
 * cli/cli.h — the llmem command line: one file per subcommand, over the helpers the command-line
 * programs share (common.h). The benchmarks are a program of their own, `llmem-bench` (bench/).
 */
#ifndef LLMEM_CLI_H
#define LLMEM_CLI_H

#include "cli/common.h"

int cli_info(int argc, char **argv);
int cli_plan(int argc, char **argv);
/* `llmem run`, `chat`, `tokenize` and `logits` (run.c), by argv[0]. */
int cli_run(int argc, char **argv);
/* `llmem gc` (gc.c): the session bank's spill store reconciled offline. */
int cli_gc(int argc, char **argv);
/* `llmem quantize MODEL_DIR OUT.gguf --type T` (quantize.c). */
int cli_quantize(int argc, char **argv);
/* `llmem serve MODEL` (serve.c). */
int cli_serve(int argc, char **argv);

struct llmem_plan;
/* Writes the plan's envelope as an SVG picture to path; CLI_FAIL (message on stderr) on error. */
int cli_plan_svg(const struct llmem_plan *plan, const char *path);

#endif
