/*
 * core/size.c — the one size parser and formatter (see llmem/size.h).
 *
 * Parsing is exact integer arithmetic: the integer part and up to 18 fraction digits are read as
 * integers, multiplied by the binary unit with overflow checks, and the fraction is rounded down.
 */
#include "llmem/size.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "core/log.h"
#include "core/size_int.h"

static int unit_shift(char c) {
    switch (tolower((unsigned char)c)) {
    case 'k': return 10;
    case 'm': return 20;
    case 'g': return 30;
    case 't': return 40;
    default: return -1;
    }
}

/* Reports why text is not a size, as llmem_size_parse's line unless quiet. */
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        if (!quiet)                                                                                \
            LLMEM_ERROR_AS("llmem_size_parse", __VA_ARGS__);                                       \
    } while (0)

static int parse(const char *text, int64_t *bytes, int quiet) {
    if (text == NULL || *text == '\0') {
        FAIL("empty size; expected a number of bytes or a size like 48G, 512M, 1.5T");
        return LLMEM_EINVAL;
    }
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    if (*p == '-') {
        FAIL("'%s': a size cannot be negative", text);
        return LLMEM_EINVAL;
    }
    if (*p == '+')
        p++;
    if (!isdigit((unsigned char)*p)) {
        FAIL("'%s' is not a size; expected a number of bytes or a size like 48G, 512M, 1.5T", text);
        return LLMEM_EINVAL;
    }

    uint64_t whole = 0;
    int too_big = 0;
    for (; isdigit((unsigned char)*p); p++) {
        unsigned d = (unsigned)(*p - '0');
        if (whole > (UINT64_MAX - d) / 10)
            too_big = 1;
        else
            whole = whole * 10 + d;
    }
    uint64_t frac = 0, frac_scale = 1;
    int has_frac = 0;
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p)) {
            FAIL("'%s' is not a size: expected digits after the decimal point", text);
            return LLMEM_EINVAL;
        }
        for (; isdigit((unsigned char)*p); p++) {
            if (frac_scale < 1000000000000000000ULL) { /* further digits cannot change bytes */
                frac = frac * 10 + (uint64_t)(*p - '0');
                frac_scale *= 10;
            }
            has_frac = 1;
        }
    }
    int shift = 0;
    if (*p != '\0' && unit_shift(*p) >= 0) {
        shift = unit_shift(*p);
        p++;
        if (*p == 'i' || *p == 'I')
            p++;
        if (*p == 'b' || *p == 'B')
            p++;
    } else if (*p == 'b' || *p == 'B') {
        p++;
    }
    while (isspace((unsigned char)*p))
        p++;
    if (*p != '\0') {
        FAIL("'%s' is not a size: unexpected '%s' (units are K, M, G, T)", text, p);
        return LLMEM_EINVAL;
    }
    if (has_frac && shift == 0) {
        FAIL("'%s': a fraction needs a unit (K, M, G or T)", text);
        return LLMEM_EINVAL;
    }
    uint64_t unit = (uint64_t)1 << shift;
    if (too_big || whole > (uint64_t)INT64_MAX / unit) {
        FAIL("'%s' is too large (the largest size is %" PRId64 " bytes)", text, INT64_MAX);
        return LLMEM_ERANGE;
    }
    uint64_t value = whole * unit;
    /* frac / frac_scale × unit, rounded down, without overflow: unit ≤ 2^40, frac < 10^18. */
    uint64_t frac_bytes = (uint64_t)(((unsigned __int128)frac * unit) / frac_scale);
    if (value > (uint64_t)INT64_MAX - frac_bytes) {
        FAIL("'%s' is too large (the largest size is %" PRId64 " bytes)", text, INT64_MAX);
        return LLMEM_ERANGE;
    }
    *bytes = (int64_t)(value + frac_bytes);
    return LLMEM_OK;
}

#undef FAIL

int llmem_size_parse(const char *text, int64_t *bytes) {
    return parse(text, bytes, 0);
}

int llmem_size_parse_quiet(const char *text, int64_t *bytes) {
    return parse(text, bytes, 1);
}

char *llmem_size_format(int64_t bytes, char *buf, size_t buf_size) {
    static const char units[] = {'B', 'K', 'M', 'G', 'T', 'P', 'E'};
    const char *sign = bytes < 0 ? "-" : "";
    uint64_t mag = bytes < 0 ? (uint64_t)0 - (uint64_t)bytes : (uint64_t)bytes;
    int u = 0;
    while (u < 6 && mag >= ((uint64_t)1 << (10 * (u + 1))))
        u++;
    if (u == 0) {
        snprintf(buf, buf_size, "%s%" PRIu64 "B", sign, mag);
    } else if (mag % ((uint64_t)1 << (10 * u)) == 0) {
        snprintf(buf, buf_size, "%s%" PRIu64 "%c", sign, mag >> (10 * u), units[u]);
    } else {
        double v = (double)mag / (double)((uint64_t)1 << (10 * u));
        snprintf(buf, buf_size, "%s%.1f%c", sign, v, units[u]);
    }
    return buf;
}

char *llmem_size_format_short(int64_t bytes, char *buf, size_t buf_size) {
    static const char units[] = {'B', 'K', 'M', 'G'};
    uint64_t mag = bytes < 0 ? (uint64_t)0 - (uint64_t)bytes : (uint64_t)bytes;
    int u = 0;
    while (u < 3 && mag >= ((uint64_t)1 << (10 * (u + 1))))
        u++;
    if (u == 0)
        snprintf(buf, buf_size, "%" PRId64 "B", bytes);
    else
        snprintf(buf, buf_size, "%.1f%c", (double)bytes / (double)((uint64_t)1 << (10 * u)),
                 units[u]);
    return buf;
}
