/* apcscore's portable CPU math: the row ops and transcendental functions of the native CPU path, written so that
 * a result's bits are a function of the inputs alone, not of the CPU's vector width (scalar, AVX2, AVX-512,
 * NEON), its vendor, the thread count, libm or the torch version.
 *
 * The construction (docs/architecture.md, "Portable bits"):
 * - Only IEEE 754 basic operations (+ - * /, sqrt, conversions, comparisons): each is correctly rounded, so it
 *   gives the same bits on every conforming CPU. Round-to-nearest-even with denormals kept is set for every call
 *   (MXCSR on x86, FPCR on AArch64), whatever torch's flush-denormal setting is.
 * - No fused multiply-add anywhere here, and none made by the compiler: built with -ffp-contract=off, never
 *   -ffast-math (cpu_gemm.py). So a * b + c is two roundings on every CPU, with or without FMA units.
 * - exp, log, tanh, erf, sin, cos are our own: fixed sequences of those operations (range reduction, a
 *   polynomial in Horner form, exact scaling by powers of two), not libm's or SLEEF's, which differ between
 *   vector widths and library versions.
 * - Every reduction has one order per output: LANES interleaved partial sums (element i goes to lane i % LANES),
 *   combined by a fixed pairwise tree. Which registers hold the lanes (SSE2, AVX2, AVX-512: GCC vector
 *   extensions, lowered to what the target has) changes nothing, since each lane is the same chain of IEEE
 *   operations. The compiler may not reorder floating-point sums (no -ffast-math), so it cannot change the order.
 * Vector code: the same source is compiled three times (scalar/SSE2, AVX2, AVX-512) and apc_math_level picks the
 * copy: all give the same bits, by the points above; tests check it on every copy this CPU runs.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* ---- scalar double functions (tables, row sums' logs, per-record figures) --------------------------------- */

static inline double d_from_bits(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }
static inline uint64_t d_bits(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }

static const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;
static const double MAGIC_D = 6755399441055744.0; /* 1.5 * 2^52: x + MAGIC - MAGIC rounds x to an integer */

/* 2^n for integer-valued n in [-1074, 1023], as two exact factors (each a normal number). */
static inline double d_pow2(int64_t n, double x) {
    int64_t n1 = n / 2, n2 = n - n1;
    return (x * d_from_bits((uint64_t)(n1 + 1023) << 52)) * d_from_bits((uint64_t)(n2 + 1023) << 52);
}

double apc_exp_d(double x) {
    if (x != x) return x;
    if (x > 709.8) return d_from_bits(0x7ff0000000000000ULL);
    if (x < -745.2) return 0.0;
    double n = (x * 1.44269504088896338700e+00 + MAGIC_D) - MAGIC_D; /* round(x / ln 2) */
    double r = (x - n * LN2_HI) - n * LN2_LO; /* |r| <= ~0.347; n * LN2_HI is exact (LN2_HI has 32 bits) */
    /* exp(r): Taylor to r^13 (the next term is < 5e-18 relative), Horner */
    double p = 1.0 / 6227020800.0;
    static const double inv_fact[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                      1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
                                      1.0 / 6.0, 0.5, 1.0, 1.0};
    for (int i = 0; i < 13; i++) p = p * r + inv_fact[i];
    return d_pow2((int64_t)n, p);
}

double apc_log_d(double x) {
    if (x != x || x < 0) return d_from_bits(0x7ff8000000000000ULL); /* NaN */
    if (x == 0) return -d_from_bits(0x7ff0000000000000ULL);
    if (x == d_from_bits(0x7ff0000000000000ULL)) return x;
    int64_t e = 0;
    if (x < 2.2250738585072014e-308) { x *= 18014398509481984.0; e = -54; } /* subnormal: scale by 2^54 */
    uint64_t u = d_bits(x);
    e += (int64_t)((u >> 52) & 0x7ff) - 1023;
    double m = d_from_bits((u & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL); /* [1, 2) */
    if (m > 1.4142135623730951) { m = m * 0.5; e += 1; } /* [sqrt(1/2), sqrt(2)) */
    double f = m - 1.0;                                   /* exact (Sterbenz) */
    double s = f / (2.0 + f), s2 = s * s;                 /* log(m) = 2 atanh(s), |s| <= 0.1716 */
    double p = 1.0 / 27.0;                                /* the next term is < 1e-19 relative */
    for (int k = 25; k >= 3; k -= 2) p = p * s2 + 1.0 / k;
    double logm = 2.0 * s + 2.0 * s * s2 * p;
    double de = (double)e;
    return de * LN2_HI + (de * LN2_LO + logm);
}

/* sin and cos of a double: reduction by pi/2 in three exact-product parts (fdlibm's split; |x| < 2^28 keeps each
 * n * part exact), then Taylor polynomials on |r| <= pi/4 (next terms < 1e-19). */
static const double PIO2_1 = 1.57079632673412561417e+00, PIO2_2 = 6.07710050630396597660e-11,
                    PIO2_3 = 2.02226624871116645580e-21, TWO_OVER_PI = 6.36619772367581382433e-01;

static inline double sin_poly(double r) {
    double r2 = r * r, p = -1.0 / 121645100408832000.0; /* -1/19! */
    static const double c[] = {1.0 / 355687428096000.0, -1.0 / 1307674368000.0, 1.0 / 6227020800.0,
                               -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0};
    for (int i = 0; i < 8; i++) p = p * r2 + c[i];
    return r + r * r2 * p;
}

static inline double cos_poly(double r) {
    double r2 = r * r, p = 1.0 / 2432902008176640000.0; /* 1/20! */
    static const double c[] = {-1.0 / 6402373705728000.0, 1.0 / 20922789888000.0, -1.0 / 87178291200.0,
                               1.0 / 479001600.0, -1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0,
                               -0.5};
    for (int i = 0; i < 9; i++) p = p * r2 + c[i];
    return 1.0 + r2 * p;
}

/* which = 0: sin, 1: cos. NaN for |x| >= 2^28. Every n * PIO2_k is exact for |x| < ~8e5 (|n| < 2^19), where the
 * reduced argument is accurate to ~1e-16; beyond, the bits are still the same everywhere, less accurate. */
static double sincos_d(double x, int which) {
    if (x != x || x > 268435456.0 || x < -268435456.0) return d_from_bits(0x7ff8000000000000ULL);
    double n = (x * TWO_OVER_PI + MAGIC_D) - MAGIC_D;
    double r = ((x - n * PIO2_1) - n * PIO2_2) - n * PIO2_3;
    int64_t q = ((int64_t)n + which) & 3;
    double s = (q & 1) ? cos_poly(r) : sin_poly(r);
    return (q & 2) ? -s : s;
}

double apc_sin_d(double x) { return sincos_d(x, 0); }
double apc_cos_d(double x) { return sincos_d(x, 1); }

/* erf by its Taylor series (alternating; enough terms that the next is < 1e-17), for |x| < 4; +-1 beyond, where
 * 1 - erf(x) < 2e-8 is below half a float ulp of 1. The terms' cancellation costs ~5 digits at |x| = 4: the float
 * result is still exact to well under an ulp. */
double apc_erf_d(double x) {
    if (x != x) return x;
    if (x >= 4.0) return 1.0;
    if (x <= -4.0) return -1.0;
    double x2 = x * x, term = x, sum = x;
    for (int n = 1; n < 200; n++) {
        term = term * (-x2) / (double)n;
        double add = term / (double)(2 * n + 1);
        sum = sum + add;
        if (add < 1e-18 * (sum < 0 ? -sum : sum) && add > -1e-18 * (sum < 0 ? -sum : sum)) break;
    }
    return sum * 1.12837916709551257390e+00; /* 2 / sqrt(pi) */
}

/* out[i] = f(in[i]) of one `which` (0 exp, 1 log, 2 sin, 3 cos, 4 erf), scalar; exp has a vector copy below. */
static void map_d_scalar(int which, const double *in, double *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double x = in[i];
        out[i] = which == 0 ? apc_exp_d(x) : which == 1 ? apc_log_d(x) : which == 2 ? apc_sin_d(x)
               : which == 3 ? apc_cos_d(x) : apc_erf_d(x);
    }
}

/* ---- double vector exp: apc_exp_d's operations, in its order, on each lane ------------------------------------ */

static const double INV_FACT[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                  1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
                                  1.0 / 6.0, 0.5, 1.0, 1.0}; /* apc_exp_d's Horner coefficients after 1/13! */

/* map_exp_d_SFX: out[i] = apc_exp_d(in[i]) bit for bit, in vectors of the copy's native width (BYTES: 16 SSE2 /
 * NEON, 32 AVX2, 64 AVX-512; a wider generic vector would have its comparisons done one lane at a time): each lane
 * the same IEEE operations in the same order as apc_exp_d (no contraction: -ffp-contract=off). (int64_t)n is read
 * from the magic sum's bits (t = x / ln 2 + 1.5 * 2^52 lies in [2^52, 2^53), where the ulp is 1, so bits(t) -
 * bits(MAGIC) = t - MAGIC = n exactly), and d_pow2's n / 2 (toward zero) by logical shifts of n + 2048 > 0. The
 * special lanes (NaN: x itself, > 709.8: +inf, < -745.2: 0) are computed on 0 and replaced, as apc_exp_d returns
 * them before any arithmetic. The tail (fewer than a vector) is apc_exp_d's. */
#define APC_EXP_D(SFX, ATTR, BYTES)                                                                               \
    typedef double vd_##SFX __attribute__((vector_size(BYTES)));                                                  \
    typedef int64_t vl_##SFX __attribute__((vector_size(BYTES)));                                                 \
    typedef uint64_t vu_##SFX __attribute__((vector_size(BYTES)));                                                \
    ATTR static void map_exp_d_##SFX(const double *in, double *out, int64_t n) {                                  \
        typedef vd_##SFX vd;                                                                                      \
        typedef vl_##SFX vl;                                                                                      \
        typedef vu_##SFX vu;                                                                                      \
        enum { W = BYTES / 8 };                                                                                   \
        const vd inf = (vd)((vl){0} + 0x7ff0000000000000LL);                                                      \
        int64_t whole = n / W * W;                                                                                \
        for (int64_t i = 0; i < whole; i += W) {                                                                  \
            vd x;                                                                                                 \
            memcpy(&x, in + i, sizeof x);                                                                         \
            const vl nan = x != x, over = x > 709.8, under = x < -745.2, special = nan | over | under;            \
            vd xs = (vd)((vl)x & ~special); /* 0 in the special lanes */                                          \
            vd t = xs * 1.44269504088896338700e+00 + MAGIC_D;                                                     \
            vd nd = t - MAGIC_D;                                                                                  \
            vd r = (xs - nd * LN2_HI) - nd * LN2_LO;                                                              \
            vd p = (vd){0} + 1.0 / 6227020800.0;                                                                  \
            _Pragma("GCC unroll 13") for (int k = 0; k < 13; k++) p = p * r + INV_FACT[k];                        \
            vu ni = (vu)t - (vu)((vd){0} + MAGIC_D) + 2048; /* n + 2048, in [973, 3072] */                        \
            vu n1 = ((ni - (vu)(ni < 2048)) >> 1) - 1024;   /* n / 2 toward zero: +1 (a mask is -1) below 0 */    \
            vu n2 = ni - 2048 - n1;                                                                               \
            vd y = (p * (vd)((n1 + 1023) << 52)) * (vd)((n2 + 1023) << 52);                                       \
            y = (vd)(((vl)y & ~special) | ((vl)x & nan) | ((vl)inf & over)); /* under: 0 */                      \
            memcpy(out + i, &y, sizeof y);                                                                        \
        }                                                                                                         \
        for (int64_t i = whole; i < n; i++) out[i] = apc_exp_d(in[i]);                                            \
    }

APC_EXP_D(base, , 16)
#ifdef APC_X86
APC_EXP_D(avx2, __attribute__((target("avx2"))), 32)
APC_EXP_D(avx512, __attribute__((target("avx512f"))), 64)
#endif

/* ---- float vector functions (GCC vector extensions: each lane the same IEEE operations) ------------------- */


/* tanh(x): an odd Taylor polynomial to x^17 for |x| < 0.5 (next term < 0.1 ulp), else (1 - t) / (1 + t) with
 * t = exp(-2|x|) <= e^-1 (no cancellation to speak of); the sign copied back. */
__attribute__((always_inline)) static inline vf vtanh(vf x) {
    const vi sign_bit = (vi){0} + (int32_t)0x80000000;
    const vi sign = (vi)x & sign_bit;
    vf a = (vf)((vi)x & ~sign_bit);
    vf a2 = a * a;
    /* tanh a = a - a^3 (1/3 - 2/15 a^2 + 17/315 a^4 - ...): the series' coefficients, rounded to float by the
     * compiler (constant folding is exact arithmetic, then one rounding: the same constants everywhere) */
    vf p = vsplat((float)(-6404582.0 / 10854718875.0));
    p = p * a2 + (float)(929569.0 / 638512875.0);
    p = p * a2 + (float)(-21844.0 / 6081075.0);
    p = p * a2 + (float)(1382.0 / 155925.0);
    p = p * a2 + (float)(-62.0 / 2835.0);
    p = p * a2 + (float)(17.0 / 315.0);
    p = p * a2 + (float)(-2.0 / 15.0);
    p = p * a2 + (float)(1.0 / 3.0);
    vf small = a - a * a2 * p;
    vf t = vexp(a * -2.0f);
    vf big = (1.0f - t) / (1.0f + t);
    vf y = vsel(a < 0.5f, small, big);
    return (vf)((vi)y | sign); /* NaN: a NaN either way */
}

/* ---- the operations, per copy ------------------------------------------------------------------------------ */

/* x[0..n) -> the fixed-tree sum of its LANES interleaved partial sums, in double (exact squares / conversions). */
static inline double tree16(const double *s) {
    double a[8];
    for (int i = 0; i < 8; i++) a[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    a[0] = a[0] + a[2];
    a[1] = a[1] + a[3];
    return a[0] + a[1];
}



/* op codes of apc_map_f */
enum { OP_EXP = 0, OP_TANH = 1, OP_SILU = 2, OP_SIGMOID = 3, OP_GELU_TANH = 4 };

#define APC_BODIES(SFX, ATTR)                                                                                     \
    /* out[i] = op(x[i]) for n floats (out may be x). */                                                         \
    ATTR static void map_f_##SFX(int op, const float *x, float *out, int64_t n) {       \
        for (int64_t i = 0; i < n; i += LANES) {                                                                  \
            vf v = vload(x + i, n - i, 0.0f), y;                                                                  \
            if (op == OP_EXP) y = vexp(v);                                                                        \
            else if (op == OP_TANH) y = vtanh(v);                                                                 \
            else if (op == OP_SILU) y = v / (1.0f + vexp(-v));          /* torch's silu: x / (1 + exp(-x)) */     \
            else if (op == OP_SIGMOID) y = 1.0f / (1.0f + vexp(-v));                                              \
            else { /* torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */        \
                vf inner = 0.7978845608028654f * (v + 0.044715f * (v * v * v));                                  \
                y = 0.5f * v * (1.0f + vtanh(inner));                                                             \
            }                                                                                                     \
            vstore(out + i, y, n - i);                                                                            \
        }                                                                                                         \
    }                                                                                                             \
    /* sums[r] = sum of row r (n floats, rows `stride` apart), in float: lanes, then the tree. */                 \
    ATTR static void row_sums_f_##SFX(const float *x, int64_t rows, int64_t n,         \
                                                                 int64_t stride, float *sums) {                   \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            vf acc = vsplat(0.0f);                                                                                \
            for (int64_t i = 0; i < n; i += LANES) acc = acc + vload(x + r * stride + i, n - i, 0.0f);            \
            float s[LANES];                                                                                       \
            memcpy(s, &acc, sizeof s);                                                                            \
            sums[r] = tree16f(s);                                                                                 \
        }                                                                                                         \
    }                                                                                                             \
    /* Per row: sum of squares (mode 0) or of values (mode 1) in double lanes, then the tree. */                  \
    ATTR static void row_sums_d_##SFX(const float *x, int64_t rows, int64_t n,         \
                                                                 int64_t stride, int mode, double *sums) {        \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            double s[LANES] = {0};                                                                                \
            const float *row = x + r * stride;                                                                    \
            for (int64_t i = 0; i < n; i += LANES) {                                                              \
                int64_t m = n - i < LANES ? n - i : LANES;                                                        \
                for (int64_t j = 0; j < m; j++) {                                                                 \
                    double v = (double)row[i + j];                                                                \
                    s[j] = s[j] + (mode == 0 ? v * v : v);                                                        \
                }                                                                                                 \
            }                                                                                                     \
            sums[r] = tree16(s);                                                                                  \
        }                                                                                                         \
    }                                                                                                             \
    /* Per row of logits: max, then the sum of exp(x - max) (float exps, double lanes), lse = max + log(sum).    \
     * A row whose max is -inf (all -inf) gets lse -inf; a NaN anywhere gives NaN. */                            \
    ATTR static void row_logsumexp_##SFX(const float *x, int64_t rows, int64_t n,      \
                                                                     int64_t stride, double *lse) {               \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            const float *row = x + r * stride;                                                                    \
            float mx = -__builtin_inff();                                                                         \
            int nan = 0;                                                                                          \
            for (int64_t i = 0; i < n; i++) {                                                                     \
                if (row[i] > mx) mx = row[i];                                                                     \
                else if (row[i] != row[i]) nan = 1;                                                               \
            }                                                                                                     \
            if (nan) { lse[r] = (double)__builtin_nanf(""); continue; }                                          \
            if (mx == -__builtin_inff()) { lse[r] = -__builtin_inf(); continue; }                                 \
            double s[LANES] = {0};                                                                                \
            for (int64_t i = 0; i < n; i += LANES) {                                                              \
                vf e = vexp(vload(row + i, n - i, -__builtin_inff()) - mx);                                      \
                float ef[LANES];                                                                                  \
                memcpy(ef, &e, sizeof ef);                                                                        \
                for (int j = 0; j < LANES; j++) s[j] = s[j] + (double)ef[j];                                      \
            }                                                                                                     \
            lse[r] = (double)mx + apc_log_d(tree16(s));                                                           \
        }                                                                                                         \
    }

APC_BODIES(base, )
#ifdef APC_X86
APC_BODIES(avx2, __attribute__((target("avx2"))))
APC_BODIES(avx512, __attribute__((target("avx512f"))))
#endif

/* Which copy runs: 2 = AVX-512F, 1 = AVX2, 0 = the baseline (SSE2 on x86-64, NEON on AArch64, or scalar). All
 * give the same bits (see the top). */
int apc_math_level(void) {
#ifdef APC_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
#else
    return 0;
#endif
}

static int pick(int level) {
    int best = apc_math_level();
    return level < 0 || level > best ? best : level;
}

#ifdef APC_X86
#define APC_DISPATCH(LEVEL, NAME, ...)                                                                             \
    do {                                                                                                          \
        int l_ = pick(LEVEL);                                                                                     \
        if (l_ == 2) NAME##_avx512(__VA_ARGS__);                                                                  \
        else if (l_ == 1) NAME##_avx2(__VA_ARGS__);                                                               \
        else NAME##_base(__VA_ARGS__);                                                                            \
    } while (0)
#else
#define APC_DISPATCH(LEVEL, NAME, ...) NAME##_base(__VA_ARGS__)
#endif

/* The entry points: level -1 = the best copy of this CPU; 0, 1, 2 force one (at most what the CPU has). nthreads:
 * OpenMP threads (torch's runtime), splitting elements or rows into contiguous ranges; which thread computes an
 * element or a row changes none of its operations, so not its bits. */

#define APC_PARALLEL(NTHREADS, TOTAL, ...)                                                                        \
    do {                                                                                                          \
        int nt_ = (NTHREADS) < 1 ? 1 : (NTHREADS);                                                                \
        if (nt_ == 1 || (TOTAL) < 2) {                                                                            \
            int64_t lo = 0, hi = (TOTAL);                                                                         \
            fpenv e_ = fp_enter();                                                                                \
            __VA_ARGS__;                                                                                               \
            fp_leave(e_);                                                                                         \
        } else {                                                                                                  \
            _Pragma("omp parallel num_threads(nt_)") {                                                           \
                int t_ = omp_get_thread_num(), n_ = omp_get_num_threads();                                        \
                int64_t lo = (TOTAL) * t_ / n_, hi = (TOTAL) * (t_ + 1) / n_;                                     \
                fpenv e_ = fp_enter(); /* per thread: MXCSR / FPCR are per-thread state */                       \
                __VA_ARGS__;                                                                                           \
                fp_leave(e_);                                                                                     \
            }                                                                                                     \
        }                                                                                                         \
    } while (0)

/* Elementwise double functions over arrays: out[i] = f(in[i]) (exp: the vector copy of `level`). */
void apc_map_d(int which, const double *in, double *out, int64_t n, int level, int nthreads) {
    int64_t groups = (n + 7) / 8; /* threads' shares start where a vector of any copy starts */
    APC_PARALLEL(nthreads, groups, {
        int64_t a = lo * 8, b = hi * 8 < n ? hi * 8 : n;
        if (b > a && which == 0) APC_DISPATCH(level, map_exp_d, in + a, out + a, b - a);
        else if (b > a) map_d_scalar(which, in + a, out + a, b - a);
    });
}

void apc_map_f(int op, const float *x, float *out, int64_t n, int level, int nthreads) {
    /* ranges of whole LANES-element groups, so that a thread's share starts where a vector starts */
    int64_t groups = (n + LANES - 1) / LANES;
    APC_PARALLEL(nthreads, groups, {
        int64_t a = lo * LANES, b = hi * LANES < n ? hi * LANES : n;
        if (b > a) APC_DISPATCH(level, map_f, op, x + a, out + a, b - a);
    });
}

void apc_row_sums_f(const float *x, int64_t rows, int64_t n, int64_t stride, float *sums, int level, int nthreads) {
    APC_PARALLEL(nthreads, rows, { if (hi > lo) APC_DISPATCH(level, row_sums_f, x + lo * stride, hi - lo, n, stride, sums + lo); });
}

void apc_row_sums_d(const float *x, int64_t rows, int64_t n, int64_t stride, int mode, double *sums, int level,
                    int nthreads) {
    APC_PARALLEL(nthreads, rows,
                 { if (hi > lo) APC_DISPATCH(level, row_sums_d, x + lo * stride, hi - lo, n, stride, mode, sums + lo); });
}

void apc_row_logsumexp(const float *x, int64_t rows, int64_t n, int64_t stride, double *lse, int level,
                       int nthreads) {
    APC_PARALLEL(nthreads, rows,
                 { if (hi > lo) APC_DISPATCH(level, row_logsumexp, x + lo * stride, hi - lo, n, stride, lse + lo); });
}
