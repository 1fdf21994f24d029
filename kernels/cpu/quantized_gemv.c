/* Weight-only int4 GEMV for decode-sized inputs: out[m, n] = sum_k x[m, k] W[n, k], W stored in groups of input
 * columns, two a byte, low nibble first (W = (q - 8) * scale[n, g] + zero[n, g]; kernels/quantized_matmul.py). For
 * fp32 and fp16 activations, where torch's packed CPU kernel is many times slower than its own dense GEMV (it is
 * fast for bf16 only). (int8 layers take dense_gemv.c's int8_gemv, which shares the dense GEMV's tiles.)
 * Each weight byte is read once from memory for all rows of x, in its stored bits; arithmetic is fp32. Threads split
 * the output channels, ROWS at a time, so one load of x feeds ROWS independent sums. GCC vector types keep the sums in
 * registers 16 lanes wide on any target (one AVX-512 register, two AVX2 ones); they are scaled per group as vectors
 * and reduced once per channel. */
#include <stdlib.h>
#include <string.h>
#include "floats.h"

#define LANES 16
#define ROWS 4
typedef float floats_v __attribute__((vector_size(4 * LANES)));
typedef uint8_t uint8_v __attribute__((vector_size(LANES)));
typedef int32_t int32_v __attribute__((vector_size(4 * LANES)));

/* bytes to floats through int32: GCC 12 turns a direct byte-to-float conversion into 16 scalar ones */
#define TO_FLOATS(bytes) __builtin_convertvector(__builtin_convertvector(bytes, int32_v), floats_v)

static inline floats_v load_floats(const float *p) {
    floats_v v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum_lanes(floats_v v) {
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* int4: channels' packed bytes q[0..ROWS-1] against x's even columns xe and odd columns xo; each group's vector sums
 * scaled by that channel's scale (scale_at(r, g)). The zeros' share is the caller's. */
static void dot_int4(const uint8_t *const *q, const float *xe, const float *xo, int64_t groups, int64_t half,
                     const void *scales, const int64_t *channel, int s_dtype, float *out) {
    floats_v acc[ROWS] = {0};
    for (int64_t g = 0; g < groups; g++) {
        floats_v part[ROWS] = {0};
        for (int64_t j = g * half; j < (g + 1) * half; j += LANES) {
            floats_v even = load_floats(xe + j), odd = load_floats(xo + j);
            for (int r = 0; r < ROWS; r++) {
                uint8_v b;
                memcpy(&b, q[r] + j, sizeof b);
                part[r] += TO_FLOATS(b & 15) * even + TO_FLOATS(b >> 4) * odd;
            }
        }
        for (int r = 0; r < ROWS; r++) acc[r] += load1(scales, channel[r] * groups + g, s_dtype) * part[r];
    }
    for (int r = 0; r < ROWS; r++) out[r] = sum_lanes(acc[r]);
}

/* x [m, k] (row stride ldx, x_dtype), out [m, n] (row stride ldo, x_dtype); scales and zeros (s_dtype) [n, k / group],
 * contiguous. Returns 0, -1 for sizes the kernel does not take, -2 out of memory. */
int quantized_gemv(const void *x, int64_t m, int64_t k, int64_t ldx, int x_dtype, const void *weight, int64_t n,
                   int64_t group, const void *scales, const void *zeros, int s_dtype, void *out, int64_t ldo,
                   int threads) {
    if (k % LANES || group <= 0 || group % (2 * LANES) || k % group) return -1;
    int64_t groups = k / group, row_bytes = k / 2;
    /* x in fp32 (even columns, then odd ones, as the nibbles pair them) and the sum of each group, which the zeros
     * multiply */
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * groups));
    if (!xf) return -2;
    float *xsum = xf + m * k;
    for (int64_t r = 0; r < m; r++) {
        float *row = xf + r * k;
        for (int64_t i = 0; i < k; i++) row[(i & 1) * (k / 2) + i / 2] = load1(x, r * ldx + i, x_dtype);
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            for (int64_t i = g * (k / groups); i < (g + 1) * (k / groups); i++) s += load1(x, r * ldx + i, x_dtype);
            xsum[r * groups + g] = s;
        }
    }
    int64_t tiles = (n + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t channel[ROWS];
        const void *rows[ROWS];
        for (int r = 0; r < ROWS; r++) { /* a partial last tile repeats its last channel: in bounds, result dropped */
            channel[r] = t * ROWS + r < n ? t * ROWS + r : n - 1;
            rows[r] = (const uint8_t *)weight + channel[r] * row_bytes;
        }
        int count = n - t * ROWS < ROWS ? (int)(n - t * ROWS) : ROWS;
        float dots[ROWS];
        for (int64_t r = 0; r < m; r++) {
            const float *xr = xf + r * k;
            dot_int4((const uint8_t *const *)rows, xr, xr + k / 2, groups, group / 2, scales, channel, s_dtype, dots);
            for (int c = 0; c < count; c++) {
                float y = dots[c]; /* (q - 8) s + z = q s + (z - 8 s): the zeros' share is sum_g (z - 8 s) sum(x_g) */
                for (int64_t g = 0; g < groups; g++) {
                    int64_t at = channel[c] * groups + g;
                    y += (load1(zeros, at, s_dtype) - 8.f * load1(scales, at, s_dtype)) * xsum[r * groups + g];
                }
                store1(out, r * ldo + channel[c], y, x_dtype);
            }
        }
    }
    free(xf);
    return 0;
}
