/*
 * core/log.c — status messages, the log callback and the assertion hook.
 *
 * The callback is process-wide and read under a lock-free pointer swap; the last error is
 * thread-local, so concurrent failures in different threads never mix their messages.
 */
#include "core/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

struct log_sink {
    llmem_log_fn fn;
    void *user;
    enum llmem_log_level max_level;
};

static struct log_sink sinks[2];
static _Atomic int sink_index;
static _Atomic(llmem_assert_fn) assert_fn;
static _Thread_local char last_error[1024];

const char *llmem_status_str(int status) {
    switch (status) {
    case LLMEM_OK: return "success";
    case LLMEM_EINVAL: return "invalid argument";
    case LLMEM_ENOMEM: return "out of memory";
    case LLMEM_EIO: return "input/output error";
    case LLMEM_ENOENT: return "not found";
    case LLMEM_EFORMAT: return "malformed input";
    case LLMEM_ERANGE: return "value out of range";
    case LLMEM_EUNSUPPORTED: return "not supported";
    case LLMEM_EBUSY: return "busy, try again later";
    default: return "unknown status";
    }
}

const char *llmem_status_name(int status) {
    switch (status) {
    case LLMEM_OK: return "LLMEM_OK";
    case LLMEM_EINVAL: return "LLMEM_EINVAL";
    case LLMEM_ENOMEM: return "LLMEM_ENOMEM";
    case LLMEM_EIO: return "LLMEM_EIO";
    case LLMEM_ENOENT: return "LLMEM_ENOENT";
    case LLMEM_EFORMAT: return "LLMEM_EFORMAT";
    case LLMEM_ERANGE: return "LLMEM_ERANGE";
    case LLMEM_EUNSUPPORTED: return "LLMEM_EUNSUPPORTED";
    case LLMEM_EBUSY: return "LLMEM_EBUSY";
    default: return "LLMEM_UNKNOWN";
    }
}

void llmem_log_set_callback(llmem_log_fn fn, void *user, enum llmem_log_level max_level) {
    /* Writers are rare (start-up); flip between two slots so a reader never sees a torn sink. */
    int next = 1 - atomic_load(&sink_index);
    sinks[next] = (struct log_sink){fn, user, max_level};
    atomic_store(&sink_index, next);
}

const char *llmem_last_error(void) {
    return last_error;
}

void llmem_log_set_last_error(const char *line) {
    snprintf(last_error, sizeof(last_error), "%s", line);
}

void llmem_log_line(enum llmem_log_level level, const char *func, const char *fmt, ...) {
    struct log_sink sink = sinks[atomic_load(&sink_index)];
    if (level != LLMEM_LOG_ERROR && (sink.fn == NULL || level > sink.max_level))
        return;

    char line[1024];
    int n = snprintf(line, sizeof(line), "%s: ", func);
    if (n < 0)
        n = 0;
    if ((size_t)n < sizeof(line)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
        va_end(ap);
    }
    if (level == LLMEM_LOG_ERROR)
        snprintf(last_error, sizeof(last_error), "%s", line);
    if (sink.fn != NULL && level <= sink.max_level)
        sink.fn(level, line, sink.user);
}

void llmem_set_assert_callback(llmem_assert_fn fn) {
    atomic_store(&assert_fn, fn);
}

void llmem_assert_fail(const char *file, int line, const char *expr) {
    llmem_assert_fn fn = atomic_load(&assert_fn);
    if (fn != NULL)
        fn(file, line, expr); /* (it may jump out; past a failed check nothing is safe to run) */
    else
        fprintf(stderr, "%s:%d: llmem assertion failed: %s\n", file, line, expr);
    abort();
}
