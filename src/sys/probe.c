/*
 * sys/probe.c — the host probe (SPEC §1): RAM, MemAvailable, the cgroup ceiling and headroom,
 * RLIMIT_MEMLOCK, online CPUs, the CPU model and its ISA features.
 *
 * Guarantee: every field is either a value read from the system or LLMEM_SYS_UNKNOWN; nothing
 * is estimated. Files are read below a root directory so that tests can hand the probe a fake
 * /proc and /sys; malformed contents yield unknowns (and a WARN line), never a crash.
 */
#include "sys/probe.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/file.h"
#include "core/log.h"

#define PROC_FILE_MAX ((int64_t)4 << 20) /* /proc/cpuinfo of a large machine fits */

/* ---------------------------------------------------------------------------------------------
 * Reading kernel pseudo-files and their numbers
 * ------------------------------------------------------------------------------------------- */

/* Reads digits at s into *value (no sign, at most INT64_MAX); *end after them. 0 when none or
 * on overflow. */
static int parse_digits(const char *s, int64_t *value, const char **end) {
    if (!isdigit((unsigned char)*s))
        return 0;
    int64_t v = 0;
    for (; isdigit((unsigned char)*s); s++) {
        int d = *s - '0';
        if (v > (INT64_MAX - d) / 10)
            return 0;
        v = v * 10 + d;
    }
    *value = v;
    *end = s;
    return 1;
}

int llmem_sys_parse_u64(const char *text, int64_t *value) {
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    int64_t v;
    if (!parse_digits(p, &v, &p))
        return 0;
    while (isspace((unsigned char)*p))
        p++;
    if (*p != '\0')
        return 0;
    *value = v;
    return 1;
}

/* The value of the first line "key<sep>value" where sep is spaces/tabs and at most one ':'
 * (meminfo "MemTotal:  1 kB", memory.stat "inactive_file 1", cpuinfo "model name\t: X").
 * Returns a pointer to the value (within its line) or NULL. */
static const char *field_value(const char *text, const char *key) {
    size_t klen = strlen(key);
    for (const char *line = text; line != NULL && *line != '\0';) {
        if (strncmp(line, key, klen) == 0 &&
            (line[klen] == ':' || line[klen] == ' ' || line[klen] == '\t')) {
            const char *p = line + klen;
            while (*p == ' ' || *p == '\t')
                p++;
            if (*p == ':')
                p++;
            while (*p == ' ' || *p == '\t')
                p++;
            return p;
        }
        line = strchr(line, '\n');
        if (line != NULL)
            line++;
    }
    return NULL;
}

/* A non-negative integer field with an optional unit "kB" (×1024), alone on its line. */
static int field_u64(const char *text, const char *key, int allow_kb, int64_t *value) {
    const char *p = field_value(text, key);
    int64_t v;
    if (p == NULL || !parse_digits(p, &v, &p))
        return 0;
    while (*p == ' ' || *p == '\t')
        p++;
    if (allow_kb && strncmp(p, "kB", 2) == 0) {
        if (v > INT64_MAX / 1024)
            return 0;
        v *= 1024;
        p += 2;
    }
    while (*p == ' ' || *p == '\t' || *p == '\r')
        p++;
    if (*p != '\n' && *p != '\0')
        return 0;
    *value = v;
    return 1;
}

int64_t llmem_sys_stat_field(const char *text, const char *key) {
    int64_t v;
    return field_u64(text, key, 0, &v) ? v : LLMEM_SYS_UNKNOWN;
}

int64_t llmem_sys_kb_field(const char *text, const char *key) {
    int64_t v;
    return field_u64(text, key, 1, &v) ? v : LLMEM_SYS_UNKNOWN;
}

/* ---------------------------------------------------------------------------------------------
 * /proc/meminfo and /proc/cpuinfo
 * ------------------------------------------------------------------------------------------- */

static void read_meminfo(const char *root, int64_t *total, int64_t *available) {
    char path[PATH_MAX];
    char *text = NULL;
    size_t len = 0;
    *total = *available = LLMEM_SYS_UNKNOWN;
    snprintf(path, sizeof(path), "%s/proc/meminfo", root);
    int status = llmem_file_read_quiet(path, PROC_FILE_MAX, &text, &len);
    if (status != LLMEM_OK) {
        LLMEM_WARN("%s: %s; RAM and available memory are unknown", path, llmem_status_str(status));
        return;
    }
    if (!field_u64(text, "MemTotal", 1, total))
        LLMEM_WARN("%s: no readable MemTotal", path);
    if (!field_u64(text, "MemAvailable", 1, available))
        LLMEM_WARN("%s: no readable MemAvailable; available memory is unknown", path);
    free(text);
}

/* Copies the rest of the line at p into out, trimmed; "" when p is NULL. */
static void copy_line(const char *p, char *out, size_t out_size) {
    out[0] = '\0';
    if (p == NULL)
        return;
    size_t n = strcspn(p, "\r\n");
    while (n > 0 && isspace((unsigned char)p[n - 1]))
        n--;
    if (n >= out_size)
        n = out_size - 1;
    memcpy(out, p, n);
    out[n] = '\0';
    for (size_t i = 0; i < n; i++) /* keep it printable: it goes into JSON and terminals */
        if ((unsigned char)out[i] < 0x20 || (unsigned char)out[i] == 0x7f)
            out[i] = ' ';
}

static void read_cpu_name(const char *root, int real, char *name, size_t name_size) {
    char path[PATH_MAX];
    char *text = NULL;
    size_t len = 0;
    name[0] = '\0';
    snprintf(path, sizeof(path), "%s/proc/cpuinfo", root);
    if (llmem_file_read_quiet(path, PROC_FILE_MAX, &text, &len) == LLMEM_OK) {
        /* x86 "model name", then what other architectures call it. */
        static const char *const keys[] = {"model name", "Hardware", "cpu model", "cpu"};
        for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]) && name[0] == '\0'; i++)
            copy_line(field_value(text, keys[i]), name, name_size);
        if (name[0] == '\0') { /* arm64 names only the implementer and part */
            char impl[32], part[32];
            copy_line(field_value(text, "CPU implementer"), impl, sizeof(impl));
            copy_line(field_value(text, "CPU part"), part, sizeof(part));
            if (impl[0] != '\0' && part[0] != '\0')
                snprintf(name, name_size, "arm implementer %s part %s", impl, part);
        }
        free(text);
    }
    if (name[0] == '\0' && real)
        llmem_sys_cpu_brand(name, name_size);
}

/* ---------------------------------------------------------------------------------------------
 * The device-info record
 * ------------------------------------------------------------------------------------------- */

const char *llmem_ceiling_source_name(enum llmem_ceiling_source source) {
    switch (source) {
    case LLMEM_CEILING_RAM: return "ram";
    case LLMEM_CEILING_CGROUP: return "cgroup";
    case LLMEM_CEILING_DEVICE: return "device";
    default: return "unknown";
    }
}

void llmem_sys_device_info_init(struct llmem_device_info *info, enum llmem_device_kind kind,
                                int index) {
    LLMEM_ASSERT(info != NULL);
    memset(info, 0, sizeof(*info));
    info->kind = kind;
    info->index = index;
    info->memory_size = LLMEM_SYS_UNKNOWN;
    info->max_recommended_working_set_size = LLMEM_SYS_UNKNOWN;
    info->ceiling_source = LLMEM_CEILING_UNKNOWN;
    info->max_buffer_length = LLMEM_SYS_UNKNOWN;
    info->available = LLMEM_SYS_UNKNOWN;
    info->memory_bandwidth = LLMEM_SYS_UNKNOWN;
    info->mem_available = LLMEM_SYS_UNKNOWN;
    info->cgroup_limit = LLMEM_SYS_UNKNOWN;
    info->cgroup_headroom = LLMEM_SYS_UNKNOWN;
    info->wired_limit = LLMEM_SYS_UNKNOWN;
    info->n_cpus = -1;
}

static int64_t physical_ram(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page_size <= 0 || pages > INT64_MAX / page_size)
        return LLMEM_SYS_UNKNOWN;
    return (int64_t)pages * page_size;
}

int64_t llmem_sys_memlock_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
        LLMEM_WARN("getrlimit(RLIMIT_MEMLOCK): %s", strerror(errno));
        return LLMEM_SYS_UNKNOWN;
    }
    if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (rlim_t)INT64_MAX)
        return LLMEM_SYS_UNLIMITED;
    return (int64_t)rl.rlim_cur;
}

/* ---------------------------------------------------------------------------------------------
 * The probe
 * ------------------------------------------------------------------------------------------- */

int llmem_sys_probe_host_at(const char *root, struct llmem_device_info *info) {
    LLMEM_ASSERT(root != NULL && info != NULL);
    llmem_sys_device_info_init(info, LLMEM_DEVICE_HOST, 0);

    /* "/" (or "") is the real system: prefix "". Otherwise the root without trailing '/'. */
    char prefix[PATH_MAX / 2];
    size_t n = strlen(root);
    while (n > 0 && root[n - 1] == '/')
        n--;
    if (n >= sizeof(prefix)) {
        LLMEM_ERROR("root directory path is too long (%zu bytes)", n);
        return LLMEM_ERANGE;
    }
    memcpy(prefix, root, n);
    prefix[n] = '\0';
    int real = n == 0;

    int64_t mem_total, mem_available;
    read_meminfo(prefix, &mem_total, &mem_available);
    int64_t ram = real ? physical_ram() : mem_total;
    if (real && ram == LLMEM_SYS_UNKNOWN)
        ram = mem_total;

    struct llmem_sys_cgroup cg;
    llmem_sys_cgroup_probe(prefix, &cg);

    info->memory_size = ram;
    info->max_buffer_length = ram;
    info->mem_available = mem_available;
    info->cgroup_version = cg.version;
    info->cgroup_limit = cg.limit;
    info->cgroup_headroom = cg.headroom;
    snprintf(info->cgroup_path, sizeof(info->cgroup_path), "%s", cg.path);

    /* The ceiling: min(RAM, cgroup limit); unknown when either cannot be read. */
    if (ram == LLMEM_SYS_UNKNOWN || cg.limit == LLMEM_SYS_UNKNOWN) {
        info->max_recommended_working_set_size = LLMEM_SYS_UNKNOWN;
        info->ceiling_source = LLMEM_CEILING_UNKNOWN;
    } else if (cg.limit == LLMEM_SYS_UNLIMITED || cg.limit >= ram) {
        info->max_recommended_working_set_size = ram;
        info->ceiling_source = LLMEM_CEILING_RAM;
    } else {
        info->max_recommended_working_set_size = cg.limit;
        info->ceiling_source = LLMEM_CEILING_CGROUP;
    }

    /* Available: MemAvailable, capped by the cgroup headroom when a limit applies. */
    if (mem_available == LLMEM_SYS_UNKNOWN || cg.headroom == LLMEM_SYS_UNKNOWN)
        info->available = LLMEM_SYS_UNKNOWN;
    else if (cg.headroom == LLMEM_SYS_UNLIMITED || cg.headroom >= mem_available)
        info->available = mem_available;
    else
        info->available = cg.headroom;

    info->wired_limit = llmem_sys_memlock_limit();
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    info->n_cpus = cpus > 0 && cpus <= INT_MAX ? (int)cpus : -1;
    read_cpu_name(prefix, real, info->name, sizeof(info->name));
    llmem_sys_isa_string(llmem_sys_isa_features(), info->arch, sizeof(info->arch));
    return LLMEM_OK;
}

int llmem_sys_probe_host(struct llmem_device_info *info) {
    return llmem_sys_probe_host_at("/", info);
}
