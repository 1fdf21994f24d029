/* A feed-forward half of a decode block, x + down(silu(gate h) * up h) with h = RMSNorm(x), in two OpenMP parallel
 * regions around torch's silu and product (kernels/cpu/ops.cpp's ffn_block; kernels/cpu_blocks.py says when it
 * runs): each thread normalises x itself and claims rows of gate and up as it is done (claims.h; with two threads
 * one streams gate and the other up), and then rows of down with the residual added. Each output is computed as
 * the composed half computes it, bit for bit; the composed half ran three regions with the norm and the residual
 * serial between them. The silu stays torch's, so the half's rounding is the module's (torch's vectorised loop and
 * its scalar tail round silu differently; a silu run from inside the region over each thread's stretch, bit for bit
 * the same, made the step no faster). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "floats.h"
#include "gemv.h"
#include "norm_rope.h"

/* gate_out = RMSNorm(x) gate^T and up_out = RMSNorm(x) up^T: x [batch, width] contiguous in dtype (fp32 or bf16),
 * gate and up [hidden, width] in dtype or int8 times their scales (s_dtypes) where those are not NULL; the outputs
 * [batch, hidden] in dtype. down (or NULL): the next GEMV's weights [width, down_row_bytes], whose rows each thread
 * will take in gemv_residual: the start of its share is fetched at the end. row_ahead: gemv_part's. Returns 0, -1
 * for a dtype beyond the kernels, -2 out of memory. */
int ffn_gate_up(const void *x, int64_t batch, int64_t width, int dtype, const void *norm, float eps,
                const void *gate, const void *gate_scales, const void *up, const void *up_scales, const int *s_dtypes,
                int64_t hidden, void *gate_out, void *up_out, const void *down, int64_t down_row_bytes,
                int64_t row_ahead, int threads) {
    if ((dtype != F32 && dtype != BF16) || batch < 1) return -1;
    int widen_gate = gemv_widens(dtype, gate_scales != NULL), widen_up = gemv_widens(dtype, up_scales != NULL);
    int64_t h_bytes = aligned(batch * width * (dtype == F32 ? 4 : 2));
    int64_t wide_bytes = aligned(sizeof(float) * batch * width);
    char *memory = aligned_alloc(64, threads * (h_bytes + wide_bytes));
    if (!memory) return -2;
    /* gate's rows then up's, each on whole 4-row tiles: with two threads, one streams gate and the other up */
    int64_t padded = (hidden + 3) / 4 * 4;
    Share shares[threads];
    shares_init(shares, 2 * padded, 4, threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        char *h = memory + t * (h_bytes + wide_bytes);
        float *wide = (float *)(h + h_bytes);
        rms_norm(x, batch, width, width, dtype, norm, eps, h);
        if (widen_gate || widen_up)
            for (int64_t i = 0; i < batch * width; i++) wide[i] = load1(h, i, dtype);
        int64_t size = claim_items(width * (gate_scales ? 1 : dtype == F32 ? 4 : 2), 4), a, b;
        while (claim(shares, t, threads, size, 4, &a, &b)) {
            if (a < padded)
                gemv_part(widen_gate ? (const void *)wide : h, batch, width, width, dtype, gate, gate_scales,
                          s_dtypes[0], a, b < hidden ? b : hidden, gate_out, hidden, row_ahead);
            if (b > padded)
                gemv_part(widen_up ? (const void *)wide : h, batch, width, width, dtype, up, up_scales, s_dtypes[1],
                          a > padded ? a - padded : 0, b - padded < hidden ? b - padded : hidden, up_out, hidden,
                          row_ahead);
        }
        if (down) prefetch_share(down, width, down_row_bytes, t, n); /* down's rows, while torch's SiLU runs */
    }
    free(memory);
    return 0;
}

/* out = residual + x w^T: x [batch, k] contiguous in dtype (fp32 or bf16), w [n, k] in dtype or int8 times scales
 * (s_dtype) where those are not NULL, residual and out [batch, n] contiguous in dtype, the sum rounded to dtype as
 * torch's add rounds it; row_ahead: gemv_part's. Returns 0, -1 for a dtype beyond the kernels, -2 out of memory. */
int gemv_residual(const void *x, int64_t batch, int64_t k, int dtype, const void *w, const void *scales, int s_dtype,
                  int64_t n, const void *residual, void *out, int64_t row_ahead, int threads) {
    if ((dtype != F32 && dtype != BF16) || batch < 1) return -1;
    int widen = gemv_widens(dtype, scales != NULL);
    float *wide = NULL;
    if (widen) { /* x is small next to w: one fp32 copy for every thread */
        if (!(wide = malloc(sizeof(float) * batch * k))) return -2;
        for (int64_t i = 0; i < batch * k; i++) wide[i] = load1(x, i, dtype);
    }
    Share shares[threads];
    shares_init(shares, n, 4, threads);
#pragma omp parallel num_threads(threads)
    gemv_residual_share(widen ? (const void *)wide : x, batch, k, k, dtype, w, scales, s_dtype, n, residual, out,
                        row_ahead, shares, omp_get_thread_num(), threads);
    free(wide);
    return 0;
}
