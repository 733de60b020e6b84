/*
 * sys/isa.c — the CPU's instruction-set features, detected at run time.
 *
 * x86-64: a feature counts only when the CPU reports it (CPUID) *and* the OS saves the registers
 * it uses (XGETBV of XCR0: SSE+AVX state for AVX, AVX2, FMA, F16C and AVX-VNNI; additionally
 * opmask+ZMM state for AVX-512, tile state for AMX), so a kernel that disabled AVX-512 gets no
 * AVX-512 kernels; AMX also needs the kernel's permission, asked for here.
 * aarch64: the auxiliary vector's hardware capabilities. Other targets report no features.
 * The result is computed once per process.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "sys/probe.h"

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__)
#include <sys/auxv.h>
#if __has_include(<asm/hwcap.h>)
#include <asm/hwcap.h>
#endif
#endif

static const char *const isa_names[] = {
    "sse4_2",    "avx",          "avx2",        "fma",         "f16c",     "avx512f",
    "avx512bw",  "avx512vl",     "avx512_vnni", "avx512_bf16", "avx_vnni", "neon",
    "neon_fp16", "neon_dotprod", "sve",         "amx_bf16",
}; /* indexed by the bit position of enum llmem_isa_feature */
_Static_assert(sizeof(isa_names) / sizeof(isa_names[0]) == 16 && LLMEM_ISA_AMX_BF16 == 1u << 15,
               "isa_names must list every enum llmem_isa_feature in bit order");

#if defined(__x86_64__)
static uint64_t read_xcr0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int amx_permitted(void) {
#if defined(__linux__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}

static uint32_t detect(void) {
    unsigned a, b, c, d;
    uint32_t f = 0;
    unsigned max_leaf = (unsigned)__get_cpuid_max(0, NULL);
    if (max_leaf < 1)
        return 0;
    __cpuid(1, a, b, c, d);
    if (c & (1u << 20))
        f |= LLMEM_ISA_SSE4_2;
    int osxsave = (c & (1u << 27)) != 0;
    uint64_t xcr0 = osxsave ? read_xcr0() : 0;
    int avx_state = (xcr0 & 0x6) == 0x6;                   /* XMM and YMM */
    int avx512_state = avx_state && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
    if (avx_state && (c & (1u << 28))) {
        f |= LLMEM_ISA_AVX;
        if (c & (1u << 12))
            f |= LLMEM_ISA_FMA;
        if (c & (1u << 29))
            f |= LLMEM_ISA_F16C;
    }
    if (max_leaf < 7 || !(f & LLMEM_ISA_AVX))
        return f;
    __cpuid_count(7, 0, a, b, c, d);
    unsigned max_subleaf = a;
    if (b & (1u << 5))
        f |= LLMEM_ISA_AVX2;
    if (avx512_state && (b & (1u << 16))) {
        f |= LLMEM_ISA_AVX512F;
        if (b & (1u << 30))
            f |= LLMEM_ISA_AVX512BW;
        if (b & (1u << 31))
            f |= LLMEM_ISA_AVX512VL;
        if (c & (1u << 11))
            f |= LLMEM_ISA_AVX512_VNNI;
    }
    /* AMX: tiles and their bf16 products (EDX bits 24 and 22), the tile configuration and data
     * in XCR0 (bits 17 and 18), and the kernel's permission for the tile data, which Linux gives
     * a process only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); once granted it
     * holds for every thread of the process. */
    if ((f & LLMEM_ISA_AVX512F) && (d & (1u << 24)) && (d & (1u << 22)) &&
        (xcr0 & 0x60000) == 0x60000 && amx_permitted())
        f |= LLMEM_ISA_AMX_BF16;
    if (max_subleaf >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if (a & (1u << 4))
            f |= LLMEM_ISA_AVX_VNNI;
        if ((f & LLMEM_ISA_AVX512F) && (a & (1u << 5)))
            f |= LLMEM_ISA_AVX512_BF16;
    }
    return f;
}

void llmem_sys_cpu_brand(char *buf, size_t buf_size) {
    unsigned regs[12];
    buf[0] = '\0';
    if ((unsigned)__get_cpuid_max(0x80000000u, NULL) < 0x80000004u)
        return;
    for (unsigned i = 0; i < 3; i++)
        __cpuid(0x80000002u + i, regs[4 * i], regs[4 * i + 1], regs[4 * i + 2], regs[4 * i + 3]);
    char brand[49];
    memcpy(brand, regs, 48);
    brand[48] = '\0';
    const char *p = brand;
    while (*p == ' ')
        p++;
    size_t n = strlen(p);
    while (n > 0 && p[n - 1] == ' ')
        n--;
    snprintf(buf, buf_size, "%.*s", (int)n, p);
}

#elif defined(__aarch64__)
static uint32_t detect(void) {
    uint32_t f = 0;
    unsigned long hw = getauxval(AT_HWCAP);
#ifdef HWCAP_ASIMD
    if (hw & HWCAP_ASIMD)
        f |= LLMEM_ISA_NEON;
#else
    f |= LLMEM_ISA_NEON; /* Advanced SIMD is mandatory on AArch64 */
#endif
#ifdef HWCAP_ASIMDHP
    if (hw & HWCAP_ASIMDHP)
        f |= LLMEM_ISA_NEON_FP16;
#endif
#ifdef HWCAP_ASIMDDP
    if (hw & HWCAP_ASIMDDP)
        f |= LLMEM_ISA_NEON_DOTPROD;
#endif
#ifdef HWCAP_SVE
    if (hw & HWCAP_SVE)
        f |= LLMEM_ISA_SVE;
#endif
    (void)hw;
    return f;
}

void llmem_sys_cpu_brand(char *buf, size_t buf_size) {
    if (buf_size > 0)
        buf[0] = '\0';
}

#else
static uint32_t detect(void) {
    return 0;
}

void llmem_sys_cpu_brand(char *buf, size_t buf_size) {
    if (buf_size > 0)
        buf[0] = '\0';
}
#endif

#define ISA_DETECTED (1u << 31)

uint32_t llmem_sys_isa_features(void) {
    static _Atomic uint32_t cached;
    uint32_t f = atomic_load_explicit(&cached, memory_order_relaxed);
    if (!(f & ISA_DETECTED)) {
        f = detect() | ISA_DETECTED; /* racing threads compute the same value */
        atomic_store_explicit(&cached, f, memory_order_relaxed);
    }
    return f & ~ISA_DETECTED;
}

char *llmem_sys_isa_string(uint32_t features, char *buf, size_t buf_size) {
    size_t used = 0;
    if (buf_size == 0)
        return buf;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof(isa_names) / sizeof(isa_names[0]); i++) {
        if (!(features & (1u << i)))
            continue;
        int n = snprintf(buf + used, buf_size - used, "%s%s", used ? " " : "", isa_names[i]);
        if (n < 0 || (size_t)n >= buf_size - used) {
            buf[used] = '\0'; /* drop a name that does not fit whole */
            break;
        }
        used += (size_t)n;
    }
    return buf;
}
