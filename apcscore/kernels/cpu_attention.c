/* apcscore's fixed-order CPU attention: the torch backend's paged attention (apcscore/attention/tiles.py,
 * torch_prefill.py, torch_decode.py) for every query row of a layer in one call, with the same bits.
 *
 * The torch backend runs a dozen small torch ops per key tile; on two cores that per-op overhead, not arithmetic,
 * was most of its time (docs/benchmarks.md, "Why lambada and gsm8k miss narrowly"). Here each query row runs the
 * same IEEE operations in the same order, in registers:
 *     q      = q * scale                                           (fp32, one rounding: the torch path's q * scale)
 *     from m = -inf, sum = +0, acc = +0, for each tile of TILE keys counted from position 0 that holds a key at or
 *     before the row's position, ascending:
 *     s_j    = +0 + chain_1 + chain_2 + ...      the GEMM's order (cpu_gemm.c): one fma chain per CHAIN of head_dim
 *     s_j    = -inf for keys past the row's position
 *     m'     = max(m, max_j s_j)                 (NaN-propagating, as torch.amax and torch.maximum)
 *     alpha  = exp(m - m');   p_j = exp(s_j - m')                      cpu_vec.h's exp, cpu_math's bits
 *     sum    = sum * alpha + rowsum(p)           rowsum: 16 interleaved lanes and the fixed tree (row_sums_f)
 *     acc_d  = acc_d * alpha + (+0 + chain_j(p_j v_jd))   one fma chain over the tile's keys (the GEMM's, K = TILE)
 *     out    = acc / sum
 * Keys past the sequence's end read its position 0 and are masked (p = 0), as pad_slots and paged_row do.
 *
 * Why this equals each torch path bit for bit (tests/attention/test_fused_attention.py checks it):
 * - The products there are cpu_gemm.c's chains, whose bits depend on the two rows and K only; the exps and row sums
 *   are cpu_math.c's, shared through cpu_vec.h; every other step is one IEEE operation (mul, add, max, div).
 * - tiled_softmax's first tile sets sum = rowsum(p), acc = pv instead of the general step from (-inf, 0, 0): the
 *   same values, since alpha = exp(-inf) = 0 and pv is never -0 (+0 + chain), so 0 * 0 + pv = pv.
 * - Tiles past a row's position (the batched and decode paths multiply them, wholly masked) leave its state
 *   exactly as it was: alpha = exp(0) = 1, rowsum = +0, pv = +0, and acc is never -0. So skipping them is exact.
 * - Rows are independent: which thread, unit or vector lane computes a row changes none of its operations.
 * The vector copies (AVX-512, AVX2+FMA, and the baseline with fmaf per lane) run the same operations per lane: the
 * same bits (cpu_math.c's header: no contraction, -ffp-contract=off, round-to-nearest set for the call).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define TILE 64      /* keys per tile: attention/tiles.py's KV_TILE */
#define CHAIN 64     /* the GEMM's fma chain block over head_dim (cpu_gemm.c's KB) */
#define UNIT_ROWS 48 /* query rows (positions x the heads of one KV head's group) per unit of work */

int apc_simd_level(void); /* cpu_gemm.c: 2 = AVX-512F, 1 = AVX2 + FMA, 0 = baseline */

/* One layer's call: the queries, the paged caches and where each item (a sequence's query chunk) lies. */
typedef struct {
    const int32_t *cu, *seq_lens; /* [items + 1]: first query row of each item, then the end; [items]: keys after */
    const int32_t *tables;        /* [items][s_table] block ids */
    int64_t s_table;
    const float *q; /* [T][Hq][D] fp32 (strides sq_t, sq_h; D contiguous) */
    int64_t sq_t, sq_h, hq, hkv, d;
    float scale;
    const char *k, *v; /* caches [blocks][block_size][Hkv][D] in elements of c_dtype (strides; D contiguous) */
    int c_dtype;
    int64_t s_block, s_slot, s_head, block_size;
    float *out; /* [T][Hq][D] fp32 (strides so_t, so_h) */
    int64_t so_t, so_h;
    int64_t unit_rows; /* the most rows of a unit: whole groups, UNIT_ROWS or fewer (or one larger group) */
} att_args;

static inline int64_t key_offset(const att_args *a, const int32_t *table, int64_t pos, int64_t seq_len, int64_t h) {
    if (pos >= seq_len) pos = 0; /* past the end: the sequence's position 0, masked */
    return (int64_t)table[pos / a->block_size] * a->s_block + (pos % a->block_size) * a->s_slot + h * a->s_head;
}

/* The tile of keys [t0, t0 + TILE) of KV head h: keys transposed, kt[d][j], and the value rows vrow[j] (pointers
 * into the cache for fp32, else into vbuf, converted exactly). Only copies values: no arithmetic. */
static void load_tile_base(const att_args *a, const int32_t *table, int64_t seq_len, int64_t h, int64_t t0, float *kt,
                           float *vbuf, const float **vrow) {
    const int64_t D = a->d;
    for (int64_t j = 0; j < TILE; j++) {
        const int64_t off = key_offset(a, table, t0 + j, seq_len, h);
        if (a->c_dtype == DT_F32) {
            const float *kr = (const float *)a->k + off;
            for (int64_t dd = 0; dd < D; dd++) kt[dd * TILE + j] = kr[dd];
            vrow[j] = (const float *)a->v + off;
        } else {
            for (int64_t dd = 0; dd < D; dd++) kt[dd * TILE + j] = load_elem(a->k, a->c_dtype, off + dd);
            for (int64_t dd = 0; dd < D; dd++) vbuf[j * D + dd] = load_elem(a->v, a->c_dtype, off + dd);
            vrow[j] = vbuf + j * D;
        }
    }
}
#define load_tile_avx2 load_tile_base

#ifdef APC_X86
/* 16 rows of 16 floats -> their transpose (out[i] = column i), in registers. */
__attribute__((target("avx512f"), always_inline)) static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

/* load_tile_base's copies, the fp32 keys transposed 16 x 16 in registers. */
__attribute__((target("avx512f"))) static void load_tile_avx512(const att_args *a, const int32_t *table,
                                                                 int64_t seq_len, int64_t h, int64_t t0, float *kt,
                                                                 float *vbuf, const float **vrow) {
    if (a->c_dtype != DT_F32) {
        load_tile_base(a, table, seq_len, h, t0, kt, vbuf, vrow);
        return;
    }
    const int64_t D = a->d;
    const float *kr[TILE];
    for (int64_t j = 0; j < TILE; j++) {
        const int64_t off = key_offset(a, table, t0 + j, seq_len, h);
        kr[j] = (const float *)a->k + off;
        vrow[j] = (const float *)a->v + off;
    }
    for (int64_t j0 = 0; j0 < TILE; j0 += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(kr[j0 + i] + d0);
            transpose16(r);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(kt + (d0 + i) * TILE + j0, r[i]);
        }
}
#endif

/* ---- the chains' vector type of each copy and its operations: one IEEE operation per lane -------------------
 * The fma chains run in the copy's own registers (16 lanes of vf for the baseline, __m256 for AVX2, __m512 for
 * AVX-512): a lane is one chain, so the width changes which lane holds a chain, never its operations. */

enum { VL_base = LANES };
typedef vf vt_base;
__attribute__((always_inline)) static inline vt_base vzero_base(void) { return vsplat(0.0f); }
__attribute__((always_inline)) static inline vt_base vset_base(float x) { return vsplat(x); }
__attribute__((always_inline)) static inline vt_base vload_base(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
__attribute__((always_inline)) static inline void vstore_base(float *p, vt_base v) { memcpy(p, &v, sizeof v); }
__attribute__((always_inline)) static inline vt_base vadd_base(vt_base a, vt_base b) { return a + b; }
__attribute__((always_inline)) static inline vt_base vmul_base(vt_base a, vt_base b) { return a * b; }
__attribute__((always_inline)) static inline vt_base vfma_base(vt_base a, vt_base b, vt_base c) {
    vf r;
    for (int i = 0; i < LANES; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
}

#ifdef APC_X86
/* The x86 copies: the same operations on T registers through the MM-prefixed intrinsics (_mm256, _mm512). */
#define APC_X86_OPS(SFX, TARGET, T, MM, WIDTH)                                                                    \
    enum { VL_##SFX = WIDTH };                                                                                    \
    typedef T vt_##SFX;                                                                                           \
    __attribute__((target(TARGET), always_inline)) static inline T vzero_##SFX(void) { return MM##_setzero_ps(); } \
    __attribute__((target(TARGET), always_inline)) static inline T vset_##SFX(float x) { return MM##_set1_ps(x); } \
    __attribute__((target(TARGET), always_inline)) static inline T vload_##SFX(const float *p) {                \
        return MM##_loadu_ps(p);                                                                                  \
    }                                                                                                             \
    __attribute__((target(TARGET), always_inline)) static inline void vstore_##SFX(float *p, T v) {              \
        MM##_storeu_ps(p, v);                                                                                     \
    }                                                                                                             \
    __attribute__((target(TARGET), always_inline)) static inline T vadd_##SFX(T a, T b) { return MM##_add_ps(a, b); } \
    __attribute__((target(TARGET), always_inline)) static inline T vmul_##SFX(T a, T b) { return MM##_mul_ps(a, b); } \
    __attribute__((target(TARGET), always_inline)) static inline T vfma_##SFX(T a, T b, T c) {                   \
        return MM##_fmadd_ps(a, b, c);                                                                            \
    }

APC_X86_OPS(avx2, "avx2,fma", __m256, _mm256, 8)
APC_X86_OPS(avx512, "avx512f", __m512, _mm512, 16)
#endif

/* The max of 4 x LANES scores, NaN if any is NaN (torch.amax). */
__attribute__((always_inline)) static inline float row_max(const vf *x) {
    vf mx = x[0];
    vi nan = (vi)(x[0] != x[0]);
    for (int i = 1; i < 4; i++) {
        mx = vsel(x[i] > mx, x[i], mx);
        nan |= (vi)(x[i] != x[i]);
    }
    float m = mx[0];
    int any = nan[0];
    for (int i = 1; i < LANES; i++) {
        m = mx[i] > m ? mx[i] : m;
        any |= nan[i];
    }
    return any ? __builtin_nanf("") : m;
}

/* max(a, b), NaN if either is (torch.maximum). */
static inline float max_nan(float a, float b) { return a != a || b != b ? __builtin_nanf("") : (b > a ? b : a); }

/* RB rows side by side in one call of rows_##SFX (RB * TILE / VL independent chains keep the fma units busy, as many
 * as the copy's registers hold); the last call of a unit may hold fewer (n < RB: its missing rows repeat its last
 * one, computed and dropped). */
#define UNROLL_RB _Pragma("GCC unroll 4")
#define UNROLL_X _Pragma("GCC unroll 8")
#define UNROLL_4 _Pragma("GCC unroll 4")

/* acc[d0, d0 + NV * VL) of the rows: acc * alpha + (+0 + the chain over the tile's keys of p_j v_jd). NV is a
 * constant in each use, so that the RB * NV chains stay in registers. */
#define APC_PV(SFX, NV, RB)                                                                                       \
    {                                                                                                             \
        vt_##SFX c[RB][NV];                                                                                       \
        UNROLL_RB for (int r = 0; r < RB; r++) UNROLL_X for (int x = 0; x < NV; x++) c[r][x] = vzero_##SFX();     \
        for (int j = 0; j < TILE; j++) {                                                                          \
            const float *vr = vrow[j] + d0;                                                                       \
            vt_##SFX vv[NV];                                                                                      \
            UNROLL_X for (int x = 0; x < NV; x++) vv[x] = vload_##SFX(vr + x * VL_##SFX);                         \
            UNROLL_RB for (int r = 0; r < RB; r++) {                                                              \
                const vt_##SFX w = vset_##SFX(p[r][j]);                                                           \
                UNROLL_X for (int x = 0; x < NV; x++) c[r][x] = vfma_##SFX(w, vv[x], c[r][x]);                    \
            }                                                                                                     \
        }                                                                                                         \
        UNROLL_RB for (int r = 0; r < RB; r++) {                                                                  \
            if (r >= n) break;                                                                                    \
            float *acc = state[r] + 2 + d0;                                                                       \
            const vt_##SFX al = vset_##SFX(alpha[r]);                                                             \
            UNROLL_X for (int x = 0; x < NV; x++) {                                                               \
                const vt_##SFX pv = vadd_##SFX(vzero_##SFX(), c[r][x]);                                           \
                vstore_##SFX(acc + x * VL_##SFX, vadd_##SFX(vmul_##SFX(vload_##SFX(acc + x * VL_##SFX), al), pv)); \
            }                                                                                                     \
        }                                                                                                         \
    }

/* ROWS: one tile step of n <= RB rows (queries q[r] at positions pos[r], state[r]: running max, sum, acc[D]).
 * UNIT: the rows of one unit (item it, KV head h, its positions [p0, p1)), tile by tile; writes their outputs. */
#define APC_ATTENTION_BODIES(SFX, ATTR, RB)                                                                        \
    ATTR static void rows_##SFX(const att_args *a, int64_t t0, const float *kt, const float **vrow,                \
                                const float *const *q, const int64_t *pos, float *const *state, int n) {          \
        enum { NX = TILE / VL_##SFX }; /* vectors of a row of the tile's keys */                                  \
        const int64_t D = a->d;                                                                                   \
        float sc[RB][TILE] __attribute__((aligned(64))); /* the scores of the tile's keys */                      \
        float p[RB][TILE] __attribute__((aligned(64)));  /* their exps */                                         \
        int64_t d0 = 0;                                                                                           \
        do { /* +0, then each chain block's sum added (head_dim > 0: at least one block) */                       \
            const int64_t d1 = D - d0 < CHAIN ? D : d0 + CHAIN;                                                   \
            vt_##SFX c[RB][NX];                                                                                   \
            UNROLL_RB for (int r = 0; r < RB; r++) UNROLL_X for (int x = 0; x < NX; x++) c[r][x] = vzero_##SFX(); \
            for (int64_t dd = d0; dd < d1; dd++) {                                                                \
                vt_##SFX kv[NX];                                                                                  \
                UNROLL_X for (int x = 0; x < NX; x++) kv[x] = vload_##SFX(kt + dd * TILE + x * VL_##SFX);         \
                UNROLL_RB for (int r = 0; r < RB; r++) {                                                          \
                    const vt_##SFX w = vset_##SFX(q[r][dd]);                                                      \
                    UNROLL_X for (int x = 0; x < NX; x++) c[r][x] = vfma_##SFX(w, kv[x], c[r][x]);                \
                }                                                                                                 \
            }                                                                                                     \
            UNROLL_RB for (int r = 0; r < RB; r++) UNROLL_X for (int x = 0; x < NX; x++) {                        \
                float *dst = sc[r] + x * VL_##SFX;                                                                \
                vstore_##SFX(dst, vadd_##SFX(d0 ? vload_##SFX(dst) : vzero_##SFX(), c[r][x]));                    \
            }                                                                                                     \
            d0 += CHAIN;                                                                                          \
        } while (d0 < D);                                                                                         \
        const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                                   \
        float m[RB], alpha[RB], sum[RB];                                                                          \
        vf diff = vsplat(0.0f);                                                                                   \
        vf s[RB][4];                                                                                              \
        UNROLL_RB for (int r = 0; r < RB; r++) {                                                                  \
            UNROLL_4 for (int x = 0; x < 4; x++) { /* keys past the row's position: -inf */                       \
                memcpy(&s[r][x], sc[r] + x * LANES, sizeof(vf));                                                  \
                s[r][x] = vsel(lane + (int32_t)(t0 + x * LANES) > (int32_t)pos[r], vsplat(-__builtin_inff()),     \
                               s[r][x]);                                                                          \
            }                                                                                                     \
            m[r] = max_nan(state[r][0], row_max(s[r]));                                                           \
            diff[r] = state[r][0] - m[r];                                                                         \
        }                                                                                                         \
        const vf alphas = vexp(diff); /* lane r: row r's alpha */                                                 \
        UNROLL_RB for (int r = 0; r < RB; r++) {                                                                  \
            alpha[r] = alphas[r];                                                                                 \
            vf lanes = vsplat(0.0f);                                                                              \
            UNROLL_4 for (int x = 0; x < 4; x++) {                                                                \
                const vf e = vexp(s[r][x] - m[r]);                                                                \
                lanes = lanes + e;                                                                                \
                memcpy(p[r] + x * LANES, &e, sizeof e);                                                           \
            }                                                                                                     \
            float l[LANES];                                                                                       \
            memcpy(l, &lanes, sizeof l);                                                                          \
            sum[r] = state[r][1] * alpha[r] + tree16f(l);                                                         \
        }                                                                                                         \
        for (d0 = 0; d0 < D; d0 += TILE) { /* acc: TILE of head_dim at a time */                                 \
            const int64_t nv = (D - d0 < TILE ? D - d0 : TILE) / VL_##SFX;                                        \
            if (nv == NX) APC_PV(SFX, NX, RB)                                                                     \
            else if (nv == 1) APC_PV(SFX, 1, RB)                                                                  \
            else if (nv == 2) APC_PV(SFX, 2, RB)                                                                  \
            else if (nv == 3) APC_PV(SFX, 3, RB)                                                                  \
            else if (nv == 4) APC_PV(SFX, 4, RB)                                                                  \
            else if (nv == 6) APC_PV(SFX, 6, RB) /* (head_dim a multiple of LANES: never 5 or 7 vectors of 8) */  \
        }                                                                                                         \
        for (int r = 0; r < n; r++) {                                                                             \
            state[r][0] = m[r];                                                                                   \
            state[r][1] = sum[r];                                                                                 \
        }                                                                                                         \
    }                                                                                                             \
    ATTR static void unit_##SFX(const att_args *a, int64_t it, int64_t h, int64_t p0, int64_t p1, float *ws) {    \
        const int64_t D = a->d, G = a->hq / a->hkv, sl = D + 2;                                                   \
        const int64_t seq_len = a->seq_lens[it], first = seq_len - (a->cu[it + 1] - a->cu[it]);                   \
        const int64_t rows = (p1 - p0) * G;                                                                       \
        const int32_t *table = a->tables + it * a->s_table;                                                       \
        float *qs = ws, *states = qs + a->unit_rows * D, *kt = states + a->unit_rows * sl, *vbuf = kt + D * TILE; \
        const float *vrow[TILE];                                                                                  \
        for (int64_t r = 0; r < rows; r++) { /* row r: position p0 + r / G, head g = r % G of the group */        \
            const float *src = a->q + (a->cu[it] + p0 + r / G) * a->sq_t + (h * G + r % G) * a->sq_h;             \
            for (int64_t dd = 0; dd < D; dd++) qs[r * D + dd] = src[dd] * a->scale;                               \
            float *st = states + r * sl;                                                                          \
            st[0] = -__builtin_inff();                                                                            \
            memset(st + 1, 0, (size_t)(D + 1) * 4);                                                               \
        }                                                                                                         \
        for (int64_t t0 = 0; t0 <= first + p1 - 1; t0 += TILE) {                                                  \
            load_tile_##SFX(a, table, seq_len, h, t0, kt, vbuf, vrow);                                            \
            /* the rows that see a key of the tile: positions from t0 on */                                       \
            for (int64_t r0 = t0 > first + p0 ? (t0 - first - p0) * G : 0; r0 < rows; r0 += RB) {                 \
                const float *q[RB];                                                                               \
                int64_t pos[RB];                                                                                  \
                float *state[RB];                                                                                 \
                for (int r = 0; r < RB; r++) {                                                                    \
                    const int64_t row = r0 + r < rows ? r0 + r : rows - 1;                                        \
                    q[r] = qs + row * D;                                                                          \
                    pos[r] = first + p0 + row / G;                                                                \
                    state[r] = states + row * sl;                                                                 \
                }                                                                                                 \
                rows_##SFX(a, t0, kt, vrow, q, pos, state, (int)(rows - r0 < RB ? rows - r0 : RB));               \
            }                                                                                                     \
        }                                                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                                      \
            const float *st = states + r * sl;                                                                    \
            float *dst = a->out + (a->cu[it] + p0 + r / G) * a->so_t + (h * G + r % G) * a->so_h;                 \
            for (int64_t dd = 0; dd < D; dd++) dst[dd] = st[2 + dd] / st[1];                                      \
        }                                                                                                         \
    }

APC_ATTENTION_BODIES(base, , 1)
#ifdef APC_X86
APC_ATTENTION_BODIES(avx2, __attribute__((target("avx2,fma"))), 1) /* 16 registers: one row's 8 chains */
APC_ATTENTION_BODIES(avx512, __attribute__((target("avx512f"))), 3)  /* 32 registers: three rows' 12 chains */
#endif

/* Floats of workspace one thread needs for head_dim d and units of `rows` rows: queries, states, a tile. */
static int64_t workspace_floats(int64_t d, int64_t rows) { return rows * d + rows * (d + 2) + 2 * d * TILE + 16; }

/* Attention of every query row of `items` sequences (decode rows and prefill chunks alike) over the keys of its
 * sequence in the paged cache, in the order of the header. Item i's query rows are cu[i] .. cu[i + 1] - 1 of q
 * (cu_seqlens), at positions seq_lens[i] - (cu[i + 1] - cu[i]) .. seq_lens[i] - 1; its keys are read
 * through tables[i] (block ids, s_table apart). Query head hq reads KV head hq / (Hq / Hkv). head_dim d: a multiple
 * of LANES. Writes out's rows of the items. nthreads: OpenMP threads over units of work (item, KV head, up to
 * UNIT_ROWS rows); simd: -1 the best this CPU has, else at most 0 / 1 / 2 (the same bits). Returns 0, or -1 where
 * the workspace could not be allocated (nothing written). */
int apc_attention(int64_t items, const int32_t *cu, const int32_t *seq_lens, const int32_t *tables, int64_t s_table, const float *q, int64_t sq_t, int64_t sq_h, int64_t hq,
                   int64_t hkv, int64_t d, float scale, const void *k_cache, const void *v_cache, int c_dtype,
                   int64_t s_block, int64_t s_slot, int64_t s_head, int64_t block_size, float *out, int64_t so_t,
                   int64_t so_h, int nthreads, int simd) {
    int level = apc_simd_level();
    if (simd >= 0 && simd < level) level = simd;
    const int64_t group = hq / hkv, per_unit = UNIT_ROWS / group > 0 ? UNIT_ROWS / group : 1;
    const att_args a = {cu, seq_lens, tables, s_table, q, sq_t, sq_h, hq, hkv, d, scale,
                        (const char *)k_cache, (const char *)v_cache, c_dtype, s_block, s_slot, s_head, block_size,
                        out, so_t, so_h, per_unit * group};
    /* units: (item, position block, KV head), longest items first would balance better; the order changes no bit */
    int64_t units = 0;
    for (int64_t i = 0; i < items; i++) units += (cu[i + 1] - cu[i] + per_unit - 1) / per_unit * hkv;
    int64_t *unit_item = malloc((size_t)(units > 0 ? units : 1) * 3 * sizeof(int64_t));
    if (!unit_item) return -1;
    int64_t u = 0;
    for (int64_t i = 0; i < items; i++)
        for (int64_t p0 = 0; p0 < cu[i + 1] - cu[i]; p0 += per_unit)
            for (int64_t h = 0; h < hkv; h++, u++) {
                unit_item[3 * u] = i;
                unit_item[3 * u + 1] = h;
                unit_item[3 * u + 2] = p0;
            }
    if (nthreads > units) nthreads = (int)units;
    if (nthreads < 1) nthreads = 1;
    const int64_t floats = (workspace_floats(d, per_unit * group) + 15) / 16 * 16; /* whole cache lines per thread */
    float *workspace = aligned_alloc(64, (size_t)(floats * 4 * nthreads));
    if (!workspace) {
        free(unit_item);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        float *ws = workspace + omp_get_thread_num() * floats;
        fpenv e = fp_enter(); /* per thread: MXCSR / FPCR are per-thread state */
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < units; k++) {
            const int64_t i = unit_item[3 * k], h = unit_item[3 * k + 1], p0 = unit_item[3 * k + 2];
            const int64_t q_len = cu[i + 1] - cu[i], p1 = p0 + per_unit < q_len ? p0 + per_unit : q_len;
#ifdef APC_X86
            if (level == 2) unit_avx512(&a, i, h, p0, p1, ws);
            else if (level == 1) unit_avx2(&a, i, h, p0, p1, ws);
            else
#endif
                unit_base(&a, i, h, p0, p1, ws);
        }
        fp_leave(e);
    }
    free(workspace);
    free(unit_item);
    return 0;
}
