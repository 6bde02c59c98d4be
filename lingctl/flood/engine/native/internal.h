/* What the kernels' source files share with each other (not entry points: hidden from the library's users). */

#ifndef LINGCTL_FLOOD_INTERNAL_H
#define LINGCTL_FLOOD_INTERNAL_H

#include <stdint.h>

#define FLOOD_HIDDEN __attribute__((visibility("hidden")))

/* out[m, :N] = in[m, :K] @ w[:K, :N] for m < M, bfloat16 rows and input-major bfloat16 weights (uint16 bit
   patterns), float32 sums (bf16.c). K even, N a multiple of 16. */
FLOOD_HIDDEN void flood_rows_bf16(const uint16_t *in, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *out);

/* n floats rounded to bfloat16, to nearest even (bf16.c). */
FLOOD_HIDDEN void flood_round_bf16(const float *x, int64_t n, uint16_t *out);

#endif
