/* The grouped int8 matmul for the few rows of a decode step (helexa/kernels/cpu/int8g.py).
 *
 * W [N, K] is int8 q with a scale (and optionally a zero) per (row, group of `group`
 * inputs): w = q * s + z (helexa/kernels/quant.py's grouped int8 layout). The torch path
 * dequantises a tile of rows to memory and multiplies it: four float bytes written and
 * read back per weight byte. Here each weight vector is dequantised in registers (one
 * sign-extend, one convert, one FMA) and used at once by every row of x, so a decode
 * step streams the int8 bytes once and nothing else. Arithmetic is fp32 throughout,
 * the same products as the reference dequantised matmul up to summation order.
 *
 * Two builds of one loop: AVX2 (8 lanes, 16 registers) and AVX-512 (16 lanes, 32
 * registers), each over R weight rows x M activation rows of accumulators (R chosen
 * so they stay in registers). Which one is faster depends on the CPU (AVX-512
 * down-clocks some, splits into two 256-bit halves on others), so the caller measures
 * both, and whether splitting the weight's rows over threads pays, at first use.
 * Built into the same library as cpu_native.c by helexa/kernels/cpu/native.py.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* scale or zero [n, g] of a [N, G] table in fp32 (bf16 = 0) or bf16 (bf16 = 1) */
static inline float sz_at(const void *t, int64_t i, int64_t bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)t)[i]) : ((const float *)t)[i];
}

#define ISA_AVX2 1
#define ISA_AVX512 2

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* One block: weight rows n0..n0+R-1 against x rows 0..M-1 (R, M compile-time constants
 * once inlined into the instances below). */
#define INT8G_BLOCK(NAME, VEC, LANES, ZERO, SET1, LOADX, CVT8, FMA, HSUM)                      \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const int R, const int M, const int bf16, const float *x, int64_t K, const int8_t *q, \
        int64_t n0, int64_t N, const void *s, const void *z, int64_t group, int64_t g0,       \
        int64_t g1, float *y) {                                                                \
        const int64_t G = K / group;                                                           \
        VEC acc[4][8];                                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[r][m] = ZERO();            \
        for (int64_t g = g0; g < g1; g++) {                                                    \
            VEC sv[4], zv[4];                                                                  \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                              \
                sv[r] = SET1(sz_at(s, (n0 + r) * G + g, bf16));                                \
                zv[r] = z ? SET1(sz_at(z, (n0 + r) * G + g, bf16)) : ZERO();                   \
            }                                                                                  \
            const int64_t k0 = g * group;                                                      \
            for (int64_t k = k0; k < k0 + group; k += LANES) {                                 \
                VEC xv[8];                                                                     \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) xv[m] = LOADX(x + m * K + k); \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                          \
                    const VEC w = FMA(CVT8(q + (n0 + r) * K + k), sv[r], zv[r]);               \
                    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                        \
                        acc[r][m] = FMA(w, xv[m], acc[r][m]);                                  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) y[m * N + n0 + r] += HSUM(acc[r][m]); \
    }

static inline __m256 cvt8_256(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
INT8G_BLOCK(block256, __m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_loadu_ps, cvt8_256,
            _mm256_fmadd_ps, hsum256)

/* Weight rows RMAX at a time as registers allow (16 ymm / 32 zmm: R*M accumulators, 2R
 * scales and zeros, M x vectors), over K in spans of whole groups whose M rows of x stay
 * in L1 (X_SPAN_FLOATS): a whole 8-row x is 64 KiB at K = 2048 and, re-read for every
 * weight row from L2, halved the 8-row product's speed (bench/quant_ops.py). */
#define X_SPAN_FLOATS 4096
#define RUN_ROWS(BLOCK, RMAX, M)                                                               \
    do {                                                                                       \
        const int64_t G = K / group;                                                           \
        int64_t span = X_SPAN_FLOATS / (M * group);                                            \
        span = span < 1 ? 1 : span;                                                            \
        for (int64_t g0 = 0; g0 < G; g0 += span) {                                             \
            const int64_t g1 = g0 + span < G ? g0 + span : G;                                  \
            int64_t n = nb;                                                                    \
            if (bf16) {                                                                        \
                for (; n + RMAX <= ne; n += RMAX)                                              \
                    BLOCK(RMAX, M, 1, x, K, q, n, N, s, z, group, g0, g1, y);                  \
                for (; n < ne; n++) BLOCK(1, M, 1, x, K, q, n, N, s, z, group, g0, g1, y);     \
            } else {                                                                           \
                for (; n + RMAX <= ne; n += RMAX)                                              \
                    BLOCK(RMAX, M, 0, x, K, q, n, N, s, z, group, g0, g1, y);                  \
                for (; n < ne; n++) BLOCK(1, M, 0, x, K, q, n, N, s, z, group, g0, g1, y);     \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* Weight rows nb..ne-1 of N (y's row stride). */
static void gemm_avx2(const float *x, int64_t M, int64_t K, const int8_t *q, int64_t N,
                      int64_t nb, int64_t ne, const void *s, const void *z, int64_t group,
                      int64_t bf16, float *y) {
    switch (M) {
        case 1: RUN_ROWS(block256, 4, 1); break;
        case 2: RUN_ROWS(block256, 2, 2); break;
        case 3: RUN_ROWS(block256, 2, 3); break;
        case 4: RUN_ROWS(block256, 2, 4); break;
        case 5: RUN_ROWS(block256, 1, 5); break;
        case 6: RUN_ROWS(block256, 1, 6); break;
        case 7: RUN_ROWS(block256, 1, 7); break;
        default: RUN_ROWS(block256, 1, 8); break;
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 cvt8_512(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INT8G_BLOCK(block512, __m512, 16, _mm512_setzero_ps, _mm512_set1_ps, _mm512_loadu_ps, cvt8_512,
            _mm512_fmadd_ps, _mm512_reduce_add_ps)

static void gemm_avx512(const float *x, int64_t M, int64_t K, const int8_t *q, int64_t N,
                        int64_t nb, int64_t ne, const void *s, const void *z, int64_t group,
                        int64_t bf16, float *y) {
    switch (M) {  /* 32 zmm */
        case 1: RUN_ROWS(block512, 4, 1); break;
        case 2: RUN_ROWS(block512, 4, 2); break;
        case 3: RUN_ROWS(block512, 4, 3); break;
        case 4: RUN_ROWS(block512, 4, 4); break;
        case 5: RUN_ROWS(block512, 2, 5); break;
        case 6: RUN_ROWS(block512, 2, 6); break;
        case 7: RUN_ROWS(block512, 2, 7); break;
        default: RUN_ROWS(block512, 2, 8); break;
    }
}
#endif

/* Which builds this library has (ISA_* bits). */
int64_t hx_int8g_isas(void) {
    int64_t isas = 0;
#if defined(__AVX2__) && defined(__FMA__)
    isas |= ISA_AVX2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    isas |= ISA_AVX512;
#endif
    return isas;
}

typedef struct {
    int64_t isa, M, K, N, nb, ne, group, bf16;
    const float *x;
    const int8_t *q;
    const void *s, *z;
    float *y;
} Job;

/* One thread's rows nb..ne-1, x's rows 8 at a time. */
static void *run_job(void *arg) {
    const Job *j = (const Job *)arg;
    for (int64_t m = 0; m < j->M; m += 8) {
        const int64_t rows = j->M - m < 8 ? j->M - m : 8;
        const float *xm = j->x + m * j->K;
        float *ym = j->y + m * j->N;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (j->isa == ISA_AVX512) {
            gemm_avx512(xm, rows, j->K, j->q, j->N, j->nb, j->ne, j->s, j->z, j->group, j->bf16, ym);
            continue;
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        gemm_avx2(xm, rows, j->K, j->q, j->N, j->nb, j->ne, j->s, j->z, j->group, j->bf16, ym);
#else
        (void)rows, (void)xm, (void)ym; /* no build: hx_int8g_gemm refuses before this */
#endif
    }
    return NULL;
}

#define MAX_THREADS 64
#define MIN_THREAD_BYTES (256 << 10) /* int8 weight bytes a thread is worth starting for */

/* y [M, N] fp32 = x [M, K] fp32 @ W^T with W = q * s + z per (row, group); q [N, K] int8,
 * s and z [N, K / group] fp32 or bf16 (z may be NULL); group a multiple of the build's
 * lanes (8 or 16). The weight rows are split over up to `threads` threads (each started
 * per call, so only when each gets MIN_THREAD_BYTES). Returns 0, or -1 when `isa` is not
 * built. */
int64_t hx_int8g_gemm(int64_t isa, const float *x, int64_t M, int64_t K, const int8_t *q,
                      int64_t N, const void *s, const void *z, int64_t group, int64_t bf16,
                      float *y, int64_t threads) {
    if (!(hx_int8g_isas() & isa) || (isa != ISA_AVX2 && isa != ISA_AVX512)) return -1;
    memset(y, 0, (size_t)(M * N) * sizeof(float));
    int64_t t = N * K / MIN_THREAD_BYTES;
    t = t < threads ? t : threads;
    t = t < MAX_THREADS ? t : MAX_THREADS;
    t = t < 1 ? 1 : t;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const int64_t per = (N + t - 1) / t;
    for (int64_t i = 0; i < t; i++) {
        const int64_t nb = i * per < N ? i * per : N, ne = nb + per < N ? nb + per : N;
        jobs[i] = (Job){isa, M, K, N, nb, ne, group, bf16, x, q, s, z, y};
        if (i > 0) started[i] = pthread_create(&ids[i], NULL, run_job, &jobs[i]) == 0;
    }
    for (int64_t i = 1; i < t; i++)
        if (!started[i]) run_job(&jobs[i]); /* could not start one: this thread does it */
    run_job(&jobs[0]);
    for (int64_t i = 1; i < t; i++)
        if (started[i]) pthread_join(ids[i], NULL);
    return 0;
}
