/* A share of one GEMV (kernels/cpu/dense_gemv.c) for the kernels that split a GEMV's rows among the threads of a
 * parallel region of their own (kernels/cpu/attention_half.c, ffn_half.c, mla_half.c, mamba_half.c, mamba2_half.c). */
#ifndef ARCHZOO_GEMV_H
#define ARCHZOO_GEMV_H
#include <stdint.h>

#include "claims.h"
#include "floats.h"

/* Whether gemv_part reads x as an fp32 copy (1: int8 weights, or bf16 ones without AVX512-BF16) or as it is (0). */
int gemv_widens(int dtype, int int8);

/* How far ahead of the line it reads a one-row GEMV prefetches (row_ahead below), for a step that streams
 * step_bytes of weights, or -1 where that is not known (an op called on its own): further where they fit in half the
 * last-level cache (kernels/cpu/dense_gemv.c says what each measured). */
int64_t row_prefetch_bytes(int64_t step_bytes);

/* out[:, n0:n1) = x W[n0:n1)^T on the calling thread: x [m, k] rows ldx apart, in dtype (fp32 or bf16) or its fp32
 * copy where gemv_widens says so; W [n, k] in dtype, or int8 times scales [n] (s_dtype) where scales is not NULL;
 * out rows ldo apart in dtype; a row of float x prefetches row_ahead bytes ahead (row_prefetch_bytes). Each output
 * equals dense_gemv's or int8_gemv's for the whole W, bit for bit. */
void gemv_part(const void *x, int64_t m, int64_t k, int64_t ldx, int dtype, const void *weight, const void *scales,
               int s_dtype, int64_t n0, int64_t n1, void *out, int64_t ldo, int64_t row_ahead);

/* bytes rounded up to whole 64-byte lines: the halves' workspaces are laid out in such pieces */
static inline int64_t aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* a thread's share [n0, n1) of n output rows: whole 4-row tiles, as dense_gemv's static schedule splits them */
static inline void tile_share(int64_t n, int t, int threads, int64_t *n0, int64_t *n1) {
    int64_t tiles = (n + 3) / 4;
    *n0 = 4 * (tiles * t / threads);
    *n1 = 4 * (tiles * (t + 1) / threads);
    *n1 = *n1 < n ? *n1 : n;
}

/* out = residual + x W^T over the rows of W's n this thread claims from `shares` (claims.h; shares_init(shares, n,
 * 4, threads) before the region), as gemv_part takes x, W, scales and row_ahead: out and residual [m, n] contiguous
 * in dtype, each sum rounded to dtype as torch's add rounds it. Every half's last step (its output projection and
 * the residual). */
static inline void gemv_residual_share(const void *x, int64_t m, int64_t k, int64_t ldx, int dtype, const void *w,
                                       const void *scales, int s_dtype, int64_t n, const void *residual, void *out,
                                       int64_t row_ahead, Share *shares, int t, int threads) {
    int64_t size = claim_items(k * (scales ? 1 : dtype == F32 ? 4 : 2), 4), n0, n1;
    while (claim(shares, t, threads, size, 4, &n0, &n1)) {
        gemv_part(x, m, k, ldx, dtype, w, scales, s_dtype, n0, n1, out, n, row_ahead);
        for (int64_t b = 0; b < m; b++)
            for (int64_t i = b * n + n0; i < b * n + n1; i++)
                store1(out, i, load1(out, i, dtype) + load1(residual, i, dtype), dtype);
    }
}

/* How much of the next weights a thread fetches while it waits between two parts of a half: a new stream starts cold
 * at every region or share, and the threads meet at barriers (and torch's SiLU runs) between them. 32 KiB: a `base`
 * bf16 attention half streamed 22.2, 17.5, 16.5 GB/s against 17.6, 15.2, 14.0 without it (alternating processes). */
#define NEXT_PREFETCH_BYTES 32768

/* The start of this thread's share (tile_share) of the n rows of w, row_bytes each, on its way to L2. */
static inline void prefetch_share(const void *w, int64_t n, int64_t row_bytes, int t, int threads) {
    int64_t n0, n1;
    tile_share(n, t, threads, &n0, &n1);
    int64_t bytes = (n1 - n0) * row_bytes < NEXT_PREFETCH_BYTES ? (n1 - n0) * row_bytes : NEXT_PREFETCH_BYTES;
    const char *first = (const char *)w + n0 * row_bytes;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(first + off, 0, 1);
}
#endif
