/*
 * sys/cgroup.c — the memory limit of this process's cgroup, and the headroom under it.
 *
 * 1. /proc/self/cgroup names the cgroup: a v1 line "N:...memory...:/path" (the memory
 *    controller's hierarchy, which wins on hybrid systems) or the v2 line "0::/path".
 * 2. /proc/self/mountinfo names where that hierarchy is mounted and which cgroup is the mount's
 *    root (containers mount their own cgroup as the root); without it the usual places are
 *    tried: /sys/fs/cgroup (v2), /sys/fs/cgroup/unified (hybrid v2), /sys/fs/cgroup/memory (v1).
 * 3. From the process's cgroup up to the mount's root, every level's limit is read (v2
 *    memory.max, v1 memory.limit_in_bytes); the tightest one is the limit. A parent's limit
 *    binds its children, so a nested container is bounded by its parent slice.
 * 4. The headroom is min over limited levels of limit − (usage − inactive_file).
 * Missing files at a level (the root cgroup has no memory.max) are skipped; a present file that
 * cannot be parsed makes the limit unknown: a limit is never guessed.
 */
#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/file.h"
#include "core/log.h"
#include "sys/probe.h"

#define CGROUP_FILE_MAX    ((int64_t)1 << 20)
#define MOUNTINFO_MAX      ((int64_t)16 << 20)
#define NO_LIMIT_THRESHOLD ((int64_t)1 << 62) /* v1 "unlimited" is 2^63 − 4096 */

struct cg_mount {
    char point[PATH_MAX]; /* with the probe's root prefix */
    char root[PATH_MAX];  /* the cgroup at the mount's root, "/" normally */
};

static int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* `token` is one of the sep-separated items of list ("rw,memory" has "memory"). */
static int has_token(const char *list, const char *token, char sep) {
    size_t tl = strlen(token);
    for (const char *p = list;;) {
        if (strncmp(p, token, tl) == 0 && (p[tl] == sep || p[tl] == '\0'))
            return 1;
        p = strchr(p, sep);
        if (p == NULL)
            return 0;
        p++;
    }
}

/* The whole text is `word`, give or take surrounding whitespace. */
static int text_is(const char *text, const char *word) {
    while (isspace((unsigned char)*text))
        text++;
    size_t wl = strlen(word);
    if (strncmp(text, word, wl) != 0)
        return 0;
    for (text += wl; isspace((unsigned char)*text);)
        text++;
    return *text == '\0';
}

/* ---------------------------------------------------------------------------------------------
 * Step 1: /proc/self/cgroup
 * ------------------------------------------------------------------------------------------- */

/* Returns 0 when the file is absent (no cgroups), 1 when parsed (version 0 if no hierarchy
 * carries a memory controller), -1 when unreadable or malformed. */
static int read_self_cgroup(const char *root, int *version, char *path, size_t path_size) {
    char file[PATH_MAX], *text = NULL;
    size_t len = 0;
    snprintf(file, sizeof(file), "%s/proc/self/cgroup", root);
    int status = llmem_file_read_quiet(file, CGROUP_FILE_MAX, &text, &len);
    if (status == LLMEM_ENOENT)
        return 0;
    if (status != LLMEM_OK) {
        LLMEM_WARN("%s: %s; the cgroup limit is unknown", file, llmem_status_str(status));
        return -1;
    }
    int n_lines = 0, v1 = 0, v2 = 0;
    char v2_path[PATH_MAX] = "";
    *version = 0;
    path[0] = '\0';
    for (char *line = text; line != NULL && *line != '\0';) {
        char *next = strchr(line, '\n');
        if (next != NULL)
            *next++ = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 != NULL && c1 > line && c2[1] == '/') {
            n_lines++;
            *c1 = *c2 = '\0';
            const char *id = line, *controllers = c1 + 1, *cpath = c2 + 1;
            if (has_token(controllers, "memory", ',') && !v1) {
                v1 = 1;
                snprintf(path, path_size, "%s", cpath);
            } else if (strcmp(id, "0") == 0 && controllers[0] == '\0') {
                v2 = 1;
                snprintf(v2_path, sizeof(v2_path), "%s", cpath);
            }
        }
        line = next;
    }
    free(text);
    if (n_lines == 0) {
        LLMEM_WARN("%s: no cgroup line; the cgroup limit is unknown", file);
        return -1;
    }
    if (v1) {
        *version = 1;
    } else if (v2) {
        *version = 2;
        snprintf(path, path_size, "%s", v2_path);
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Step 2: where the hierarchy is mounted
 * ------------------------------------------------------------------------------------------- */

/* Undoes mountinfo's octal escapes (\040 for a space) in place. */
static void unescape(char *s) {
    char *out = s;
    for (const char *p = s; *p != '\0'; p++) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '3' && p[2] >= '0' && p[2] <= '7' &&
            p[3] >= '0' && p[3] <= '7') {
            *out++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 3;
        } else {
            *out++ = *p;
        }
    }
    *out = '\0';
}

static int find_mount_in_mountinfo(const char *root, int version, struct cg_mount *m) {
    char file[PATH_MAX], *text = NULL;
    size_t len = 0;
    snprintf(file, sizeof(file), "%s/proc/self/mountinfo", root);
    if (llmem_file_read_quiet(file, MOUNTINFO_MAX, &text, &len) != LLMEM_OK)
        return 0;
    int found = 0;
    for (char *line = text; line != NULL && *line != '\0' && !found;) {
        char *next = strchr(line, '\n');
        if (next != NULL)
            *next++ = '\0';
        /* id parent maj:min root mount-point options [optional...] - fstype source super */
        char *fields[64];
        int n = 0;
        for (char *save = NULL, *tok = strtok_r(line, " ", &save); tok != NULL && n < 64;
             tok = strtok_r(NULL, " ", &save))
            fields[n++] = tok;
        int dash = -1;
        for (int i = 6; i < n; i++)
            if (strcmp(fields[i], "-") == 0) {
                dash = i;
                break;
            }
        if (dash >= 0 && dash + 1 < n) {
            const char *fstype = fields[dash + 1];
            const char *super = dash + 3 < n ? fields[dash + 3] : "";
            int match = version == 2
                            ? strcmp(fstype, "cgroup2") == 0
                            : strcmp(fstype, "cgroup") == 0 && has_token(super, "memory", ',');
            if (match) {
                unescape(fields[3]);
                unescape(fields[4]);
                int a = snprintf(m->point, sizeof(m->point), "%s%s", root, fields[4]);
                int b = snprintf(m->root, sizeof(m->root), "%s", fields[3]);
                found = a > 0 && (size_t)a < sizeof(m->point) && b > 0 &&
                        (size_t)b < sizeof(m->root) && is_dir(m->point);
            }
        }
        line = next;
    }
    free(text);
    return found;
}

static int find_mount(const char *root, int version, struct cg_mount *m) {
    if (find_mount_in_mountinfo(root, version, m))
        return 1;
    static const char *const v2_places[] = {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"};
    static const char *const v1_places[] = {"/sys/fs/cgroup/memory"};
    const char *const *places = version == 2 ? v2_places : v1_places;
    size_t n_places = version == 2 ? 2 : 1;
    for (size_t i = 0; i < n_places; i++) {
        char probe[PATH_MAX];
        int a = snprintf(m->point, sizeof(m->point), "%s%s", root, places[i]);
        int b = snprintf(probe, sizeof(probe), "%s/%s", m->point,
                         version == 2 ? "cgroup.controllers" : "memory.limit_in_bytes");
        struct stat st;
        if (a > 0 && (size_t)a < sizeof(m->point) && b > 0 && (size_t)b < sizeof(probe) &&
            stat(probe, &st) == 0) {
            snprintf(m->root, sizeof(m->root), "/");
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Steps 3–4: the walk to the mount's root
 * ------------------------------------------------------------------------------------------- */

struct cg_walk {
    int version;
    int n_limit_files; /* levels that had a limit file */
    int unknown;       /* a limit file could not be read or parsed */
    int headroom_unknown;
    int64_t limit;    /* tightest, or LLMEM_SYS_UNLIMITED */
    int64_t headroom; /* smallest, or LLMEM_SYS_UNLIMITED */
};

/* Reads one small cgroup file; 1 with *text on success, 0 when absent, -1 when unreadable. */
static int read_cg_file(const char *dir, const char *name, char **text) {
    char file[PATH_MAX];
    size_t len = 0;
    int n = snprintf(file, sizeof(file), "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof(file))
        return -1;
    int status = llmem_file_read_quiet(file, CGROUP_FILE_MAX, text, &len);
    if (status == LLMEM_ENOENT)
        return 0;
    if (status != LLMEM_OK) {
        LLMEM_WARN("%s: %s", file, llmem_status_str(status));
        return -1;
    }
    return 1;
}

static void walk_level(const char *dir, struct cg_walk *w) {
    const char *limit_name = w->version == 2 ? "memory.max" : "memory.limit_in_bytes";
    const char *usage_name = w->version == 2 ? "memory.current" : "memory.usage_in_bytes";
    char *text = NULL;
    int r = read_cg_file(dir, limit_name, &text);
    if (r == 0)
        return;
    w->n_limit_files++;
    if (r < 0) {
        w->unknown = 1;
        return;
    }
    int64_t limit;
    int parsed = llmem_sys_parse_u64(text, &limit);
    if (!parsed && !(w->version == 2 && text_is(text, "max"))) {
        LLMEM_WARN("%s/%s: '%.40s' is not a limit; the cgroup limit is unknown", dir, limit_name,
                   text);
        w->unknown = 1;
    }
    free(text);
    if (!parsed || limit >= NO_LIMIT_THRESHOLD)
        return; /* "max", v1's "unlimited", or unknown (recorded above) */

    if (w->limit == LLMEM_SYS_UNLIMITED || limit < w->limit)
        w->limit = limit;

    /* Headroom at this level: limit − (usage − inactive_file). */
    int64_t usage = LLMEM_SYS_UNKNOWN, inactive = 0;
    if (read_cg_file(dir, usage_name, &text) > 0) {
        if (!llmem_sys_parse_u64(text, &usage)) {
            LLMEM_WARN("%s/%s: '%.40s' is not a size", dir, usage_name, text);
            usage = LLMEM_SYS_UNKNOWN;
        }
        free(text);
    }
    if (usage == LLMEM_SYS_UNKNOWN) {
        w->headroom_unknown = 1;
        return;
    }
    if (read_cg_file(dir, "memory.stat", &text) > 0) {
        /* v1 reports the hierarchy's total under total_*; v2's numbers are hierarchical. */
        int64_t v =
            w->version == 1 ? llmem_sys_stat_field(text, "total_inactive_file") : LLMEM_SYS_UNKNOWN;
        if (v == LLMEM_SYS_UNKNOWN)
            v = llmem_sys_stat_field(text, "inactive_file");
        if (v != LLMEM_SYS_UNKNOWN && v <= usage)
            inactive = v;
        free(text);
    }
    int64_t headroom = limit - (usage - inactive);
    if (headroom < 0)
        headroom = 0;
    if (w->headroom == LLMEM_SYS_UNLIMITED || headroom < w->headroom)
        w->headroom = headroom;
}

/* The directory of cgroup `cpath` under mount m, as the relative part below the mount point. */
static void relative_path(const struct cg_mount *m, const char *cpath, char *rel, size_t rel_size) {
    size_t rl = strlen(m->root);
    const char *r = "";
    if (strcmp(m->root, "/") == 0)
        r = cpath;
    else if (strncmp(cpath, m->root, rl) == 0 && (cpath[rl] == '/' || cpath[rl] == '\0'))
        r = cpath + rl;
    /* Anything unmappable (a cgroup outside the mounted subtree, "..", deleted cgroups) falls
     * back to the mount point: inside a container that is the container's own cgroup. */
    if (strstr(r, "/..") != NULL)
        r = "";
    snprintf(rel, rel_size, "%s", r);
    size_t n = strlen(rel);
    while (n > 0 && rel[n - 1] == '/')
        rel[--n] = '\0';
}

void llmem_sys_cgroup_probe(const char *root, struct llmem_sys_cgroup *cg) {
    char cpath[PATH_MAX];
    memset(cg, 0, sizeof(*cg));
    cg->limit = cg->headroom = LLMEM_SYS_UNKNOWN;

    int r = read_self_cgroup(root, &cg->version, cpath, sizeof(cpath));
    if (r < 0)
        return;
    if (r == 0 || cg->version == 0) { /* no cgroups, or no memory controller: no limit */
        cg->version = 0;
        cg->limit = cg->headroom = LLMEM_SYS_UNLIMITED;
        return;
    }
    size_t pl = strnlen(cpath, sizeof(cg->path) - 1); /* for display: may be truncated */
    memcpy(cg->path, cpath, pl);
    cg->path[pl] = '\0';

    struct cg_mount mount, *m = &mount;
    if (!find_mount(root, cg->version, m)) {
        LLMEM_WARN("cgroup v%d memory hierarchy is not mounted; the cgroup limit is unknown",
                   cg->version);
        return;
    }

    char rel[PATH_MAX], dir[PATH_MAX];
    relative_path(m, cpath, rel, sizeof(rel));
    int n = snprintf(dir, sizeof(dir), "%s%s", m->point, rel);
    if (n < 0 || (size_t)n >= sizeof(dir) || !is_dir(dir)) {
        LLMEM_DEBUG("%s%s is not a directory; reading the mount point %s", m->point, rel, m->point);
        rel[0] = '\0';
    }

    struct cg_walk w = {cg->version, 0, 0, 0, LLMEM_SYS_UNLIMITED, LLMEM_SYS_UNLIMITED};
    for (size_t rl = strlen(rel);;) {
        rel[rl] = '\0';
        n = snprintf(dir, sizeof(dir), "%s%s", m->point, rel);
        if (n < 0 || (size_t)n >= sizeof(dir)) {
            w.unknown = 1;
            break;
        }
        walk_level(dir, &w);
        if (rl == 0)
            break;
        char *slash = strrchr(rel, '/');
        rl = slash != NULL ? (size_t)(slash - rel) : 0;
    }

    if (w.unknown || (w.version == 1 && w.n_limit_files == 0)) {
        if (w.n_limit_files == 0)
            LLMEM_WARN("%s: no memory.limit_in_bytes; the cgroup limit is unknown", m->point);
        return; /* limit and headroom stay unknown */
    }
    cg->limit = w.limit;
    cg->headroom = w.limit == LLMEM_SYS_UNLIMITED ? LLMEM_SYS_UNLIMITED
                   : w.headroom_unknown           ? LLMEM_SYS_UNKNOWN
                                                  : w.headroom;
}

int llmem_sys_cgroup_v2_dir(const char *root, char *dir, size_t dir_size) {
    char cpath[PATH_MAX], rel[PATH_MAX];
    int version = 0;
    if (read_self_cgroup(root, &version, cpath, sizeof(cpath)) != 1 || version != 2)
        return 0;
    struct cg_mount m;
    if (!find_mount(root, 2, &m))
        return 0;
    relative_path(&m, cpath, rel, sizeof(rel));
    int n = snprintf(dir, dir_size, "%s%s", m.point, rel);
    if (n < 0 || (size_t)n >= dir_size || !is_dir(dir)) {
        n = snprintf(dir, dir_size, "%s", m.point);
        if (n < 0 || (size_t)n >= dir_size)
            return 0;
    }
    return 1;
}
