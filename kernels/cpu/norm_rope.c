/* The decode step's two small per-layer ops as plain loops (kernels/cpu_fused.py): RMSNorm and rotary position
 * embedding. Each replaces 7-12 torch ops (~25-70 µs a call eagerly on a 2-core CPU) with one call of a few µs, and
 * keeps torch's rounding steps, so an fp32 or bf16 result differs from the torch composition only in the sum order of
 * the mean and in the last bit of a cosine. fp32 arithmetic throughout; x, weight and out share one dtype (F32, BF16).
 * ISO C mode (-std=c11) keeps a * b + c as two roundings, as torch's separate mul and add are. */
#include <math.h>
#include "floats.h"
#include "norm_rope.h"

/* as torch rounds a result to dtype between two ops */
static inline float rounded(float x, int dtype) {
    if (dtype != BF16) return x;
    uint16_t h;
    store1(&h, 0, x, BF16);
    return load1(&h, 0, BF16);
}

/* out[r] = weight * dtype(x[r] / sqrt(mean(x[r]^2) + eps)): attention/norm.py's RMSNorm (HF Llama's, normalised in
 * fp32 and cast back before the gain). x rows ldx elements apart (unit column stride); out [rows, dim] contiguous. */
int rms_norm(const void *x, int64_t rows, int64_t dim, int64_t ldx, int dtype, const void *weight, float eps,
             void *out) {
    if (dtype != F32 && dtype != BF16) return -1;
    int64_t width = dtype == F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * ldx * width;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float v = load1(row, i, dtype);
            sum += v * v;
        }
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        char *o = (char *)out + r * dim * width;
        for (int64_t i = 0; i < dim; i++) {
            float normed = rounded(load1(row, i, dtype) * scale, dtype);
            store1(o, i, load1(weight, i, dtype) * normed, dtype);
        }
    }
    return 0;
}

/* out = x * cos + rotate_half(x) * sin (attention/rope.py, HF Llama's rotate-half layout) for x [B, H, T, D] at any
 * strides (sb, sh, st; unit column stride), positions [B, T] int64 at strides (pb, pt), inv_freq [D / 2] fp32.
 * Angles are fp32 position x frequency products, and cos and sin are rounded to dtype before use, as torch's are.
 * out [B, H, T, D] contiguous. */
void rotary_angles(float position, const float *inv_freq, int64_t half, int dtype, float *cosines, float *sines) {
    for (int64_t i = 0; i < half; i++) {
        float angle = position * inv_freq[i];
        cosines[i] = rounded(cosf(angle), dtype);
        sines[i] = rounded(sinf(angle), dtype);
    }
}

void rotary_row(const void *in, void *out, const float *cosines, const float *sines, int64_t half, int dtype) {
    for (int64_t i = 0; i < half; i++) {
        float first = load1(in, i, dtype), second = load1(in, i + half, dtype);
        float c = cosines[i], s = sines[i];
        store1(out, i, rounded(first * c, dtype) + rounded(-second * s, dtype), dtype);
        store1(out, i + half, rounded(second * c, dtype) + rounded(first * s, dtype), dtype);
    }
}

int rotary(const void *x, int64_t batch, int64_t heads, int64_t seq, int64_t dim, int64_t sb, int64_t sh, int64_t st,
           const int64_t *positions, int64_t pb, int64_t pt, const float *inv_freq, int dtype, void *out) {
    if ((dtype != F32 && dtype != BF16) || dim % 2 || dim / 2 > MAX_HALF) return -1;
    int64_t half = dim / 2, width = dtype == F32 ? 4 : 2;
    float cosines[MAX_HALF], sines[MAX_HALF];
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t t = 0; t < seq; t++) {
            rotary_angles((float)positions[b * pb + t * pt], inv_freq, half, dtype, cosines, sines);
            for (int64_t h = 0; h < heads; h++)
                rotary_row((const char *)x + (b * sb + h * sh + t * st) * width,
                           (char *)out + (((b * heads + h) * seq + t) * dim) * width, cosines, sines, half, dtype);
        }
    }
    return 0;
}
