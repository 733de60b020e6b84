/*
 * core/npy.c — float32 .npy files: a 10-byte preamble (magic, version 1.0, header length), a
 * Python-dict header padded with spaces to a multiple of 64 bytes and ending in '\n', then the
 * raw little-endian data.
 */
#include "core/npy.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/file.h"
#include "core/log.h"
#include "llmem/status.h"

int llmem_npy_write_f32(const char *path, const float *data, int64_t rows, int64_t cols) {
    char header[128];
    int n =
        snprintf(header, sizeof(header),
                 "{'descr': '<f4', 'fortran_order': False, 'shape': (%" PRId64 ", %" PRId64 "), }",
                 rows, cols);
    int total = (10 + n + 1 + 63) / 64 * 64; /* preamble + dict + '\n', padded */
    int pad = total - 10 - n - 1;
    memset(header + n, ' ', (size_t)pad);
    header[n + pad] = '\n';
    uint16_t hlen = (uint16_t)(n + pad + 1);
    unsigned char pre[10] = {0x93,
                             'N',
                             'U',
                             'M',
                             'P',
                             'Y',
                             1,
                             0,
                             (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        LLMEM_ERROR("%s: %s", path, strerror(errno));
        return LLMEM_EIO;
    }
    size_t count = (size_t)(rows * cols);
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(header, 1, hlen, f) == hlen &&
             fwrite(data, sizeof(float), count, f) == count;
    ok &= fclose(f) == 0;
    if (!ok) {
        LLMEM_ERROR("%s: write failed: %s", path, strerror(errno));
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}

int llmem_npy_read_f32(const char *path, float **data, int64_t *rows, int64_t *cols) {
    int fd;
    int opened = llmem_file_open_regular(path, __func__, &fd);
    if (opened != LLMEM_OK)
        return opened;
    FILE *f = fdopen(fd, "rb");
    if (f == NULL) {
        LLMEM_ERROR("%s: %s", path, strerror(errno));
        close(fd);
        return LLMEM_ENOMEM;
    }
    int status = LLMEM_EFORMAT;
    unsigned char pre[10];
    char header[4096];
    float *buf = NULL;
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0 || pre[6] != 1) {
        LLMEM_ERROR("%s: not a version 1 .npy file", path);
        goto out;
    }
    size_t hlen = (size_t)pre[8] | (size_t)pre[9] << 8;
    if (hlen >= sizeof(header) || fread(header, 1, hlen, f) != hlen) {
        LLMEM_ERROR("%s: truncated header", path);
        goto out;
    }
    header[hlen] = '\0';
    if (strstr(header, "'descr': '<f4'") == NULL ||
        strstr(header, "'fortran_order': False") == NULL) {
        LLMEM_ERROR("%s: not a C-order float32 array (%s)", path, header);
        goto out;
    }
    const char *shape = strstr(header, "'shape': (");
    long long r = 0, c = 1;
    if (shape == NULL || (sscanf(shape, "'shape': (%lld, %lld)", &r, &c) < 1) || r < 0 || c < 0 ||
        (r > 0 && c > INT64_MAX / 4 / r)) {
        LLMEM_ERROR("%s: bad shape in the header", path);
        goto out;
    }
    if (strstr(shape, ",)") != NULL) { /* 1-D */
        c = r;
        r = 1;
    }
    size_t count = (size_t)(r * c);
    buf = malloc(count * sizeof(float) + 1);
    if (buf == NULL) {
        LLMEM_ERROR("%s: out of memory for %lld × %lld floats", path, r, c);
        status = LLMEM_ENOMEM;
        goto out;
    }
    if (fread(buf, sizeof(float), count, f) != count) {
        LLMEM_ERROR("%s: truncated data (%lld × %lld floats expected)", path, r, c);
        goto out;
    }
    *data = buf;
    buf = NULL;
    *rows = r;
    *cols = c;
    status = LLMEM_OK;
out:
    free(buf);
    fclose(f);
    return status;
}
