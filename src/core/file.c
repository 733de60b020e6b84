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

static const char *file_kind(mode_t mode) {
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISSOCK(mode))
        return "a socket";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    return "a special file";
}

int llmem_file_open_regular_at(int dir_fd, const char *name, int *fd, char *why, size_t why_size) {
    *fd = -1;
    /* O_NONBLOCK: opening a FIFO with no writer (or a tty, a device) must not wait */
    int f = openat(dir_fd, name, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f < 0) {
        int err = errno;
        snprintf(why, why_size, "%s", strerror(err));
        return err == ENOENT || err == ENOTDIR ? LLMEM_ENOENT : LLMEM_EIO;
    }
    struct stat st;
    if (fstat(f, &st) != 0) {
        snprintf(why, why_size, "cannot stat: %s", strerror(errno));
        close(f);
        return LLMEM_EIO;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, why_size, "%s, not a regular file", file_kind(st.st_mode));
        close(f);
        return LLMEM_EFORMAT;
    }
    int flags = fcntl(f, F_GETFL);
    if (flags < 0 || fcntl(f, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        snprintf(why, why_size, "fcntl: %s", strerror(errno));
        close(f);
        return LLMEM_EIO;
    }
    *fd = f;
    return LLMEM_OK;
}

int llmem_file_open_regular(const char *path, const char *func, int *fd) {
    char why[160];
    int status = llmem_file_open_regular_at(AT_FDCWD, path, fd, why, sizeof(why));
    if (status != LLMEM_OK)
        LLMEM_ERROR_AS(func, "%s: %s", path, why);
    return status;
}

/* Reads to end of file, so files whose size the kernel reports as 0 (/proc, /sys) read whole.
 * Failures log at `level`: ERROR for files the caller needs, DEBUG for probes. */
static int file_read(const char *path, int64_t max_bytes, int level, char **data, size_t *len) {
#define FILE_FAIL(...) llmem_log_line((enum llmem_log_level)level, "llmem_file_read", __VA_ARGS__)
    int status = LLMEM_OK;
    char why[160];
    int fd;
    if ((status = llmem_file_open_regular_at(AT_FDCWD, path, &fd, why, sizeof(why))) != LLMEM_OK) {
        FILE_FAIL("%s: %s", path, why);
        return status;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        FILE_FAIL("%s: cannot stat: %s", path, strerror(errno));
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
