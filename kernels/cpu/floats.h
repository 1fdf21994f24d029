/* fp32 / bf16 / fp16 elements as fp32, for the CPU kernels beside this file (fp32 arithmetic throughout). */
#ifndef ARCHZOO_FLOATS_H
#define ARCHZOO_FLOATS_H
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float load1(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return (float)((const _Float16 *)p)[i];
}

static inline void store1(void *p, int64_t i, float x, int dtype) {
    if (dtype == F32) {
        ((float *)p)[i] = x;
    } else if (dtype == BF16) {
        uint32_t bits;
        memcpy(&bits, &x, 4);
        bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even, as torch does */
        ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
    } else {
        ((_Float16 *)p)[i] = (_Float16)x;
    }
}
#endif
