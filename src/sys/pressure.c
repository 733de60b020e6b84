/*
 * sys/pressure.c — memory pressure as the guard sees it (SPEC §6.4): this process's resident
 * memory (/proc/self/statm: resident pages × page size) and the kernel's pressure stall
 * information for memory (/proc/pressure/memory: the "some" and "full" 10-second averages, in
 * percent of wall time), and the counters of the cgroup v2 memory.events of this process's
 * cgroup (high, max, oom: how often usage crossed memory.high, hit memory.max, invoked the OOM
 * killer; the guard watches them rise); and the resident memory with its peak from
 * /proc/self/status, which the plan's runtime baseline and --stats report. Read below a root
 * directory so that tests can fake them.
 */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/file.h"
#include "llmem/status.h"
#include "llmem/sys.h"
#include "sys/probe.h"

static int read_small(const char *root, const char *path, char **text) {
    char full[4096];
    snprintf(full, sizeof(full), "%s%s", root, path);
    size_t len = 0;
    return llmem_file_read_quiet(full, 1 << 16, text, &len);
}

/* The avg10 of the line starting with `kind` ("some" or "full"); −1 when absent. */
static double psi_avg10(const char *text, const char *kind) {
    for (const char *line = text; line != NULL && *line;) {
        if (strncmp(line, kind, strlen(kind)) == 0) {
            const char *a = strstr(line, "avg10=");
            const char *end = strchr(line, '\n');
            if (a != NULL && (end == NULL || a < end))
                return strtod(a + 6, NULL);
        }
        line = strchr(line, '\n');
        line = line != NULL ? line + 1 : NULL;
    }
    return -1;
}

/* The memory.events path of this process's cgroup below root, found once per root: the last
 * root asked for and its answer are remembered ("" when there is none). */
static void events_path(const char *root, char *path, size_t size) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static char cached_root[PATH_MAX], cached_path[PATH_MAX];
    static int cached;
    pthread_mutex_lock(&lock);
    if (!cached || strcmp(cached_root, root) != 0) {
        char dir[PATH_MAX];
        cached_path[0] = '\0';
        static const char name[] = "/memory.events";
        if (llmem_sys_cgroup_v2_dir(root, dir, sizeof(dir)) &&
            strlen(dir) + sizeof(name) <= sizeof(cached_path)) {
            const size_t n = strlen(dir); /* (a copy, not snprintf: the length is checked) */
            memcpy(cached_path, dir, n);
            memcpy(cached_path + n, name, sizeof(name));
        }
        snprintf(cached_root, sizeof(cached_root), "%s", root);
        cached = strlen(root) < sizeof(cached_root);
    }
    snprintf(path, size, "%s", cached_path);
    pthread_mutex_unlock(&lock);
}

static void read_events(const char *root, struct llmem_sys_pressure *p) {
    char path[PATH_MAX], *text = NULL;
    size_t len = 0;
    events_path(root, path, sizeof(path));
    if (path[0] == '\0' || llmem_file_read_quiet(path, 1 << 16, &text, &len) != LLMEM_OK)
        return;
    p->cgroup_high = llmem_sys_stat_field(text, "high");
    p->cgroup_max = llmem_sys_stat_field(text, "max");
    p->cgroup_oom = llmem_sys_stat_field(text, "oom");
    free(text);
}

void llmem_sys_pressure_read_at(const char *root, struct llmem_sys_pressure *p) {
    p->cgroup_high = p->cgroup_max = p->cgroup_oom = LLMEM_SYS_UNKNOWN;
    p->resident_bytes = LLMEM_SYS_UNKNOWN;
    p->psi_some_avg10 = p->psi_full_avg10 = -1;
    char *text = NULL;
    if (read_small(root, "/proc/self/statm", &text) == LLMEM_OK) {
        long long size = 0, resident = 0;
        if (sscanf(text, "%lld %lld", &size, &resident) == 2 && resident >= 0)
            p->resident_bytes = (int64_t)resident * (int64_t)sysconf(_SC_PAGESIZE);
        free(text);
    }
    if (read_small(root, "/proc/pressure/memory", &text) == LLMEM_OK) {
        p->psi_some_avg10 = psi_avg10(text, "some");
        p->psi_full_avg10 = psi_avg10(text, "full");
        free(text);
    }
    read_events(root, p);
}

void llmem_sys_pressure_read(struct llmem_sys_pressure *p) {
    llmem_sys_pressure_read_at("", p);
}

void llmem_sys_resident_read_at(const char *root, struct llmem_sys_resident *r) {
    r->current_bytes = r->peak_bytes = LLMEM_SYS_UNKNOWN;
    char *text = NULL;
    if (read_small(root, "/proc/self/status", &text) != LLMEM_OK)
        return;
    r->current_bytes = llmem_sys_kb_field(text, "VmRSS");
    r->peak_bytes = llmem_sys_kb_field(text, "VmHWM");
    free(text);
}

void llmem_sys_resident_read(struct llmem_sys_resident *r) {
    llmem_sys_resident_read_at("", r);
}
