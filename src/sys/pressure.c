/*
 * sys/pressure.c — memory pressure as the guard sees it (SPEC §6.4): this process's resident
 * memory (/proc/self/statm: resident pages × page size) and the kernel's pressure stall
 * information for memory (/proc/pressure/memory: the "some" and "full" 10-second averages, in
 * percent of wall time). Read below a root directory so that tests can fake both files.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/file.h"
#include "llmem/status.h"
#include "llmem/sys.h"

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

void llmem_sys_pressure_read_at(const char *root, struct llmem_sys_pressure *p) {
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
}

void llmem_sys_pressure_read(struct llmem_sys_pressure *p) {
    llmem_sys_pressure_read_at("", p);
}
