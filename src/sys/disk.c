/*
 * sys/disk.c — free disk space, for the session bank's spill store (SPEC §6.3: it stops writing
 * while the disk is nearly full, and its default size cap is a fraction of the free space).
 */
#include <sys/statvfs.h>

#include "llmem/sys.h"

int64_t llmem_sys_disk_free(const char *path) {
    struct statvfs st;
    if (path == NULL || statvfs(path, &st) != 0)
        return LLMEM_SYS_UNKNOWN;
    unsigned long long bytes = (unsigned long long)st.f_bavail * (unsigned long long)st.f_frsize;
    return bytes > (unsigned long long)INT64_MAX ? INT64_MAX : (int64_t)bytes;
}
