/* One Mamba decode step on CPU, in place: the selective-scan recurrence advanced by one token per row.
 * Semantics of kernels/selective_state_update.py (mamba-ssm's selective_state_update), Mamba-2 layout; Mamba-1 is
 * one head and one group:
 *   dt <- softplus(dt + dt_bias);  state <- state * exp(A * dt) + dt * B * x;  y <- sum_n(state * C) + D * x,
 *   then y * silu(z).
 * Every input is fp32 with any strides (0 included: Mamba-2 passes per-head dt, A, D as broadcast views); the state
 * is fp32, bf16 or fp16 and is read and written once, which is what a decode step must cost. y is fp32 [B, H, P].
 * Returns 0, or -1 for sizes beyond its buffers. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "floats.h"
#include "vector_exp.h"

#define MAX_STATE 1024 /* d_state per channel (mamba-ssm's largest is 256) */

/* one channel's state row, fp32 and contiguous, as are B and C (the engine's layout): a loop the compiler
 * vectorizes, where the general one's per-element dtype and strides kept it scalar (a `small` Mamba-2 layer's update
 * took ~200 µs for its 256 KiB of state, 2-core EPYC) */
static float update_row(float *restrict state, const float *restrict decay, float dx, const float *restrict Bv,
                        const float *restrict Cv, int dstate) {
    float y = 0.0f;
    for (int n = 0; n < dstate; n++) {
        float s = state[n] * decay[n] + dx * Bv[n];
        state[n] = s;
        y += s * Cv[n];
    }
    return y;
}

/* strides: s* state [B,H,P,N]; x*, dt*, z* [B,H,P]; a* A [H,P,N]; b*, c* B and C [B,G,N]; d*, db* D, dt_bias [H,P].
 * dt_bias, D and z may be NULL. */
int selective_state_update(void *state, int64_t s_b, int64_t s_h, int64_t s_p, int64_t s_n, int state_dtype,
                            const float *x, int64_t x_b, int64_t x_h, int64_t x_p,
                            const float *dt, int64_t dt_b, int64_t dt_h, int64_t dt_p,
                            const float *dt_bias, int64_t db_h, int64_t db_p,
                            const float *A, int64_t a_h, int64_t a_p, int64_t a_n,
                            const float *Bm, int64_t b_b, int64_t b_g, int64_t b_n,
                            const float *Cm, int64_t c_b, int64_t c_g, int64_t c_n,
                            const float *D, int64_t d_h, int64_t d_p,
                            const float *z, int64_t z_b, int64_t z_h, int64_t z_p,
                            float *out, int batch, int heads, int head_dim, int dstate, int groups, int softplus,
                            int threads) {
    if (dstate > MAX_STATE || groups < 1 || heads % groups) return -1;
    int heads_per_group = heads / groups;
    /* Mamba-2's dt, dt_bias and A are one number per head (stride 0 across its channels): a thread then computes a
     * head's delta and decay once, not once per channel (its softplus and exp were most of the step) */
    int per_channel = dt_p != 0 || (dt_bias && db_p != 0) || a_p != 0;
    /* one task per (sequence, head, channel): Mamba-1 has a single head of d_inner channels */
#pragma omp parallel num_threads(threads)
    {
        int64_t cached = -1; /* the (sequence, head) whose delta and decay this thread holds */
        float delta = 0.0f, decay[MAX_STATE];
#pragma omp for schedule(static)
        for (int64_t row = 0; row < (int64_t)batch * heads * head_dim; row++) {
            int p = (int)(row % head_dim), h = (int)(row / head_dim % heads), b = (int)(row / head_dim / heads);
            int g = h / heads_per_group;
            const float *Bv = Bm + b * b_b + g * b_g, *Cv = Cm + b * c_b + g * c_g, *a = A + h * a_h + p * a_p;
            if (per_channel || row / head_dim != cached) {
                delta = dt[b * dt_b + h * dt_h + p * dt_p] + (dt_bias ? dt_bias[h * db_h + p * db_p] : 0.0f);
                if (softplus) delta = delta > 20.0f ? delta : log1pf(expf(delta));
                if (a_n == 0) { /* Mamba-2: A is one number per head */
                    float shared = expf(a[0] * delta);
                    for (int n = 0; n < dstate; n++) decay[n] = shared;
                } else { /* Mamba-1: one exp per state element, 8 lanes at a time along a contiguous row of A */
                    int n = 0;
                    if (a_n == 1)
                        for (; n + 8 <= dstate; n += 8) *(v8 *)(decay + n) = exp8(*(const v8 *)(a + n) * delta);
                    for (; n < dstate; n++) decay[n] = expf(a[n * a_n] * delta);
                }
                cached = row / head_dim;
            }
            float xv = x[b * x_b + h * x_h + p * x_p], dx = delta * xv, y = 0.0f;
            int64_t base = b * s_b + h * s_h + p * s_p;
            if (state_dtype == F32 && s_n == 1 && b_n == 1 && c_n == 1) {
                y = update_row((float *)state + base, decay, dx, Bv, Cv, dstate);
            } else {
                for (int n = 0; n < dstate; n++) {
                    float s = load1(state, base + n * s_n, state_dtype) * decay[n] + dx * Bv[n * b_n];
                    store1(state, base + n * s_n, s, state_dtype);
                    y += s * Cv[n * c_n];
                }
            }
            if (D) y += D[h * d_h + p * d_p] * xv;
            if (z) {
                float zv = z[b * z_b + h * z_h + p * z_p];
                y *= zv / (1.0f + expf(-zv));
            }
            out[(b * heads + h) * head_dim + p] = y;
        }
    }
    return 0;
}
