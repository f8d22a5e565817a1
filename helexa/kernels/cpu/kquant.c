/* The quantised matmul of a decode step's few rows with integer dot products
 * (helexa/kernels/cpu/kquant.py).
 *
 * W [N, K] is w = s * u + z per (row, group of `group` inputs), with u stored in 4 bits
 * (0..15, two values a byte: byte i of a 64-value chunk holds u[i] | u[i + 32] << 4) or as
 * signed int8: the layouts GGUF's Q4_K / Q5_K / Q6_K / Q8_0 and GPTQ / AWQ /
 * compressed-tensors int4 unpack to (helexa/kernels/quant.py). As llama.cpp does for its
 * K-quants, the activation row is quantised once per call, in blocks of 32, and every
 * weight block of 32 is dotted with it in integers, then scaled once per block by s * dx in
 * fp32. llama.cpp's int8 activations (error amax / 254 a value) moved greedy tokens of the
 * parity tests; here each value is v = nearest(x * 16256 / amax), 15 bits in an int16
 * (error amax / 32512). Two ways to dot it:
 *   - wide (plain C, AVX2, VNNI): the weight's values are widened to int16 once per weight
 *     vector and multiplied with every activation row by pmaddwd (int16 pairs summed into
 *     int32) or VNNI's vpdpwssd (the same, accumulating): the widening is paid once for all
 *     of a step's rows;
 *   - halves (VNNI8): v held as two int8 halves (v = 128 * hi + lo, lo in -64..63) and each
 *     weight byte dotted with both by vpdpbusd, (dot_hi << 7) + dot_lo: no widening, twice
 *     the dot products, so faster at one row and slower at eight on the Xeon it was measured
 *     on (signed int8 weights use the sign trick, |w| against x with w's sign).
 * No product or sum leaves int32 (|u| <= 128, |v| <= 16256). The zeros are applied once
 * per group against the group's sum of the same v, a dot over the row's groups.
 *
 * Five builds: plain C (any CPU), AVX2, AVX2 with VNNI (AVX-VNNI or AVX512-VNNI at 256
 * bits) and AVX-512 (with AVX512-VNNI where there), all wide, and VNNI8. Integer sums are
 * exact in all; their fp32 sums differ only in order. Which runs a layer is measured
 * (kquant.py). Weight rows are split over threads started per call (only when each gets
 * MIN_THREAD_BYTES), as in int8g.c. Built into the same library as native.c by
 * helexa/kernels/cpu/native.py.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KQ_PLAIN 1
#define KQ_AVX2 2
#define KQ_VNNI 4
#define KQ_VNNI8 8
#define KQ_AVX512 16
#define XBLOCK 32 /* activation values per int8 scale */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
#endif
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HAVE_VNNI 1
#endif
#endif

int64_t hx_kq_isas(void) {
    int64_t isas = KQ_PLAIN;
#ifdef HAVE_AVX2
    isas |= KQ_AVX2;
#endif
#ifdef HAVE_VNNI
    isas |= KQ_VNNI | KQ_VNNI8;
#endif
#ifdef HAVE_AVX512
    isas |= KQ_AVX512;
#endif
    return isas;
}

/* ---------------------------------------------------------------- the activation */

/* x [M, K] fp32 -> xq int16 [M, K], dx [M, K / 32] and xs [M, K / 16] = dx * (sum of 16 v):
 * per 32 values dx = amax / VMAX and v = nearest-even(x * (VMAX / amax)). One rule in every
 * build. */
#define VMAX 16256.0f /* 127 * 128: two int8 halves hold it */
static void quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *dx,
                          float *xs) {
    const int64_t B = K / XBLOCK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < B; b++) {
            const float *v = x + m * K + b * XBLOCK;
            int16_t *q = xq + m * K + b * XBLOCK;
            float amax = 0.0f;
            for (int i = 0; i < XBLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float iscale = amax > 0.0f ? VMAX / amax : 0.0f;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < XBLOCK; i++) {
                float r = rintf(v[i] * iscale);
                r = r > VMAX ? VMAX : (r < -VMAX ? -VMAX : r);
                q[i] = (int16_t)r;
                if (i < 16) s0 += q[i]; else s1 += q[i];
            }
            const float d = amax / VMAX;
            dx[m * B + b] = d;
            xs[m * 2 * B + 2 * b] = d * (float)s0;
            xs[m * 2 * B + 2 * b + 1] = d * (float)s1;
        }
    }
}

/* v int16 [M, K] -> per block of 32: hi [32] then lo [32] int8, v = 128 * hi + lo. */
static void split_halves(const int16_t *v, int64_t M, int64_t K, int8_t *halves) {
    for (int64_t i = 0; i < M * K; i++) {
        const int32_t h = (v[i] + 64) >> 7, b = i / XBLOCK, j = i % XBLOCK;
        halves[b * 2 * XBLOCK + j] = (int8_t)h;
        halves[b * 2 * XBLOCK + XBLOCK + j] = (int8_t)(v[i] - 128 * h);
    }
}

/* ---------------------------------------------------------------- plain C */

/* y[m, n] for weight rows nb..ne-1 (zeros not yet added). */
static void rows_plain(int64_t bits, int64_t M, int64_t K, const int16_t *xq, const float *dx,
                       const uint8_t *w, int64_t N, int64_t nb, int64_t ne, const float *s,
                       int64_t group, const int32_t *gi, float *y) {
    const int64_t G = K / group, B = K / XBLOCK;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    for (int64_t n = nb; n < ne; n++) {
        const uint8_t *wr = w + n * row_bytes;
        for (int64_t m = 0; m < M; m++) {
            const int16_t *xr = xq + m * K;
            float acc = 0.0f;
            for (int64_t b = 0; b < B; b++) {
                int32_t part[2] = {0, 0}; /* the block's two halves: groups of 16 */
                for (int i = 0; i < XBLOCK; i++) {
                    const int64_t k = b * XBLOCK + i;
                    int32_t u;
                    if (bits == 4) {
                        const uint8_t byte = wr[(k / 64) * 32 + (k % 32)];
                        u = (k % 64) < 32 ? (byte & 0x0F) : (byte >> 4);
                    } else {
                        u = (int8_t)wr[k];
                    }
                    part[i >= 16] += u * xr[k];
                }
                if (group == 16) {
                    acc += ((float)part[0] * s[n * G + 2 * b] +
                            (float)part[1] * s[n * G + 2 * b + 1]) * dx[m * B + b];
                } else {
                    acc += (float)(part[0] + part[1]) * (s[n * G + gi[b]] * dx[m * B + b]);
                }
            }
            y[m * N + n] = acc;
        }
    }
}

/* ---------------------------------------------------------------- AVX2 (+ VNNI) */

#ifdef HAVE_AVX2
/* acc + (int16 pairs of a . b summed into int32 x 8) */
static inline __m256i dotw_avx2(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#ifdef HAVE_VNNI
static inline __m256i dotw_vnni(__m256i acc, __m256i a, __m256i b) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_dpwssd_epi32(acc, a, b); /* AVX512-VNNI + VL */
#endif
}
#endif

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

#define LOADX(p) _mm256_loadu_si256((const __m256i *)(p))
/* Weight rows are read PF_ROWS ahead: a step's weights stream from L3 or memory, where the
 * hardware's prefetchers alone left the loop at two thirds of its in-cache speed (a prefetch
 * never faults, past the last row included). */
#define PF_ROWS 8
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
/* int8 / uint8 [32] -> int16 [16] x 2 */
#define WIDEN(CVT, v, a, b)                                                                    \
    do {                                                                                       \
        a = CVT(_mm256_castsi256_si128(v));                                                    \
        b = CVT(_mm256_extracti128_si256(v, 1));                                               \
    } while (0)

/* Every block's R x MR fp32 accumulators: declared zero, and each summed into y at the end. */
#define ACC_ZERO(T, ZERO)                                                                      \
    T acc[4][8];                                                                               \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) acc[r][m] = ZERO()
#define ACC_STORE(HSUM)                                                                        \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                        \
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++)                                   \
            y[m * N + n0 + r] = HSUM(acc[r][m])

/* R weight rows x MR activation rows of accumulators; DOT accumulates int16 pair products. */
#define KQ_BLOCK(NAME, DOT)                                                                    \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const int R, const int MR, const int64_t bits, int64_t K, const int16_t *xq,         \
        const float *dx, const uint8_t *w, int64_t N, int64_t n0, const float *s,             \
        int64_t group, const int32_t *gi, float *y) {                                          \
        const int64_t G = K / group, B = K / XBLOCK;                                           \
        const int64_t row_bytes = bits == 4 ? K / 2 : K;                                       \
        const __m256i zero = _mm256_setzero_si256();                                           \
        ACC_ZERO(__m256, _mm256_setzero_ps);                                                   \
        if (bits == 4) {                                                                       \
            const __m256i low = _mm256_set1_epi8(0x0F);                                        \
            for (int64_t c = 0; c < K / 64; c++) {                                             \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                          \
                    PREFETCH(w + (n0 + r + PF_ROWS) * row_bytes + c * 32);                     \
                    const __m256i v = LOADX(w + (n0 + r) * row_bytes + c * 32);                \
                    __m256i u0, u1, u2, u3; /* values 64c + 16i .. + 15 */                     \
                    WIDEN(_mm256_cvtepu8_epi16, _mm256_and_si256(v, low), u0, u1);             \
                    WIDEN(_mm256_cvtepu8_epi16, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), \
                          u2, u3);                                                             \
                    const float *sr = s + (n0 + r) * G;                                        \
                    const float s_lo = sr[gi[2 * c]], s_hi = sr[gi[2 * c + 1]];                \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {                     \
                        const int16_t *xr = xq + m * K + c * 64;                               \
                        const __m256i p_lo = DOT(DOT(zero, u0, LOADX(xr)), u1, LOADX(xr + 16)); \
                        const __m256i p_hi =                                                   \
                            DOT(DOT(zero, u2, LOADX(xr + 32)), u3, LOADX(xr + 48));            \
                        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_lo),                  \
                                                    _mm256_set1_ps(s_lo * dx[m * B + 2 * c]),  \
                                                    acc[r][m]);                                \
                        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_hi),                  \
                                                    _mm256_set1_ps(s_hi * dx[m * B + 2 * c + 1]), \
                                                    acc[r][m]);                                \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        } else {                                                                               \
            for (int64_t b = 0; b < B; b++) {                                                  \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                          \
                    __m256i u0, u1;                                                            \
                    PREFETCH(w + (n0 + r + PF_ROWS) * row_bytes + b * XBLOCK);                 \
                    WIDEN(_mm256_cvtepi8_epi16, LOADX(w + (n0 + r) * row_bytes + b * XBLOCK),  \
                          u0, u1);                                                             \
                    const float *sr = s + (n0 + r) * G;                                        \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {                     \
                        const int16_t *xr = xq + m * K + b * XBLOCK;                           \
                        const float d = dx[m * B + b];                                         \
                        if (group == 16) { /* a scale per 16 values */                         \
                            acc[r][m] = _mm256_fmadd_ps(                                       \
                                _mm256_cvtepi32_ps(DOT(zero, u0, LOADX(xr))),                  \
                                _mm256_set1_ps(sr[2 * b] * d), acc[r][m]);                     \
                            acc[r][m] = _mm256_fmadd_ps(                                       \
                                _mm256_cvtepi32_ps(DOT(zero, u1, LOADX(xr + 16))),             \
                                _mm256_set1_ps(sr[2 * b + 1] * d), acc[r][m]);                 \
                        } else {                                                               \
                            const __m256i p = DOT(DOT(zero, u0, LOADX(xr)), u1, LOADX(xr + 16)); \
                            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                 \
                                                        _mm256_set1_ps(sr[gi[b]] * d),         \
                                                        acc[r][m]);                            \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        ACC_STORE(hsum8);                                                                      \
    }

KQ_BLOCK(block_avx2, dotw_avx2)
#ifdef HAVE_VNNI
KQ_BLOCK(block_vnni, dotw_vnni)
#endif

#ifdef HAVE_VNNI
/* u8 [32] . s8 [32] -> int32 x 8 (lane l: bytes 4l..4l+3) */
static inline __m256i dot_u8s8_vnni(__m256i u, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x); /* AVX512-VNNI + VL */
#endif
}
/* The chunk's scale vector: one scale, or (groups of 16) the two halves' (lanes 0-3, 4-7). */
static inline __m256 chunk_scale(const float *sr, int64_t group, int64_t b, const int32_t *gi) {
    if (group == 16) {
        return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(sr[2 * b])),
                                    _mm_set1_ps(sr[2 * b + 1]), 1);
    }
    return _mm256_set1_ps(sr[gi[b]]);
}

/* u8 [32] . v [32] from the two halves at xr: (dot_hi << 7) + dot_lo */
#define DOT2(DOT, u, xr)                                                                            \
    _mm256_add_epi32(                                                                          \
        _mm256_slli_epi32(DOT(u, _mm256_loadu_si256((const __m256i *)(xr))), 7),              \
        DOT(u, _mm256_loadu_si256((const __m256i *)((xr) + 32))))
/* the same for signed int8 weights w (|w| = a) */
#define DOT2S(DOT, a, w, xr)                                                                        \
    _mm256_add_epi32(                                                                          \
        _mm256_slli_epi32(                                                                     \
            DOT(a, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr)), w)), 7),       \
        DOT(a, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)((xr) + 32)), w)))

/* The halves form: R weight rows x MR activation rows; DOT is the u8 . s8 product. */
#define KQ_BLOCK8(NAME, DOT)                                                                    \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const int R, const int MR, const int64_t bits, int64_t K, const int8_t *xq,          \
        const float *dx, const uint8_t *w, int64_t N, int64_t n0, const float *s,             \
        int64_t group, const int32_t *gi, float *y) {                                          \
        const int64_t G = K / group, B = K / XBLOCK;                                           \
        const int64_t row_bytes = bits == 4 ? K / 2 : K;                                       \
        ACC_ZERO(__m256, _mm256_setzero_ps);                                                   \
        if (bits == 4) {                                                                       \
            const __m256i low = _mm256_set1_epi8(0x0F);                                        \
            for (int64_t c = 0; c < K / 64; c++) {                                             \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                          \
                    PREFETCH(w + (n0 + r + PF_ROWS) * row_bytes + c * 32);                     \
                    const __m256i v = _mm256_loadu_si256(                                      \
                        (const __m256i *)(w + (n0 + r) * row_bytes + c * 32));                 \
                    const __m256i lo = _mm256_and_si256(v, low);                               \
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);         \
                    const float *sr = s + (n0 + r) * G;                                        \
                    const float s_lo = sr[gi[2 * c]], s_hi = sr[gi[2 * c + 1]]; \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {                     \
                        const int8_t *xr = xq + m * 2 * K + c * 128;                           \
                        const __m256 p_lo = _mm256_cvtepi32_ps(DOT2(DOT, lo, xr));                  \
                        const __m256 p_hi = _mm256_cvtepi32_ps(DOT2(DOT, hi, xr + 64));             \
                        acc[r][m] = _mm256_fmadd_ps(                                           \
                            p_lo, _mm256_set1_ps(s_lo * dx[m * B + 2 * c]), acc[r][m]);        \
                        acc[r][m] = _mm256_fmadd_ps(                                           \
                            p_hi, _mm256_set1_ps(s_hi * dx[m * B + 2 * c + 1]), acc[r][m]);    \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        } else {                                                                               \
            for (int64_t b = 0; b < B; b++) {                                                  \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                          \
                    PREFETCH(w + (n0 + r + PF_ROWS) * row_bytes + b * XBLOCK);                 \
                    const __m256i v = _mm256_loadu_si256(                                      \
                        (const __m256i *)(w + (n0 + r) * row_bytes + b * XBLOCK));             \
                    const __m256i a = _mm256_abs_epi8(v);                                      \
                    const __m256 sv = chunk_scale(s + (n0 + r) * G, group, b, gi);     \
                    _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {                     \
                        const int8_t *xr = xq + m * 2 * K + b * 2 * XBLOCK;                    \
                        const __m256 p = _mm256_cvtepi32_ps(DOT2S(DOT, a, v, xr));                  \
                        acc[r][m] = _mm256_fmadd_ps(                                           \
                            p, _mm256_mul_ps(sv, _mm256_set1_ps(dx[m * B + b])), acc[r][m]);   \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        ACC_STORE(hsum8);                                                                      \
    }

KQ_BLOCK8(block_vnni8, dot_u8s8_vnni)
#endif

/* Rows nb..ne-1, R at a time so R * MR accumulators stay in registers. */
#define KQ_RUN(BLOCK, RMAX, MR)                                                                \
    do {                                                                                       \
        int64_t n = nb;                                                                        \
        for (; n + RMAX <= ne; n += RMAX) BLOCK(RMAX, MR, bits, K, xq, dx, w, N, n, s, group, gi, y); \
        for (; n < ne; n++) BLOCK(1, MR, bits, K, xq, dx, w, N, n, s, group, gi, y);              \
    } while (0)

#define KQ_ROWS(NAME, BLOCK, XT)                                                               \
    static void NAME(int64_t bits, int64_t M, int64_t K, const XT *xq, const float *dx,       \
                     const uint8_t *w, int64_t N, int64_t nb, int64_t ne, const float *s,     \
                     int64_t group, const int32_t *gi, float *y) {                             \
        switch (M) {                                                                           \
            case 1: KQ_RUN(BLOCK, 4, 1); break;                                                \
            case 2: KQ_RUN(BLOCK, 4, 2); break;                                                \
            case 3: KQ_RUN(BLOCK, 2, 3); break;                                                \
            case 4: KQ_RUN(BLOCK, 2, 4); break;                                                \
            case 5: KQ_RUN(BLOCK, 1, 5); break;                                                \
            case 6: KQ_RUN(BLOCK, 1, 6); break;                                                \
            case 7: KQ_RUN(BLOCK, 1, 7); break;                                                \
            default: KQ_RUN(BLOCK, 1, 8); break;                                               \
        }                                                                                      \
    }

KQ_ROWS(rows_avx2, block_avx2, int16_t)
#ifdef HAVE_VNNI
KQ_ROWS(rows_vnni, block_vnni, int16_t)
KQ_ROWS(rows_vnni8, block_vnni8, int8_t)
#endif

#ifdef HAVE_AVX512
/* The wide form at 512 bits: a block of 32 values is one int16 vector, dotted by one
 * vpdpwssd (AVX512-VNNI) or pmaddwd + add; 4-bit rows are read 128 values at a time (K a
 * multiple of 128, else the AVX2 loop runs the call). */
static inline __m512i dotw512(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

static inline __attribute__((always_inline)) void block_avx512(
    const int R, const int MR, const int64_t bits, int64_t K, const int16_t *xq,
    const float *dx, const uint8_t *w, int64_t N, int64_t n0, const float *s, int64_t group,
    const int32_t *gi, float *y) {
    const int64_t G = K / group, B = K / XBLOCK;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    const __m512i zero = _mm512_setzero_si512();
    ACC_ZERO(__m512, _mm512_setzero_ps);
    if (bits == 4) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int64_t c = 0; c < K / 128; c++) {
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                PREFETCH(w + (n0 + r + PF_ROWS) * row_bytes + c * 64);
                const __m512i v = _mm512_loadu_si512(w + (n0 + r) * row_bytes + c * 64);
                const __m512i lo = _mm512_and_si512(v, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                __m512i u[4]; /* blocks 4c .. 4c + 3 */
                u[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo));
                u[1] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi));
                u[2] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
                u[3] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
                const float *sr = s + (n0 + r) * G;
                _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {
                    const int16_t *xr = xq + m * K + c * 128;
                    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
                        const __m512i p = dotw512(zero, u[j], _mm512_loadu_si512(xr + 32 * j));
                        acc[r][m] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(p),
                            _mm512_set1_ps(sr[gi[4 * c + j]] * dx[m * B + 4 * c + j]), acc[r][m]);
                    }
                }
            }
        }
    } else {
        for (int64_t b = 0; b < B; b++) {
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                PREFETCH(w + (n0 + r + PF_ROWS) * row_bytes + b * XBLOCK);
                const __m512i u = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(w + (n0 + r) * row_bytes + b * XBLOCK)));
                const float *sr = s + (n0 + r) * G;
                /* groups of 16: lanes 0-7 hold values 0-15, lanes 8-15 values 16-31 */
                const __m512 sv = group == 16
                    ? _mm512_castpd_ps(_mm512_insertf64x4(
                          _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(sr[2 * b]))),
                          _mm256_castps_pd(_mm256_set1_ps(sr[2 * b + 1])), 1))
                    : _mm512_set1_ps(sr[gi[b]]);
                _Pragma("GCC unroll 8") for (int m = 0; m < MR; m++) {
                    const __m512i p =
                        dotw512(zero, u, _mm512_loadu_si512(xq + m * K + b * XBLOCK));
                    acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), sv),
                                                _mm512_set1_ps(dx[m * B + b]), acc[r][m]);
                }
            }
        }
    }
    ACC_STORE(_mm512_reduce_add_ps);
}

static void rows_avx512(int64_t bits, int64_t M, int64_t K, const int16_t *xq, const float *dx,
                        const uint8_t *w, int64_t N, int64_t nb, int64_t ne, const float *s,
                        int64_t group, const int32_t *gi, float *y) {
    if (bits == 4 && K % 128) {
        rows_avx2(bits, M, K, xq, dx, w, N, nb, ne, s, group, gi, y);
        return;
    }
    switch (M) { /* 32 zmm: R * MR accumulators and 4 weight vectors */
        case 1: KQ_RUN(block_avx512, 4, 1); break;
        case 2: KQ_RUN(block_avx512, 4, 2); break;
        case 3: KQ_RUN(block_avx512, 4, 3); break;
        case 4: KQ_RUN(block_avx512, 4, 4); break;
        case 5: KQ_RUN(block_avx512, 2, 5); break;
        case 6: KQ_RUN(block_avx512, 2, 6); break;
        case 7: KQ_RUN(block_avx512, 2, 7); break;
        default: KQ_RUN(block_avx512, 2, 8); break;
    }
}
#endif
#endif /* HAVE_AVX2 */

/* ---------------------------------------------------------------- the call */

typedef struct {
    int64_t isa, bits, M, K, N, nb, ne, group;
    const int16_t *xq;
    const int8_t *halves; /* VNNI8: xq as two int8 halves [M, 2K] */
    const float *dx, *xs, *s, *z; /* xs [M, G]: each group's dx * sum of xq */
    const int32_t *gi; /* scale index of each chunk of 32 (groups >= 32) */
    const uint8_t *w;
    float *y;
} Job;

/* One thread's weight rows: activation rows 8 at a time, then each row's zeros (a dot of
 * the row's zeros with the groups' activation sums). */
static void *run_job(void *arg) {
    const Job *j = (const Job *)arg;
    const int64_t K = j->K, N = j->N, G = K / j->group, B = K / XBLOCK;
    for (int64_t m = 0; m < j->M; m += 8) {
        const int64_t rows = j->M - m < 8 ? j->M - m : 8;
        const int16_t *xq = j->xq + m * K;
        const float *dx = j->dx + m * B;
        float *y = j->y + m * N;
#ifdef HAVE_AVX512
        if (j->isa == KQ_AVX512) {
            rows_avx512(j->bits, rows, K, xq, dx, j->w, N, j->nb, j->ne, j->s, j->group, j->gi,
                        y);
            continue;
        }
#endif
#ifdef HAVE_VNNI
        if (j->isa == KQ_VNNI8) {
            rows_vnni8(j->bits, rows, K, j->halves + m * 2 * K, dx, j->w, N, j->nb, j->ne, j->s,
                       j->group, j->gi, y);
            continue;
        }
        if (j->isa == KQ_VNNI) {
            rows_vnni(j->bits, rows, K, xq, dx, j->w, N, j->nb, j->ne, j->s, j->group, j->gi, y);
            continue;
        }
#endif
#ifdef HAVE_AVX2
        if (j->isa == KQ_AVX2) {
            rows_avx2(j->bits, rows, K, xq, dx, j->w, N, j->nb, j->ne, j->s, j->group, j->gi, y);
            continue;
        }
#endif
        rows_plain(j->bits, rows, K, xq, dx, j->w, N, j->nb, j->ne, j->s, j->group, j->gi, y);
    }
    if (j->z) {
        for (int64_t m = 0; m < j->M; m++) {
            const float *xg = j->xs + m * G;
            for (int64_t n = j->nb; n < j->ne; n++) {
                const float *zr = j->z + n * G;
                float acc = 0.0f;
                for (int64_t g = 0; g < G; g++) acc += zr[g] * xg[g];
                j->y[m * N + n] += acc;
            }
        }
    }
    return NULL;
}

#define MAX_THREADS 64
#define MIN_THREAD_BYTES (128 << 10) /* weight bytes a thread is worth starting for */

/* y [M, N] fp32 = x [M, K] fp32 @ W^T, W = s * u + z per (row, group); w [N, K / 2] (bits 4)
 * or [N, K] int8 (bits 8); s, z [N, K / group] fp32 (z may be NULL). K a multiple of 64
 * (bits 4) or 32, group 16 (bits 8 only) or a multiple of 32 dividing K. Returns 0, -1 when
 * `isa` is not built, -2 for a shape it does not take, -3 when out of memory. */
int64_t hx_kq_gemm(int64_t isa, const float *x, int64_t M, int64_t K, const uint8_t *w,
                   int64_t bits, int64_t N, const float *s, const float *z, int64_t group,
                   float *y, int64_t threads) {
    if (!(hx_kq_isas() & isa) ||
        (isa != KQ_PLAIN && isa != KQ_AVX2 && isa != KQ_VNNI && isa != KQ_VNNI8 &&
         isa != KQ_AVX512))
        return -1;
    if ((bits != 4 && bits != 8) || K % (bits == 4 ? 64 : XBLOCK) || group < 16 ||
        K % group || (group != 16 && group % XBLOCK) || (bits == 4 && group == 16))
        return -2;
    int16_t *xq = malloc((size_t)(M * K) * sizeof(int16_t));
    float *dx = malloc((size_t)(M * (K / XBLOCK)) * sizeof(float));
    float *xs = malloc((size_t)(M * (K / 16)) * sizeof(float));
    int32_t *gi = malloc((size_t)(K / XBLOCK) * sizeof(int32_t));
    int8_t *halves = isa == KQ_VNNI8 ? malloc((size_t)(M * 2 * K)) : NULL;
    if (!xq || !dx || !xs || !gi || (isa == KQ_VNNI8 && !halves)) {
        free(xq), free(dx), free(xs), free(gi), free(halves);
        return -3;
    }
    quantize_rows(x, M, K, xq, dx, xs);
    if (halves) split_halves(xq, M, K, halves);
    for (int64_t b = 0; b < K / XBLOCK; b++) gi[b] = (int32_t)(b * XBLOCK / group);
    if (z) { /* the sums of 16 -> each group's, in place (a group spans >= 16 values) */
        const int64_t G = K / group, per = group / 16;
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < G; g++) {
                float sum = 0.0f;
                for (int64_t i = 0; i < per; i++) sum += xs[m * (K / 16) + g * per + i];
                xs[m * G + g] = sum;
            }
    }
    int64_t t = N * K * bits / 8 / MIN_THREAD_BYTES;
    t = t < threads ? t : threads;
    t = t < MAX_THREADS ? t : MAX_THREADS;
    t = t < 1 ? 1 : t;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const int64_t per = ((N + t - 1) / t + 3) / 4 * 4; /* whole blocks of 4 rows a thread */
    for (int64_t i = 0; i < t; i++) {
        const int64_t nb = i * per < N ? i * per : N, ne = nb + per < N ? nb + per : N;
        jobs[i] = (Job){isa, bits, M, K, N, nb, ne, group, xq, halves, dx, xs, s, z, gi, w, y};
        if (i > 0) started[i] = pthread_create(&ids[i], NULL, run_job, &jobs[i]) == 0;
    }
    for (int64_t i = 1; i < t; i++)
        if (!started[i]) run_job(&jobs[i]); /* could not start one: this thread does it */
    run_job(&jobs[0]);
    for (int64_t i = 1; i < t; i++)
        if (started[i]) pthread_join(ids[i], NULL);
    free(xq), free(dx), free(xs), free(gi), free(halves);
    return 0;
}

/* The activation quantisation alone (the tests compare it with the torch reference's). */
void hx_kq_quantize(const float *x, int64_t M, int64_t K, int16_t *xq, float *dx, float *xs) {
    quantize_rows(x, M, K, xq, dx, xs);
}
