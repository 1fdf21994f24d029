/* Mamba's selective scan over a whole prompt on CPU, for inference (no per-step states kept for a backward):
 *   h_t = exp(dt_t * A) * h_{t-1} + dtx_t * B_t,   y_t = sum_n h_t * C_t       (ssm/scan.py's scan_forward)
 * One task per (sequence, 8 channels): the 8 channels' states stay in L1 across all T steps, and each step is
 * vector arithmetic across those channels, so a prompt costs one pass over its inputs, not ~5 tensor ops per token.
 * Inputs fp32 and contiguous: dt, dtx, y [batch, T, channels]; A [channels, dstate]; B, C [batch, T, dstate];
 * state [batch, channels, dstate] is read as h_{-1} and overwritten with h_{T-1}. channels must be a multiple of 8.
 * Returns 0, or -1 for sizes it does not take. */
#include <stdint.h>

#define LANES 8
#define MAX_STATE 1024

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* lanes of a where mask (-1) is set, of b elsewhere: C has no ?: on vectors */
static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* exp on 8 lanes: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by the degree-6 Taylor-like polynomial of the Cephes
 * library's expf (relative error ~2e-7 over the range), and 2^k built in the exponent bits. Arguments are clamped to
 * the finite fp32 range (exp(-87.3) ~ 1e-38 stands in for anything smaller: a decay that has already vanished). */
static inline v8 exp8(v8 x) {
    x = select8(x < splat(88.3f), x, splat(88.3f));
    x = select8(x > splat(-87.3f), x, splat(-87.3f));
    v8 scaled = x * 1.44269504f;
    v8 half = select8(scaled < splat(0.0f), splat(-0.5f), splat(0.5f));
    v8i k = __builtin_convertvector(scaled + half, v8i); /* round half away from zero */
    v8 kf = __builtin_convertvector(k, v8);
    v8 r = x - kf * 0.693359375f - kf * -2.12194440e-4f; /* ln2 in two parts: r keeps its low bits */
    v8 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((k + 127) << 23);
}

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
