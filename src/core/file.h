/*
 * core/file.h — whole-file reads with a size bound and clear errors.
 */
#ifndef LLMEM_CORE_FILE_H
#define LLMEM_CORE_FILE_H

#include <stddef.h>
#include <stdint.h>

/* Reads the whole file (to end of file, so /proc and /sys files work) into a malloc'ed,
 * NUL-terminated buffer. LLMEM_ENOENT when missing, LLMEM_ERANGE
 * when larger than max_bytes, LLMEM_EIO on a read error, LLMEM_ENOMEM. Each failure is logged with
 * the path. *len excludes the terminator. */
int llmem_file_read(const char *path, int64_t max_bytes, char **data, size_t *len);
/* The same, reading to end of file also where the size is reported as 0 (/proc, /sys), but
 * logging failures only at DEBUG: for probes where a missing file is normal. */
int llmem_file_read_quiet(const char *path, int64_t max_bytes, char **data, size_t *len);

/* Reads exactly len bytes at offset; LLMEM_EIO (logged) on a short read. */
int llmem_file_pread(int fd, const char *path, void *buf, size_t len, int64_t offset);

/* Joins dir and name with one '/' into buf; LLMEM_ERANGE (logged) when it does not fit. */
int llmem_path_join(char *buf, size_t buf_size, const char *dir, const char *name);

#endif
