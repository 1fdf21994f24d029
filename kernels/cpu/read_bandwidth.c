/* The machine's memory read rate: every byte of a buffer loaded once, 64 bytes at a time, by `threads` OpenMP threads
 * each streaming its own contiguous share, the loads folded into an XOR so the compiler keeps them. This is the floor's
 * rate on a CPU (harness/roofline.py): what a decode step that only read its weights and cache could reach. */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define LANES 8 /* 8 x 8 bytes: one 64-byte cache line per step, one AVX-512 load (two AVX2 ones) */
typedef uint64_t words_v __attribute__((vector_size(8 * LANES)));

/* XOR of every 64-byte line of buf[0, bytes); bytes a multiple of 64 * threads * 4 (the caller rounds down). */
uint64_t read_bandwidth(const void *buf, int64_t bytes, int threads) {
    uint64_t result = 0;
    int64_t lines = bytes / sizeof(words_v);
#pragma omp parallel num_threads(threads) reduction(^ : result)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t first = lines * t / n, last = lines * (t + 1) / n;
        const words_v *p = (const words_v *)buf;
        words_v a = {0}, b = {0}, c = {0}, d = {0}; /* four chains: independent loads in flight */
        int64_t i = first;
        for (; i + 4 <= last; i += 4) {
            a ^= p[i];
            b ^= p[i + 1];
            c ^= p[i + 2];
            d ^= p[i + 3];
        }
        for (; i < last; i++) a ^= p[i];
        words_v all = a ^ b ^ c ^ d;
        for (int l = 0; l < LANES; l++) result ^= all[l];
    }
    return result;
}
