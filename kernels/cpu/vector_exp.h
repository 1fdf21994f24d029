/* exp on 8 fp32 lanes for the CPU kernels beside this file (Mamba's scan and state update), with GCC vector types:
 * no libm call per element, which kept their decay loops scalar. */
#ifndef ARCHZOO_VECTOR_EXP_H
#define ARCHZOO_VECTOR_EXP_H
#include <stdint.h>

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
#endif
