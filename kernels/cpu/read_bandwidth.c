/* The machine's memory read rate: every byte of a buffer loaded once, 64 bytes at a time, by `threads` OpenMP threads
 * each streaming its own contiguous share, the loads folded into an XOR so the compiler keeps them. This is the floor's
 * rate on a CPU (harness/roofline.py): what a decode step that only read its weights and cache could reach. */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define LANES 8 /* 8 x 8 bytes: one 64-byte cache line per step, one AVX-512 load (two AVX2 ones) */
typedef uint64_t words_v __attribute__((vector_size(8 * LANES)));

/* XOR of the lines [first, last) of p: four chains, so independent loads are in flight */
static words_v read_lines(const words_v *p, int64_t first, int64_t last) {
    words_v a = {0}, b = {0}, c = {0}, d = {0};
    int64_t i = first;
    for (; i + 4 <= last; i += 4) {
        a ^= p[i];
        b ^= p[i + 1];
        c ^= p[i + 2];
        d ^= p[i + 3];
    }
    for (; i < last; i++) a ^= p[i];
    return a ^ b ^ c ^ d;
}

static uint64_t fold(words_v v) {
    uint64_t r = 0;
    for (int l = 0; l < LANES; l++) r ^= v[l];
    return r;
}

/* XOR of every 64-byte line of buf[0, bytes); bytes a multiple of 64 * threads * 4 (the caller rounds down). */
uint64_t read_bandwidth(const void *buf, int64_t bytes, int threads) {
    uint64_t result = 0;
    int64_t lines = bytes / sizeof(words_v);
#pragma omp parallel num_threads(threads) reduction(^ : result)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        result ^= fold(read_lines((const words_v *)buf, lines * t / n, lines * (t + 1) / n));
    }
    return result;
}

/* XOR of every whole 64-byte line of count buffers (each 64-byte aligned, bytes[i] long), read one after another in
 * one parallel region, each thread its share of each buffer with no wait between them: the rate the memory a model's
 * weights lie in is read at, beside the rate a GEMV streams it (benchmarks/weight_streaming.py). */
uint64_t read_buffers(const void *const *bufs, const int64_t *bytes, int64_t count, int threads) {
    uint64_t result = 0;
#pragma omp parallel num_threads(threads) reduction(^ : result)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        words_v all = {0};
        for (int64_t b = 0; b < count; b++) {
            int64_t lines = bytes[b] / (int64_t)sizeof(words_v);
            all ^= read_lines((const words_v *)bufs[b], lines * t / n, lines * (t + 1) / n);
        }
        result ^= fold(all);
    }
    return result;
}
