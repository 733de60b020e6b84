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

int llmem_file_read(const char *path, int64_t max_bytes, char **data, size_t *len) {
    int status = LLMEM_OK;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        LLMEM_ERROR("%s: %s", path, strerror(errno));
        return errno == ENOENT ? LLMEM_ENOENT : LLMEM_EIO;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        LLMEM_ERROR("%s: %s", path, strerror(errno));
        status = LLMEM_EIO;
        goto out_close;
    }
    if (!S_ISREG(st.st_mode)) {
        LLMEM_ERROR("%s: not a regular file", path);
        status = LLMEM_EIO;
        goto out_close;
    }
    if ((int64_t)st.st_size > max_bytes) {
        LLMEM_ERROR("%s: %" PRId64 " bytes is more than the %" PRId64 " allowed for this file",
                    path, (int64_t)st.st_size, max_bytes);
        status = LLMEM_ERANGE;
        goto out_close;
    }
    size_t size = (size_t)st.st_size;
    char *buf = malloc(size + 1);
    if (buf == NULL) {
        LLMEM_ERROR("%s: out of memory reading %zu bytes", path, size);
        status = LLMEM_ENOMEM;
        goto out_close;
    }
    status = llmem_file_pread(fd, path, buf, size, 0);
    if (status != LLMEM_OK) {
        free(buf);
        goto out_close;
    }
    buf[size] = '\0';
    *data = buf;
    *len = size;
out_close:
    close(fd);
    return status;
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
