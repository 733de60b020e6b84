/*
 * tests/test-sys.c — the machine probe: fake /proc and /sys trees for cgroup v2 (nested limits,
 * "max"), v1 (host and container mounts), no cgroup and garbage contents; the ISA features
 * against the compiler's own CPU detection; the real host; the JSON form.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "testutil.h"

#include "core/json.h"
#include "llmem/status.h"
#include "llmem/sys.h"
#include "sys/probe.h"

#define GIB ((int64_t)1 << 30)
#define MIB ((int64_t)1 << 20)

/* ---- fake trees ------------------------------------------------------------------------------ */

/* Writes root/rel, creating the directories on the way. */
static void put(const char *root, const char *rel, const char *text) {
    char path[4096];
    int n = snprintf(path, sizeof(path), "%s/%s", root, rel);
    assert_true(n > 0 && (size_t)n < sizeof(path));
    for (char *p = path + strlen(root) + 1; *p != '\0'; p++) {
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0755);
            *p = '/';
        }
    }
    free(tu_write_file(root, rel, text, -1));
}

static void mkdirs(const char *root, const char *rel) {
    char keep[4096];
    snprintf(keep, sizeof(keep), "%s/.keep", rel);
    put(root, keep, "");
}

/* 32 GiB of RAM, 20 GiB available. */
static void put_meminfo(const char *root) {
    put(root, "proc/meminfo",
        "MemTotal:       33554432 kB\n"
        "MemFree:        10485760 kB\n"
        "MemAvailable:   20971520 kB\n"
        "Buffers:           1860 kB\n");
}

static const char v2_mountinfo[] =
    "22 1 0:21 / / rw,relatime - overlay overlay rw\n"
    "30 22 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n";

static const char v1_mountinfo[] =
    "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n"
    "30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "31 30 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "34 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

static struct llmem_device_info probe(const char *root) {
    struct llmem_device_info info;
    tu_count_errors(LLMEM_LOG_DEBUG); /* every line through the callback; none an error */
    assert_int_equal(llmem_sys_probe_host_at(root, &info), LLMEM_OK);
    tu_count_errors_stop();
    assert_int_equal(tu_error_lines, 0);
    return info;
}

/* ---- cgroup v2 ------------------------------------------------------------------------------- */

/* Limit on the grandparent slice, "max" below it: the slice binds. */
static void test_v2_nested_parent_limit(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/user.slice/app.scope/leaf\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n");
    put(root, "sys/fs/cgroup/user.slice/memory.max", "8589934592\n");
    put(root, "sys/fs/cgroup/user.slice/memory.current", "4294967296\n");
    put(root, "sys/fs/cgroup/user.slice/memory.stat",
        "anon 3221225472\nfile 1073741824\nactive_file 0\ninactive_file 1073741824\n");
    put(root, "sys/fs/cgroup/user.slice/app.scope/memory.max", "max\n");
    put(root, "sys/fs/cgroup/user.slice/app.scope/memory.current", "100\n");
    put(root, "sys/fs/cgroup/user.slice/app.scope/leaf/memory.max", "max\n");
    put(root, "sys/fs/cgroup/user.slice/app.scope/leaf/memory.current", "100\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.kind, LLMEM_DEVICE_HOST);
    assert_int_equal(info.memory_size, 32 * GIB); /* MemTotal under a fake root */
    assert_int_equal(info.max_buffer_length, 32 * GIB);
    assert_int_equal(info.mem_available, 20 * GIB);
    assert_int_equal(info.cgroup_version, 2);
    assert_string_equal(info.cgroup_path, "/user.slice/app.scope/leaf");
    assert_int_equal(info.cgroup_limit, 8 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 8 * GIB);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_CGROUP);
    /* headroom = 8G − (4G − 1G inactive file) = 5G, below MemAvailable */
    assert_int_equal(info.cgroup_headroom, 5 * GIB);
    assert_int_equal(info.available, 5 * GIB);
    tu_rmtree(root);
    free(root);
}

/* A tighter limit on the leaf than on the parent: the leaf binds; headroom is the smallest. */
static void test_v2_nested_leaf_tighter(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/a/b\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/cgroup.controllers", "memory\n");
    put(root, "sys/fs/cgroup/a/memory.max", "17179869184\n");
    put(root, "sys/fs/cgroup/a/memory.current", "16106127360\n");  /* 15G: 1G headroom */
    put(root, "sys/fs/cgroup/a/b/memory.max", "6442450944\n");     /* 6G */
    put(root, "sys/fs/cgroup/a/b/memory.current", "1073741824\n"); /* 1G: 5G headroom */

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_limit, 6 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 6 * GIB);
    assert_int_equal(info.cgroup_headroom, 1 * GIB); /* no memory.stat: usage counts whole */
    assert_int_equal(info.available, 1 * GIB);
    tu_rmtree(root);
    free(root);
}

/* Every level "max", and no mountinfo: found at the usual place; no limit, ceiling is RAM. */
static void test_v2_all_max_without_mountinfo(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/system.slice/x.service\n");
    put(root, "sys/fs/cgroup/cgroup.controllers", "memory\n");
    put(root, "sys/fs/cgroup/system.slice/memory.max", "max\n");
    put(root, "sys/fs/cgroup/system.slice/x.service/memory.max", "max\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 2);
    assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNLIMITED);
    assert_int_equal(info.cgroup_headroom, LLMEM_SYS_UNLIMITED);
    assert_int_equal(info.max_recommended_working_set_size, 32 * GIB);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_RAM);
    assert_int_equal(info.available, 20 * GIB);
    tu_rmtree(root);
    free(root);
}

/* A limit above RAM does not raise the ceiling; the limit is still reported. */
static void test_v2_limit_above_ram(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/big\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/big/memory.max", "68719476736\n"); /* 64G */
    put(root, "sys/fs/cgroup/big/memory.current", "1073741824\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_limit, 64 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 32 * GIB);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_RAM);
    assert_int_equal(info.available, 20 * GIB); /* 63G headroom does not bind */
    tu_rmtree(root);
    free(root);
}

/* A container with a private cgroup namespace: "0::/" and the limit at the mount point. */
static void test_v2_namespace_root(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/memory.max", "2147483648\n");
    put(root, "sys/fs/cgroup/memory.current", "536870912\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_limit, 2 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 2 * GIB);
    assert_int_equal(info.available, 2 * GIB - 512 * MIB);
    tu_rmtree(root);
    free(root);
}

/* ---- cgroup v1 ------------------------------------------------------------------------------- */

/* Hybrid host: memory on v1 (wins over the unified v2 line), limit on the leaf. */
static void test_v1_leaf_limit(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup",
        "9:name=systemd:/\n4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n");
    put(root, "proc/self/mountinfo", v1_mountinfo);
    put(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put(root, "sys/fs/cgroup/memory/docker/memory.limit_in_bytes", "9223372036854771712\n");
    put(root, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "4294967296\n");
    put(root, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "2147483648\n");
    put(root, "sys/fs/cgroup/memory/docker/abc/memory.stat",
        "cache 1073741824\ninactive_file 5\ntotal_inactive_file 536870912\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 1);
    assert_string_equal(info.cgroup_path, "/docker/abc");
    assert_int_equal(info.cgroup_limit, 4 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 4 * GIB);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_CGROUP);
    assert_int_equal(info.cgroup_headroom, 4 * GIB - (2 * GIB - 512 * MIB));
    assert_int_equal(info.available, info.cgroup_headroom);
    tu_rmtree(root);
    free(root);
}

/* Container without a cgroup namespace: the mount's root is the container's cgroup. */
static void test_v1_container_mount(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "4:memory:/kubepods/pod1/c1\n");
    put(root, "proc/self/mountinfo",
        "100 90 0:31 /kubepods/pod1/c1 /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup "
        "rw,memory\n");
    put(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n");
    put(root, "sys/fs/cgroup/memory/memory.usage_in_bytes", "268435456\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 1);
    assert_int_equal(info.cgroup_limit, 1 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 1 * GIB);
    assert_int_equal(info.available, 768 * MIB);
    tu_rmtree(root);
    free(root);
}

/* v1 "unlimited" everywhere (the real value is 2^63 − 4096): no limit, not a huge one. */
static void test_v1_unlimited(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "4:memory:/user.slice\n");
    put(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put(root, "sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes", "9223372036854771712\n");
    put(root, "sys/fs/cgroup/memory/user.slice/memory.usage_in_bytes", "1\n");

    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 1);
    assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNLIMITED);
    assert_int_equal(info.max_recommended_working_set_size, 32 * GIB);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_RAM);
    assert_int_equal(info.available, 20 * GIB);
    tu_rmtree(root);
    free(root);
}

/* ---- no cgroup, missing files, garbage --------------------------------------------------------
 */

static void test_no_cgroup(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 0);
    assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNLIMITED);
    assert_string_equal(info.cgroup_path, "");
    assert_int_equal(info.max_recommended_working_set_size, 32 * GIB);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_RAM);
    assert_int_equal(info.available, 20 * GIB);
    tu_rmtree(root);
    free(root);
}

/* Cgroups without a memory controller anywhere: no memory limit. */
static void test_no_memory_controller(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "3:cpu:/x\n2:pids:/x\n");
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 0);
    assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNLIMITED);
    assert_int_equal(info.max_recommended_working_set_size, 32 * GIB);
    tu_rmtree(root);
    free(root);
}

/* An empty root: nothing can be read, everything file-based is unknown. */
static void test_empty_root(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.memory_size, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.max_buffer_length, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.max_recommended_working_set_size, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.ceiling_source, LLMEM_CEILING_UNKNOWN);
    assert_int_equal(info.available, LLMEM_SYS_UNKNOWN);
    assert_string_equal(info.name, "");
    tu_rmtree(root);
    free(root);
}

/* The cgroup hierarchy is named but not mounted: the limit is unknown, so is the ceiling. */
static void test_cgroup_not_mounted(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/x\n");
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_version, 2);
    assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.max_recommended_working_set_size, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.available, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.memory_size, 32 * GIB); /* RAM is still known */
    tu_rmtree(root);
    free(root);
}

static void test_garbage_meminfo(void **state) {
    (void)state;
    static const char *const bad[] = {
        "",
        "MemTotal: lots\nMemAvailable: -5 kB\n",
        "MemTotal:99999999999999999999999 kB\nMemAvailable: 1 MB\n",
        "MemTotal: 18014398509481984 kB\n", /* overflows ×1024 */
        "MemTotalX: 1 kB\nMemAvailableX: 1 kB\n",
        "\x01\x02\xff\xfe:::\n\n\n:",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *root = tu_mkdtemp();
        put(root, "proc/meminfo", bad[i]);
        struct llmem_device_info info = probe(root);
        assert_int_equal(info.memory_size, LLMEM_SYS_UNKNOWN);
        assert_int_equal(info.mem_available, LLMEM_SYS_UNKNOWN);
        assert_int_equal(info.available, LLMEM_SYS_UNKNOWN);
        assert_int_equal(info.max_recommended_working_set_size, LLMEM_SYS_UNKNOWN);
        tu_rmtree(root);
        free(root);
    }
}

static void test_garbage_cgroup_files(void **state) {
    (void)state;
    static const char *const bad[] = {
        "",
        "\n",
        "maximum\n",
        "max max\n",
        "-1\n",
        "1.5G\n",
        "12abc\n",
        "99999999999999999999999999\n",
        "\xff\xfe\x00",
        " 12 34\n",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *root = tu_mkdtemp();
        put_meminfo(root);
        put(root, "proc/self/cgroup", "0::/a/b\n");
        put(root, "proc/self/mountinfo", v2_mountinfo);
        put(root, "sys/fs/cgroup/a/memory.max", "4294967296\n");
        put(root, "sys/fs/cgroup/a/memory.current", "0\n");
        put(root, "sys/fs/cgroup/a/b/memory.max", bad[i]);
        struct llmem_device_info info = probe(root);
        assert_int_equal(info.cgroup_version, 2);
        assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNKNOWN);
        assert_int_equal(info.max_recommended_working_set_size, LLMEM_SYS_UNKNOWN);
        assert_int_equal(info.ceiling_source, LLMEM_CEILING_UNKNOWN);
        assert_int_equal(info.memory_size, 32 * GIB);
        tu_rmtree(root);
        free(root);
    }
}

/* A readable limit with garbage usage: the limit holds, the headroom (and available) do not. */
static void test_garbage_usage(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/a\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/a/memory.max", "4294967296\n");
    put(root, "sys/fs/cgroup/a/memory.current", "lots\n");
    put(root, "sys/fs/cgroup/a/memory.stat", "inactive_file nope\n");
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_limit, 4 * GIB);
    assert_int_equal(info.max_recommended_working_set_size, 4 * GIB);
    assert_int_equal(info.cgroup_headroom, LLMEM_SYS_UNKNOWN);
    assert_int_equal(info.available, LLMEM_SYS_UNKNOWN);
    tu_rmtree(root);
    free(root);
}

static void test_garbage_self_cgroup_and_mountinfo(void **state) {
    (void)state;
    static const char *const bad_self[] = {"", "garbage\n", ":::\n", "0:\n", "\xff\xff"};
    for (size_t i = 0; i < sizeof(bad_self) / sizeof(bad_self[0]); i++) {
        char *root = tu_mkdtemp();
        put_meminfo(root);
        put(root, "proc/self/cgroup", bad_self[i]);
        struct llmem_device_info info = probe(root);
        assert_int_equal(info.cgroup_version, 0);
        assert_int_equal(info.cgroup_limit, LLMEM_SYS_UNKNOWN);
        assert_int_equal(info.max_recommended_working_set_size, LLMEM_SYS_UNKNOWN);
        tu_rmtree(root);
        free(root);
    }
    /* Broken mountinfo lines are skipped; the usual place is still found. */
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/a\n");
    put(root, "proc/self/mountinfo", "- - -\n1 2 3 4 5 6 - cgroup2\n\\\\\\ - \n\n - cgroup2");
    put(root, "sys/fs/cgroup/cgroup.controllers", "memory\n");
    put(root, "sys/fs/cgroup/a/memory.max", "1073741824\n");
    put(root, "sys/fs/cgroup/a/memory.current", "0\n");
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_limit, 1 * GIB);
    tu_rmtree(root);
    free(root);
}

/* A cgroup directory that does not exist below the mount (moved, or the mount is the
 * container's own cgroup): the mount point is read instead. */
static void test_missing_leaf_reads_mount_point(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    put(root, "proc/self/cgroup", "0::/gone/away\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/memory.max", "3221225472\n");
    put(root, "sys/fs/cgroup/memory.current", "0\n");
    mkdirs(root, "sys/fs/cgroup/other");
    struct llmem_device_info info = probe(root);
    assert_int_equal(info.cgroup_limit, 3 * GIB);
    tu_rmtree(root);
    free(root);
}

static void test_cpu_name(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put(root, "proc/cpuinfo",
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6338 "
        "CPU @ 2.00GHz   \nflags\t\t: fpu\n\nprocessor\t: 1\nmodel name\t: other\n");
    struct llmem_device_info info = probe(root);
    assert_string_equal(info.name, "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz");
    tu_rmtree(root);
    free(root);

    root = tu_mkdtemp();
    put(root, "proc/cpuinfo",
        "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n"
        "CPU part\t: 0xd0c\n");
    info = probe(root);
    assert_string_equal(info.name, "arm implementer 0x41 part 0xd0c");
    tu_rmtree(root);
    free(root);
}

/* ---- the real machine ------------------------------------------------------------------------ */

static void test_real_host(void **state) {
    (void)state;
    struct llmem_device_info info = probe("/");
    assert_true(info.memory_size > 0);
    assert_int_equal(info.max_buffer_length, info.memory_size);
    assert_true(info.n_cpus >= 1);
    assert_true(info.wired_limit >= 0 || info.wired_limit == LLMEM_SYS_UNLIMITED);
    if (info.max_recommended_working_set_size != LLMEM_SYS_UNKNOWN) {
        assert_true(info.max_recommended_working_set_size > 0);
        assert_true(info.max_recommended_working_set_size <= info.memory_size);
    }
    if (info.available != LLMEM_SYS_UNKNOWN)
        assert_true(info.available <= info.memory_size);
#if defined(__x86_64__)
    assert_true(info.name[0] != '\0');
    assert_true(info.arch[0] != '\0');
#endif
    struct llmem_device_info again;
    assert_int_equal(llmem_sys_probe_host(&again), LLMEM_OK);
    assert_int_equal(again.memory_size, info.memory_size);
}

static int has_word(const char *list, const char *word) {
    size_t n = strlen(word);
    for (const char *p = strstr(list, word); p != NULL; p = strstr(p + 1, word))
        if ((p == list || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\0'))
            return 1;
    return 0;
}

static void test_isa_matches_compiler(void **state) {
    (void)state;
    uint32_t f = llmem_sys_isa_features();
    char list[LLMEM_SYS_ARCH_MAX];
    llmem_sys_isa_string(f, list, sizeof(list));
#if defined(__x86_64__)
    __builtin_cpu_init();
    assert_true(list[0] != '\0'); /* every x86-64 CPU llmem runs on has at least SSE4.2 */
    assert_int_equal(!!(f & LLMEM_ISA_SSE4_2), !!__builtin_cpu_supports("sse4.2"));
    assert_int_equal(!!(f & LLMEM_ISA_AVX), !!__builtin_cpu_supports("avx"));
    assert_int_equal(!!(f & LLMEM_ISA_AVX2), !!__builtin_cpu_supports("avx2"));
    assert_int_equal(has_word(list, "avx2"), !!__builtin_cpu_supports("avx2"));
    assert_int_equal(!!(f & LLMEM_ISA_FMA), !!__builtin_cpu_supports("fma"));
    assert_int_equal(!!(f & LLMEM_ISA_AVX512F), !!__builtin_cpu_supports("avx512f"));
    assert_int_equal(!!(f & LLMEM_ISA_AVX512BW), !!__builtin_cpu_supports("avx512bw"));
    assert_int_equal(!!(f & LLMEM_ISA_AVX512VL), !!__builtin_cpu_supports("avx512vl"));
    assert_int_equal(!!(f & LLMEM_ISA_AVX512_VNNI), !!__builtin_cpu_supports("avx512vnni"));
    assert_int_equal(has_word(list, "avx512f"), !!__builtin_cpu_supports("avx512f"));
    assert_false(f & (LLMEM_ISA_NEON | LLMEM_ISA_SVE));
    if (f & LLMEM_ISA_AMX_BF16) /* (the tiles run: test-cpuops) */
        assert_true(has_word(list, "amx_bf16") && (f & LLMEM_ISA_AVX512F));
#elif defined(__aarch64__)
    assert_true(f & LLMEM_ISA_NEON);
    assert_true(has_word(list, "neon"));
#endif
    if (f & LLMEM_ISA_AVX2)
        assert_true(has_word(list, "avx2"));
    /* Implied features: AVX2 needs AVX's OS state, the AVX-512 extensions need AVX-512F. */
    if (f & LLMEM_ISA_AVX2)
        assert_true(f & LLMEM_ISA_AVX);
    if (f & (LLMEM_ISA_AVX512BW | LLMEM_ISA_AVX512VL | LLMEM_ISA_AVX512_BF16))
        assert_true(f & LLMEM_ISA_AVX512F);
    assert_int_equal(llmem_sys_isa_features(), f); /* cached and stable */
}

static void test_isa_string(void **state) {
    (void)state;
    char buf[LLMEM_SYS_ARCH_MAX];
    assert_string_equal(llmem_sys_isa_string(0, buf, sizeof(buf)), "");
    assert_string_equal(
        llmem_sys_isa_string(LLMEM_ISA_AVX | LLMEM_ISA_AVX2 | LLMEM_ISA_F16C, buf, sizeof(buf)),
        "avx avx2 f16c");
    assert_string_equal(
        llmem_sys_isa_string(LLMEM_ISA_AVX512F | LLMEM_ISA_AVX512_BF16, buf, sizeof(buf)),
        "avx512f avx512_bf16");
    /* Too small: whole names only. */
    char small[9];
    assert_string_equal(
        llmem_sys_isa_string(LLMEM_ISA_AVX | LLMEM_ISA_AVX2 | LLMEM_ISA_FMA, small, sizeof(small)),
        "avx avx2");
}

/* ---- helpers and JSON ------------------------------------------------------------------------ */

static void test_parse_u64(void **state) {
    (void)state;
    int64_t v = 7;
    assert_true(llmem_sys_parse_u64(" 42\n", &v));
    assert_int_equal(v, 42);
    assert_true(llmem_sys_parse_u64("9223372036854775807", &v));
    assert_int_equal(v, INT64_MAX);
    v = 7;
    assert_false(llmem_sys_parse_u64("9223372036854775808", &v));
    assert_false(llmem_sys_parse_u64("", &v));
    assert_false(llmem_sys_parse_u64("-1", &v));
    assert_false(llmem_sys_parse_u64("+1", &v));
    assert_false(llmem_sys_parse_u64("1 2", &v));
    assert_false(llmem_sys_parse_u64("max", &v));
    assert_int_equal(v, 7);
    assert_int_equal(llmem_sys_stat_field("anon 1\ninactive_file 22\n", "inactive_file"), 22);
    assert_int_equal(llmem_sys_stat_field("total_inactive_file 3\n", "inactive_file"),
                     LLMEM_SYS_UNKNOWN);
}

/* The device's JSON as printed and parsed back (integers are written as raw text). */
static cJSON *to_json(const struct llmem_device_info *info) {
    cJSON *obj = cJSON_CreateObject(), *back = NULL;
    assert_non_null(obj);
    assert_int_equal(llmem_sys_device_info_json(info, obj), LLMEM_OK);
    char *text = llmem_json_print(obj, 0);
    assert_non_null(text);
    assert_int_equal(llmem_json_parse(text, strlen(text), "device info", &back), LLMEM_OK);
    free(text);
    cJSON_Delete(obj);
    return back;
}

static void test_json(void **state) {
    (void)state;
    struct llmem_device_info info;
    llmem_sys_device_info_init(&info, LLMEM_DEVICE_HOST, 0);
    snprintf(info.name, sizeof(info.name), "cpu \"x\"");
    info.memory_size = 32 * GIB;
    info.max_recommended_working_set_size = 8 * GIB;
    info.ceiling_source = LLMEM_CEILING_CGROUP;
    info.cgroup_limit = 8 * GIB;
    info.cgroup_version = 2;
    info.wired_limit = LLMEM_SYS_UNLIMITED;
    info.n_cpus = 4;

    cJSON *obj = to_json(&info);
    int64_t v;
    const char *s;
    assert_int_equal(llmem_json_get_string(obj, "backend", &s), LLMEM_OK);
    assert_string_equal(s, "cpu");
    assert_int_equal(llmem_json_get_string(obj, "name", &s), LLMEM_OK);
    assert_string_equal(s, "cpu \"x\"");
    assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(obj, "arch")));
    assert_int_equal(llmem_json_get_int(obj, "memory_size", &v), LLMEM_OK);
    assert_int_equal(v, 32 * GIB);
    assert_int_equal(llmem_json_get_int(obj, "max_recommended_working_set_size", &v), LLMEM_OK);
    assert_int_equal(v, 8 * GIB);
    assert_int_equal(llmem_json_get_string(obj, "ceiling_source", &s), LLMEM_OK);
    assert_string_equal(s, "cgroup");
    assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(obj, "available")));
    assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(obj, "max_buffer_length")));
    assert_int_equal(llmem_json_get_int(obj, "cgroup_limit", &v), LLMEM_OK);
    assert_int_equal(v, 8 * GIB);
    assert_int_equal(llmem_json_get_string(obj, "wired_limit", &s), LLMEM_OK);
    assert_string_equal(s, "unlimited");
    assert_int_equal(llmem_json_get_int(obj, "cgroup_version", &v), LLMEM_OK);
    assert_int_equal(v, 2);
    assert_int_equal(llmem_json_get_int(obj, "n_cpus", &v), LLMEM_OK);
    assert_int_equal(v, 4);
    assert_null(cJSON_GetObjectItemCaseSensitive(obj, "index"));
    cJSON_Delete(obj);

    /* A CUDA device carries no host-only keys. */
    llmem_sys_device_info_init(&info, LLMEM_DEVICE_CUDA, 3);
    obj = to_json(&info);
    assert_int_equal(llmem_json_get_int(obj, "index", &v), LLMEM_OK);
    assert_int_equal(v, 3);
    assert_null(cJSON_GetObjectItemCaseSensitive(obj, "cgroup_limit"));
    assert_null(cJSON_GetObjectItemCaseSensitive(obj, "wired_limit"));
    cJSON_Delete(obj);
}

static void test_root_forms(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    put_meminfo(root);
    char slashed[4200];
    snprintf(slashed, sizeof(slashed), "%s///", root);
    struct llmem_device_info info = probe(slashed);
    assert_int_equal(info.memory_size, 32 * GIB);
    tu_rmtree(root);
    free(root);
    assert_string_equal(llmem_ceiling_source_name(LLMEM_CEILING_RAM), "ram");
    assert_string_equal(llmem_ceiling_source_name((enum llmem_ceiling_source)99), "unknown");
}

/* Memory pressure: resident pages from statm, PSI averages; unreadable files are unknown. */
static void test_pressure(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    struct llmem_sys_pressure p;
    llmem_sys_pressure_read_at(root, &p); /* nothing there */
    assert_int_equal(p.resident_bytes, LLMEM_SYS_UNKNOWN);
    assert_true(p.psi_some_avg10 < 0 && p.psi_full_avg10 < 0);
    put(root, "proc/self/statm", "765 434 405 5 0 123 0\n");
    put(root, "proc/pressure/memory",
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=99\n"
        "full avg10=0.75 avg60=0.20 avg300=0.00 total=5\n");
    llmem_sys_pressure_read_at(root, &p);
    assert_int_equal(p.resident_bytes, 434 * (int64_t)sysconf(_SC_PAGESIZE));
    assert_true(p.psi_some_avg10 == 12.5 && p.psi_full_avg10 == 0.75);
    put(root, "proc/pressure/memory", "garbage\n");
    llmem_sys_pressure_read_at(root, &p);
    assert_true(p.psi_some_avg10 < 0 && p.psi_full_avg10 < 0);
    assert_int_equal(p.cgroup_high, LLMEM_SYS_UNKNOWN); /* no cgroup under this root */
    llmem_sys_pressure_read(&p);                        /* the real one reads this process */
    assert_true(p.resident_bytes > 0);
    tu_rmtree(root);
    free(root);

    /* the cgroup v2 memory.events counters of this process's cgroup */
    root = tu_mkdtemp();
    put(root, "proc/self/cgroup", "0::/app.slice/llmem.scope\n");
    put(root, "proc/self/mountinfo", v2_mountinfo);
    put(root, "sys/fs/cgroup/cgroup.controllers", "memory\n");
    put(root, "sys/fs/cgroup/app.slice/llmem.scope/memory.events",
        "low 0\nhigh 17\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n");
    llmem_sys_pressure_read_at(root, &p);
    assert_int_equal(p.cgroup_high, 17);
    assert_int_equal(p.cgroup_max, 3);
    assert_int_equal(p.cgroup_oom, 1); /* "oom", not "oom_kill" */
    put(root, "sys/fs/cgroup/app.slice/llmem.scope/memory.events", "high 18\nmax x\n");
    llmem_sys_pressure_read_at(root, &p); /* read again each time; a bad line is unknown */
    assert_int_equal(p.cgroup_high, 18);
    assert_int_equal(p.cgroup_max, LLMEM_SYS_UNKNOWN);
    assert_int_equal(p.cgroup_oom, LLMEM_SYS_UNKNOWN);
    tu_rmtree(root);
    free(root);

    /* v1: no memory.events */
    root = tu_mkdtemp();
    put(root, "proc/self/cgroup", "4:memory:/user/job\n");
    put(root, "proc/self/mountinfo", v1_mountinfo);
    put(root, "sys/fs/cgroup/memory/user/job/memory.limit_in_bytes", "1073741824\n");
    llmem_sys_pressure_read_at(root, &p);
    assert_int_equal(p.cgroup_high, LLMEM_SYS_UNKNOWN);
    tu_rmtree(root);
    free(root);
}

/* Free disk space: statvfs of a directory that exists, unknown for one that does not. */
static void test_disk_free(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    assert_true(llmem_sys_disk_free(dir) > 0);
    assert_int_equal(llmem_sys_disk_free("/nonexistent/llmem"), LLMEM_SYS_UNKNOWN);
    assert_int_equal(llmem_sys_disk_free(NULL), LLMEM_SYS_UNKNOWN);
    tu_rmtree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_v2_nested_parent_limit),
        cmocka_unit_test(test_v2_nested_leaf_tighter),
        cmocka_unit_test(test_v2_all_max_without_mountinfo),
        cmocka_unit_test(test_v2_limit_above_ram),
        cmocka_unit_test(test_v2_namespace_root),
        cmocka_unit_test(test_v1_leaf_limit),
        cmocka_unit_test(test_v1_container_mount),
        cmocka_unit_test(test_v1_unlimited),
        cmocka_unit_test(test_no_cgroup),
        cmocka_unit_test(test_no_memory_controller),
        cmocka_unit_test(test_empty_root),
        cmocka_unit_test(test_cgroup_not_mounted),
        cmocka_unit_test(test_garbage_meminfo),
        cmocka_unit_test(test_garbage_cgroup_files),
        cmocka_unit_test(test_garbage_usage),
        cmocka_unit_test(test_garbage_self_cgroup_and_mountinfo),
        cmocka_unit_test(test_missing_leaf_reads_mount_point),
        cmocka_unit_test(test_cpu_name),
        cmocka_unit_test(test_real_host),
        cmocka_unit_test(test_isa_matches_compiler),
        cmocka_unit_test(test_isa_string),
        cmocka_unit_test(test_parse_u64),
        cmocka_unit_test(test_json),
        cmocka_unit_test(test_root_forms),
        cmocka_unit_test(test_pressure),
        cmocka_unit_test(test_disk_free),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
