/*
 * cli/serve.c — `llmem serve MODEL`: the model opened inside its plan (16 sequences by default),
 * the OpenAI-compatible HTTP server on top (llmem/server.h), until SIGINT or SIGTERM.
 *
 * The signals are blocked in every thread before any is created and taken by sigwait on the main
 * thread, which then stops the server (requests in flight end, the engine's scheduler stops) and
 * closes the engine. stderr carries the plan line and one line with the URL and the limits
 * applied; the library's log lines follow (LLMEM_VERBOSE=1 for one per request).
 */
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "llmem/engine.h"
#include "llmem/server.h"
#include "llmem/tokenizer.h"

enum {
    OPT_HOST = CLI_OPT_ENGINE_END,
    OPT_PORT,
    OPT_API_KEY,
    OPT_MAX_SEQUENCES,
    OPT_MAX_QUEUE,
    OPT_MAX_BODY,
    OPT_MODEL_NAME,
    OPT_CHAT_TEMPLATE,
    OPT_HELP,
};

static const struct option options[] = {
    CLI_ENGINE_OPTIONS,
    {"host", required_argument, NULL, OPT_HOST},
    {"port", required_argument, NULL, OPT_PORT},
    {"api-key", required_argument, NULL, OPT_API_KEY},
    {"max-sequences", required_argument, NULL, OPT_MAX_SEQUENCES},
    {"max-queue", required_argument, NULL, OPT_MAX_QUEUE},
    {"max-body", required_argument, NULL, OPT_MAX_BODY},
    {"model-name", required_argument, NULL, OPT_MODEL_NAME},
    {"chat-template", required_argument, NULL, OPT_CHAT_TEMPLATE},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

static const char usage[] =
    "usage: llmem serve MODEL [options]\n"
    "\n"
    "An OpenAI-compatible HTTP server: POST /v1/completions, POST /v1/chat/completions\n"
    "(stream: true for server-sent events), GET /v1/models, GET /health, GET /metrics\n"
    "(Prometheus), POST /admin/cache/clear. Stops on SIGINT or SIGTERM.\n"
    "\n"
    "server options:\n"
    "  --host ADDR          the address to bind (default 127.0.0.1; any other than loopback\n"
    "                       needs --api-key)\n"
    "  --port N             the port (default 8080; 0: a free one, printed at start)\n"
    "  --api-key KEY        require 'Authorization: Bearer KEY' (every route but /health)\n"
    "  --max-sequences N    requests decoded together (default 16; the plan counts them)\n"
    "  --max-queue N        waiting requests beyond which a request gets 503 (default 256)\n"
    "  --max-body SIZE      the largest request body (default 4M; larger: 413)\n"
    "  --model-name NAME    the model id clients use (default: the directory's name, or the\n"
    "                       GGUF file's without .gguf)\n"
    "  --chat-template T    chatml, llama3 or mistral (default: the model's own; a model\n"
    "                       without one serves chat only with this)\n";

int cli_serve(int argc, char **argv) {
    struct llmem_engine_config ec;
    llmem_engine_config_default(&ec);
    ec.max_sequences = 16;
    struct llmem_server_config sc;
    llmem_server_config_default(&sc);
    const char *tmpl_name = NULL;
    int help = 0, rc = CLI_OK, c;
    int64_t v = 0;
    optind = 1;
    opterr = 0;
    while (rc == CLI_OK && (c = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (c) {
        case OPT_HOST: sc.host = optarg; break;
        case OPT_PORT:
            rc = cli_parse_int("--port", optarg, 0, 65535, &v);
            sc.port = (int)v;
            break;
        case OPT_API_KEY: sc.api_key = optarg; break;
        case OPT_MAX_SEQUENCES:
            rc = cli_parse_int("--max-sequences", optarg, 1, 4096, &ec.max_sequences);
            break;
        case OPT_MAX_QUEUE:
            rc = cli_parse_int("--max-queue", optarg, 1, 1 << 20, &sc.max_queue);
            break;
        case OPT_MAX_BODY:
            rc = cli_parse_size("--max-body", optarg, &sc.max_body_bytes);
            if (rc == CLI_OK && sc.max_body_bytes <= 0)
                rc = cli_usage_error("serve", "--max-body must be positive");
            break;
        case OPT_MODEL_NAME: sc.model_name = optarg; break;
        case OPT_CHAT_TEMPLATE: tmpl_name = optarg; break;
        case 'h':
        case OPT_HELP: help = 1; break;
        case ':': rc = cli_usage_error("serve", "%s needs a value", argv[optind - 1]); break;
        default:
            if ((rc = cli_engine_option(c, optarg, &ec)) < 0)
                rc = cli_usage_error("serve", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (help) {
        printf("%s\n%s", usage, cli_engine_help);
        return CLI_OK;
    }
    if (optind != argc - 1)
        return cli_usage_error("serve", "needs one MODEL directory (see --help)");
    const char *model = argv[optind];
    if (tmpl_name != NULL && llmem_chat_template_parse(tmpl_name, &sc.chat_template) != LLMEM_OK)
        return CLI_USAGE;
    char *dir = strdup(model);
    if (dir == NULL)
        return CLI_FAIL;
    for (size_t n = strlen(dir); n > 1 && dir[n - 1] == '/'; n--)
        dir[n - 1] = '\0';
    if (sc.model_name == NULL) { /* the directory's name, or the file's without ".gguf" */
        char *name = basename(dir);
        size_t n = strlen(name);
        if (n > 5 && strcmp(name + n - 5, ".gguf") == 0)
            name[n - 5] = '\0';
        sc.model_name = name;
    }
    /* a bad host or a missing key is said before the model loads */
    if (llmem_server_config_check(&sc) != LLMEM_OK) {
        free(dir);
        return CLI_USAGE;
    }

    /* Every thread created from here on inherits the mask: only sigwait below takes them. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* what the server holds beside the engine is part of the plan's runtime baseline */
    ec.runtime_reserve_bytes = llmem_server_runtime_reserve(&sc, ec.max_sequences);
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    if ((rc = cli_engine_open("serve", model, &ec, 0, &e)) != CLI_OK)
        goto out;
    if (llmem_server_start(e, &sc, &s) != LLMEM_OK) {
        fprintf(stderr, "llmem serve: cannot start the server\n");
        rc = CLI_FAIL;
        goto out;
    }
    char line[512];
    llmem_engine_limits_line(e, line, sizeof(line));
    fprintf(stderr, "llmem: serving %s at %s; limits applied: %s\n", sc.model_name,
            llmem_server_url(s), line);
    fflush(stderr);
    int sig = 0;
    sigwait(&stop, &sig);
    fprintf(stderr, "llmem: %s: stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    llmem_server_stop(s);
out:
    llmem_engine_close(e);
    free(dir);
    return rc;
}
