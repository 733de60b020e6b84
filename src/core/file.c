/*
 * core/file.c — bounded whole-file reads and positioned reads, with errors that name the path.
 */
#include "core/file.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/log.h"

/* Reads to end of file, so files whose size the kernel reports as 0 (/proc, /sys) read whole.
 * Failures log at `level`: ERROR for files the caller needs, DEBUG for probes. */
static int file_read(const char *path, int64_t max_bytes, int level, char **data, size_t *len) {
#define FILE_FAIL(...) llmem_log_line((enum llmem_log_level)level, "llmem_file_read", __VA_ARGS__)
    int status = LLMEM_OK;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        FILE_FAIL("%s: %s", path, strerror(errno));
        return errno == ENOENT || errno == ENOTDIR ? LLMEM_ENOENT : LLMEM_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        FILE_FAIL("%s: not a regular file", path);
        status = LLMEM_EIO;
        goto out_close;
    }
    if ((int64_t)st.st_size > max_bytes)
        goto too_big;
    /* Start at the reported size (+1 to see EOF in one read); grow for files that lie about it. */
    size_t cap = (size_t)st.st_size + 1 < 4096 ? 4096 : (size_t)st.st_size + 1, used = 0;
    char *buf = malloc(cap);
    if (buf == NULL)
        goto out_nomem;
    for (;;) {
        if (used + 1 >= cap) {
            if ((int64_t)used > max_bytes) {
                free(buf);
                goto too_big;
            }
            char *grown = realloc(buf, cap * 2);
            if (grown == NULL) {
                free(buf);
                goto out_nomem;
            }
            buf = grown;
            cap *= 2;
        }
        ssize_t n = read(fd, buf + used, cap - used - 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            FILE_FAIL("%s: read failed: %s", path, strerror(errno));
            free(buf);
            status = LLMEM_EIO;
            goto out_close;
        }
        if (n == 0)
            break;
        used += (size_t)n;
    }
    if ((int64_t)used > max_bytes) {
        free(buf);
        goto too_big;
    }
    buf[used] = '\0';
    *data = buf;
    *len = used;
    goto out_close;
too_big:
    FILE_FAIL("%s: more than the %" PRId64 " bytes allowed for this file", path, max_bytes);
    status = LLMEM_ERANGE;
    goto out_close;
out_nomem:
    FILE_FAIL("%s: out of memory reading it", path);
    status = LLMEM_ENOMEM;
out_close:
    close(fd);
    return status;
#undef FILE_FAIL
}

int llmem_file_read(const char *path, int64_t max_bytes, char **data, size_t *len) {
    return file_read(path, max_bytes, LLMEM_LOG_ERROR, data, len);
}

int llmem_file_read_quiet(const char *path, int64_t max_bytes, char **data, size_t *len) {
    return file_read(path, max_bytes, LLMEM_LOG_DEBUG, data, len);
}

int llmem_file_pread(int fd, const char *path, void *buf, size_t len, int64_t offset) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, (char *)buf + done, len - done, (off_t)(offset + (int64_t)done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            LLMEM_ERROR("%s: read failed: %s", path, strerror(errno));
            return LLMEM_EIO;
        }
        if (n == 0) {
            LLMEM_ERROR("%s: file ends after %" PRId64 " bytes, expected %zu more", path,
                        offset + (int64_t)done, len - done);
            return LLMEM_EIO;
        }
        done += (size_t)n;
    }
    return LLMEM_OK;
}

int llmem_path_join(char *buf, size_t buf_size, const char *dir, const char *name) {
    size_t dl = strlen(dir);
    const char *sep = (dl > 0 && dir[dl - 1] == '/') ? "" : "/";
    int n = snprintf(buf, buf_size, "%s%s%s", dir, sep, name);
    if (n < 0 || (size_t)n >= buf_size) {
        LLMEM_ERROR("path too long: %s/%s", dir, name);
        return LLMEM_ERANGE;
    }
    return LLMEM_OK;
}
