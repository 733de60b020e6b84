/*
 * llmem/status.h — status codes, the log callback and the assertion hook.
 *
 * Every fallible llmem function returns an `enum llmem_status` (0 on success, negative on
 * failure). The function that detects a failure logs exactly one line at LLMEM_LOG_ERROR, starting
 * with its own name; callers pass the status up without logging again, so a failure produces one
 * clear message. The library never prints and never exits: without a callback, log lines are only
 * kept as the calling thread's last error (`llmem_last_error`).
 */
#ifndef LLMEM_STATUS_H
#define LLMEM_STATUS_H

#include "llmem/api.h"

#ifdef __cplusplus
extern "C" {
#endif

enum llmem_status {
    LLMEM_OK = 0,
    LLMEM_EINVAL = -1,       /* an argument or option value is invalid */
    LLMEM_ENOMEM = -2,       /* out of memory, or a memory limit refused the allocation */
    LLMEM_EIO = -3,          /* a read, write or system call failed */
    LLMEM_ENOENT = -4,       /* a file, model or name does not exist */
    LLMEM_EFORMAT = -5,      /* a file or document is malformed */
    LLMEM_ERANGE = -6,       /* a number is out of range or would overflow */
    LLMEM_EUNSUPPORTED = -7, /* valid input that this build does not support */
    LLMEM_EBUSY = -8         /* a queue or resource is full for now: try again later */
};

/* A short human description ("out of memory"); never NULL, also for unknown values. */
LLMEM_API const char *llmem_status_str(int status);
/* The enum spelling ("LLMEM_ENOMEM"); never NULL. */
LLMEM_API const char *llmem_status_name(int status);

enum llmem_log_level {
    LLMEM_LOG_ERROR = 0,
    LLMEM_LOG_WARN = 1,
    LLMEM_LOG_INFO = 2,
    LLMEM_LOG_DEBUG = 3
};

typedef void (*llmem_log_fn)(enum llmem_log_level level, const char *line, void *user);

/* Installs the process-wide log callback; lines above max_level are dropped. NULL removes it.
 * A line being logged on another thread as it is replaced may still reach the old callback: keep
 * what its `user` points at alive until the threads that log (an engine, a server) are closed. */
LLMEM_API void llmem_log_set_callback(llmem_log_fn fn, void *user, enum llmem_log_level max_level);

/* The last line this thread logged at LLMEM_LOG_ERROR ("" when none); valid until the next. */
LLMEM_API const char *llmem_last_error(void);

/* Called on API misuse (LLMEM_ASSERT); the default prints file:line to stderr and aborts. A
 * callback may report and jump out (longjmp, as a test harness does); if it returns, the process
 * aborts: nothing past a failed check is safe to run. */
typedef void (*llmem_assert_fn)(const char *file, int line, const char *expr);
LLMEM_API void llmem_set_assert_callback(llmem_assert_fn fn);

#ifdef __cplusplus
}
#endif

#endif
