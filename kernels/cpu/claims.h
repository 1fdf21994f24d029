/* A GEMV's rows (or a half's units of work) handed out as they are done, for the kernels that split work among the
 * threads of a parallel region of their own. Each thread starts on its own share, split as tile_share splits rows,
 * and takes CLAIM_BYTES of it at a time from the front; a thread whose share is done takes pieces from the back of
 * another's. So a thread streams its own stretch of W in address order, as a fixed split would, and the threads end
 * together: with a fixed split, whichever thread the memory served slower kept the other waiting at the next
 * barrier. On the 2-core Xeon (`small` gqa, batch 1) the barrier waits fell from ~9.5% to ~2.7% of perf's samples;
 * the step moved 0-2% (the memory, not the idle thread, bounds it there). Which thread computes a row changes
 * nothing in its sums. */
#ifndef ARCHZOO_CLAIMS_H
#define ARCHZOO_CLAIMS_H
#include <stdatomic.h>
#include <stdint.h>

/* a thread's share [front, back) of the items, the two ends packed in one word (front low) so one compare-and-swap
 * claims from either end; alone on its cache line */
typedef struct {
    _Alignas(64) _Atomic uint64_t ends;
} Share;

#define CLAIM_BYTES 32768 /* ~1 µs of one core's stream: a claim a microsecond, and the threads end within one */

static inline uint64_t pack_ends(int64_t front, int64_t back) { return (uint64_t)front | (uint64_t)back << 32; }

/* shares[0..threads) over items [0, total) in granules (4: tile_share's whole 4-row tiles; 1: units), as tile_share
 * splits rows; called before the parallel region that claims them */
static inline void shares_init(Share *shares, int64_t total, int64_t granule, int threads) {
    int64_t granules = (total + granule - 1) / granule;
    for (int t = 0; t < threads; t++) {
        int64_t front = granule * (granules * t / threads), back = granule * (granules * (t + 1) / threads);
        atomic_store_explicit(&shares[t].ends, pack_ends(front, back < total ? back : total), memory_order_relaxed);
    }
}

/* items a claim takes: about CLAIM_BYTES of rows item_bytes long, whole granules, at least one */
static inline int64_t claim_items(int64_t item_bytes, int64_t granule) {
    int64_t items = CLAIM_BYTES / (item_bytes > 0 ? item_bytes : 1) / granule * granule;
    return items > granule ? items : granule;
}

/* one claim of up to `size` items (whole granules) from the front of `share` (from_back 0) or its back; 0 if empty */
static inline int claim_from(Share *share, int from_back, int64_t size, int64_t granule, int64_t *a, int64_t *b) {
    uint64_t ends = atomic_load_explicit(&share->ends, memory_order_relaxed);
    for (;;) {
        int64_t front = (int64_t)(ends & 0xffffffffu), back = (int64_t)(ends >> 32);
        if (front >= back) return 0;
        int64_t lo = front, hi = back;
        if (from_back) { /* back may end off a granule (the last share ends at total): start on one */
            lo = ((back - 1) / granule + 1) * granule - size;
            lo = lo > front ? lo : front;
        } else {
            hi = front + size < back ? front + size : back;
        }
        uint64_t next = from_back ? pack_ends(front, lo) : pack_ends(hi, back);
        if (atomic_compare_exchange_weak_explicit(&share->ends, &ends, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *a = lo, *b = hi;
            return 1;
        }
    }
}

/* thread t's next claim [*a, *b): its own share's front, then the backs of the others' in turn; 0 when none is left.
 * The barrier after the work makes every thread's outputs seen. */
static inline int claim(Share *shares, int t, int threads, int64_t size, int64_t granule, int64_t *a, int64_t *b) {
    if (claim_from(&shares[t], 0, size, granule, a, b)) return 1;
    for (int i = 1; i < threads; i++)
        if (claim_from(&shares[(t + i) % threads], 1, size, granule, a, b)) return 1;
    return 0;
}
#endif
