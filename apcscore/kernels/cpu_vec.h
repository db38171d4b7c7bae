/* The vector helpers that cpu_math.c and cpu_attention.c share: the lane type, the floating-point environment
 * of every call, and the float exp, fixed-tree sum, loads and stores of the portable math. One definition, so the
 * attention's exps and sums are the row ops' bits (cpu_math.c's header says why they are the same on every CPU).
 * Included by both C files (static inline: each copy is compiled for the target of the function it is inlined in).
 */
#ifndef APC_CPU_VEC_H
#define APC_CPU_VEC_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define APC_X86 1
#endif

#define LANES 16
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

/* ---- floating-point environment: round to nearest even, no flush-to-zero, no denormals-are-zero ---------- */

typedef struct { uint64_t saved; } fpenv;

static inline fpenv fp_enter(void) {
    fpenv e = {0};
#if defined(APC_X86)
    e.saved = _mm_getcsr();
    _mm_setcsr(0x1F80);
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    e.saved = fpcr;
    fpcr &= ~((uint64_t)1 << 24 | (uint64_t)3 << 22 | (uint64_t)1 << 19); /* FZ off, RMode nearest, FZ16 off */
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
    return e;
}

static inline void fp_leave(fpenv e) {
#if defined(APC_X86)
    _mm_setcsr((unsigned int)e.saved);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(e.saved));
#else
    (void)e;
#endif
}

/* ---- float vector functions (GCC vector extensions: each lane the same IEEE operations) ------------------- */

__attribute__((always_inline)) static inline vf vsplat(float x) { return (vf){0} + x; }
__attribute__((always_inline)) static inline vf vsel(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) for float lanes: n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln2 in two exact-product parts,
 * exp(r) by Taylor to r^7 (|r| <= 0.347: the next term is 0.05 ulp), times 2^n as two exact
 * factors (so denormal results round once, at the last product). NaN stays NaN; x < -104 gives 0, x > 88.8
 * +inf, as the exact function rounded to float does. */
__attribute__((always_inline)) static inline vf vexp(vf x) {
    const vf lo = vsplat(-104.0f), hi = vsplat(89.0f);
    x = vsel(x < lo, lo, x); /* NaN compares false: kept */
    x = vsel(x > hi, hi, x);
    const vf magic = vsplat(12582912.0f);
    vf n = (x * 1.44269502163f + magic) - magic;
    vf r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    /* exp(r) = 1 + (r + r^2 q(r)), q = 1/2 + r/6 + ... + r^5/7!: the small terms summed first, so the one
     * rounding that matters is the last add (max error 0.99 ulp, measured on 2e6 arguments) */
    vf q = vsplat(1.0f / 5040.0f);
    q = q * r + 1.0f / 720.0f;
    q = q * r + 1.0f / 120.0f;
    q = q * r + 1.0f / 24.0f;
    q = q * r + 1.0f / 6.0f;
    q = q * r + 0.5f;
    vf p = 1.0f + (r + (r * r) * q);
    vi ni = __builtin_convertvector(n, vi); /* exact: n is an integer in [-150, 129] */
    vi n1 = ni >> 1, n2 = ni - n1;          /* each in [-75, 65]: normal scale factors */
    vf s1 = (vf)((n1 + 127) << 23), s2 = (vf)((n2 + 127) << 23);
    return (p * s1) * s2;
}

static inline float tree16f(const float *s) {
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    a[0] = a[0] + a[2];
    a[1] = a[1] + a[3];
    return a[0] + a[1];
}

/* Loads LANES floats from p (n_left of them real; the others are `fill`). */
__attribute__((always_inline)) static inline vf vload(const float *p, int64_t n_left, float fill) {
    vf v;
    if (n_left >= LANES) {
        memcpy(&v, p, sizeof v);
    } else {
        float tmp[LANES];
        for (int j = 0; j < LANES; j++) tmp[j] = j < n_left ? p[j] : fill;
        memcpy(&v, tmp, sizeof v);
    }
    return v;
}

__attribute__((always_inline)) static inline void vstore(float *p, vf v, int64_t n_left) {
    if (n_left >= LANES) {
        memcpy(p, &v, sizeof v);
    } else {
        float tmp[LANES];
        memcpy(tmp, &v, sizeof v);
        for (int j = 0; j < n_left; j++) p[j] = tmp[j];
    }
}

/* ---- the dtypes of weights and caches, and their exact conversions to fp32 ------------------------------ */

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) { /* exact IEEE half -> single (normals, subnormals, inf, nan) */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_elem(const void *p, int dtype, int64_t i) {
    if (dtype == DT_F32) return ((const float *)p)[i];
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

#endif
