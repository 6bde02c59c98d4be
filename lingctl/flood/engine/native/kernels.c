/* Float32 CPU kernels for flood's decode-heavy steps: routed experts and attention over the segment KV cache.

   Both replace many small library calls per layer (one matrix product per expert, one attention call per
   request) with one call that walks the work itself. Every output row is computed from its own inputs
   alone, with a fixed order of additions, so a row's bits never depend on which other rows share the call
   or how many there are: batch invariance by construction, at any row count (no padding needed).

   Built by lingctl/flood/engine/native/__init__.py with the system C compiler. kernels.h documents each entry
   point: its arrays (contiguous float32 or int64) and the sizes and ranges the caller checks before calling. */

#include "kernels.h"
#include "internal.h"

#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FLOOD_VNNI 1 /* the int8 dot products use AVX-512 VNNI (vpdpbusd); elsewhere a portable loop */
#endif

#ifdef __AVX512F__
/* exp of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (about 1 ulp against
   the C library's expf), times 2^n. Arguments are clamped to [-87.3, 88.7] (a finite result for any input; an
   argument below that range gives about 1e-38 where the true value is smaller still). The same instructions for
   every lane, so a value's result never depends on its neighbours. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* SwiGLU of n gate and up values: out = silu(g) * u. */
static void swiglu(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#define MB 8  /* rows per register block */
#define NB 32 /* columns per register block: 8 x 32 float accumulators fit the 32 vector registers */

/* out[m, :N] = in[m, :K] @ w[:K, :N] for m < M (w row-major, "input-major"): rows_gemm. Every output is one
   chain of fused multiply-adds over k in order, started from zero, whichever code below computes it and however
   many rows share the call, so a row's bits never depend on M. */
#ifdef __AVX512F__
/* One block of flood_rows_walk (internal.h): R rows (R <= 6) by C vectors of 16 columns over kn weight rows, the
   accumulators in registers, so each weight vector loaded serves R rows. The partial sums live in ``out`` between
   passes (exact: float32 in and out), so the chain of additions over k is the same as in one pass. With ``pf``
   each weight row's step also prefetches C lines of the next pass into L2 (the walk says why). */
static inline __attribute__((always_inline)) void few_rows_block(const float *in, int64_t K, const float *w, int64_t N,
                                                                int64_t kn, int first, int R, int C,
                                                                const float *pf, float *out) {
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * N + 16 * c);
    for (int64_t k = 0; k < kn; k++) {
        const float *wr = w + k * N;
        __m512 wv[4];
        for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_ps(wr + 16 * c);
        if (pf)
            for (int c = 0; c < C; c++) _mm_prefetch((const char *)(pf + (k * C + c) * 16), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            __m512 av = _mm512_set1_ps(in[r * K + k]);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(av, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + r * N + 16 * c, acc[r][c]);
}

/* R and C constants in each call below, so each pair gets its own unrolled loop. */
#define FEW_ROWS_CASES(C)                                                                                      \
    switch (R) {                                                                                               \
    case 1: few_rows_block(in, K, w, N, kn, first, 1, C, pf, out); break;                                     \
    case 2: few_rows_block(in, K, w, N, kn, first, 2, C, pf, out); break;                                     \
    case 3: few_rows_block(in, K, w, N, kn, first, 3, C, pf, out); break;                                     \
    case 4: few_rows_block(in, K, w, N, kn, first, 4, C, pf, out); break;                                     \
    case 5: few_rows_block(in, K, w, N, kn, first, 5, C, pf, out); break;                                     \
    default: few_rows_block(in, K, w, N, kn, first, 6, C, pf, out); break;                                    \
    }
static void few_rows_cols(const void *in_, int64_t K, const void *w_, int64_t N, int64_t kn, int first, int R,
                          int C, const void *pf_, float *out) {
    const float *in = (const float *)in_, *w = (const float *)w_, *pf = (const float *)pf_;
    if (C == 4) { FEW_ROWS_CASES(4) }
    else if (C == 2) { FEW_ROWS_CASES(2) }
    else { FEW_ROWS_CASES(1) }
}
#undef FEW_ROWS_CASES

/* Any M; at 64 rows as fast as the 8 x 32 blocks below, at a few rows bound by memory (bench/flood_expert_kernel.py). */
static void rows_gemm(const float *in, int64_t M, int64_t K, const float *w, int64_t N, float *out) {
    flood_rows_walk(in, sizeof(float), M, K, w, sizeof(float), N, out, few_rows_cols);
}
#else
/* Without AVX-512: few rows (M <= MB, a decode step's share of one expert) sweep each weight row from start to end,
   accumulating into a block of columns in L1, which streams a weight that is not in cache best. */
#define NCHUNK 256
static void few_rows_gemm(const float *in, int64_t M, int64_t K, const float *w, int64_t N, float *out) {
    float acc[MB][NCHUNK];
    for (int64_t n0 = 0; n0 < N; n0 += NCHUNK) {
        int64_t nb = N - n0 < NCHUNK ? N - n0 : NCHUNK;
        for (int64_t m = 0; m < M; m++)
            memset(acc[m], 0, sizeof(float) * (size_t)nb);
        for (int64_t k = 0; k < K; k++) {
            const float *wr = w + k * N + n0;
            for (int64_t m = 0; m < M; m++) {
                float av = in[m * K + k];
                float *ac = acc[m];
                for (int64_t n = 0; n < nb; n++) ac[n] += av * wr[n];
            }
        }
        for (int64_t m = 0; m < M; m++)
            memcpy(out + m * N + n0, acc[m], sizeof(float) * (size_t)nb);
    }
}

/* More rows: MB x NB register blocks; in has at least ceil(M / MB) * MB rows (the caller zero-pads), out as
   many. */
static void small_gemm(const float *in, int64_t M, int64_t K, const float *w, int64_t N, float *out) {
    int64_t n_main = N - N % NB;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const float *a = in + m0 * K;
        for (int64_t n0 = 0; n0 < n_main; n0 += NB) {
            float acc[MB][NB];
            for (int m = 0; m < MB; m++)
                for (int n = 0; n < NB; n++) acc[m][n] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const float *wr = w + k * N + n0;
                for (int m = 0; m < MB; m++) {
                    float av = a[m * K + k];
                    for (int n = 0; n < NB; n++) acc[m][n] += av * wr[n];
                }
            }
            for (int m = 0; m < MB; m++)
                memcpy(out + (m0 + m) * N + n0, acc[m], sizeof(float) * NB);
        }
        for (int64_t n = n_main; n < N; n++) { /* columns past the last full block */
            for (int m = 0; m < MB; m++) {
                float s = 0.0f;
                for (int64_t k = 0; k < K; k++) s += a[m * K + k] * w[k * N + n];
                out[(m0 + m) * N + n] = s;
            }
        }
    }
}

static void rows_gemm(const float *in, int64_t M, int64_t K, const float *w, int64_t N, float *out) {
    if (M <= MB) few_rows_gemm(in, M, K, w, N, out);
    else small_gemm(in, M, K, w, N, out);
}
#endif

/* The walk of rows_gemm and of the bfloat16 products (internal.h). Rows go in sets of up to SET_ROWS: within a
   set, each pass of FLOOD_PASS_ROWS weight rows serves every group of 6 rows before the next pass, so the weights
   are read from memory once per set (an expert of Ling-lite is 11.5 MB of gate and up weights, far more than the
   caches keep: group by group it would be read once per 6 rows), while the set's partial sums (SET_ROWS x N
   floats, a few hundred KB at most) stay in L2. The set's first group also prefetches the next pass: the block
   at columns n0 its rows in address order from n0 * FLOOD_PASS_ROWS on, so all the blocks together cover them
   once and memory sees one steady sequential stream (the other groups find the pass in cache). Walking blocks of
   columns without the prefetch showed memory pieces of rows 1 KB apart and read them at under half the read
   bandwidth (bench/flood_expert_kernel.py: 9.1 against 5.9 ms for the tiny MoE's decode step). */
#define SET_ROWS 24
void flood_rows_walk(const void *in, size_t in_size, int64_t M, int64_t K, const void *w, size_t w_size, int64_t N,
                     float *out, flood_block_fn block) {
    const char *a0 = (const char *)in, *w0 = (const char *)w;
    for (int64_t s0 = 0; s0 < M; s0 += SET_ROWS) {
        int64_t s1 = M - s0 < SET_ROWS ? M : s0 + SET_ROWS;
        for (int64_t k0 = 0; k0 < K; k0 += FLOOD_PASS_ROWS) {
            int64_t kn = K - k0 < FLOOD_PASS_ROWS ? K - k0 : FLOOD_PASS_ROWS;
            const char *wk = w0 + (size_t)(k0 * N) * w_size;
            int first = k0 == 0;
            for (int64_t m0 = s0; m0 < s1; m0 += 6) {
                int R = s1 - m0 < 6 ? (int)(s1 - m0) : 6;
                const char *a = a0 + (size_t)(m0 * K + k0) * in_size;
                float *o = out + m0 * N;
                const char *next = m0 == s0 && kn == FLOOD_PASS_ROWS ? wk + (size_t)(FLOOD_PASS_ROWS * N) * w_size : NULL;
                int64_t n0 = 0;
#define AT(n0) (wk + (size_t)(n0) * w_size)
#define PF(n0) (next ? next + (size_t)((n0) * FLOOD_PASS_ROWS) * w_size : NULL)
                for (; n0 + 64 <= N; n0 += 64) block(a, K, AT(n0), N, kn, first, R, 4, PF(n0), o + n0);
                for (; n0 + 32 <= N; n0 += 32) block(a, K, AT(n0), N, kn, first, R, 2, PF(n0), o + n0);
                for (; n0 + 16 <= N; n0 += 16) block(a, K, AT(n0), N, kn, first, R, 1, PF(n0), o + n0);
#undef AT
#undef PF
            }
        }
    }
}

/* Dot product in a fixed order: LANES independent partial sums (which the compiler maps onto vector lanes),
   then summed pairwise, then the tail. */
#define LANES 16
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[d + l] * b[d + l];
    for (int w = LANES / 2; w > 0; w /= 2) /* pairwise, always the same pairs */
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    float s = part[0];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* Dot products of R input rows (R <= 4) with one row b, each in the same fixed order: LANES partial sums
   over the full blocks, the tail added lane by lane into the same partial sums, then summed pairwise. Every
   step is per lane (no sum across elements until the pairwise one), so however the compiler vectorises it each
   row's bits are the same for any R: rows taken four at a time give four independent chains of fused
   multiply-adds, which the FMA units overlap, and a row alone still gives the same result. */
static inline __attribute__((always_inline)) void dot_block(const float *a, int64_t stride, const int R,
                                                           const float *b, int64_t n, float *out) {
    float part[4][LANES];
    for (int r = 0; r < R; r++)
        for (int l = 0; l < LANES; l++) part[r][l] = 0.0f;
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) {
            float bv = b[d + l];
            for (int r = 0; r < R; r++) part[r][l] += a[r * stride + d + l] * bv;
        }
    int64_t tail = n - d;
    for (int r = 0; r < R; r++) {
        for (int64_t l = 0; l < tail; l++) part[r][l] += a[r * stride + d + l] * b[d + l];
        for (int w = LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++) part[r][l] += part[r][l + w];
        out[r] = part[r][0];
    }
}

/* R a constant in each call below, so each count gets its own unrolled, vectorised loop. */
static void dot_rows(const float *a, int64_t stride, int R, const float *b, int64_t n, float *out) {
    switch (R) {
    case 1: dot_block(a, stride, 1, b, n, out); break;
    case 2: dot_block(a, stride, 2, b, n, out); break;
    case 3: dot_block(a, stride, 3, b, n, out); break;
    default: dot_block(a, stride, 4, b, n, out); break;
    }
}

/* out[r, o] = scale[o] * (in[r, :K] . w[o, :K]) (+ bias[o]) for r < M and o in [o0, o1): int8 weights one row per
   output ("output-major", Int8Linear's layout), read once whatever M is: each weight row is widened once into
   ``wide`` (K floats, exact: |q| <= 127, and in L1), then dotted with every input row. Every row goes through
   the same code whatever M is (a variant that widened in registers for one row compiled its tail into other
   roundings), so a row's result never depends on M. */
static void rows_q8(const float *in, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                    int64_t N, float *out, int64_t o0, int64_t o1, float *wide) {
    for (int64_t o = o0; o < o1; o++) {
        const int8_t *wo = w + o * K;
        float so = scale[o], bo = bias ? bias[o] : 0.0f;
        for (int64_t k = 0; k < K; k++) wide[k] = (float)wo[k];
        for (int64_t r = 0; r < M; r += 4) {
            int R = M - r < 4 ? (int)(M - r) : 4;
            float sums[4];
            dot_rows(in + r * K, K, R, wide, K, sums);
            for (int j = 0; j < R; j++) out[(r + j) * N + o] = sums[j] * so + bo;
        }
    }
}

/* Activations quantized per row for the int8 x int8 path: q = round(x / s) in [-127, 127] with s = max|x| / 127,
   stored offset by 128 as unsigned bytes (the form the u8 x s8 dot-product instructions take); returns s. */
static float quantize_row(const float *x, int64_t K, uint8_t *q) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
    for (int64_t k = 0; k < K; k++) {
        float v = nearbyintf(x[k] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[k] = (uint8_t)((int)v + 128);
    }
    return s;
}

/* For R <= 4 quantized rows a (offset by 128) and one int8 weight row w: out[r] = sum_k (a[r, k] - 128) * w[k],
   exact in int32 (|sum| <= K * 127 * 127), so the order of the additions cannot change it: the same integer on
   any CPU, at any R, with or without VNNI. */
static void dot_u8s8_rows(const uint8_t *a, int64_t stride, int R, const int8_t *w, int64_t K, int32_t *out) {
#ifdef FLOOD_VNNI
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i wsum = _mm512_setzero_si512(); /* sum of w, times 128 below: removes the offset of a */
    const __m512i ones = _mm512_set1_epi8(1);
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512((const void *)(a + r * stride + k)), wv);
    }
    if (k < K) { /* masked loads: nothing past the rows is read */
        __mmask64 m = (__mmask64)((~0ULL) >> (64 - (K - k)));
        __m512i wv = _mm512_maskz_loadu_epi8(m, w + k);
        wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(m, a + r * stride + k), wv);
    }
    int32_t offset = 128 * _mm512_reduce_add_epi32(wsum);
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_epi32(acc[r]) - offset;
#else
    for (int r = 0; r < R; r++) {
        const uint8_t *ar = a + r * stride;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; k++) sum += ((int32_t)ar[k] - 128) * (int32_t)w[k];
        out[r] = sum;
    }
#endif
}

/* out[r, o] for int8 activations (``q``, ``qs``: M rows quantized by quantize_row) and int8 weights: the exact
   integer dot product times the two scales (+ bias), in the same order for every row. */
#ifdef FLOOD_VNNI
/* Four quantized rows a against four weight rows w at once (16 accumulators): each activation vector loaded serves
   four weight rows and each weight vector four rows, so many-row products (prompts, busy experts) read a quarter
   of the bytes per product. out[r][c] = sum_k (a[r, k] - 128) * w[c, k], the same integers as dot_u8s8_rows. */
static void block_u8s8_4x4(const uint8_t *a, const int8_t *w, int64_t K, int32_t out[4][4]) {
    __m512i acc[4][4], wsum[4];
    const __m512i ones = _mm512_set1_epi8(1);
    for (int c = 0; c < 4; c++) {
        wsum[c] = _mm512_setzero_si512();
        for (int r = 0; r < 4; r++) acc[r][c] = _mm512_setzero_si512();
    }
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512i wv[4];
        for (int c = 0; c < 4; c++) {
            wv[c] = _mm512_loadu_si512((const void *)(w + c * K + k));
            wsum[c] = _mm512_dpbusd_epi32(wsum[c], ones, wv[c]);
        }
        for (int r = 0; r < 4; r++) {
            __m512i av = _mm512_loadu_si512((const void *)(a + r * K + k));
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], av, wv[c]);
        }
    }
    if (k < K) {
        __mmask64 m = (__mmask64)((~0ULL) >> (64 - (K - k)));
        __m512i wv[4];
        for (int c = 0; c < 4; c++) {
            wv[c] = _mm512_maskz_loadu_epi8(m, w + c * K + k);
            wsum[c] = _mm512_dpbusd_epi32(wsum[c], ones, wv[c]);
        }
        for (int r = 0; r < 4; r++) {
            __m512i av = _mm512_maskz_loadu_epi8(m, a + r * K + k);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], av, wv[c]);
        }
    }
    for (int c = 0; c < 4; c++) {
        int32_t offset = 128 * _mm512_reduce_add_epi32(wsum[c]);
        for (int r = 0; r < 4; r++) out[r][c] = _mm512_reduce_add_epi32(acc[r][c]) - offset;
    }
}
#endif

static void rows_i8(const uint8_t *q, const float *qs, int64_t M, int64_t K, const int8_t *w, const float *scale,
                    const float *bias, int64_t N, float *out, int64_t o0, int64_t o1) {
    int64_t o = o0;
#ifdef FLOOD_VNNI
    /* Whole 4 x 4 blocks first (exact integers: the same results as the row-by-row loop below). */
    for (; o + 4 <= o1 && M >= 4; o += 4) {
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) {
            int32_t sums[4][4];
            block_u8s8_4x4(q + r * K, w + o * K, K, sums);
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) {
                    float bo = bias ? bias[o + c] : 0.0f;
                    out[(r + i) * N + o + c] = (float)sums[i][c] * (qs[r + i] * scale[o + c]) + bo;
                }
        }
        for (int c = 0; c < 4 && r < M; c++) { /* the last rows (fewer than 4) of these four outputs */
            int R = (int)(M - r);
            int32_t sums[4];
            dot_u8s8_rows(q + r * K, K, R, w + (o + c) * K, K, sums);
            float so = scale[o + c], bo = bias ? bias[o + c] : 0.0f;
            for (int j = 0; j < R; j++) out[(r + j) * N + o + c] = (float)sums[j] * (qs[r + j] * so) + bo;
        }
    }
#endif
    for (; o < o1; o++) {
        const int8_t *wo = w + o * K;
        float so = scale[o], bo = bias ? bias[o] : 0.0f;
        for (int64_t r = 0; r < M; r += 4) {
            int R = M - r < 4 ? (int)(M - r) : 4;
            int32_t sums[4];
            dot_u8s8_rows(q + r * K, K, R, wo, K, sums);
            for (int j = 0; j < R; j++) out[(r + j) * N + o] = (float)sums[j] * (qs[r + j] * so) + bo;
        }
    }
}

/* Buffers of one thread for the int8-activation path: quantized rows and their scales. */
typedef struct {
    uint8_t *q;
    float *qs;
} act8_buf;

/* One expert's product for its m rows: float32 input-major weights (scale NULL) or int8 output-major ones with
   per-output scales. */
static void product(const float *in, int64_t m, int64_t K, const void *w, const float *scale, int64_t N, float *out,
                    float *wide, act8_buf *act8) {
    if (scale && act8) {
        for (int64_t r = 0; r < m; r++) act8->qs[r] = quantize_row(in + r * K, K, act8->q + r * K);
        rows_i8(act8->q, act8->qs, m, K, (const int8_t *)w, scale, NULL, N, out, 0, N);
    } else if (scale) {
        rows_q8(in, m, K, (const int8_t *)w, scale, NULL, N, out, 0, N, wide);
    } else {
        rows_gemm(in, m, K, (const float *)w, N, out);
    }
}

/* Routed experts of one layer, the experts [e0, e1) of it: see kernels.h. */
static void moe_experts(const void *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt, const void *gate_up,
                        const float *gate_up_scale, const void *down, const float *down_scale, int64_t I, int64_t e0,
                        int64_t e1, float *outs, float *scratch, int64_t *slot, int act_int8, int bf16) {
    int64_t N = T * Kt;
    size_t wsize = gate_up_scale ? sizeof(int8_t) : bf16 ? sizeof(uint16_t) : sizeof(float);
    /* per thread: rows [N + MB, D] (one expert's gathered inputs, zero-padded), h [N + MB, 2I], act [N + MB, I] */
    int64_t span = e1 - e0;
    if (span <= 0) return;
    int64_t *count = (int64_t *)calloc((size_t)span + 1, sizeof(int64_t));
    int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)span);
    if (!count || !pos) { free(count); free(pos); return; }
    for (int64_t n = 0; n < N; n++)
        if (idx[n] >= e0 && idx[n] < e1) count[idx[n] - e0 + 1]++;
    for (int64_t e = 0; e < span; e++) count[e + 1] += count[e];
    memcpy(pos, count, sizeof(int64_t) * (size_t)span);
    for (int64_t n = 0; n < N; n++)
        if (idx[n] >= e0 && idx[n] < e1) slot[pos[idx[n] - e0]++] = n;
    free(pos);
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
    float *rows = scratch, *h, *act;
    float *own = NULL;
#ifdef _OPENMP
    if (omp_get_thread_num() > 0) { /* thread 0 uses the caller's scratch, the others their own */
        own = (float *)malloc(sizeof(float) * (size_t)((N + MB) * (D + 3 * I)));
        rows = own;
    }
#endif
    h = rows + (N + MB) * D;
    act = h + (N + MB) * 2 * I;
    int64_t widest = D > I ? D : I;
    float *wide = gate_up_scale ? (float *)malloc(sizeof(float) * (size_t)widest) : NULL;
    act8_buf buf = {NULL, NULL}, *act8 = NULL;
    if (gate_up_scale && act_int8) {
        buf.q = (uint8_t *)malloc((size_t)((N + MB) * widest));
        buf.qs = (float *)malloc(sizeof(float) * (size_t)(N + MB));
        if (buf.q && buf.qs) act8 = &buf;
        else { free(wide); wide = NULL; } /* the loop below then skips every expert: no partial result */
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t e = 0; e < span; e++) {
        int64_t a = count[e], b = count[e + 1], m = b - a;
        if (!m || !rows || (gate_up_scale && !wide)) continue;
        const char *gu = (const char *)gate_up + (size_t)((e0 + e) * D * 2 * I) * wsize;
        const char *dn = (const char *)down + (size_t)((e0 + e) * I * D) * wsize;
        const float *gs = gate_up_scale ? gate_up_scale + (e0 + e) * 2 * I : NULL;
        const float *ds = down_scale ? down_scale + (e0 + e) * D : NULL;
        if (bf16) { /* bfloat16 rows and weights (bf16.c), float32 sums, SwiGLU in float32 */
            uint16_t *rows16 = (uint16_t *)rows, *act16 = (uint16_t *)h; /* h is free once act is made */
            for (int64_t r = 0; r < m; r++)
                memcpy(rows16 + r * D, (const uint16_t *)x + (slot[a + r] / Kt) * D, sizeof(uint16_t) * (size_t)D);
            flood_rows_bf16(rows16, m, D, (const uint16_t *)gu, 2 * I, h);
            for (int64_t r = 0; r < m; r++) swiglu(h + r * 2 * I, h + r * 2 * I + I, I, act + r * I);
            flood_round_bf16(act, m * I, act16); /* the down product's input in bfloat16, as torch's would be */
            flood_rows_bf16(act16, m, I, (const uint16_t *)dn, D, rows);
            for (int64_t r = 0; r < m; r++)
                memcpy(outs + slot[a + r] * D, rows + r * D, sizeof(float) * (size_t)D);
            continue;
        }
        int64_t mp = (m + MB - 1) / MB * MB; /* zero rows up to a whole register block */
        for (int64_t r = 0; r < m; r++)
            memcpy(rows + r * D, (const float *)x + (slot[a + r] / Kt) * D, sizeof(float) * (size_t)D);
        memset(rows + m * D, 0, sizeof(float) * (size_t)((mp - m) * D));
        product(rows, m, D, gu, gs, 2 * I, h, wide, act8);
        for (int64_t r = 0; r < m; r++) swiglu(h + r * 2 * I, h + r * 2 * I + I, I, act + r * I);
        memset(act + m * I, 0, sizeof(float) * (size_t)((mp - m) * I)); /* the zero rows, as for the input */
        product(act, m, I, dn, ds, D, rows, wide, act8);
        for (int64_t r = 0; r < m; r++)
            memcpy(outs + slot[a + r] * D, rows + r * D, sizeof(float) * (size_t)D);
    }
    free(own);
    free(wide);
    free(buf.q);
    free(buf.qs);
    }
    free(count);
}

/* Routed experts with float32 weights (kernels.h). */
void flood_moe_experts(const float *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt, const float *gate_up,
                       const float *down, int64_t E, int64_t I, int64_t e0, int64_t e1, float *outs,
                       float *scratch, int64_t *slot) {
    (void)E;
    moe_experts(x, T, D, idx, Kt, gate_up, NULL, down, NULL, I, e0, e1, outs, scratch, slot, 0, 0);
}

/* Routed experts with bfloat16 rows and weights (kernels.h). */
void flood_moe_experts_bf16(const uint16_t *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt,
                            const uint16_t *gate_up, const uint16_t *down, int64_t E, int64_t I, int64_t e0, int64_t e1,
                            float *outs, float *scratch, int64_t *slot) {
    (void)E;
    moe_experts(x, T, D, idx, Kt, gate_up, NULL, down, NULL, I, e0, e1, outs, scratch, slot, 0, 1);
}

/* Routed experts with int8 weights and per-output-column scales (kernels.h). */
void flood_moe_experts_q8(const float *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt,
                          const int8_t *gate_up, const float *gate_up_scale, const int8_t *down,
                          const float *down_scale, int64_t E, int64_t I, int64_t e0, int64_t e1, float *outs,
                          float *scratch, int64_t *slot, int act_int8) {
    (void)E;
    moe_experts(x, T, D, idx, Kt, gate_up, gate_up_scale, down, down_scale, I, e0, e1, outs, scratch, slot,
                act_int8, 0);
}

/* y[t] = sum over the token's Kt routed slots, in ascending expert id, of weight * output; rows [t0, t1)
   (kernels.h). */
void flood_moe_combine(const int64_t *idx, const float *wt, int64_t Kt, int64_t D, const float *outs, float *y,
                       int64_t t0, int64_t t1) {
    int64_t kn = Kt < 64 ? Kt : 64;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t t = t0; t < t1; t++) {
        int64_t ks[64];
        float *yt = y + t * D;
        memset(yt, 0, sizeof(float) * (size_t)D);
        for (int64_t k = 0; k < kn; k++) ks[k] = k;
        for (int64_t k = 1; k < kn; k++) { /* insertion sort of the token's slots by expert id */
            int64_t v = ks[k], j = k;
            while (j > 0 && idx[t * Kt + ks[j - 1]] > idx[t * Kt + v]) { ks[j] = ks[j - 1]; j--; }
            ks[j] = v;
        }
        for (int64_t k = 0; k < kn; k++) {
            int64_t n = t * Kt + ks[k];
            float w = wt[n];
            const float *o = outs + n * D;
            for (int64_t d = 0; d < D; d++) yt[d] += w * o[d];
        }
    }
}

#define LINEAR_ROWS 16 /* output rows a thread takes at a time */

/* An int8 linear layer, output columns [o0, o1) (kernels.h). */
void flood_linear_q8(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                     int64_t N, float *y, int64_t o0, int64_t o1, uint8_t *qx, float *qs) {
    if (qx) { /* int8 activations: every row quantized once, then the integer products */
        for (int64_t m = 0; m < M; m++) qs[m] = quantize_row(x + m * K, K, qx + m * K);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
        for (int64_t b = o0; b < o1; b += LINEAR_ROWS) {
            int64_t end = b + LINEAR_ROWS < o1 ? b + LINEAR_ROWS : o1;
            rows_i8(qx, qs, M, K, w, scale, bias, N, y, b, end);
        }
        return;
    }
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
    float *wide = (float *)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t b = o0; b < o1; b += LINEAR_ROWS) {
        int64_t end = b + LINEAR_ROWS < o1 ? b + LINEAR_ROWS : o1;
        if (wide) rows_q8(x, M, K, w, scale, bias, N, y, b, end, wide);
    }
    free(wide);
    }
}

#ifdef __AVX512F__
/* One query head over its keys with the head held in registers (Dh a multiple of 16, at most 16 * HEAD_VECTORS):
   the query and the output accumulators stay in registers for the whole walk over the keys, where the portable
   loop below re-reads and re-writes the output row once per key. Each score is one chain of fused multiply-adds
   over the head's vectors, then a fixed tree over the lanes; the output is one chain per lane over the keys in
   order: a query's bits depend on its own keys alone. */
#define HEAD_VECTORS 8
/* Keys are scattered over the KV pool (a request's segments), so the hardware cannot guess the next one: each
   key's (or value's) lines are fetched this many keys ahead. */
#define KEYS_AHEAD 8
static inline __attribute__((always_inline)) void prefetch_head(const float *p, const int NV) {
    for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(p + 16 * v), _MM_HINT_T0);
}
static inline __attribute__((always_inline)) void head_walk(const float *qh, const int NV, const float *kpool,
                                                           const float *vpool, int64_t Kh, int64_t kh,
                                                           const int64_t *ks, int64_t seen, float scale,
                                                           float *scores, float *o) {
    __m512 qv[HEAD_VECTORS], acc[HEAD_VECTORS];
    int64_t Dh = 16 * NV;
    for (int v = 0; v < NV; v++) qv[v] = _mm512_loadu_ps(qh + 16 * v);
    float mx = -INFINITY;
    for (int64_t j = 0; j < seen; j++) {
        const float *kv = kpool + (ks[j] * Kh + kh) * Dh;
        if (j + KEYS_AHEAD < seen) prefetch_head(kpool + (ks[j + KEYS_AHEAD] * Kh + kh) * Dh, NV);
        __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kv));
        for (int v = 1; v < NV; v++) d = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kv + 16 * v), d);
        float s = _mm512_reduce_add_ps(d) * scale;
        scores[j] = s;
        mx = s > mx ? s : mx;
    }
    /* exp(s - max) 16 keys at a time, summed in 16 lanes over the blocks, then a fixed tree over the lanes (the
       last block masked: lanes past the keys add zero) */
    __m512 sums = _mm512_setzero_ps(), mv = _mm512_set1_ps(mx);
    for (int64_t j = 0; j < seen; j += 16) {
        __mmask16 m = seen - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - j)) - 1u);
        __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), mv));
        p = _mm512_maskz_mov_ps(m, p);
        _mm512_mask_storeu_ps(scores + j, m, p);
        sums = _mm512_add_ps(sums, p);
    }
    float sum = _mm512_reduce_add_ps(sums);
    for (int v = 0; v < NV; v++) acc[v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; j++) {
        const float *vv = vpool + (ks[j] * Kh + kh) * Dh;
        if (j + KEYS_AHEAD < seen) prefetch_head(vpool + (ks[j + KEYS_AHEAD] * Kh + kh) * Dh, NV);
        __m512 p = _mm512_set1_ps(scores[j]);
        for (int v = 0; v < NV; v++) acc[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vv + 16 * v), acc[v]);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[v], inv));
}

static void head_in_registers(const float *qh, int64_t Dh, const float *kpool, const float *vpool, int64_t Kh,
                              int64_t kh, const int64_t *ks, int64_t seen, float scale, float *scores, float *o) {
    switch (Dh / 16) { /* each head size its own unrolled loop */
    case 1: head_walk(qh, 1, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    case 2: head_walk(qh, 2, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    case 3: head_walk(qh, 3, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    case 4: head_walk(qh, 4, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    case 5: head_walk(qh, 5, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    case 6: head_walk(qh, 6, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    case 7: head_walk(qh, 7, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    default: head_walk(qh, 8, kpool, vpool, Kh, kh, ks, seen, scale, scores, o); break;
    }
}
#endif

/* Attention of query rows over the KV pool, one unit (a run of queries of one request) at a time, causal and
   bottom-right aligned: see kernels.h for the unit layout. */
void flood_attention(const float *q, int64_t H, int64_t Dh, const float *kpool, const float *vpool, int64_t Kh,
                     const int64_t *units, int64_t U, const int64_t *keys, float scale, float *out,
                     float *scores0, int64_t max_keys) {
    int64_t group = H / Kh;
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
    float *scores = scores0;
#ifdef _OPENMP
    float *own = NULL;
    if (omp_get_thread_num() > 0) scores = own = (float *)malloc(sizeof(float) * (size_t)(max_keys > 0 ? max_keys : 1));
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t u = 0; u < U; u++) {
        if (!scores) continue;
        int64_t q_start = units[4 * u], q_len = units[4 * u + 1];
        const int64_t *ks = keys + units[4 * u + 2];
        int64_t key_len = units[4 * u + 3];
        for (int64_t i = 0; i < q_len; i++) {
            int64_t seen = key_len - q_len + i + 1;
            for (int64_t hh = 0; hh < H; hh++) {
                const float *qh = q + ((q_start + i) * H + hh) * Dh;
                int64_t kh = hh / group;
                float *o = out + ((q_start + i) * H + hh) * Dh;
#ifdef __AVX512F__
                if (Dh % 16 == 0 && Dh <= 16 * HEAD_VECTORS) {
                    head_in_registers(qh, Dh, kpool, vpool, Kh, kh, ks, seen, scale, scores, o);
                    continue;
                }
#endif
                float mx = -INFINITY;
                for (int64_t j = 0; j < seen; j++) {
                    const float *kv = kpool + (ks[j] * Kh + kh) * Dh;
                    float s = dot(qh, kv, Dh) * scale;
                    scores[j] = s;
                    if (s > mx) mx = s;
                }
                float sum = 0.0f;
                for (int64_t j = 0; j < seen; j++) {
                    float p = expf(scores[j] - mx);
                    scores[j] = p;
                    sum += p;
                }
                memset(o, 0, sizeof(float) * (size_t)Dh);
                for (int64_t j = 0; j < seen; j++) {
                    const float *vv = vpool + (ks[j] * Kh + kh) * Dh;
                    float p = scores[j];
                    for (int64_t d = 0; d < Dh; d++) o[d] += p * vv[d];
                }
                float inv = 1.0f / sum;
                for (int64_t d = 0; d < Dh; d++) o[d] *= inv;
            }
        }
    }
#ifdef _OPENMP
    free(own);
#endif
    }
}

/* Rows of bfloat16 weights quantized to int8 as lingctl.flood.weights.quantize.quantize_rows does it, bit for bit
   (kernels.h): the absmax of a row, its scale amax / 127 rounded to the scale dtype, then each weight divided by
   the scale, rounded half to even and clamped. */
int flood_quantize_rows_bf16(const uint16_t *src, int64_t rows, int64_t K, int8_t *dst, float *scale,
                             int scale_bf16) {
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) reduction(| : bad)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *w = src + r * K;
        uint16_t top = 0; /* magnitudes of positive floats order as their bit patterns do */
        for (int64_t k = 0; k < K; k++) {
            uint16_t a = (uint16_t)(w[k] & 0x7FFF);
            top = a > top ? a : top;
        }
        if (top >= 0x7F80) { bad = 1; continue; } /* infinity or NaN: the caller quantizes this chunk itself */
        union { uint32_t u; float f; } amax = {.u = (uint32_t)top << 16}, s;
        s.f = amax.f / 127.0f;
        if (scale_bf16) { /* round to bfloat16, to nearest even (s is finite and non-negative) */
            uint32_t lsb = (s.u >> 16) & 1u;
            s.u = (s.u + 0x7FFFu + lsb) & 0xFFFF0000u;
        }
        if (s.f == 0.0f) s.f = 1.0f;
        scale[r] = s.f;
        int8_t *q = dst + r * K;
        for (int64_t k = 0; k < K; k++) {
            union { uint32_t u; float f; } x = {.u = (uint32_t)w[k] << 16};
            float v = nearbyintf(x.f / s.f);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[k] = (int8_t)v;
        }
    }
    return bad ? -1 : 0;
}

/* 1 when the int8 x int8 products use AVX-512 VNNI (kernels.h). */
int flood_vnni(void) {
#ifdef FLOOD_VNNI
    return 1;
#else
    return 0;
#endif
}

/* 1 when built with OpenMP (kernels.h). */
int flood_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
