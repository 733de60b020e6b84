/*
 * sys/device_json.c — a struct llmem_device_info as JSON fields (see sys/probe.h for the keys).
 * Unknown is null, "no limit" is the string "unlimited", sizes are exact integers in bytes.
 */
#include "core/json.h"
#include "core/log.h"
#include "sys/probe.h"

static int add_size(cJSON *obj, const char *key, int64_t value) {
    if (value == LLMEM_SYS_UNLIMITED)
        return llmem_json_add_string(obj, key, "unlimited");
    if (value < 0)
        return llmem_json_add_null(obj, key);
    return llmem_json_add_int(obj, key, value);
}

static int add_text(cJSON *obj, const char *key, const char *value) {
    return value[0] != '\0' ? llmem_json_add_string(obj, key, value)
                            : llmem_json_add_null(obj, key);
}

int llmem_sys_device_info_json(const struct llmem_device_info *info, cJSON *obj) {
    int host = info->kind == LLMEM_DEVICE_HOST;
    int s = llmem_json_add_string(obj, "backend", host ? "cpu" : "cuda");
    if (s == LLMEM_OK && !host)
        s = llmem_json_add_int(obj, "index", info->index);
    if (s == LLMEM_OK)
        s = add_text(obj, "name", info->name);
    if (s == LLMEM_OK)
        s = add_text(obj, "arch", info->arch);
    if (s == LLMEM_OK)
        s = add_size(obj, "memory_size", info->memory_size);
    if (s == LLMEM_OK)
        s = add_size(obj, "max_recommended_working_set_size",
                     info->max_recommended_working_set_size);
    if (s == LLMEM_OK)
        s = llmem_json_add_string(obj, "ceiling_source",
                                  llmem_ceiling_source_name(info->ceiling_source));
    if (s == LLMEM_OK)
        s = add_size(obj, "max_buffer_length", info->max_buffer_length);
    if (s == LLMEM_OK)
        s = add_size(obj, "available", info->available);
    if (s == LLMEM_OK)
        s = add_size(obj, "memory_bandwidth", info->memory_bandwidth);
    if (!host)
        return s;
    if (s == LLMEM_OK)
        s = add_size(obj, "mem_available", info->mem_available);
    if (s == LLMEM_OK)
        s = add_size(obj, "cgroup_limit", info->cgroup_limit);
    if (s == LLMEM_OK)
        s = add_size(obj, "cgroup_headroom", info->cgroup_headroom);
    if (s == LLMEM_OK)
        s = llmem_json_add_int(obj, "cgroup_version", info->cgroup_version);
    if (s == LLMEM_OK)
        s = add_text(obj, "cgroup_path", info->cgroup_path);
    if (s == LLMEM_OK)
        s = add_size(obj, "wired_limit", info->wired_limit);
    if (s == LLMEM_OK)
        s = info->n_cpus > 0 ? llmem_json_add_int(obj, "n_cpus", info->n_cpus)
                             : llmem_json_add_null(obj, "n_cpus");
    return s;
}
