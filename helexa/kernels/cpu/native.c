/* CPU kernels for fp32 models: the decode step's fused element-wise work over helexa's
 * paged, head-major KV pool, and a matmul for the few-row products of batched decode.
 *
 * A decode step of a dense Llama-family layer is four matrix products (which
 * torch runs: they are the weight-streaming floor) and, between them, some
 * forty small element-wise ops. In eager torch each costs 5-10 us of dispatch
 * whatever its size; here they are three calls per layer that do the
 * arithmetic and nothing else:
 *
 *   hx_attn_decode   q/k RMSNorm, rotary, K/V write into the pool, attention
 *                    of each row's query heads over its context (block table)
 *   hx_add_rmsnorm   residual add, then RMSNorm (optionally weighted)
 *   hx_silu_mul      silu(gate) * up
 *   hx_gemm          y = x W^T + b over W packed in 16-column panels, for which oneDNN's
 *                    blocked matmul runs at ~35% of the FMA peak when x has 2-16 rows
 *   hx_decode_layers all of a step's layers at once when every matmul has a native kernel
 *                    (these panels, kquant.c's or int8g.c's)
 *
 * Layout contract (helexa/kernels/attention.py PagedKV): K and V of one layer are
 * [kv_heads, num_slots, head_dim] contiguous; token t of a row lives in slot
 * table[t / block_size] * block_size + t % block_size. All arithmetic is fp32;
 * RMSNorm and rotary follow transformers (x * rsqrt(mean(x^2) + eps) * w;
 * rotate-half with a signed sin table). Built and loaded by helexa/kernels/cpu/native.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void rmsnorm_row(float *restrict x, const float *restrict w, int64_t n, float eps) {
    float ss = dot(x, x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    if (w) {
        for (int64_t i = 0; i < n; i++) x[i] = (x[i] * inv) * w[i];
    } else {
        for (int64_t i = 0; i < n; i++) x[i] *= inv;
    }
}

static void rotate(float *restrict x, const float *restrict cos_, const float *restrict sin_,
                   float *restrict tmp, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) tmp[i] = x[i] * cos_[i] + x[i + half] * sin_[i];
    for (int64_t i = half; i < d; i++) tmp[i] = x[i] * cos_[i] + x[i - half] * sin_[i];
    memcpy(x, tmp, (size_t)d * sizeof(float));
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* e^x for eight floats: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its
 * degree-6 Taylor-like minimax polynomial (Cephes' coefficients); relative error ~2e-7. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* x[i] = e^(x[i] - m); returns the sum. */
static float exp_sub_sum(float *restrict x, int64_t n, float m) {
    float sum = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; i < n; i++) { x[i] = expf(x[i] - m); sum += x[i]; }
    return sum;
}

/* Scores of G queries (one kv head's group) against one block's n keys. */
static void block_scores(const float *restrict qg, const float *restrict kb, int64_t n,
                         int64_t G, int64_t D, float scale, float *restrict sc, int64_t T) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (int64_t j = 0; j < G; j++) {
            const float *qj = qg + j * D;
            int64_t i = 0;
            for (; i + 4 <= n; i += 4) {  /* four keys at once: one q load feeds four FMAs */
                const float *k0 = kb + i * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t e = 0; e < D; e += 8) {
                    __m256 qv = _mm256_loadu_ps(qj + e);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + e), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + D + e), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * D + e), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * D + e), a3);
                }
                /* transpose-add the four accumulators into one vector of four sums */
                __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
                __m256 h = _mm256_hadd_ps(h01, h23);
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                _mm_storeu_ps(sc + j * T + i, _mm_mul_ps(r, _mm_set1_ps(scale)));
            }
            for (; i < n; i++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t e = 0; e < D; e += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qj + e), _mm256_loadu_ps(kb + i * D + e), a);
                sc[j * T + i] = hsum8(a) * scale;
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < G; j++)
            sc[j * T + i] = dot(qg + j * D, kb + i * D, D) * scale;
}

/* o[j] += sum_i p[j][i] * v_i over one block's n values (o in registers, 64 dims a pass). */
static void block_values(const float *restrict vb, int64_t n, int64_t G, int64_t D,
                         const float *restrict p, int64_t T, float *restrict og) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 64 == 0) {
        for (int64_t j = 0; j < G; j++)
            for (int64_t e0 = 0; e0 < D; e0 += 64) {
                float *o = og + j * D + e0;
                __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8),
                       o2 = _mm256_loadu_ps(o + 16), o3 = _mm256_loadu_ps(o + 24),
                       o4 = _mm256_loadu_ps(o + 32), o5 = _mm256_loadu_ps(o + 40),
                       o6 = _mm256_loadu_ps(o + 48), o7 = _mm256_loadu_ps(o + 56);
                for (int64_t i = 0; i < n; i++) {
                    const float *v = vb + i * D + e0;
                    const __m256 pv = _mm256_set1_ps(p[j * T + i]);
                    o0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v), o0);
                    o1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8), o1);
                    o2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 16), o2);
                    o3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 24), o3);
                    o4 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 32), o4);
                    o5 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 40), o5);
                    o6 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 48), o6);
                    o7 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 56), o7);
                }
                _mm256_storeu_ps(o, o0); _mm256_storeu_ps(o + 8, o1);
                _mm256_storeu_ps(o + 16, o2); _mm256_storeu_ps(o + 24, o3);
                _mm256_storeu_ps(o + 32, o4); _mm256_storeu_ps(o + 40, o5);
                _mm256_storeu_ps(o + 48, o6); _mm256_storeu_ps(o + 56, o7);
            }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < G; j++) {
            const float pj = p[j * T + i];
            float *o = og + j * D;
            for (int64_t e = 0; e < D; e++) o[e] += pj * vb[i * D + e];
        }
}

/* One kv head: its G query heads qg [G, D] over T context tokens of K/V [num_slots, D]
 * (this head's plane), found through the row's block table; writes og [G, D]. */
static void attend(const float *qg, const float *kh, const float *vh, const int64_t *table,
                   int64_t block_size, int64_t T, int64_t G, int64_t D, float scale,
                   float *scores, float *og) {
    for (int64_t t0 = 0; t0 < T; t0 += block_size) {
        const int64_t n = T - t0 < block_size ? T - t0 : block_size;
        block_scores(qg, kh + table[t0 / block_size] * block_size * D, n, G, D, scale,
                     scores + t0, T);
    }
    for (int64_t j = 0; j < G; j++) {
        float *sj = scores + j * T, m = sj[0], sum = 0.0f;
        for (int64_t t = 1; t < T; t++) m = sj[t] > m ? sj[t] : m;
        sum = exp_sub_sum(sj, T, m);
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < T; t++) sj[t] *= inv;
    }
    memset(og, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < T; t0 += block_size) {
        const int64_t n = T - t0 < block_size ? T - t0 : block_size;
        block_values(vh + table[t0 / block_size] * block_size * D, n, G, D, scores + t0, T,
                     og);
    }
}

/* qkv: [B, (H + 2*KVH) * D] (this step's projections; q and k are normed and rotated in
 * place). qk_norm: [(H + KVH), D] weights or NULL. cos/sin: [L, D] tables indexed by
 * positions[b]. k_pool/v_pool: [KVH, num_slots, D]. tables: [B, max_blocks] block ids.
 * out: [B, H * D]. work: at least G * (max position + 1) + D floats.
 * Row b's new token sits at positions[b] and is written to its slot before attending. */
void hx_attn_decode(float *qkv, int64_t B, int64_t H, int64_t KVH, int64_t D,
                    const float *qk_norm, float eps, const float *cos_tab, const float *sin_tab,
                    const int64_t *positions, float *k_pool, float *v_pool, int64_t num_slots,
                    const int64_t *tables, int64_t max_blocks, int64_t block_size,
                    float *out, float scale, float *work) {
    const int64_t G = H / KVH, W = (H + 2 * KVH) * D;
    for (int64_t b = 0; b < B; b++) {
        float *row = qkv + b * W;
        float *q = row, *k = row + H * D, *v = row + (H + KVH) * D;
        const int64_t pos = positions[b], T = pos + 1;
        const float *c = cos_tab + pos * D, *s = sin_tab + pos * D;
        float *tmp = work;  /* D floats, then the scores */
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x = q + h * D;  /* q heads then k heads: contiguous */
            if (qk_norm) rmsnorm_row(x, qk_norm + h * D, D, eps);
            rotate(x, c, s, tmp, D);
        }
        const int64_t *table = tables + b * max_blocks;
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        for (int64_t g = 0; g < KVH; g++) {
            memcpy(k_pool + (g * num_slots + slot) * D, k + g * D, (size_t)D * sizeof(float));
            memcpy(v_pool + (g * num_slots + slot) * D, v + g * D, (size_t)D * sizeof(float));
        }
        float *scores = work + D;  /* [G, T] */
        for (int64_t g = 0; g < KVH; g++)
            attend(q + g * G * D, k_pool + g * num_slots * D, v_pool + g * num_slots * D,
                   table, block_size, T, G, D, scale, scores, out + b * H * D + g * G * D);
    }
}

/* x [B, N] += delta (when not NULL); normed [B, N] = RMSNorm(x) * weight (when not NULL). */
void hx_add_rmsnorm(float *x, const float *delta, float *normed, const float *weight,
                    int64_t B, int64_t N, float eps) {
    for (int64_t b = 0; b < B; b++) {
        float *xr = x + b * N, *nr = normed + b * N;
        if (delta) {
            const float *dr = delta + b * N;
            for (int64_t i = 0; i < N; i++) xr[i] += dr[i];
        }
        memcpy(nr, xr, (size_t)N * sizeof(float));
        rmsnorm_row(nr, weight, N, eps);
    }
}

/* gate_up [B, 2I] (gate | up) -> out [B, I] = silu(gate) * up. */
void hx_silu_mul(const float *gate_up, float *out, int64_t B, int64_t I) {
    for (int64_t b = 0; b < B; b++) {
        const float *g = gate_up + b * 2 * I, *u = g + I;
        float *o = out + b * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* GEMM panels: W [N, K] packed as Wp[ceil(N / 16)][K][16] (zero-padded columns), so one
 * panel is a contiguous K x 16 stream; rows of x go four at a time (8 accumulators), the
 * panel re-read from L2 for each four. PANEL_PREFETCH floats ahead are prefetched: without
 * it the 8-row product runs ~25% slower (measured on AMD EPYC, AVX2). */
#define PANEL 16
#define PANEL_PREFETCH 256

#if defined(__AVX2__) && defined(__FMA__)
#define GEMM_ROWS(R)                                                                          \
    static void gemm_rows##R(const float *x, int64_t K, const float *w, const float *bias,   \
                             float *y, int64_t ldy) {                                        \
        __m256 a[R][2];                                                                      \
        const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();               \
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();           \
        for (int r = 0; r < R; r++) { a[r][0] = b0; a[r][1] = b1; }                          \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) {                            \
            _mm_prefetch((const char *)(w + k * PANEL + PANEL_PREFETCH), _MM_HINT_T0);       \
            const __m256 w0 = _mm256_loadu_ps(w + k * PANEL);                                \
            const __m256 w1 = _mm256_loadu_ps(w + k * PANEL + 8);                            \
            for (int r = 0; r < R; r++) {                                                    \
                const __m256 xv = _mm256_broadcast_ss(x + r * K + k);                        \
                a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);                                  \
                a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);                                  \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++) {                                                        \
            _mm256_storeu_ps(y + r * ldy, a[r][0]);                                          \
            _mm256_storeu_ps(y + r * ldy + 8, a[r][1]);                                      \
        }                                                                                    \
    }
GEMM_ROWS(1)
GEMM_ROWS(2)
GEMM_ROWS(3)
GEMM_ROWS(4)
#ifdef __AVX512F__
/* With AVX-512 a panel's 16 columns are one register, so up to 8 rows take one pass of the
 * panel (8 accumulators, as 4 rows take at 256 bits): each column's sum is the same chain of
 * FMAs over k, bit for bit. The 8-row product of the 29M qwen3 of bench/engine.py ran at
 * half the single row's weight bandwidth with two passes of 4. */
static inline __attribute__((always_inline)) void gemm_rows512(
    const int R, const float *x, int64_t K, const float *w, const float *bias, float *y,
    int64_t ldy) {
    __m512 a[8];
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) a[r] = b;
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w + k * PANEL + PANEL_PREFETCH), _MM_HINT_T0);
        const __m512 wv = _mm512_loadu_ps(w + k * PANEL);
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
            a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wv, a[r]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, a[r]);
}
#endif
#else
static void gemm_rows(const float *x, int64_t R, int64_t K, const float *w, const float *bias,
                      float *y, int64_t ldy) {
    for (int64_t r = 0; r < R; r++) {
        float *acc = y + r * ldy;
        for (int c = 0; c < PANEL; c++) acc[c] = bias ? bias[c] : 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float xv = x[r * K + k];
            for (int c = 0; c < PANEL; c++) acc[c] += xv * w[k * PANEL + c];
        }
    }
}
#endif

/* Rows of x against one panel, into y (ldy floats a row). */
static void gemm_panel(const float *x, int64_t M, int64_t K, const float *w, const float *bias,
                       float *y, int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
    int64_t m = 0;
#ifdef __AVX512F__
    while (M - m >= 2) {
        const int64_t rows = M - m < 8 ? M - m : 8;
        const float *xm = x + m * K;
        float *ym = y + m * ldy;
        switch (rows) {
            case 2: gemm_rows512(2, xm, K, w, bias, ym, ldy); break;
            case 3: gemm_rows512(3, xm, K, w, bias, ym, ldy); break;
            case 4: gemm_rows512(4, xm, K, w, bias, ym, ldy); break;
            case 5: gemm_rows512(5, xm, K, w, bias, ym, ldy); break;
            case 6: gemm_rows512(6, xm, K, w, bias, ym, ldy); break;
            case 7: gemm_rows512(7, xm, K, w, bias, ym, ldy); break;
            default: gemm_rows512(8, xm, K, w, bias, ym, ldy); break;
        }
        m += rows;
    }
#endif
    for (; m + 4 <= M; m += 4) gemm_rows4(x + m * K, K, w, bias, y + m * ldy, ldy);
    switch (M - m) {
        case 3: gemm_rows3(x + m * K, K, w, bias, y + m * ldy, ldy); break;
        case 2: gemm_rows2(x + m * K, K, w, bias, y + m * ldy, ldy); break;
        case 1: gemm_rows1(x + m * K, K, w, bias, y + m * ldy, ldy); break;
        default: break;
    }
#else
    gemm_rows(x, M, K, w, bias, y, ldy);
#endif
}

/* y [M, N] = x [M, K] @ W^T (+ bias [N]) with W packed as above (bias padded to the
 * panels: ceil(N / 16) * 16 floats, or NULL). */
void hx_gemm(const float *x, int64_t M, int64_t K, const float *wp, int64_t N,
             const float *bias, float *y) {
    const int64_t full = N / PANEL;
    for (int64_t p = 0; p < full; p++)
        gemm_panel(x, M, K, wp + p * K * PANEL, bias ? bias + p * PANEL : NULL, y + p * PANEL, N);
    const int64_t rest = N - full * PANEL;
    if (rest) {  /* the last, partial panel: through a scratch row of 16 (4 rows at a time) */
        float tmp[4 * PANEL];
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t rows = M - m < 4 ? M - m : 4;
            gemm_panel(x + m * K, rows, K, wp + full * K * PANEL,
                       bias ? bias + full * PANEL : NULL, tmp, PANEL);
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + (m + r) * N + full * PANEL, tmp + r * PANEL,
                       (size_t)rest * sizeof(float));
        }
    }
}

/* One matmul of hx_decode_layers, MAT_WORDS int64 words (helexa/kernels/cpu/decode.py
 * builds them from each layer's kernel): kind, N, K, weight, bias (0 = none), then per kind
 * isa, bits, group, scales, zeros, threads. Kinds: MAT_PANELS, hx_gemm's 16-column panels
 * (bias padded to them); MAT_KQUANT, kquant.c's integer kernel; MAT_INT8G, int8g.c's. */
#define MAT_WORDS 11
enum { MAT_PANELS = 0, MAT_KQUANT = 1, MAT_INT8G = 2 };
int64_t hx_kq_gemm(int64_t isa, const float *x, int64_t M, int64_t K, const uint8_t *w,
                   int64_t bits, int64_t N, const float *s, const float *z, int64_t group,
                   float *y, int64_t threads);
int64_t hx_int8g_gemm(int64_t isa, const float *x, int64_t M, int64_t K, const int8_t *q,
                      int64_t N, const void *s, const void *z, int64_t group, int64_t bf16,
                      float *y, int64_t threads);

static int64_t mat(const int64_t *d, const float *x, int64_t M, float *y) {
#define P(i) ((const void *)(intptr_t)d[i])
    const int64_t N = d[1], K = d[2];
    const float *bias = (const float *)P(4);
    int64_t rc;
    switch (d[0]) {
        case MAT_PANELS:
            hx_gemm(x, M, K, (const float *)P(3), N, bias, y);
            return 0;
        case MAT_KQUANT:
            rc = hx_kq_gemm(d[5], x, M, K, (const uint8_t *)P(3), d[6], N, (const float *)P(8),
                            (const float *)P(9), d[7], y, d[10]);
            break;
        case MAT_INT8G:
            rc = hx_int8g_gemm(d[5], x, M, K, (const int8_t *)P(3), N, P(8), P(9), d[7], 0, y,
                               d[10]);
            break;
        default:
            return -4;
    }
#undef P
    if (rc == 0 && bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
    return rc;
}

/* A whole decode step's layers in one call, for models whose every matmul has a native
 * kernel at this batch size: per layer qkv, attention, o_proj, residual + norm, gate|up,
 * silu * up, down, residual + the next norm, with no Python between them (each eager call
 * between two weight streams runs with cold caches). plan: [L, 4 * MAT_WORDS + 5] words per
 * layer: the matmuls qkv, o, gate|up, down (see mat()); q/k norm weight (0 = none); the
 * weights (0 = folded) of the post-attention norm and of the norm after the MLP (the next
 * layer's input norm, or the final one); the layer's K and V pools. eps: [L, 3] (q/k norm,
 * post-attention norm, next norm). x [B, hidden] is the residual stream and normed its first
 * norm on entry; on return normed holds the final norm of x. Scratch: qkv [B, (H+2KVH)*D],
 * attn_out [B, H*D], tmp [B, hidden], gate_up [B, 2*inter], act [B, inter]. head (MAT_WORDS
 * words, or NULL): the LM head's matmul of the final norm into logits [B, its N]. embed
 * (EMBED_WORDS words, or NULL): x's rows are first looked up from a grouped int8 table
 * (group, V, int8 q [V, hidden], fp32 scales and zeros [V, hidden / group], zeros 0 = none)
 * at ids [B] (-5 for an id outside 0..V-1), and normed (norm0, eps0) computed from them.
 * Each Python operation between two weight streams started with cold caches: a step's
 * embedding through numpy took ~200 us there, against ~5 us here. Returns 0, or a matmul's
 * error code (the step's result is then not to be used). */
#define EMBED_WORDS 5
static int64_t lookup_int8g(const int64_t *e, const int64_t *ids, int64_t B, int64_t K,
                            float *x) {
    const int64_t group = e[0], V = e[1], G = K / group;
    const int8_t *q = (const int8_t *)(intptr_t)e[2];
    const float *s = (const float *)(intptr_t)e[3], *z = (const float *)(intptr_t)e[4];
    for (int64_t b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= V) return -5;
    for (int64_t b = 0; b < B; b++) {
        const int8_t *qr = q + ids[b] * K;
        const float *sr = s + ids[b] * G, *zr = z ? z + ids[b] * G : NULL;
        float *xr = x + b * K;
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < group; i++) {
                const float v = (float)qr[g * group + i] * sr[g];
                xr[g * group + i] = zr ? v + zr[g] : v;
            }
    }
    return 0;
}

int64_t hx_decode_layers(int64_t L, const int64_t *plan, const float *eps, float *x,
                         float *normed, int64_t B, int64_t hidden, int64_t H, int64_t KVH,
                         int64_t D, int64_t inter, float *qkv, float *attn_out, float *tmp,
                         float *gate_up, float *act, const float *cos_tab,
                         const float *sin_tab, const int64_t *positions, int64_t num_slots,
                         const int64_t *tables, int64_t max_blocks, int64_t block_size,
                         float scale, float *work, const int64_t *head, float *logits,
                         const int64_t *embed, const int64_t *ids, const float *norm0,
                         float eps0) {
#define W(i) ((float *)(intptr_t)p[4 * MAT_WORDS + (i)])
    int64_t rc = 0;
    if (embed) {
        if ((rc = lookup_int8g(embed, ids, B, hidden, x))) return rc;
        hx_add_rmsnorm(x, NULL, normed, norm0, B, hidden, eps0);
    }
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const int64_t *p = plan + l * (4 * MAT_WORDS + 5);
        const float *e = eps + l * 3;
        if ((rc = mat(p, normed, B, qkv))) break;
        hx_attn_decode(qkv, B, H, KVH, D, W(0), e[0], cos_tab, sin_tab, positions, W(3), W(4),
                       num_slots, tables, max_blocks, block_size, attn_out, scale, work);
        if ((rc = mat(p + MAT_WORDS, attn_out, B, tmp))) break;
        hx_add_rmsnorm(x, tmp, normed, W(1), B, hidden, e[1]);
        if ((rc = mat(p + 2 * MAT_WORDS, normed, B, gate_up))) break;
        hx_silu_mul(gate_up, act, B, inter);
        rc = mat(p + 3 * MAT_WORDS, act, B, tmp);
        if (rc == 0) hx_add_rmsnorm(x, tmp, normed, W(2), B, hidden, e[2]);
    }
#undef W
    if (rc == 0 && head) rc = mat(head, normed, B, logits);
    return rc;
}
