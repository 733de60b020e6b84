/*
 * llmem/sys.h — the machine probe (SPEC §1): what memory this process can have, and the CPU.
 *
 * One struct describes a device, the host or a CUDA device (filled by llmem/backend.h), as the
 * analog of MLX's `mx.device_info()`. Every number is either read from the system or marked
 * LLMEM_SYS_UNKNOWN: a value that cannot be read is never guessed. Limits that are not set are
 * LLMEM_SYS_UNLIMITED, which is distinct from unknown.
 *
 * Host sources (Linux):
 *   memory_size        sysconf(_SC_PHYS_PAGES) × page size
 *   ceiling            min(memory_size, cgroup_limit)  (max_recommended_working_set_size)
 *   max_buffer_length  memory_size
 *   available          MemAvailable of /proc/meminfo, capped by the cgroup headroom
 *   cgroup_limit       the tightest memory limit on the path from this process's cgroup to the
 *                      root of its hierarchy: v2 `memory.max`, v1 `memory.limit_in_bytes` of the
 *                      memory controller (v1 "unlimited", any value ≥ 2^62, reads as unlimited)
 *   cgroup_headroom    min over the limited cgroups on that path of
 *                      limit − (usage − inactive_file): the page cache the kernel would reclaim
 *                      first (mapped weights, for one) does not count against the headroom
 *   wired_limit        the soft RLIMIT_MEMLOCK (getrlimit); RLIM_INFINITY reads as unlimited
 *   n_cpus             sysconf(_SC_NPROCESSORS_ONLN)
 *   memory_bandwidth   unknown (CUDA devices: their memory's peak)
 *   name, arch         "model name" of /proc/cpuinfo (else the CPUID brand string), and the ISA
 *                      features this CPU *and* the OS support (CPUID + XGETBV on x86-64)
 * A cgroup limit that is present but unreadable makes the ceiling unknown, as does an unknown
 * RAM size; a cgroup usage that cannot be read makes `available` unknown under a limit.
 */
#ifndef LLMEM_SYS_H
#define LLMEM_SYS_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Markers for the int64_t fields below (sizes are never negative otherwise). */
#define LLMEM_SYS_UNKNOWN ((int64_t)-1) /* could not be read */
#define LLMEM_SYS_UNLIMITED                                                                        \
    ((int64_t)-2) /* no limit is set (cgroup_limit, cgroup_headroom,                               \
                     wired_limit only) */

enum llmem_device_kind { LLMEM_DEVICE_HOST = 0, LLMEM_DEVICE_CUDA };

/* Where the ceiling (max_recommended_working_set_size) comes from. */
enum llmem_ceiling_source {
    LLMEM_CEILING_UNKNOWN = 0, /* RAM or a present cgroup limit could not be read */
    LLMEM_CEILING_RAM,         /* physical RAM: no cgroup limit, or one at or above RAM */
    LLMEM_CEILING_CGROUP,      /* the cgroup memory limit, below RAM */
    LLMEM_CEILING_DEVICE       /* total device memory (CUDA) */
};
/* "unknown", "ram", "cgroup", "device". */
LLMEM_API const char *llmem_ceiling_source_name(enum llmem_ceiling_source source);

#define LLMEM_SYS_NAME_MAX   128
#define LLMEM_SYS_ARCH_MAX   256
#define LLMEM_SYS_CGPATH_MAX 256

struct llmem_device_info {
    enum llmem_device_kind kind;
    int index;                     /* CUDA device ordinal; 0 for the host */
    char name[LLMEM_SYS_NAME_MAX]; /* CPU model or device name; "" when unknown */
    char arch[LLMEM_SYS_ARCH_MAX]; /* host: ISA features ("avx avx2 fma ..."); CUDA: "sm_90" */

    int64_t memory_size;                      /* host: physical RAM; CUDA: total device memory */
    int64_t max_recommended_working_set_size; /* the ceiling */
    enum llmem_ceiling_source ceiling_source;
    int64_t max_buffer_length; /* the largest single buffer: RAM / device memory */
    int64_t available;         /* host: see above; CUDA: cudaMemGetInfo free */
    int64_t memory_bandwidth; /* CUDA: bytes/s its memory peaks at, 2 × the memory clock × the bus
                                 width; the host: unknown (no register says it: llmem plan
                                 measures it) */

    /* host only (CUDA devices: UNKNOWN, 0, "") */
    int64_t mem_available;   /* MemAvailable alone */
    int64_t cgroup_limit;    /* bytes, UNLIMITED (none) or UNKNOWN */
    int64_t cgroup_headroom; /* bytes, UNLIMITED (no limit) or UNKNOWN */
    int cgroup_version;      /* 1 or 2 for the hierarchy holding the memory controller,
                                0 when there is none */
    char cgroup_path[LLMEM_SYS_CGPATH_MAX]; /* the process's memory cgroup ("" when none);
                                               display only, may be truncated */
    int64_t wired_limit;                    /* bytes, UNLIMITED or UNKNOWN */
    int n_cpus;                             /* online CPUs; -1 when unknown or for a device */
};

/* Sets every field to its unknown value (numbers UNKNOWN, strings "", versions 0). */
LLMEM_API void llmem_sys_device_info_init(struct llmem_device_info *info,
                                          enum llmem_device_kind kind, int index);

/* Probes the host. Always fills *info (with unknowns where something cannot be read); returns
 * LLMEM_OK. Nothing is logged at ERROR level: a missing file is normal, a malformed one is a
 * WARN line naming it. */
LLMEM_API int llmem_sys_probe_host(struct llmem_device_info *info);

/* The same, reading /proc and /sys below `root` instead of "/" (for tests with a fake tree:
 * root/proc/meminfo, root/proc/self/cgroup, root/proc/self/mountinfo, root/proc/cpuinfo,
 * root/sys/fs/cgroup/...). With a root other than "/", memory_size is MemTotal of
 * root/proc/meminfo instead of sysconf; n_cpus, wired_limit and the ISA features always describe
 * the real process. LLMEM_ERANGE (logged) when root is too long for a path. */
LLMEM_API int llmem_sys_probe_host_at(const char *root, struct llmem_device_info *info);

/* The soft RLIMIT_MEMLOCK of this process in bytes (read with getrlimit, also as root, where
 * the kernel would let mlock go past it): LLMEM_SYS_UNLIMITED or LLMEM_SYS_UNKNOWN otherwise. */
LLMEM_API int64_t llmem_sys_memlock_limit(void);

/* ---------------------------------------------------------------------------------------------
 * ISA features (x86-64: CPUID, with XGETBV for the AVX and AVX-512 register state the OS saves;
 * aarch64: the auxiliary vector; other targets: none)
 * ------------------------------------------------------------------------------------------- */

enum llmem_isa_feature {
    LLMEM_ISA_SSE4_2 = 1u << 0,
    LLMEM_ISA_AVX = 1u << 1,
    LLMEM_ISA_AVX2 = 1u << 2,
    LLMEM_ISA_FMA = 1u << 3,
    LLMEM_ISA_F16C = 1u << 4,
    LLMEM_ISA_AVX512F = 1u << 5,
    LLMEM_ISA_AVX512BW = 1u << 6,
    LLMEM_ISA_AVX512VL = 1u << 7,
    LLMEM_ISA_AVX512_VNNI = 1u << 8,
    LLMEM_ISA_AVX512_BF16 = 1u << 9,
    LLMEM_ISA_AVX_VNNI = 1u << 10,
    LLMEM_ISA_NEON = 1u << 11,
    LLMEM_ISA_NEON_FP16 = 1u << 12,    /* asimdhp */
    LLMEM_ISA_NEON_DOTPROD = 1u << 13, /* asimddp */
    LLMEM_ISA_SVE = 1u << 14,
    /* AMX tiles with bf16 products: the CPU has them, the OS enables their state and granted
     * this process their use (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM), asked once) */
    LLMEM_ISA_AMX_BF16 = 1u << 15
};

/* The features usable in this process (a mask of enum llmem_isa_feature), detected once. */
LLMEM_API uint32_t llmem_sys_isa_features(void);
/* Space-separated names in the order of the enum ("sse4_2 avx avx2 fma f16c avx512f ..."; ""
 * for none) into buf, always NUL-terminated; returns buf. */
LLMEM_API char *llmem_sys_isa_string(uint32_t features, char *buf, size_t buf_size);

/* ---------------------------------------------------------------------------------------------
 * Memory pressure (SPEC §6.4)
 * ------------------------------------------------------------------------------------------- */

struct llmem_sys_pressure {
    int64_t resident_bytes; /* this process's resident memory; LLMEM_SYS_UNKNOWN */
    double psi_some_avg10;  /* % of the last 10 s some task stalled on memory; −1 unknown */
    double psi_full_avg10;  /* % of the last 10 s all tasks stalled on memory; −1 unknown */
    /* the counters of this process's cgroup v2 memory.events (they only ever grow); UNKNOWN
     * without a v2 memory cgroup: times usage went over memory.high (and was throttled), times
     * it reached memory.max (reclaim was forced), times the OOM killer was invoked */
    int64_t cgroup_high, cgroup_max, cgroup_oom;
};
/* Reads /proc/self/statm, /proc/pressure/memory and the cgroup's memory.events (the cgroup's
 * directory is found once per root and remembered); what cannot be read is unknown. */
LLMEM_API void llmem_sys_pressure_read(struct llmem_sys_pressure *p);
/* The same below `root` (a directory prefix without a trailing '/'), for tests. */
LLMEM_API void llmem_sys_pressure_read_at(const char *root, struct llmem_sys_pressure *p);

/* This process's resident memory now and at its peak (VmRSS and VmHWM of /proc/self/status:
 * anonymous and file-backed pages, mapped weights included); LLMEM_SYS_UNKNOWN when unreadable. */
struct llmem_sys_resident {
    int64_t current_bytes;
    int64_t peak_bytes;
};
LLMEM_API void llmem_sys_resident_read(struct llmem_sys_resident *r);
LLMEM_API void llmem_sys_resident_read_at(const char *root, struct llmem_sys_resident *r);

/* ---------------------------------------------------------------------------------------------
 * Disk space
 * ------------------------------------------------------------------------------------------- */

/* Bytes an unprivileged process can still write on the file system holding path (statvfs:
 * f_bavail × f_frsize); LLMEM_SYS_UNKNOWN when it cannot be read. */
LLMEM_API int64_t llmem_sys_disk_free(const char *path);

#ifdef __cplusplus
}
#endif

#endif
