/* Mamba's selective scan on CPU: the forward over a whole prompt, and its backward for training:
 *   h_t = exp(dt_t * A) * h_{t-1} + dtx_t * B_t,   y_t = sum_n h_t * C_t       (ssm/scan.py's scan_forward)
 * One task per (sequence, 8 channels): the 8 channels' states stay in L1 across all T steps, and each step is
 * vector arithmetic across those channels, so a prompt costs one pass over its inputs, not ~5 tensor ops per token.
 * Inputs fp32 and contiguous: dt, dtx, y [batch, T, channels]; A [channels, dstate]; B, C [batch, T, dstate];
 * state [batch, channels, dstate] is read as h_{-1} and overwritten with h_{T-1}. channels must be a multiple of 8.
 * Returns 0, or -1 for sizes it does not take. */
#include <stdint.h>
#include <stdlib.h>

#include "vector_exp.h"

#define LANES 8 /* exp8's */
#define MAX_STATE 1024

int selective_scan(const float *dt, const float *dtx, const float *A, const float *B, const float *C, float *state,
                   float *y, int batch, int length, int channels, int dstate, int threads) {
    if (channels % LANES || dstate > MAX_STATE || dstate < 1) return -1;
    int groups = channels / LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < (int64_t)batch * groups; task++) {
        int b = (int)(task / groups), c0 = (int)(task % groups) * LANES;
        v8 h[MAX_STATE], a[MAX_STATE]; /* [n][lane]: the 8 channels' state and A, transposed so a step is per n */
        float *s = state + ((int64_t)b * channels + c0) * dstate;
        for (int n = 0; n < dstate; n++)
            for (int lane = 0; lane < LANES; lane++) {
                h[n][lane] = s[(int64_t)lane * dstate + n];
                a[n][lane] = A[(int64_t)(c0 + lane) * dstate + n];
            }
        for (int t = 0; t < length; t++) {
            int64_t row = ((int64_t)b * length + t) * channels + c0, bc = ((int64_t)b * length + t) * dstate;
            v8 step = *(const v8 *)(dt + row), input = *(const v8 *)(dtx + row), out = splat(0.0f);
            for (int n = 0; n < dstate; n++) {
                h[n] = exp8(step * a[n]) * h[n] + input * B[bc + n];
                out += h[n] * C[bc + n];
            }
            *(v8 *)(y + row) = out;
        }
        for (int n = 0; n < dstate; n++)
            for (int lane = 0; lane < LANES; lane++) s[(int64_t)lane * dstate + n] = h[n][lane];
    }
    return 0;
}

/* The gradients of selective_scan, given dL/dy [batch, T, channels] and dL/dh_{T-1} [batch, channels, dstate]
 * (ssm/scan.py's SelectiveScan.backward, the reference). Each (sequence, 8 channels) task first replays its
 * forward to keep every state h_t and decay in a private buffer (2 T * dstate * 8 floats), then walks back in time:
 *   dL/dh_t = carry + gy_t C_t;   g_dtx_t = sum_n dL/dh_t B_t;   g_B_t += dL/dh_t dtx_t;   g_C_t += h_t gy_t
 *   p = dL/dh_t * h_{t-1} * exp(dt_t A);   g_A += p dt_t;   g_dt_t = sum_n p A;   carry = dL/dh_t * exp(dt_t A).
 * B and C are shared by all channels, so each task writes its own partial g_B, g_C [batch, groups, T, dstate]
 * and g_A [batch, channels, dstate] (summed by the caller); g_h0 [batch, channels, dstate] is dL/dh_{-1}.
 * grad_last may be NULL (no gradient on the final state). Returns 0, -1 for sizes it does not take, -2 out of memory. */
int selective_scan_backward(const float *dt, const float *dtx, const float *A, const float *B, const float *C,
                            const float *h0, const float *grad_y, const float *grad_last, float *g_dt, float *g_dtx,
                            float *g_A, float *g_B, float *g_C, float *g_h0, int batch, int length, int channels,
                            int dstate, int threads) {
    if (channels % LANES || dstate > MAX_STATE || dstate < 1) return -1;
    int groups = channels / LANES, failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < (int64_t)batch * groups; task++) {
        int b = (int)(task / groups), group = (int)(task % groups), c0 = group * LANES;
        /* hs[(t + 1) * dstate + n] = h_t (hs[n] = h_{-1}), then decays[t * dstate + n] = exp(dt_t A): kept, not recomputed */
        v8 *hs = malloc(sizeof(v8) * (2 * (int64_t)length + 1) * dstate), *decays = hs + ((int64_t)length + 1) * dstate;
        if (!hs) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        v8 a[MAX_STATE], carry[MAX_STATE], ga[MAX_STATE];
        const float *s0 = h0 + ((int64_t)b * channels + c0) * dstate;
        for (int n = 0; n < dstate; n++)
            for (int lane = 0; lane < LANES; lane++) {
                hs[n][lane] = s0[(int64_t)lane * dstate + n];
                a[n][lane] = A[(int64_t)(c0 + lane) * dstate + n];
                carry[n][lane] = grad_last ? grad_last[((int64_t)b * channels + c0 + lane) * dstate + n] : 0.0f;
                ga[n][lane] = 0.0f;
            }
        for (int t = 0; t < length; t++) { /* replay the forward, keeping every state */
            int64_t row = ((int64_t)b * length + t) * channels + c0, bc = ((int64_t)b * length + t) * dstate;
            v8 step = *(const v8 *)(dt + row), input = *(const v8 *)(dtx + row);
            const v8 *previous = hs + (int64_t)t * dstate;
            v8 *h = hs + (int64_t)(t + 1) * dstate;
            v8 *decay = decays + (int64_t)t * dstate;
            for (int n = 0; n < dstate; n++) {
                decay[n] = exp8(step * a[n]);
                h[n] = decay[n] * previous[n] + input * B[bc + n];
            }
        }
        for (int t = length - 1; t >= 0; t--) {
            int64_t row = ((int64_t)b * length + t) * channels + c0, bc = ((int64_t)b * length + t) * dstate;
            int64_t partial = (((int64_t)b * groups + group) * length + t) * dstate;
            v8 step = *(const v8 *)(dt + row), input = *(const v8 *)(dtx + row), gy = *(const v8 *)(grad_y + row);
            const v8 *h = hs + (int64_t)(t + 1) * dstate, *previous = hs + (int64_t)t * dstate;
            const v8 *decays_t = decays + (int64_t)t * dstate;
            v8 grad_input = splat(0.0f), grad_step = splat(0.0f);
            for (int n = 0; n < dstate; n++) {
                v8 decay = decays_t[n];
                v8 grad_h = carry[n] + gy * C[bc + n];
                v8 gc = h[n] * gy, gb = grad_h * input;
                float sum_c = 0.0f, sum_b = 0.0f;
                for (int lane = 0; lane < LANES; lane++) {
                    sum_c += gc[lane];
                    sum_b += gb[lane];
                }
                g_C[partial + n] = sum_c;
                g_B[partial + n] = sum_b;
                grad_input += grad_h * B[bc + n];
                v8 p = grad_h * previous[n] * decay;
                ga[n] += p * step;
                grad_step += p * a[n];
                carry[n] = grad_h * decay;
            }
            *(v8 *)(g_dtx + row) = grad_input;
            *(v8 *)(g_dt + row) = grad_step;
        }
        float *gh0 = g_h0 + ((int64_t)b * channels + c0) * dstate, *gA = g_A + ((int64_t)b * channels + c0) * dstate;
        for (int n = 0; n < dstate; n++)
            for (int lane = 0; lane < LANES; lane++) {
                gh0[(int64_t)lane * dstate + n] = carry[n][lane];
                gA[(int64_t)lane * dstate + n] = ga[n][lane];
            }
        free(hs);
    }
    return failed ? -2 : 0;
}
