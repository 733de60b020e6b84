/*
 * core/file.h — whole-file reads with a size bound and clear errors.
 */
#ifndef LLMEM_CORE_FILE_H
#define LLMEM_CORE_FILE_H

#include <stddef.h>
#include <stdint.h>

/* Opens name (relative to dir_fd, or AT_FDCWD) read-only without blocking, so a FIFO or a device
 * in place of a file cannot hang the caller, and refuses anything but a regular file; the
 * descriptor returned in *fd is blocking again. Logs nothing: on failure *fd = -1 and why holds
 * the reason (naming the kind of file found). LLMEM_ENOENT when missing, LLMEM_EFORMAT when not a
 * regular file, LLMEM_EIO otherwise. */
int llmem_file_open_regular_at(int dir_fd, const char *name, int *fd, char *why, size_t why_size);
/* The same for a path, logging one line naming it at ERROR as func on failure. */
int llmem_file_open_regular(const char *path, const char *func, int *fd);

/* Reads the whole file (to end of file, so /proc and /sys files work) into a malloc'ed,
 * NUL-terminated buffer. LLMEM_ENOENT when missing, LLMEM_EFORMAT when not a regular file (a FIFO
 * is refused without waiting on it), LLMEM_ERANGE
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
