/* A Mamba-2 layer's half of a decode block, x + out_proj(Mamba-2's step(RMSNorm(x))), in one OpenMP parallel region
 * (kernels/cpu/ops.cpp's mamba2_block; kernels/cpu_blocks.py says when it runs). Each thread normalises x itself and
 * takes runs of in_proj's rows (of z, of the conv's channels and of dt), then the conv step and SiLU of its
 * channels; after a wait, whole heads of the state update, each channel's output gated by SiLU(z); after another,
 * the gated RMSNorm of every group (each thread normalises the whole row itself) and tiles of out_proj with the
 * residual. The composed half ran three parallel regions and one more per sequence's state update, with the conv
 * step, ~12 torch ops and the norm serial between them.
 * Its roundings are the module's (ssm/mamba2.py's Mamba2.step) in x's dtype, as kernels/cpu/mamba_half.c's are; its
 * exps are glibc's where torch's are SLEEF's and the norm's mean sums in order: equal to the module's path to
 * rounding. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "floats.h"
#include "gemv.h"
#include "norm_rope.h"
#include "ssm_step.h"

/* this thread's share of rows [first, first + n) of in_proj, in 4-row tiles, into proj (rows ld apart) */
static void in_rows(const void *in, int64_t batch, int64_t width, int64_t ldx, int dtype, const void *w, int64_t first,
                    int64_t n, int t, int threads, void *proj, int64_t ld, int64_t row_ahead) {
    int64_t n0, n1;
    tile_share(n, t, threads, &n0, &n1);
    if (n0 < n1) gemv_part(in, batch, width, ldx, dtype, w, NULL, F32, first + n0, first + n1, proj, ld, row_ahead);
}

/* x [batch, width] (contiguous, fp32 or bf16) + out_proj(Mamba-2's step): in_w [d_inner + conv_dim + heads, width]
 * (z, then x, B and C, then dt), conv_w [conv_dim, d_conv], conv_b [conv_dim] or NULL, dt_bias, A_log and D [heads],
 * gate_norm [d_inner], out_w [width, d_inner], all in dtype, contiguous; d_inner = heads * head_dim and conv_dim =
 * d_inner + 2 groups dstate. The conv state [slots, conv_dim, d_conv] and the SSM state [slots, heads, head_dim,
 * dstate], in dtype, each slot's contiguous and conv_stride and ssm_stride elements apart: sequence b's are slot
 * slots[b] (checked by the caller), updated in place. out [batch, width]; row_ahead: gemv_part's. Returns 0, -1 for
 * sizes beyond the kernels, -2 out of memory. */
int mamba2_half(const void *x, int64_t batch, int64_t width, int dtype, const void *norm, float eps,
                const void *in_w, const void *conv_w, const void *conv_b, const void *dt_bias, const void *A_log,
                const void *D, const void *gate_norm, float gate_eps, const void *out_w, void *conv,
                int64_t conv_stride, int64_t d_conv, void *ssm, int64_t ssm_stride, const int64_t *slots,
                int64_t heads, int64_t head_dim, int64_t dstate, int64_t groups, void *out, int64_t row_ahead,
                int threads) {
    if ((dtype != F32 && dtype != BF16) || batch < 1 || d_conv < 1 || dstate < 1 || groups < 1 || heads % groups)
        return -1;
    int64_t elem = dtype == F32 ? 4 : 2, d_inner = heads * head_dim, conv_dim = d_inner + 2 * groups * dstate;
    int64_t in_width = d_inner + conv_dim + heads, group_width = d_inner / groups;
    int64_t widest = width > d_inner ? width : d_inner;
    /* shared: in_proj's output, the conv's, the gated state update's (fp32); per thread: x normalised, an fp32 copy
     * of a GEMV's input, the normed row, one state row and its decay, a group's B and C in fp32 */
    int64_t proj_bytes = aligned(batch * in_width * elem), act_bytes = aligned(batch * conv_dim * elem);
    int64_t gated_bytes = aligned(sizeof(float) * batch * d_inner);
    int64_t shared_bytes = proj_bytes + act_bytes + gated_bytes;
    int64_t h_bytes = aligned(batch * width * elem), wide_bytes = aligned(sizeof(float) * batch * widest);
    int64_t normed_bytes = aligned(batch * d_inner * elem), row_bytes = aligned(sizeof(float) * dstate);
    int64_t thread_bytes = h_bytes + wide_bytes + normed_bytes + 4 * row_bytes;
    char *memory = aligned_alloc(64, shared_bytes + threads * thread_bytes);
    if (!memory) return -2;
    char *proj = memory, *act = proj + proj_bytes;
    float *gated = (float *)(act + act_bytes);
    Share o_shares[threads]; /* out_proj's rows, claimed as they are done (claims.h) */
    shares_init(o_shares, width, 4, threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        char *h = memory + shared_bytes + t * thread_bytes;
        float *wide = (float *)(h + h_bytes);
        char *normed = (char *)wide + wide_bytes;
        float *row = (float *)(normed + normed_bytes), *decay = (float *)((char *)row + row_bytes);
        float *Bv = (float *)((char *)decay + row_bytes), *Cv = (float *)((char *)Bv + row_bytes);
        int64_t ldx, c0, c1;
        rms_norm(x, batch, width, width, dtype, norm, eps, h);
        const void *in = gemv_input(h, batch, width, width, dtype, wide, &ldx);
        in_rows(in, batch, width, ldx, dtype, in_w, 0, d_inner, t, n, proj, in_width, row_ahead);
        in_rows(in, batch, width, ldx, dtype, in_w, d_inner, conv_dim, t, n, proj, in_width, row_ahead);
        in_rows(in, batch, width, ldx, dtype, in_w, d_inner + conv_dim, heads, t, n, proj, in_width, row_ahead);
        tile_share(conv_dim, t, n, &c0, &c1); /* the conv channels whose in_proj rows this thread computed */
        for (int64_t b = 0; b < batch; b++) {
            char *window = (char *)conv + slots[b] * conv_stride * elem;
            for (int64_t c = c0; c < c1; c++)
                store1(act, b * conv_dim + c,
                       conv_silu(window + c * d_conv * elem, d_conv, load1(proj, b * in_width + d_inner + c, dtype),
                                 conv_w, conv_b, c, dtype), dtype);
        }
#pragma omp barrier
        int64_t h0 = heads * t / n, h1 = heads * (t + 1) / n;
        for (int64_t hd = h0; hd < h1; hd++) {
            int64_t g = hd / (heads / groups);
            float a = -expf(load1(A_log, hd, dtype)), bias = load1(dt_bias, hd, dtype), skip = load1(D, hd, dtype);
            for (int64_t b = 0; b < batch; b++) {
                float delta = softplus(load1(proj, b * in_width + d_inner + conv_dim + hd, dtype) + bias);
                float shared = expf(a * delta);
                for (int64_t j = 0; j < dstate; j++) decay[j] = shared;
                const char *bc = act + (b * conv_dim + d_inner + g * dstate) * elem; /* this group's B, C */
                for (int64_t j = 0; j < dstate; j++) {
                    Bv[j] = load1(bc, j, dtype);
                    Cv[j] = load1(bc, groups * dstate + j, dtype);
                }
                for (int64_t p = 0; p < head_dim; p++) {
                    int64_t c = hd * head_dim + p;
                    float xv = load1(act, b * conv_dim + c, dtype);
                    char *state = (char *)ssm + (slots[b] * ssm_stride + c * dstate) * elem;
                    float y = update_row(state, dtype, decay, delta * xv, Bv, Cv, dstate, row) + skip * xv;
                    gated[b * d_inner + c] = rounded(y, dtype) * silu(load1(proj, b * in_width + c, dtype));
                }
            }
        }
        prefetch_share(out_w, width, d_inner * elem, t, n);
#pragma omp barrier
        /* the gated RMSNorm over each group of channels, its mean summed in order, into this thread's row */
        for (int64_t b = 0; b < batch; b++)
            for (int64_t g = 0; g < groups; g++) {
                const float *v = gated + b * d_inner + g * group_width;
                float squares = 0.f;
                for (int64_t c = 0; c < group_width; c++) squares += v[c] * v[c];
                float scale = 1.f / sqrtf(squares / (float)group_width + gate_eps);
                for (int64_t c = 0; c < group_width; c++) {
                    int64_t i = g * group_width + c;
                    store1(normed, b * d_inner + i, load1(gate_norm, i, dtype) * rounded(v[c] * scale, dtype), dtype);
                }
            }
        in = gemv_input(normed, batch, d_inner, d_inner, dtype, wide, &ldx);
        gemv_residual_share(in, batch, d_inner, ldx, dtype, out_w, NULL, F32, width, x, out, row_ahead, o_shares, t,
                            threads);
    }
    free(memory);
    return 0;
}
