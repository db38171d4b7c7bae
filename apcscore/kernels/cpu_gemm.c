/* apcscore's CPU GEMM: C[M, N] (fp32) = A[M, K] . B[N, K]^T with a reduction order fixed by construction.
 *
 * Every output element is the sum of its K products in one fixed order (APC_ORDER_VERSION names it):
 *     c = +0
 *     for each block b of KB consecutive k, counted from k = 0 (the last block may be shorter):
 *         p = +0;  for k in b, ascending:  p = fma(a[m, k], b[n, k], p)      (one fma chain per block)
 *         c = c + p                                                          (blocks added in ascending order)
 * IEEE 754 defines fma as the exact a*b + c rounded once, and + as the exact sum rounded once (round-to-nearest-
 * even, which is fixed here, with denormals kept: MXCSR is set to its power-on value for the call). So an
 * element's bits depend on its row of A, its row of B and K only: not on M, on the row's position in the call, on
 * N, on the thread count, on the tiling, on the instruction set (the AVX-512, AVX2 and scalar fmaf() kernels give
 * the same bits), or on the CPU vendor. Tiles and cache blocks (KC, a multiple of KB) only change *which* register
 * holds a chain, never its order. Edge tiles run the same micro-kernel on zero-padded copies.
 *
 * Why blocks: one chain over the whole of K accumulates rounding errors over K steps; KB-step chains whose sums
 * are added up accumulate over KB + K/KB steps (K = 1536: 64 + 24 instead of 1536), which measured 2-3x closer
 * to a float64 product than the single chain and as close as MKL (docs/architecture.md, "Portable bits"). A
 * block's chain restarts from +0 in registers and is added to C in memory, so it costs one add per KB fmas.
 *
 * Layouts: B is packed once per weight into panels of NR columns, [ceil(N/NR)][K][NR], in B's own dtype
 * (fp32, bf16 or fp16; zero-padded columns); A is packed per call into [ceil(M/MR)][K][MR] fp32 (converted
 * exactly: bf16 and fp16 values are fp32 values). Threads (OpenMP: torch's own runtime once torch is loaded)
 * split the panels of N. Build: gcc -O2 -fopenmp -ffp-contract=off (see cpu_gemm.py); never -ffast-math.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h" /* APC_X86, the dtypes and their exact conversions to fp32 */

#define MR 6
#define NR 16
#define KC 256 /* k cache block: a B micro-panel [KC][NR] fp32 is 16 KiB (L1); a multiple of KB */
#ifndef KB
#define KB 64 /* k block of one fma chain (the order above; changing it changes bits) */
#endif
/* The order of the sums, as run metadata and the numerics fingerprint record it. */
int apc_order_version(void) { return 2000 + KB; } /* 2: blocked chains; 1 (before): one chain over K */
#define MC 96  /* rows of A per block: [MC][KC] fp32 is 96 KiB (L2) */


/* ---- packing ------------------------------------------------------------------------------------- */

/* Size in bytes of B packed: ceil(N/NR) * K * NR elements of its dtype. */
int64_t apc_packed_b_bytes(int64_t n, int64_t k, int dtype) { return ((n + NR - 1) / NR) * k * NR * elem_size(dtype); }

static void pack_b_range(const void *b, int dtype, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k,
                         void *packed, int64_t p0, int64_t p1);

/* B [N, K] (strides in elements) -> panels [ceil(N/NR)][K][NR], same dtype, padding columns zero. */
void apc_pack_b(const void *b, int dtype, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k, void *packed,
                int nthreads) {
    int64_t panels = (n + NR - 1) / NR;
    if (nthreads > panels) nthreads = (int)panels;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        pack_b_range(b, dtype, n, k, stride_n, stride_k, packed, panels * t / nt, panels * (t + 1) / nt);
    }
}

/* A rows [m0, m0 + rows) -> micro-panels [ceil(rows/MR)][K][MR] fp32, padding rows zero. */
static void pack_a(const void *a, int dtype, int64_t m0, int64_t rows, int64_t k, int64_t stride_m,
                   int64_t stride_k, float *dst) {
    int64_t panels = (rows + MR - 1) / MR;
    for (int64_t p = 0; p < panels; p++) {
        float *d = dst + p * k * MR;
        for (int64_t i = 0; i < MR; i++) {
            int64_t r = p * MR + i;
            if (r < rows) {
                const int64_t base = (m0 + r) * stride_m;
                if (dtype == DT_F32 && stride_k == 1) {
                    const float *src = (const float *)a + base;
                    for (int64_t kk = 0; kk < k; kk++) d[kk * MR + i] = src[kk];
                } else {
                    for (int64_t kk = 0; kk < k; kk++) d[kk * MR + i] = load_elem(a, dtype, base + kk * stride_k);
                }
            } else {
                for (int64_t kk = 0; kk < k; kk++) d[kk * MR + i] = 0.0f;
            }
        }
    }
}

/* ---- micro-kernels: c[MR][NR] (row stride ldc) continues its chains over kc steps -------------------- */

static void ukernel_scalar(int64_t kc, const float *ap, const void *bp, int bdtype, float *c, int64_t ldc) {
    for (int64_t i = 0; i < MR; i++) {
        for (int64_t j = 0; j < NR; j++) {
            float sum = c[i * ldc + j];
            for (int64_t k0 = 0; k0 < kc; k0 += KB) {
                const int64_t k1 = kc - k0 < KB ? kc : k0 + KB;
                float acc = 0.0f;
                for (int64_t kk = k0; kk < k1; kk++) acc = fmaf(ap[kk * MR + i], load_elem(bp, bdtype, kk * NR + j), acc);
                sum = sum + acc;
            }
            c[i * ldc + j] = sum;
        }
    }
}

#ifdef APC_X86
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void load_b16(const void *bp, int bdtype, int64_t kk, __m256 *b0,
                                                                 __m256 *b1) {
    if (bdtype == DT_F32) {
        const float *p = (const float *)bp + kk * NR;
        *b0 = _mm256_loadu_ps(p);
        *b1 = _mm256_loadu_ps(p + 8);
    } else if (bdtype == DT_BF16) {
        const uint16_t *p = (const uint16_t *)bp + kk * NR;
        __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
        __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
        *b0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
        *b1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    } else {
        const uint16_t *p = (const uint16_t *)bp + kk * NR;
        *b0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *b1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void ukernel_avx2(
    int64_t kc, const float *ap, const void *bp, int bdtype, float *c, int64_t ldc) {
    for (int64_t k0 = 0; k0 < kc; k0 += KB) { /* one chain per block from +0, then added to C */
        const int64_t k1 = kc - k0 < KB ? kc : k0 + KB;
        __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps();
        __m256 c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
        __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps();
        __m256 c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
        for (int64_t kk = k0; kk < k1; kk++) {
            __m256 b0, b1, a;
            load_b16(bp, bdtype, kk, &b0, &b1);
            const float *ak = ap + kk * MR;
            a = _mm256_broadcast_ss(ak + 0); c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
            a = _mm256_broadcast_ss(ak + 1); c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
            a = _mm256_broadcast_ss(ak + 2); c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
            a = _mm256_broadcast_ss(ak + 3); c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
            a = _mm256_broadcast_ss(ak + 4); c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
            a = _mm256_broadcast_ss(ak + 5); c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
        }
#define APC_ADD8(P, R) _mm256_storeu_ps((P), _mm256_add_ps(_mm256_loadu_ps(P), (R)))
        APC_ADD8(c + 0 * ldc, c00); APC_ADD8(c + 0 * ldc + 8, c01);
        APC_ADD8(c + 1 * ldc, c10); APC_ADD8(c + 1 * ldc + 8, c11);
        APC_ADD8(c + 2 * ldc, c20); APC_ADD8(c + 2 * ldc + 8, c21);
        APC_ADD8(c + 3 * ldc, c30); APC_ADD8(c + 3 * ldc + 8, c31);
        APC_ADD8(c + 4 * ldc, c40); APC_ADD8(c + 4 * ldc + 8, c41);
        APC_ADD8(c + 5 * ldc, c50); APC_ADD8(c + 5 * ldc + 8, c51);
#undef APC_ADD8
    }
}

/* One copy of a kernel per B dtype, NAME_f32 / NAME_bf16 / NAME_f16 (the dtype branch leaves the k loop). PARAMS:
 * the copies' parameters; then the kernel's arguments before its B dtype (the copies end with c and ldc, as the
 * kernels do). APC_BY_DTYPE picks the copy of a dtype. */
#define APC_PER_DTYPE(NAME, TARGET, PARAMS, ...)                                                                   \
    __attribute__((target(TARGET))) static void NAME##_f32 PARAMS { NAME(__VA_ARGS__, DT_F32, c, ldc); }           \
    __attribute__((target(TARGET))) static void NAME##_bf16 PARAMS { NAME(__VA_ARGS__, DT_BF16, c, ldc); }         \
    __attribute__((target(TARGET))) static void NAME##_f16 PARAMS { NAME(__VA_ARGS__, DT_F16, c, ldc); }
#define APC_BY_DTYPE(NAME, DTYPE) ((DTYPE) == DT_F32 ? NAME##_f32 : (DTYPE) == DT_BF16 ? NAME##_bf16 : NAME##_f16)
#define APC_KERNEL_PARAMS (int64_t kc, const float *ap, const void *bp, float *c, int64_t ldc)

APC_PER_DTYPE(ukernel_avx2, "avx2,fma,f16c", APC_KERNEL_PARAMS, kc, ap, bp)

/* AVX-512: the same MR x NR tile with one 16-lane register per row. Each lane is one element's chain, fed the same
 * a and b values in the same k order as the AVX2 and scalar kernels: the same bits, half the instructions. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 load_b16_512(const void *bp, int bdtype,
                                                                                     int64_t kk) {
    if (bdtype == DT_F32) return _mm512_loadu_ps((const float *)bp + kk * NR);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)bp + kk * NR));
    if (bdtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

__attribute__((target("avx512f"), always_inline)) static inline void ukernel_avx512(
    int64_t kc, const float *ap, const void *bp, int bdtype, float *c, int64_t ldc) {
    for (int64_t k0 = 0; k0 < kc; k0 += KB) { /* one chain per block from +0, then added to C */
        const int64_t k1 = kc - k0 < KB ? kc : k0 + KB;
        __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps();
        __m512 c3 = _mm512_setzero_ps(), c4 = _mm512_setzero_ps(), c5 = _mm512_setzero_ps();
        for (int64_t kk = k0; kk < k1; kk++) {
            const __m512 b = load_b16_512(bp, bdtype, kk);
            const float *ak = ap + kk * MR;
            c0 = _mm512_fmadd_ps(_mm512_set1_ps(ak[0]), b, c0);
            c1 = _mm512_fmadd_ps(_mm512_set1_ps(ak[1]), b, c1);
            c2 = _mm512_fmadd_ps(_mm512_set1_ps(ak[2]), b, c2);
            c3 = _mm512_fmadd_ps(_mm512_set1_ps(ak[3]), b, c3);
            c4 = _mm512_fmadd_ps(_mm512_set1_ps(ak[4]), b, c4);
            c5 = _mm512_fmadd_ps(_mm512_set1_ps(ak[5]), b, c5);
        }
#define APC_ADD16(P, R) _mm512_storeu_ps((P), _mm512_add_ps(_mm512_loadu_ps(P), (R)))
        APC_ADD16(c + 0 * ldc, c0); APC_ADD16(c + 1 * ldc, c1); APC_ADD16(c + 2 * ldc, c2);
        APC_ADD16(c + 3 * ldc, c3); APC_ADD16(c + 4 * ldc, c4); APC_ADD16(c + 5 * ldc, c5);
    }
}

APC_PER_DTYPE(ukernel_avx512, "avx512f", APC_KERNEL_PARAMS, kc, ap, bp)

/* AVX-512, WIDE panels side by side: the MR x (WIDE * NR) tile of WIDE consecutive B panels (pstride bytes apart)
 * in MR * WIDE accumulators (24 of the 32 registers). Six chains in flight leave the FMA units waiting on their
 * latency (4 cycles, 2 units); 24 keep them busy (default model's GEMMs on a 2-core Xeon: 206-252 -> 278-291
 * GFLOPS, benchmarks/gemm_cpu.py). Each element's chain is still fed the same a and b values in the same k order:
 * the same bits as one panel at a time. */
#define WIDE 4
__attribute__((target("avx512f"), always_inline)) static inline void ukernel_avx512_wide(
    int64_t kc, const float *ap, const void *bp, int64_t pstride, int bdtype, float *c, int64_t ldc) {
    for (int64_t k0 = 0; k0 < kc; k0 += KB) { /* one chain per block from +0, then added to C */
        const int64_t k1 = kc - k0 < KB ? kc : k0 + KB;
        __m512 acc[MR][WIDE];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
            for (int g = 0; g < WIDE; g++) acc[i][g] = _mm512_setzero_ps();
        for (int64_t kk = k0; kk < k1; kk++) {
            __m512 b[WIDE];
#pragma GCC unroll 4
            for (int g = 0; g < WIDE; g++) b[g] = load_b16_512((const char *)bp + g * pstride, bdtype, kk);
            const float *ak = ap + kk * MR;
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) {
                const __m512 a = _mm512_set1_ps(ak[i]);
#pragma GCC unroll 4
                for (int g = 0; g < WIDE; g++) acc[i][g] = _mm512_fmadd_ps(a, b[g], acc[i][g]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
            for (int g = 0; g < WIDE; g++) APC_ADD16(c + i * ldc + g * NR, acc[i][g]);
    }
}

APC_PER_DTYPE(ukernel_avx512_wide, "avx512f",
              (int64_t kc, const float *ap, const void *bp, int64_t pstride, float *c, int64_t ldc), kc, ap, bp,
              pstride)
#endif

/* Which micro-kernel runs: 2 = AVX-512F, 1 = AVX2+FMA, 0 = portable scalar fmaf() (the path of every other CPU:
 * AArch64's fmaf is its fused multiply-add instruction). All give the same bits (see the
 * top). (__builtin_cpu_supports also asks the OS: XGETBV for the AVX and AVX-512 register state.) */
int apc_simd_level(void) {
#ifdef APC_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
#else
    return 0;
#endif
}

/* Bytes of workspace apc_gemm needs per thread: one packed A block [MC][K] fp32. */
int64_t apc_workspace_bytes(int64_t k, int nthreads) { return (int64_t)nthreads * MC * k * 4 + 64; }

/* Row blocks [ir0, rows) of one B panel (bp: its k block pc, cols valid columns) into cp = C's rows ic.. at the
 * panel's first column. Edge tiles (fewer than MR rows or NR columns) run the same kernel on a zero-padded copy. */
static void panel_rows(int64_t rows, int64_t ir0, int64_t pc, int64_t kc, int64_t k, const float *apack,
                       const char *bp, int b_dtype, float *cp, int64_t ldc, int64_t cols, int simd) {
    float tile[MR * NR];
    for (int64_t ir = ir0; ir < rows; ir += MR) {
        const float *ap = apack + (ir / MR) * k * MR + pc * MR;
        int64_t r = rows - ir < MR ? rows - ir : MR;
        float *cc = cp + ir * ldc;
        float *dst = cc;
        int64_t ld = ldc;
        if (r < MR || cols < NR) { /* edge tile: the same kernel on a zero-padded copy */
            memset(tile, 0, sizeof tile);
            if (pc > 0)
                for (int64_t i = 0; i < r; i++) memcpy(tile + i * NR, cc + i * ldc, (size_t)cols * 4);
            dst = tile;
            ld = NR;
        } else if (pc == 0) { /* every chain starts from +0 */
            for (int64_t i = 0; i < MR; i++) memset(cc + i * ldc, 0, NR * 4);
        }
#ifdef APC_X86
        if (simd >= 2)
            APC_BY_DTYPE(ukernel_avx512, b_dtype)(kc, ap, bp, dst, ld);
        else if (simd == 1)
            APC_BY_DTYPE(ukernel_avx2, b_dtype)(kc, ap, bp, dst, ld);
        else
#endif
            ukernel_scalar(kc, ap, bp, b_dtype, dst, ld);
        if (dst == tile)
            for (int64_t i = 0; i < r; i++) memcpy(cc + i * ldc, tile + i * NR, (size_t)cols * 4);
    }
}

/* Panels [p0, p1) of N for every row: one thread's share of apc_gemm (apack: its packed-A buffer). */
static void gemm_panels(int64_t m, int64_t n, int64_t k, const void *a, int a_dtype, int64_t sa_m, int64_t sa_k,
                        const void *bpacked, int b_dtype, float *c, int64_t ldc, float *apack, int64_t p0, int64_t p1,
                        int simd) {
    int64_t bes = elem_size(b_dtype);
#if defined(APC_X86)
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(0x1F80); /* round to nearest even, no flush-to-zero, no denormals-are-zero, all masked */
#elif defined(__aarch64__)
    uint64_t fpcr, csr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    csr = fpcr; /* FZ off (torch's flush-denormal sets it), round to nearest, FZ16 off */
    fpcr &= ~((uint64_t)1 << 24 | (uint64_t)3 << 22 | (uint64_t)1 << 19);
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
#endif
    for (int64_t ic = 0; ic < m && p0 < p1; ic += MC) {
        int64_t rows = m - ic < MC ? m - ic : MC;
        pack_a(a, a_dtype, ic, rows, k, sa_m, sa_k, apack);
        for (int64_t pc = 0; pc < k; pc += KC) {
            int64_t kc = k - pc < KC ? k - pc : KC;
            for (int64_t p = p0; p < p1; p++) {
                const char *bp = (const char *)bpacked + (p * k + pc) * NR * bes;
                float *cp = c + ic * ldc + p * NR;
                int64_t cols = n - p * NR < NR ? n - p * NR : NR, full = 0;
#ifdef APC_X86
                if (simd >= 2 && p + WIDE <= p1 && (p + WIDE) * NR <= n) { /* WIDE full panels, full row blocks */
                    full = rows / MR * MR;
                    for (int64_t ir = 0; ir < full; ir += MR) {
                        const float *ap = apack + (ir / MR) * k * MR + pc * MR;
                        float *cc = cp + ir * ldc;
                        if (pc == 0) /* every chain starts from +0 */
                            for (int64_t i = 0; i < MR; i++) memset(cc + i * ldc, 0, WIDE * NR * 4);
                        APC_BY_DTYPE(ukernel_avx512_wide, b_dtype)(kc, ap, bp, k * NR * bes, cc, ldc);
                    }
                    for (int64_t g = 1; g < WIDE; g++) /* the last rows of the other panels, one panel at a time */
                        panel_rows(rows, full, pc, kc, k, apack, bp + g * k * NR * bes, b_dtype, cp + g * NR, ldc, NR,
                                   simd);
                    p += WIDE - 1;
                }
#endif
                panel_rows(rows, full, pc, kc, k, apack, bp, b_dtype, cp, ldc, cols, simd);
            }
        }
    }
#if defined(APC_X86)
    _mm_setcsr(csr);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(csr));
#endif
}

/* C[m, n] (fp32, row stride ldc) = A[M, K] (dtype a_dtype, strides sa_m, sa_k) . Bpacked^T.
 * workspace: apc_workspace_bytes(k, nthreads) bytes. simd: -1 = best available, 0 = scalar, 1 = AVX2, 2 = AVX-512
 * (at most what apc_simd_level() says). Thread t computes
 * panels [P*t/T, P*(t+1)/T) of N: which thread computes an element changes nothing in its chain. */
void apc_gemm(int64_t m, int64_t n, int64_t k, const void *a, int a_dtype, int64_t sa_m, int64_t sa_k,
              const void *bpacked, int b_dtype, float *c, int64_t ldc, void *workspace, int nthreads, int simd) {
    if (simd < 0 || simd > apc_simd_level()) simd = apc_simd_level(); /* never more than this CPU has */
    if (k == 0) { /* no products: every sum is +0 (the block loop below would leave C as it was) */
        for (int64_t i = 0; i < m; i++) memset(c + i * ldc, 0, (size_t)n * 4);
        return;
    }
    int64_t panels = (n + NR - 1) / NR;
    float *base = (float *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    if (nthreads > panels) nthreads = (int)panels;
    if (nthreads <= 1) {
        gemm_panels(m, n, k, a, a_dtype, sa_m, sa_k, bpacked, b_dtype, c, ldc, base, 0, panels, simd);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        gemm_panels(m, n, k, a, a_dtype, sa_m, sa_k, bpacked, b_dtype, c, ldc, base + (int64_t)t * MC * k,
                    panels * t / nt, panels * (t + 1) / nt, simd);
    }
}

/* Panels [p0, p1) of B [N, K] (strides in elements), one thread (apc_bmm packs each product's B itself). */
static void pack_b_range(const void *b, int dtype, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k,
                         void *packed, int64_t p0, int64_t p1) {
    int64_t es = elem_size(dtype);
    if (dtype == DT_F32) { /* the attention operands: typed copies, contiguous runs where a stride is 1 */
        const float *src = (const float *)b;
        float *dst = (float *)packed;
        for (int64_t p = p0; p < p1; p++) {
            int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            float *d = dst + p * k * NR;
            if (stride_n == 1) {
                for (int64_t kk = 0; kk < k; kk++) {
                    memcpy(d + kk * NR, src + kk * stride_k + p * NR, (size_t)cols * 4);
                    if (cols < NR) memset(d + kk * NR + cols, 0, (size_t)(NR - cols) * 4);
                }
            } else {
                if (cols < NR) memset(d, 0, (size_t)k * NR * 4);
                for (int64_t j = 0; j < cols; j++) {
                    const float *col = src + (p * NR + j) * stride_n;
                    for (int64_t kk = 0; kk < k; kk++) d[kk * NR + j] = col[kk * stride_k];
                }
            }
        }
        return;
    }
    for (int64_t p = p0; p < p1; p++) {
        char *dst = (char *)packed + p * k * NR * es;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                char *d = dst + (kk * NR + j) * es;
                if (col < n) memcpy(d, (const char *)b + (col * stride_n + kk * stride_k) * es, (size_t)es);
                else memset(d, 0, (size_t)es);
            }
        }
    }
}

/* Bytes of workspace apc_bmm needs: per thread a packed A block and one product's packed B. */
int64_t apc_bmm_workspace_bytes(int64_t n, int64_t k, int b_dtype, int nthreads) {
    return (int64_t)nthreads * (MC * k * 4 + apc_packed_b_bytes(n, k, b_dtype) + 64) + 64;
}

/* Batched products over two batch dimensions (i0 < b0, i1 < b1; strides in elements, per operand):
 * C[i0, i1] (fp32, [M, N], row stride ldc) = A[i0, i1] [M, K] . B[i0, i1]^T, B given as [N, K] through
 * (sb_n, sb_k) strides (a transposed view works). The same chains as apc_gemm: each product runs on one
 * thread, products are spread over the threads. */
void apc_bmm(int64_t b0, int64_t b1, int64_t m, int64_t n, int64_t k,
             const void *a, int a_dtype, int64_t sa0, int64_t sa1, int64_t sa_m, int64_t sa_k,
             const void *b, int b_dtype, int64_t sb0, int64_t sb1, int64_t sb_n, int64_t sb_k,
             float *c, int64_t sc0, int64_t sc1, int64_t ldc, void *workspace, int nthreads, int simd) {
    if (simd < 0 || simd > apc_simd_level()) simd = apc_simd_level(); /* never more than this CPU has */
    int64_t items = b0 * b1, panels = (n + NR - 1) / NR, aes = elem_size(a_dtype), bes = elem_size(b_dtype);
    int64_t per_thread = (MC * k * 4 + apc_packed_b_bytes(n, k, b_dtype) + 64) & ~(int64_t)63;
    char *base = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
    if (k == 0) { /* no products: every sum is +0 */
        for (int64_t it = 0; it < items; it++)
            for (int64_t i = 0; i < m; i++) memset(c + (it / b1) * sc0 + (it % b1) * sc1 + i * ldc, 0, (size_t)n * 4);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        int64_t i0 = it / b1, i1 = it % b1;
        char *ws = base + (int64_t)omp_get_thread_num() * per_thread;
        void *bp = ws + MC * k * 4;
        pack_b_range((const char *)b + (i0 * sb0 + i1 * sb1) * bes, b_dtype, n, k, sb_n, sb_k, bp, 0, panels);
        gemm_panels(m, n, k, (const char *)a + (i0 * sa0 + i1 * sa1) * aes, a_dtype, sa_m, sa_k, bp, b_dtype,
                    c + i0 * sc0 + i1 * sc1, ldc, (float *)ws, 0, panels, simd);
    }
}

/* ---- products with the paged KV cache as B (decode attention without a gather) ------------------- */

/* Where position pos of sequence s, head h lies in the cache [blocks][block_size][heads][D] (strides in
 * elements, D's stride 1): cache[table[pos / bs]][pos % bs][h]. Positions at or past the sequence's length are
 * its position 0, as the gathering path pads them (they are masked; reading a real key adds no NaN). */
static inline int64_t paged_row(const int32_t *table, int64_t pos, int64_t seq_len, int64_t bs, int64_t s_block,
                                int64_t s_slot, int64_t head_off) {
    if (pos >= seq_len) pos = 0;
    return (int64_t)table[pos / bs] * s_block + (pos % bs) * s_slot + head_off;
}

/* Packs B of one product from the cache (rows: element offsets of its positions, count npos, each row D
 * elements). values == 0: B [N = positions][K = D] (q . k); values == 1: B [N = D][K = positions] (p . v).
 * The same panels [ceil(N/NR)][K][NR], in the cache's dtype, as pack_b_range makes of the gathered copy. */
static void pack_b_paged(const char *cache, int dtype, const int64_t *rows, int64_t n, int64_t k, int values,
                         char *packed) {
    const int64_t es = elem_size(dtype), panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        char *d = packed + p * k * NR * es;
        if (values) { /* row kk of the panel: NR consecutive elements of position kk's row */
            for (int64_t kk = 0; kk < k; kk++) {
                memcpy(d + kk * NR * es, cache + (rows[kk] + p * NR) * es, (size_t)(cols * es));
                if (cols < NR) memset(d + (kk * NR + cols) * es, 0, (size_t)((NR - cols) * es));
            }
        } else { /* column j of the panel: position p * NR + j's row, along k */
            if (cols < NR) memset(d, 0, (size_t)(k * NR * es));
            for (int64_t j = 0; j < cols; j++) {
                const char *src = cache + rows[p * NR + j] * es;
                if (dtype == DT_F32)
                    for (int64_t kk = 0; kk < k; kk++) ((float *)d)[kk * NR + j] = ((const float *)src)[kk];
                else
                    for (int64_t kk = 0; kk < k; kk++) memcpy(d + (kk * NR + j) * es, src + kk * es, (size_t)es);
            }
        }
    }
}

/* Bytes of workspace apc_bmm_paged needs: apc_bmm's, plus the row offsets of one product's positions. */
int64_t apc_bmm_paged_workspace_bytes(int64_t n, int64_t k, int b_dtype, int nthreads) {
    return apc_bmm_workspace_bytes(n, k, b_dtype, nthreads) + (int64_t)nthreads * ((n > k ? n : k) * 8 + 64);
}

/* apc_bmm with B read in place from the paged KV cache through block tables: no gathered copy. Products are
 * (h < heads, s < seqs, t < tiles); A[h, s, t] is [M, K] (strides sa_*); C[h, s, t] is [M, N] (fp32, row stride
 * ldc). Sequence s's positions are counted from first and, for values, from first + t * K:
 *   values == 0 (scores):  B[n][kk] = key(first + n)[kk]             (K = head_dim, N = the keys)
 *   values == 1 (P . V):   B[n][kk] = value(first + t * K + kk)[n]    (K = the keys of tile t, N = head_dim)
 * with key(pos) = cache[tables[s][pos / block_size]][pos % block_size][h] (see paged_row). B holds the same
 * values as the gathered copy apc_bmm was given, packed in the same panels, and every element runs the same
 * gemm_panels chain: the same bits. */
void apc_bmm_paged(int64_t heads, int64_t seqs, int64_t tiles, int64_t m, int64_t n, int64_t k,
                   const void *a, int a_dtype, int64_t sa_h, int64_t sa_s, int64_t sa_t, int64_t sa_m, int64_t sa_k,
                   const void *cache, int c_dtype, int64_t s_block, int64_t s_slot, int64_t s_head,
                   const int32_t *tables, int64_t s_table, const int32_t *seq_lens, int64_t block_size, int64_t first,
                   int values, float *c, int64_t sc_h, int64_t sc_s, int64_t sc_t, int64_t ldc, void *workspace,
                   int nthreads, int simd) {
    if (simd < 0 || simd > apc_simd_level()) simd = apc_simd_level(); /* never more than this CPU has */
    const int64_t items = heads * seqs * tiles, panels = (n + NR - 1) / NR, aes = elem_size(a_dtype);
    const int64_t npos = values ? k : n;
    const int64_t per_thread = ((MC * k * 4 + apc_packed_b_bytes(n, k, c_dtype) + 64) & ~(int64_t)63)
                               + ((npos * 8 + 64) & ~(int64_t)63);
    char *base = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    if (nthreads > items) nthreads = (int)items;
    if (nthreads < 1) nthreads = 1;
    if (k == 0) { /* no products: every sum is +0 */
        for (int64_t it = 0; it < items; it++) {
            float *ci = c + (it / (seqs * tiles)) * sc_h + (it / tiles % seqs) * sc_s + (it % tiles) * sc_t;
            for (int64_t i = 0; i < m; i++) memset(ci + i * ldc, 0, (size_t)n * 4);
        }
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t h = it / (seqs * tiles), s = it / tiles % seqs, t = it % tiles;
        char *ws = base + (int64_t)omp_get_thread_num() * per_thread;
        char *bp = ws + MC * k * 4;
        int64_t *rows = (int64_t *)(ws + ((MC * k * 4 + apc_packed_b_bytes(n, k, c_dtype) + 64) & ~(int64_t)63));
        const int64_t start = first + (values ? t * k : 0);
        for (int64_t j = 0; j < npos; j++)
            rows[j] = paged_row(tables + s * s_table, start + j, seq_lens[s], block_size, s_block, s_slot,
                                h * s_head);
        pack_b_paged((const char *)cache, c_dtype, rows, n, k, values, bp);
        gemm_panels(m, n, k, (const char *)a + (h * sa_h + s * sa_s + t * sa_t) * aes, a_dtype, sa_m, sa_k, bp,
                    c_dtype, c + h * sc_h + s * sc_s + t * sc_t, ldc, (float *)ws, 0, panels, simd);
    }
}
