/* What the kernels' source files share with each other (not entry points: hidden from the library's users). */

#ifndef LINGCTL_FLOOD_INTERNAL_H
#define LINGCTL_FLOOD_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#define FLOOD_HIDDEN __attribute__((visibility("hidden")))

/* Weight rows per pass of the row products (even: the bfloat16 products take them in pairs). */
#define FLOOD_PASS_ROWS 16

/* One block of a row product: R rows (R <= 6) by C vectors of 16 columns over kn weight rows; the sums are kept in
   out between passes (first: start from zero); pf NULL, or where the lines of the next pass this block prefetches
   begin (C lines per weight-row step, in address order). */
typedef void (*flood_block_fn)(const void *in, int64_t K, const void *w, int64_t N, int64_t kn, int first, int R,
                               int C, const void *pf, float *out);

/* out[m, :N] = in[m, :K] @ w[:K, :N] for m < M by calls of block over sets of rows, passes of weight rows and
   blocks of columns (kernels.c says in which order, and why); elements of in_size and w_size bytes. N is a
   multiple of 16. */
FLOOD_HIDDEN void flood_rows_walk(const void *in, size_t in_size, int64_t M, int64_t K, const void *w, size_t w_size,
                                  int64_t N, float *out, flood_block_fn block);

/* out[m, :N] = in[m, :K] @ w[:K, :N] for m < M, bfloat16 rows and input-major bfloat16 weights (uint16 bit
   patterns), float32 sums (bf16.c). K even, N a multiple of 16. */
FLOOD_HIDDEN void flood_rows_bf16(const uint16_t *in, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *out);

/* n floats rounded to bfloat16, to nearest even (bf16.c). */
FLOOD_HIDDEN void flood_round_bf16(const float *x, int64_t n, uint16_t *out);

#endif
