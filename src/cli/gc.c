/*
 * cli/gc.c — `llmem gc`: the session bank's spill store reconciled offline. Every chunk file is
 * read and its checksum checked; rows whose file is missing, truncated or corrupt are dropped,
 * orphan and temp files removed, and the store held to its size cap. A store that a running
 * process owns is left alone (exit status 1).
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli/cli.h"
#include "core/json.h"
#include "llmem/size.h"
#include "llmem/spill.h"

static const char usage[] =
    "usage: llmem gc [--bank-dir DIR] [--spill-max SIZE] [--json]\n"
    "\n"
    "Reconciles the session bank's spill store while no engine uses it: reads every chunk file\n"
    "and checks it, drops manifest rows whose file is missing, truncated or corrupt, removes\n"
    "orphan and temp files, and evicts the least recently used chunks over the size cap.\n"
    "  --bank-dir DIR    the store (default: $XDG_CACHE_HOME/llmem/bank, else\n"
    "                    ~/.cache/llmem/bank)\n"
    "  --spill-max SIZE  the size cap (default: as llmem run: by RAM, at most a quarter of the\n"
    "                    disk)\n"
    "  --json            one JSON object: dir, files, bytes, cap_bytes, rows_dropped,\n"
    "                    orphans_removed, temps_removed, rows_rebuilt, evicted_files\n";

int cli_gc(int argc, char **argv) {
    static const struct option options[] = {
        {"bank-dir", required_argument, NULL, 'd'},
        {"spill-max", required_argument, NULL, 'm'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    struct llmem_spill_config c;
    llmem_spill_config_default(&c);
    int json = 0, opt, rc = CLI_OK;
    optind = 1;
    opterr = 0;
    while (rc == CLI_OK && (opt = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (opt) {
        case 'd': c.dir = optarg; break;
        case 'm':
            rc = cli_parse_size("--spill-max", optarg, &c.max_bytes);
            if (rc == CLI_OK && c.max_bytes == 0)
                rc = cli_usage_error("gc", "--spill-max must be more than 0");
            break;
        case 'j': json = 1; break;
        case 'h': printf("%s", usage); return CLI_OK;
        case ':': rc = cli_usage_error("gc", "%s needs a value", argv[optind - 1]); break;
        default: rc = cli_usage_error("gc", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (optind != argc)
        return cli_usage_error("gc", "unexpected argument '%s' (see --help)", argv[optind]);
    char dir[4096];
    if (c.dir == NULL) {
        if (llmem_spill_default_dir(dir, sizeof(dir)) != LLMEM_OK)
            return CLI_FAIL;
        c.dir = dir;
    }
    struct llmem_spill_stats st;
    if (llmem_spill_gc(&c, &st) != LLMEM_OK)
        return CLI_FAIL; /* the library's one line says why, naming the store */
    if (json) {
        cJSON *root = cJSON_CreateObject();
        int bad = root == NULL || llmem_json_add_string(root, "dir", c.dir);
        const struct {
            const char *key;
            int64_t value;
        } fields[] = {
            {"files", st.files},
            {"bytes", st.bytes},
            {"cap_bytes", st.cap_bytes},
            {"rows_dropped", st.rows_dropped},
            {"orphans_removed", st.orphans_removed},
            {"temps_removed", st.temps_removed},
            {"rows_rebuilt", st.rows_rebuilt},
            {"evicted_files", st.evicted_files},
            {"evicted_bytes", st.evicted_bytes},
        };
        for (size_t i = 0; !bad && i < sizeof(fields) / sizeof(fields[0]); i++)
            bad = llmem_json_add_int(root, fields[i].key, fields[i].value);
        if (bad) {
            cJSON_Delete(root);
            return CLI_FAIL;
        }
        return cli_print_json(root);
    }
    char b[32], cap[32];
    printf("%s: %" PRId64 " chunk %s, %s in all (cap %s)\n", c.dir, st.files,
           st.files == 1 ? "file" : "files", llmem_size_format_short(st.bytes, b, sizeof(b)),
           llmem_size_format_short(st.cap_bytes, cap, sizeof(cap)));
    printf("  rows dropped (file missing, truncated or corrupt): %" PRId64 "\n", st.rows_dropped);
    printf("  orphan files removed: %" PRId64 ", temp files removed: %" PRId64 "\n",
           st.orphans_removed, st.temps_removed);
    if (st.rows_rebuilt > 0)
        printf("  rows rebuilt from chunk files (the manifest was unreadable): %" PRId64 "\n",
               st.rows_rebuilt);
    printf("  chunks evicted over the cap: %" PRId64 " (%s)\n", st.evicted_files,
           llmem_size_format_short(st.evicted_bytes, b, sizeof(b)));
    return CLI_OK;
}
