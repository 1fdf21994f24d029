/* The parts of a Mamba or Mamba-2 decode step that kernels/cpu/mamba_half.c and mamba2_half.c share: a GEMV's
 * input as the GEMV reads it, the conv step, softplus and SiLU, one state row's update. */
#ifndef ARCHZOO_SSM_STEP_H
#define ARCHZOO_SSM_STEP_H
#include <math.h>
#include <stdint.h>

#include "floats.h"
#include "gemv.h"

static inline float silu(float v) { return v / (1.f + expf(-v)); }

/* softplus as mamba-ssm's step takes it: the identity above 20 */
static inline float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }

/* src [rows, cols] (rows ld apart) for gemv_part: itself, or its fp32 copy in wide (rows cols apart) where the GEMV
 * reads fp32 (bf16 without AVX512-BF16); *ldx is set to the row stride of what is returned */
static inline const void *gemv_input(const void *src, int64_t rows, int64_t cols, int64_t ld, int dtype,
                                     float *wide, int64_t *ldx) {
    if (!gemv_widens(dtype, 0)) {
        *ldx = ld;
        return src;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) wide[r * cols + c] = load1(src, r * ld + c, dtype);
    *ldx = cols;
    return wide;
}

/* v rounded to dtype and back: what an op computing in dtype stores */
static inline float rounded(float v, int dtype) {
    if (dtype == F32) return v;
    uint16_t bits;
    store1(&bits, 0, v, dtype);
    return load1(&bits, 0, dtype);
}

/* one state row (dstate elements in dtype) advanced in place, state * decay + dx * B; returns sum(state * C) (B
 * and C fp32). fp32 rows in place, in a loop the compiler vectorizes; bf16 ones through the fp32 row `wide` */
static inline float update_row(void *state, int dtype, const float *restrict decay, float dx,
                               const float *restrict Bv, const float *restrict Cv, int64_t dstate,
                               float *restrict wide) {
    float *restrict s = dtype == F32 ? (float *)state : wide, y = 0.f;
    if (dtype != F32)
        for (int64_t j = 0; j < dstate; j++) s[j] = load1(state, j, dtype);
    for (int64_t j = 0; j < dstate; j++) {
        s[j] = s[j] * decay[j] + dx * Bv[j];
        y += s[j] * Cv[j];
    }
    if (dtype != F32)
        for (int64_t j = 0; j < dstate; j++) store1(state, j, s[j], dtype);
    return y;
}

/* channel c's conv window in `window` (d_conv elements) shifted by one with v at its end; returns SiLU(window . taps
 * + bias) rounded to dtype, each product and the sum and the bias's add rounded as the module's ops in dtype round */
static inline float conv_silu(void *window, int64_t d_conv, float v, const void *taps, const void *bias, int64_t c,
                              int dtype) {
    float sum = 0.f;
    for (int64_t j = 0; j < d_conv; j++) {
        float w = j + 1 < d_conv ? load1(window, j + 1, dtype) : v;
        store1(window, j, w, dtype);
        sum += rounded(w * load1(taps, c * d_conv + j, dtype), dtype);
    }
    float mixed = rounded(sum, dtype);
    if (bias) mixed = rounded(mixed + load1(bias, c, dtype), dtype);
    return rounded(silu(mixed), dtype);
}

#endif
