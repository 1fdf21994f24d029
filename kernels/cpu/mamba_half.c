/* A Mamba layer's half of a decode block, x + out_proj(Mamba's step(RMSNorm(x))), in one OpenMP parallel region
 * (kernels/cpu/ops.cpp's mamba_block; kernels/cpu_blocks.py says when it runs). Each thread normalises x itself and
 * takes a run of channels: their in_proj rows (x and z), their conv step and SiLU; after a wait, tiles of x_proj
 * (dt's low rank, B, C); after another, its channels' dt_proj rows and their state rows' update; after a third,
 * tiles of out_proj with the residual. The composed half ran five parallel regions (one per GEMV and one per
 * sequence's state update) with ~15 torch ops between them: `small` fp32, a layer took 424 µs at batch 1 against
 * 307 for its four GEMVs, and 661 against 350 at batch 4 (2-core EPYC).
 * Its roundings are the module's (ssm/mamba.py's Mamba.step) in x's dtype: the GEMVs' outputs, the conv's products
 * and sums, the SiLU, dt_proj's output and the state update's output are rounded where its ops round. The SiLU's exp
 * is glibc's and A's and the decay's exps are exp8's, where torch's are SLEEF's, and dt_proj sums in its own order:
 * the half equals the module's path to rounding, not bit for bit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "floats.h"
#include "gemv.h"
#include "norm_rope.h"
#include "ssm_step.h"
#include "vector_exp.h"

/* x [batch, width] (contiguous, fp32 or bf16) + out_proj(Mamba's step): in_w [2 d_inner, width], conv_w [d_inner,
 * d_conv], conv_b [d_inner] or NULL, x_w [rank + 2 dstate, d_inner], dt_w [d_inner, rank], dt_b [d_inner], A_log
 * [d_inner, dstate], D [d_inner], out_w [width, d_inner], all in dtype, contiguous. The conv state [slots, d_inner,
 * d_conv] and the SSM state [slots, d_inner, dstate], in dtype, each slot's contiguous and conv_stride and
 * ssm_stride elements apart: sequence b's are slot slots[b] (checked by the caller), updated in place. out [batch,
 * width]; row_ahead: gemv_part's. Returns 0, -1 for sizes beyond the kernels, -2 out of memory. */
int mamba_half(const void *x, int64_t batch, int64_t width, int dtype, const void *norm, float eps,
               const void *in_w, const void *conv_w, const void *conv_b, const void *x_w, const void *dt_w,
               const void *dt_b, const void *A_log, const void *D, const void *out_w, void *conv, int64_t conv_stride,
               int64_t d_conv, void *ssm, int64_t ssm_stride, const int64_t *slots, int64_t d_inner, int64_t dstate,
               int64_t rank, void *out, int64_t row_ahead, int threads) {
    if ((dtype != F32 && dtype != BF16) || batch < 1 || d_conv < 1 || dstate < 1) return -1;
    int64_t elem = dtype == F32 ? 4 : 2, steps_width = rank + 2 * dstate;
    int64_t widest = width > d_inner ? width : d_inner;
    /* shared: in_proj's output (x then z), the conv's, x_proj's, dt_proj's, the state update's; per thread: x
     * normalised, an fp32 copy of a GEMV's input, one channel's -exp(A), decay and state row, B and C in fp32 */
    int64_t proj_bytes = aligned(batch * 2 * d_inner * elem), inner_bytes = aligned(batch * d_inner * elem);
    int64_t steps_bytes = aligned(batch * steps_width * elem);
    int64_t shared_bytes = proj_bytes + 3 * inner_bytes + steps_bytes;
    int64_t h_bytes = aligned(batch * width * elem), wide_bytes = aligned(sizeof(float) * batch * widest);
    int64_t row_bytes = aligned(sizeof(float) * (dstate + 8));
    int64_t thread_bytes = h_bytes + wide_bytes + 3 * row_bytes + aligned(sizeof(float) * batch * 2 * dstate);
    char *memory = aligned_alloc(64, shared_bytes + threads * thread_bytes);
    if (!memory) return -2;
    char *proj = memory, *xc = proj + proj_bytes, *dt = xc + inner_bytes, *y = dt + inner_bytes;
    char *steps = y + inner_bytes;
    Share o_shares[threads]; /* out_proj's rows, claimed as they are done (claims.h) */
    shares_init(o_shares, width, 4, threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        char *h = memory + shared_bytes + t * thread_bytes;
        float *wide = (float *)(h + h_bytes), *A = (float *)((char *)wide + wide_bytes);
        float *decay = (float *)((char *)A + row_bytes), *row = (float *)((char *)decay + row_bytes);
        float *BC = (float *)((char *)row + row_bytes);
        int64_t c0, c1, ldx;
        tile_share(d_inner, t, n, &c0, &c1); /* this thread's channels, through the conv and the state update */
        rms_norm(x, batch, width, width, dtype, norm, eps, h);
        const void *in = gemv_input(h, batch, width, width, dtype, wide, &ldx);
        if (c0 < c1) {
            gemv_part(in, batch, width, ldx, dtype, in_w, NULL, F32, c0, c1, proj, 2 * d_inner, row_ahead);
            gemv_part(in, batch, width, ldx, dtype, in_w, NULL, F32, d_inner + c0, d_inner + c1, proj, 2 * d_inner,
                      row_ahead);
        }
        for (int64_t b = 0; b < batch; b++) {
            char *window = (char *)conv + slots[b] * conv_stride * elem;
            for (int64_t c = c0; c < c1; c++)
                store1(xc, b * d_inner + c,
                       conv_silu(window + c * d_conv * elem, d_conv, load1(proj, b * 2 * d_inner + c, dtype), conv_w,
                                 conv_b, c, dtype), dtype);
        }
        prefetch_share(x_w, steps_width, d_inner * elem, t, n);
#pragma omp barrier
        int64_t r0, r1;
        tile_share(steps_width, t, n, &r0, &r1);
        in = gemv_input(xc, batch, d_inner, d_inner, dtype, wide, &ldx);
        if (r0 < r1) gemv_part(in, batch, d_inner, ldx, dtype, x_w, NULL, F32, r0, r1, steps, steps_width, row_ahead);
        prefetch_share(dt_w, d_inner, rank * elem, t, n);
#pragma omp barrier
        for (int64_t b = 0; b < batch; b++) /* B and C of every sequence, in fp32 for the state rows' loop */
            for (int64_t j = 0; j < 2 * dstate; j++)
                BC[b * 2 * dstate + j] = load1(steps, b * steps_width + rank + j, dtype);
        in = gemv_input(steps, batch, rank, steps_width, dtype, wide, &ldx);
        if (c0 < c1) gemv_part(in, batch, rank, ldx, dtype, dt_w, NULL, F32, c0, c1, dt, d_inner, row_ahead);
        for (int64_t c = c0; c < c1; c++) {
            int64_t j;
            for (j = 0; j < dstate; j++) A[j] = load1(A_log, c * dstate + j, dtype);
            for (j = 0; j + 8 <= dstate; j += 8) *(v8 *)(A + j) = -exp8(*(const v8 *)(A + j));
            for (; j < dstate; j++) A[j] = -expf(A[j]);
            float bias = load1(dt_b, c, dtype), skip = load1(D, c, dtype);
            for (int64_t b = 0; b < batch; b++) {
                float delta = softplus(load1(dt, b * d_inner + c, dtype) + bias);
                for (j = 0; j + 8 <= dstate; j += 8) *(v8 *)(decay + j) = exp8(*(const v8 *)(A + j) * delta);
                for (; j < dstate; j++) decay[j] = expf(A[j] * delta);
                float xv = load1(xc, b * d_inner + c, dtype);
                char *state = (char *)ssm + (slots[b] * ssm_stride + c * dstate) * elem;
                const float *Bv = BC + 2 * b * dstate;
                float sum = update_row(state, dtype, decay, delta * xv, Bv, Bv + dstate, dstate, row) + skip * xv;
                float z = load1(proj, b * 2 * d_inner + d_inner + c, dtype);
                store1(y, b * d_inner + c, sum * silu(z), dtype);
            }
        }
        prefetch_share(out_w, width, d_inner * elem, t, n);
#pragma omp barrier
        in = gemv_input(y, batch, d_inner, d_inner, dtype, wide, &ldx);
        gemv_residual_share(in, batch, d_inner, ldx, dtype, out_w, NULL, F32, width, x, out, row_ahead, o_shares, t,
                            threads);
    }
    free(memory);
    return 0;
}
