/*
 * core/log.h — internal logging and assertions.
 *
 * LLMEM_ERROR(fmt, ...) logs one line "function_name: message" at LLMEM_LOG_ERROR and records it
 * as the thread's last error; LLMEM_WARN / LLMEM_INFO / LLMEM_DEBUG log the same way without
 * touching the last error. LLMEM_ASSERT(cond) is for API misuse only (never for bad input).
 */
#ifndef LLMEM_CORE_LOG_H
#define LLMEM_CORE_LOG_H

#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define LLMEM_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define LLMEM_PRINTF(a, b)
#endif

void llmem_log_line(enum llmem_log_level level, const char *func, const char *fmt, ...)
    LLMEM_PRINTF(3, 4);
void llmem_assert_fail(const char *file, int line, const char *expr) __attribute__((noreturn));
/* Makes `line` the calling thread's last error (llmem_last_error) without logging it again: a
 * failure another thread logged, handed to the thread that reports it. */
void llmem_log_set_last_error(const char *line);

#define LLMEM_ERROR(...) llmem_log_line(LLMEM_LOG_ERROR, __func__, __VA_ARGS__)
#define LLMEM_WARN(...)  llmem_log_line(LLMEM_LOG_WARN, __func__, __VA_ARGS__)
#define LLMEM_INFO(...)  llmem_log_line(LLMEM_LOG_INFO, __func__, __VA_ARGS__)
#define LLMEM_DEBUG(...) llmem_log_line(LLMEM_LOG_DEBUG, __func__, __VA_ARGS__)
/* For helpers that report on behalf of the public function that called them. */
#define LLMEM_ERROR_AS(func, ...) llmem_log_line(LLMEM_LOG_ERROR, func, __VA_ARGS__)

/* For invariant checkers (llmem_mem_check, llmem_kv_check): logs "invariant broken: …", sets the
 * caller's `status` to LLMEM_EFORMAT and jumps to its `out` label. */
#define LLMEM_INVARIANT(cond, ...)                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            LLMEM_ERROR("invariant broken: " __VA_ARGS__);                                         \
            status = LLMEM_EFORMAT;                                                                \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

#define LLMEM_ASSERT(cond)                                                                         \
    do {                                                                                           \
        if (!(cond))                                                                               \
            llmem_assert_fail(__FILE__, __LINE__, #cond);                                          \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
