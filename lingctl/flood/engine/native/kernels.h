/* flood's CPU kernels (float32 activations; float32 or int8 weights): the entry points that
   lingctl/flood/engine/native/__init__.py calls through ctypes (its _SIGNATURES table declares each one's
   argument and result types in this order).

   Every array is contiguous (row-major) and every size is in elements. The callers check each size, shape,
   dtype and index range below before calling: the kernels trust them and do not check again.

   Shape legend: T tokens (rows) of the step, D hidden size, E experts, I expert width (2I: gate and up rows
   fused), Kt experts per token, N = T * Kt routed slots, H query heads, Kh key/value heads, Dh head size,
   U attention units, C KV pool capacity in slots. */

#ifndef LINGCTL_FLOOD_KERNELS_H
#define LINGCTL_FLOOD_KERNELS_H

#include <stdint.h>

/* Routed experts of one layer, experts [e0, e1) of it (a caller without OpenMP splits the experts between
   threads; with OpenMP one call takes all of them and spreads them itself).
     x        [T, D] float32: the layer's input rows
     idx      [T, Kt] int64: each token's expert ids, every one in [0, E)
     gate_up  [E, D, 2I] float32: gate and up weights, input-major
     down     [E, I, D] float32: down weights, input-major
     outs     [N, D] float32: row n is written with the output of routed slot n when its expert is in [e0, e1)
     scratch  at least (N + 8) * (D + 3I) floats: the calling thread's rows, activations and products
     slot     at least N int64s
   D and 2I are multiples of 32 (every column block full); 0 <= e0 <= e1 <= E. */
void flood_moe_experts(const float *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt, const float *gate_up,
                       const float *down, int64_t E, int64_t I, int64_t e0, int64_t e1, float *outs,
                       float *scratch, int64_t *slot);

/* The same with int8 weights, w = q * scale per output, laid out output-major (one row per output, as
   Int8Linear and the loader's stacks hold them):
     gate_up        [E, 2I, D] int8;  gate_up_scale [E, 2I] float32
     down           [E, D, I] int8;   down_scale    [E, D] float32
   Each output is a fixed-order dot product of the input row with the widened weight row (exact widening),
   times its scale, so a row's bits do not depend on the other rows or the thread count. Any D and I > 0.
   act_int8 = 1: each input row (and each SwiGLU output row) is first quantized to int8 with one scale per row,
   and the products are exact integer dot products (AVX-512 VNNI where built for it, else a portable loop: the
   same integers), times both scales. */
void flood_moe_experts_q8(const float *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt,
                          const int8_t *gate_up, const float *gate_up_scale, const int8_t *down,
                          const float *down_scale, int64_t E, int64_t I, int64_t e0, int64_t e1, float *outs,
                          float *scratch, int64_t *slot, int act_int8);

/* The same with bfloat16 rows and weights (uint16 bit patterns), in the float32 layout above:
     x        [T, D] bfloat16
     gate_up  [E, D, 2I] bfloat16, input-major; down [E, I, D] bfloat16
   The products sum pairs of bfloat16 products in float32 (AVX-512 BF16 where built for it, else float32 FMAs in
   the same order), the SwiGLU is computed in float32 and rounded to bfloat16 for the down product, and outs is
   float32. Each output is one chain over k in order, so a row's bits do not depend on the other rows or the
   thread count. D and 2I are multiples of 32, as above. */
void flood_moe_experts_bf16(const uint16_t *x, int64_t T, int64_t D, const int64_t *idx, int64_t Kt,
                            const uint16_t *gate_up, const uint16_t *down, int64_t E, int64_t I, int64_t e0, int64_t e1,
                            float *outs, float *scratch, int64_t *slot);

/* An int8 linear layer, output columns [o0, o1) of y (Int8Linear's layout: one weight row per output).
     x      [M, K] float32
     w      [N, K] int8; scale [N] float32; bias [N] float32 or NULL
     y      [M, N] float32: y[m, o] = scale[o] * (x[m, :] . w[o, :]) + bias[o], the dot product summed in a
            fixed order, so a row's bits do not depend on M or on the thread count
     qx, qs NULL, or [M, K] bytes and [M] floats: then the rows of x are quantized to int8 into them first (one
            scale per row) and the dot products are exact integer ones, as act_int8 above
   0 <= o0 <= o1 <= N. With qx, one call must cover all of [0, N) (the rows are quantized in the call). */
void flood_linear_q8(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                     int64_t N, float *y, int64_t o0, int64_t o1, uint8_t *qx, float *qs);

/* Quantize rows of bfloat16 weights to int8 with one scale per row, exactly as quantize_rows in
   lingctl/flood/weights/quantize.py (the loader's conversion, in one pass per row instead of several).
     src    [rows, K] bfloat16 (as uint16 bit patterns)
     dst    [rows, K] int8: q = clamp(round_half_even(w / scale), -127, 127)
     scale  [rows] float32: max|w| / 127, rounded to bfloat16 first when scale_bf16 is 1; 1 for an all-zero row
   Returns 0, or -1 when a row holds an infinity or a NaN (the caller then quantizes those rows itself). */
int flood_quantize_rows_bf16(const uint16_t *src, int64_t rows, int64_t K, int8_t *dst, float *scale,
                             int scale_bf16);

/* 1 when the bfloat16 products use AVX-512 BF16 (vdpbf16ps), 0 for float32 FMAs in the same order (which do not
   flush denormals to zero as the instruction does). */
int flood_bf16_dot(void);

/* 1 when the int8 x int8 products use AVX-512 VNNI, 0 for the portable loop (the same results). */
int flood_vnni(void);

/* The weighted sum of each token's routed outputs, rows [t0, t1) of y.
     idx  [T, Kt] int64: expert ids (the sum runs in ascending expert id, so a row's bits are fixed)
     wt   [T, Kt] float32: routing weights
     outs [N, D] float32: what flood_moe_experts wrote
     y    [T, D] float32: written
   Kt <= 64; 0 <= t0 <= t1 <= T. */
void flood_moe_combine(const int64_t *idx, const float *wt, int64_t Kt, int64_t D, const float *outs, float *y,
                       int64_t t0, int64_t t1);

/* Causal attention of query rows over the segment KV cache, one unit (a run of queries of one request) at a
   time.
     q        [T, H, Dh] float32
     kpool    [C, Kh, Dh] float32; vpool the same shape. H is a multiple of Kh (grouped-query attention)
     units    [U, 4] int64 (q_start, q_len, key_offset, key_len): the unit's keys are the slots
              keys[key_offset : key_offset + key_len] in position order, and its query i (0-based) sees the
              first key_len - q_len + i + 1 of them. q_start + q_len <= T, key_len >= q_len >= 0.
     keys     int64 slots in [0, C)
     scale    the softmax scale
     out      [T, H, Dh] float32: the rows of every unit written
     scores0  at least max_keys floats (the first thread's; the others allocate their own)
     max_keys >= every unit's key_len */
void flood_attention(const float *q, int64_t H, int64_t Dh, const float *kpool, const float *vpool, int64_t Kh,
                     const int64_t *units, int64_t U, const int64_t *keys, float scale, float *out,
                     float *scores0, int64_t max_keys);

/* 1 when built with OpenMP: the calls then spread over torch's own OpenMP threads (same runtime, same
   thread count), and the caller does not split the work itself. */
int flood_openmp(void);

#endif
