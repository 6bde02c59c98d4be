/* bfloat16 row products for flood's routed experts under --dtype bfloat16: bfloat16 activations times bfloat16
   weights, summed in float32 (what torch's bf16 products compute, in one call per layer instead of one library
   call per expert, and without padding rows).

   The weights stay input-major ([K, N], as the expert stacks hold them). Two neighbouring weight rows k and k+1
   are interleaved in registers into pairs (w[k, n], w[k+1, n]), so one VDPBF16PS multiplies 16 output columns by
   a pair of activations: 32 multiply-adds per instruction, twice a float32 FMA's. Each output is one chain over
   the pairs in order, started from zero, so a row's bits never depend on the other rows or the thread count.
   Without the BF16 instructions the pair step is done by two float32 FMAs, odd element first as the
   instruction's definition says; the BF16 instructions also flush denormal inputs and results to zero, the
   emulation does not, so the two can differ in the last bits on the same data (each is fixed on its machine). */

#include "internal.h"
#include "kernels.h"

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif


#if defined(__AVX512F__) && defined(__AVX512BW__)
/* acc + a[odd] * w[odd] + a[even] * w[even] in each 32-bit lane of pairs. */
static inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i w) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w);
#else
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(w, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                           acc);
#endif
}

/* One block of flood_rows_walk (internal.h): R rows (R <= 6) by C vectors of 16 columns over kn weight rows (kn
   even), the accumulators in registers, kept in ``out`` between passes (exact); ``pf``: lines of the next pass to
   prefetch, C per pair of weight rows. */
static inline __attribute__((always_inline)) void pairs_block(const uint16_t *in, int64_t K, const uint16_t *w,
                                                             int64_t N, int64_t kn, int first, int R, int C,
                                                             const uint16_t *pf, float *out) {
    /* lane i of the result takes element i of the low half (row k) and element i of the high half (row k + 1) */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * N + 16 * c);
    for (int64_t k = 0; k < kn; k += 2) {
        const uint16_t *w0 = w + k * N, *w1 = w0 + N;
        __m512i wv[4];
        for (int c = 0; c < C; c++) {
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const void *)(w0 + 16 * c))),
                                              _mm256_loadu_si256((const void *)(w1 + 16 * c)), 1);
            wv[c] = _mm512_permutexvar_epi16(interleave, both);
        }
        if (pf)
            for (int c = 0; c < C; c++) _mm_prefetch((const char *)(pf + ((k / 2) * C + c) * 32), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, in + r * K + k, sizeof pair);
            __m512i av = _mm512_set1_epi32(pair);
            for (int c = 0; c < C; c++) acc[r][c] = dot_pairs(acc[r][c], av, wv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(out + r * N + 16 * c, acc[r][c]);
}

#define PAIRS_CASES(C)                                                                                         \
    switch (R) {                                                                                               \
    case 1: pairs_block(in, K, w, N, kn, first, 1, C, pf, out); break;                                        \
    case 2: pairs_block(in, K, w, N, kn, first, 2, C, pf, out); break;                                        \
    case 3: pairs_block(in, K, w, N, kn, first, 3, C, pf, out); break;                                        \
    case 4: pairs_block(in, K, w, N, kn, first, 4, C, pf, out); break;                                        \
    case 5: pairs_block(in, K, w, N, kn, first, 5, C, pf, out); break;                                        \
    default: pairs_block(in, K, w, N, kn, first, 6, C, pf, out); break;                                       \
    }
static void pairs_cols(const void *in_, int64_t K, const void *w_, int64_t N, int64_t kn, int first, int R, int C,
                       const void *pf_, float *out) {
    const uint16_t *in = (const uint16_t *)in_, *w = (const uint16_t *)w_, *pf = (const uint16_t *)pf_;
    if (C == 4) { PAIRS_CASES(4) }
    else if (C == 2) { PAIRS_CASES(2) }
    else { PAIRS_CASES(1) }
}
#undef PAIRS_CASES

void flood_rows_bf16(const uint16_t *in, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *out) {
    flood_rows_walk(in, sizeof(uint16_t), M, K, w, sizeof(uint16_t), N, out, pairs_cols);
}
#else
static inline float widen(uint16_t b) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)b << 16};
    return v.f;
}

/* Portable: the same pairs in the same order, by float32 fused multiply-adds. */
void flood_rows_bf16(const uint16_t *in, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *out) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * N;
        memset(o, 0, sizeof(float) * (size_t)N);
        for (int64_t k = 0; k < K; k += 2) {
            float a0 = widen(in[m * K + k]), a1 = widen(in[m * K + k + 1]);
            const uint16_t *w0 = w + k * N, *w1 = w0 + N;
            for (int64_t n = 0; n < N; n++) {
                float s = o[n] + a1 * widen(w1[n]);
                o[n] = s + a0 * widen(w0[n]);
            }
        }
    }
}
#endif

/* float32 to bfloat16, rounded to nearest even (as torch rounds); NaN stays NaN. */
void flood_round_bf16(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + i));
        __m512i bias = _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256((void *)(out + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < n; i++) {
        union { float f; uint32_t u; } v = {.f = x[i]};
        out[i] = x[i] != x[i] ? (uint16_t)0x7FC0 : (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
    }
}

/* 1 when the pair products use AVX-512 BF16 (kernels.h). */
int flood_bf16_dot(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
