/*
 * cli/info.c — `llmem info [--json] [--options]`: the machine probe of SPEC §1 for the host and
 * every CUDA device, and the LLMEM_* variables set. Human output is an aligned list that says
 * where the ceiling comes from; --json is one object with the host's fields at the top level (and
 * again under "host"), "devices" and "options". --options lists every variable with its doc.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "core/json.h"
#include "core/options.h"
#include "llmem/backend.h"
#include "llmem/kv.h"
#include "llmem/status.h"
#include "llmem/size.h"
#include "llmem/sys.h"
#include "sys/probe.h"

static const char info_usage[] =
    "usage: llmem info [--json] [--options]\n"
    "\n"
    "Probes this machine: physical RAM, the cgroup memory limit, the ceiling (the smaller of the\n"
    "two), available memory, RLIMIT_MEMLOCK, the CPU, its ISA features and the instruction sets\n"
    "of the CPU attention and matmul kernels they select, every CUDA device with its total\n"
    "and free memory, and whether NCCL is built in (a model split over devices). A value that "
    "cannot be read is shown as unknown. The LLMEM_* environment\n"
    "variables that are set follow; one whose value is not accepted is shown as such, and info\n"
    "fails.\n"
    "\n"
    "options:\n"
    "  --json      print one JSON object on stdout: the host's fields at the top level (sizes\n"
    "              in bytes; null when unknown, \"unlimited\" when no limit is set), the same\n"
    "              under \"host\", \"attention_kernels\" (avx512, avx2 or scalar),\n"
    "              \"matmul_kernels\" (quantized weights at fast precision: avx512_vnni,\n"
    "              avx2 or scalar), \"bf16_matmul_kernels\" (bf16 weights at fast precision:\n"
    "              amx_bf16 or avx512_bf16, else the f32 kernels: avx512, avx2 or\n"
    "              scalar),\n"
    "              \"cuda_built\" and \"nccl_built\" (a model splits over devices),\n"
    "              \"devices\": one object per CUDA device, and \"options\": the LLMEM_*\n"
    "              variables set, by name, with their values as text\n"
    "  --options   list every LLMEM_* variable instead: its type, default, what it accepts\n"
    "              and what it does (with --json: an array under \"options\")\n"
    "  -h, --help  show this help\n";

#define LABEL "  %-13s "

/* A size for people: "23.5G", "unknown", or `unlimited_word` for LLMEM_SYS_UNLIMITED. */
static const char *fmt_size(int64_t v, const char *unlimited_word, char *buf, size_t n) {
    if (v == LLMEM_SYS_UNLIMITED)
        return unlimited_word;
    if (v < 0)
        return "unknown";
    return llmem_size_format(v, buf, n);
}

static void print_host(const struct llmem_device_info *h) {
    char a[LLMEM_SIZE_STR_MAX], b[LLMEM_SIZE_STR_MAX];
    printf("host: %s", h->name[0] ? h->name : "unknown CPU");
    if (h->n_cpus > 0)
        printf(", %d CPU%s", h->n_cpus, h->n_cpus == 1 ? "" : "s");
    printf("\n");
    printf(LABEL "%s\n", "isa", h->arch[0] ? h->arch : "none detected");
    printf(LABEL "%s kernels\n", "attention", llmem_kv_kernels_name());
    printf(LABEL "%s kernels (quantized weights, fast precision)\n", "matmul",
           llmem_backend_cpu_matmul_kernels());
    const char *bf16 = llmem_backend_cpu_bf16_kernels();
    printf(LABEL "%s kernels (bf16 weights, fast precision: %s)\n", "", bf16,
           strcmp(bf16, "amx_bf16") == 0      ? "activations rounded to bf16, AMX tiles"
           : strcmp(bf16, "avx512_bf16") == 0 ? "activations rounded to bf16"
                                              : "f32 FMAs, no AVX512-BF16");
    printf(LABEL "%s (physical RAM)\n", "memory", fmt_size(h->memory_size, "", a, sizeof(a)));

    /* The ceiling, and why. */
    printf(LABEL "%s ", "ceiling", fmt_size(h->max_recommended_working_set_size, "", a, sizeof(a)));
    switch (h->ceiling_source) {
    case LLMEM_CEILING_CGROUP: printf("(cgroup v%d limit, below RAM)\n", h->cgroup_version); break;
    case LLMEM_CEILING_RAM:
        if (h->cgroup_limit == LLMEM_SYS_UNLIMITED)
            printf("(RAM; no cgroup limit)\n");
        else
            printf("(RAM; the cgroup v%d limit %s is not below it)\n", h->cgroup_version,
                   llmem_size_format(h->cgroup_limit, b, sizeof(b)));
        break;
    default:
        printf("(%s)\n", h->memory_size < 0 ? "RAM unknown" : "cgroup limit unreadable");
        break;
    }
    printf(LABEL "%s\n", "max buffer", fmt_size(h->max_buffer_length, "", a, sizeof(a)));

    /* Available, and what bounds it. */
    printf(LABEL "%s", "available", fmt_size(h->available, "", a, sizeof(a)));
    if (h->available >= 0 && h->cgroup_headroom >= 0 && h->available == h->cgroup_headroom &&
        h->available < h->mem_available)
        printf(" (cgroup headroom; MemAvailable %s)\n",
               llmem_size_format(h->mem_available, b, sizeof(b)));
    else if (h->available >= 0)
        printf(" (MemAvailable)\n");
    else
        printf("\n");

    /* The cgroup itself. */
    if (h->cgroup_version == 0) {
        printf(LABEL "%s\n", "cgroup",
               h->cgroup_limit == LLMEM_SYS_UNLIMITED ? "none (no memory controller)" : "unknown");
    } else {
        printf(LABEL "v%d %s, limit %s", "cgroup", h->cgroup_version,
               h->cgroup_path[0] ? h->cgroup_path : "?",
               fmt_size(h->cgroup_limit, "none", a, sizeof(a)));
        if (h->cgroup_limit >= 0)
            printf(", headroom %s", fmt_size(h->cgroup_headroom, "none", b, sizeof(b)));
        printf("\n");
    }
    printf(LABEL "%s (RLIMIT_MEMLOCK)\n", "wired limit",
           fmt_size(h->wired_limit, "unlimited", a, sizeof(a)));
}

static void print_device(const struct llmem_device_info *d) {
    char a[LLMEM_SIZE_STR_MAX];
    printf("cuda %d: %s", d->index, d->name[0] ? d->name : "unknown device");
    if (d->arch[0])
        printf(", %s", d->arch);
    printf("\n");
    printf(LABEL "%s (device memory)\n", "memory", fmt_size(d->memory_size, "", a, sizeof(a)));
    printf(LABEL "%s (device memory)\n", "ceiling",
           fmt_size(d->max_recommended_working_set_size, "", a, sizeof(a)));
    printf(LABEL "%s\n", "max buffer", fmt_size(d->max_buffer_length, "", a, sizeof(a)));
    printf(LABEL "%s (cudaMemGetInfo free)\n", "available",
           fmt_size(d->available, "", a, sizeof(a)));
    if (d->memory_bandwidth > 0)
        printf(LABEL "%.0f GB/s (peak: memory clock × bus width)\n", "bandwidth",
               (double)d->memory_bandwidth / 1e9);
}

/* ---- options -------------------------------------------------------------------------------- */

/* Whether the option is well formed; the library's line says why not on stderr. */
static int option_ok(enum llmem_option id) {
    return llmem_option_check(id) == LLMEM_OK;
}

/* The variables set, one a line; returns how many are not accepted. */
static int print_options_set(void) {
    int n_set = 0, n_bad = 0;
    for (int i = 0; i < LLMEM_OPT_COUNT; i++) {
        const enum llmem_option id = (enum llmem_option)i;
        const char *text = llmem_option_text(id);
        if (text == NULL)
            continue;
        if (n_set++ == 0)
            printf("options:\n");
        printf("  %s=%s", llmem_option_info(id)->name, text);
        if (!option_ok(id)) {
            char accepted[160];
            llmem_option_accepted(llmem_option_info(id), accepted, sizeof(accepted));
            printf(" (not accepted: expected %s)", accepted);
            n_bad++;
        }
        printf("\n");
    }
    if (n_set == 0)
        printf("options: no LLMEM_* variable set (`llmem info --options` lists them)\n");
    return n_bad;
}

/* "options": the variables set, by name, their values as text; returns how many are not
 * accepted, or -1 when out of memory. */
static int add_options_set(cJSON *root) {
    cJSON *obj = cJSON_AddObjectToObject(root, "options");
    if (obj == NULL)
        return -1;
    int n_bad = 0;
    for (int i = 0; i < LLMEM_OPT_COUNT; i++) {
        const enum llmem_option id = (enum llmem_option)i;
        const char *text = llmem_option_text(id);
        if (text == NULL)
            continue;
        if (llmem_json_add_string(obj, llmem_option_info(id)->name, text) != LLMEM_OK)
            return -1;
        n_bad += !option_ok(id);
    }
    return n_bad;
}

/* `llmem info --options`: every variable with its type, default, what it accepts and its doc. */
static int print_options_all(int json) {
    cJSON *root = json ? cJSON_CreateObject() : NULL;
    cJSON *list = root != NULL ? cJSON_AddArrayToObject(root, "options") : NULL;
    if (json && list == NULL)
        goto out_delete;
    int n_bad = 0;
    for (int i = 0; i < LLMEM_OPT_COUNT; i++) {
        const enum llmem_option id = (enum llmem_option)i;
        const struct llmem_option_info *o = llmem_option_info(id);
        const char *text = llmem_option_text(id);
        char accepted[160];
        llmem_option_accepted(o, accepted, sizeof(accepted));
        if (text != NULL)
            n_bad += !option_ok(id);
        if (!json) {
            printf("%s (%s, %s%s%s%s)\n    %s\n    accepts %s\n", o->name,
                   llmem_option_type_name(o->type),
                   o->def != NULL ? "default " : "unset by default", o->def != NULL ? o->def : "",
                   text != NULL ? "; set to " : "", text != NULL ? text : "", o->doc, accepted);
            continue;
        }
        cJSON *item = cJSON_CreateObject();
        if (item == NULL || !cJSON_AddItemToArray(list, item)) {
            cJSON_Delete(item);
            goto out_delete;
        }
        if (llmem_json_add_string(item, "name", o->name) != LLMEM_OK ||
            llmem_json_add_string(item, "type", llmem_option_type_name(o->type)) != LLMEM_OK ||
            (o->def != NULL ? llmem_json_add_string(item, "default", o->def)
                            : llmem_json_add_null(item, "default")) != LLMEM_OK ||
            llmem_json_add_string(item, "accepts", accepted) != LLMEM_OK ||
            llmem_json_add_string(item, "doc", o->doc) != LLMEM_OK ||
            (text != NULL ? llmem_json_add_string(item, "value", text)
                          : llmem_json_add_null(item, "value")) != LLMEM_OK)
            goto out_delete;
    }
    if (json && cli_print_json(root) != CLI_OK)
        return CLI_FAIL;
    return n_bad > 0 ? CLI_FAIL : CLI_OK;
out_delete:
    fprintf(stderr, "llmem info: out of memory building the JSON output\n");
    cJSON_Delete(root);
    return CLI_FAIL;
}

/* ---- the machine ---------------------------------------------------------------------------- */

static int print_json(const struct llmem_device_info *host, const struct llmem_device_info *devices,
                      int n_devices) {
    cJSON *root = cJSON_CreateObject();
    if (root == NULL || llmem_sys_device_info_json(host, root) != LLMEM_OK ||
        llmem_json_add_bool(root, "cuda_built", llmem_backend_cuda_available()) != LLMEM_OK ||
        llmem_json_add_bool(root, "nccl_built", llmem_backend_nccl_available()) != LLMEM_OK ||
        llmem_json_add_string(root, "attention_kernels", llmem_kv_kernels_name()) != LLMEM_OK ||
        llmem_json_add_string(root, "matmul_kernels", llmem_backend_cpu_matmul_kernels()) !=
            LLMEM_OK ||
        llmem_json_add_string(root, "bf16_matmul_kernels", llmem_backend_cpu_bf16_kernels()) !=
            LLMEM_OK)
        goto out_delete;
    cJSON *host_obj = cJSON_AddObjectToObject(root, "host");
    if (host_obj == NULL || llmem_sys_device_info_json(host, host_obj) != LLMEM_OK)
        goto out_delete;
    cJSON *list = cJSON_AddArrayToObject(root, "devices");
    if (list == NULL)
        goto out_delete;
    for (int i = 0; i < n_devices; i++) {
        cJSON *dev = cJSON_CreateObject();
        if (dev == NULL || !cJSON_AddItemToArray(list, dev)) {
            cJSON_Delete(dev);
            goto out_delete;
        }
        if (llmem_sys_device_info_json(&devices[i], dev) != LLMEM_OK)
            goto out_delete;
    }
    const int n_bad = add_options_set(root);
    if (n_bad < 0)
        goto out_delete;
    int status = cli_print_json(root);
    return status == CLI_OK && n_bad > 0 ? CLI_FAIL : status;
out_delete:
    fprintf(stderr, "llmem info: out of memory building the JSON output\n");
    cJSON_Delete(root);
    return CLI_FAIL;
}

int cli_info(int argc, char **argv) {
    int json = 0, options = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--options") == 0) {
            options = 1;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(info_usage, stdout);
            return CLI_OK;
        } else {
            cli_usage_error("info", "unknown %s '%s' (see `llmem info --help`)",
                            argv[i][0] == '-' ? "option" : "argument", argv[i]);
            return CLI_USAGE;
        }
    }
    if (options)
        return print_options_all(json);

    struct llmem_device_info host;
    if (llmem_sys_probe_host(&host) != LLMEM_OK)
        return CLI_FAIL;

    int n_devices = 0, status = CLI_OK;
    llmem_backend_device_count(&n_devices);
    struct llmem_device_info *devices = NULL;
    if (n_devices > 0) {
        devices = calloc((size_t)n_devices, sizeof(*devices));
        if (devices == NULL) {
            fprintf(stderr, "llmem info: out of memory\n");
            return CLI_FAIL;
        }
    }
    int n_ok = 0;
    for (int i = 0; i < n_devices; i++)
        if (llmem_backend_device_info(i, &devices[n_ok]) == LLMEM_OK)
            n_ok++;
        else
            status = CLI_FAIL; /* the runtime's error is already on stderr */

    if (json) {
        int s = print_json(&host, devices, n_ok);
        if (s != CLI_OK)
            status = s;
    } else {
        print_host(&host);
        for (int i = 0; i < n_ok; i++)
            print_device(&devices[i]);
        if (!llmem_backend_cuda_available())
            printf("cuda: not built in\n");
        else if (n_devices == 0)
            printf("cuda: no devices (LLMEM_VERBOSE=1 says why)\n");
        if (llmem_backend_cuda_available())
            printf("nccl: %s\n", llmem_backend_nccl_available()
                                     ? "built in (--tensor-parallel over devices)"
                                     : "not built in (a model runs on one device)");
        if (print_options_set() > 0)
            status = CLI_FAIL;
    }
    free(devices);
    return status;
}
