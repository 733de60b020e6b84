/*
 * sys/probe.h — internals of the machine probe shared by its files and by cli/: parsing kernel
 * pseudo-files, the cgroup walk, and the JSON form of a struct llmem_device_info.
 */
#ifndef LLMEM_SYS_PROBE_H
#define LLMEM_SYS_PROBE_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "llmem/sys.h"

/* Parses a whole file's text as one non-negative decimal integer (surrounding whitespace
 * allowed). Returns 1 and sets *value, or 0 for anything else (empty, sign, junk, overflow). */
int llmem_sys_parse_u64(const char *text, int64_t *value);

/* The value of a "key value" line of a cgroup memory.stat (or "Key: value" without a unit);
 * LLMEM_SYS_UNKNOWN when absent or malformed. */
int64_t llmem_sys_stat_field(const char *text, const char *key);
/* The value of a "Key: N kB" line (/proc/meminfo, /proc/self/status) in bytes;
 * LLMEM_SYS_UNKNOWN when absent or malformed. */
int64_t llmem_sys_kb_field(const char *text, const char *key);

/* The CPUID brand string on x86-64 ("" elsewhere or when the CPU has none). */
void llmem_sys_cpu_brand(char *buf, size_t buf_size);

/* The memory cgroup of this process, as read below `root` (see llmem_sys_probe_host_at). */
struct llmem_sys_cgroup {
    int version;                     /* 0 (none), 1 or 2 */
    int64_t limit;                   /* bytes, LLMEM_SYS_UNLIMITED or LLMEM_SYS_UNKNOWN */
    int64_t headroom;                /* bytes, LLMEM_SYS_UNLIMITED or LLMEM_SYS_UNKNOWN */
    char path[LLMEM_SYS_CGPATH_MAX]; /* the cgroup path from /proc/self/cgroup */
};
/* root: "" for the real system, else a directory prefix without a trailing '/'. Never fails:
 * what cannot be read is UNKNOWN in *cg. */
void llmem_sys_cgroup_probe(const char *root, struct llmem_sys_cgroup *cg);

/* The directory of this process's cgroup in the v2 hierarchy, as read below `root` (its mount
 * point when the cgroup's own directory is not there): 1 with dir filled, 0 when the memory
 * controller is not on a v2 hierarchy or nothing can be read. */
int llmem_sys_cgroup_v2_dir(const char *root, char *dir, size_t dir_size);

/* Adds the device's fields to obj. Keys: backend ("cpu" | "cuda"), index (CUDA only), name,
 * arch, memory_size, max_recommended_working_set_size, ceiling_source, max_buffer_length,
 * available, memory_bandwidth (bytes/s); for the host also mem_available, cgroup_limit,
 * cgroup_headroom, cgroup_version, cgroup_path, wired_limit, n_cpus. Sizes are integers in bytes;
 * an unknown value (or an empty string) is null; a limit that is not set (LLMEM_SYS_UNLIMITED) is
 * the string "unlimited". Returns LLMEM_OK or LLMEM_ENOMEM (logged). */
int llmem_sys_device_info_json(const struct llmem_device_info *info, cJSON *obj);

#endif
