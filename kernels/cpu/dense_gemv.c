/* Dense GEMV / small GEMM for decode: out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]), with x, W, bias and out all fp32
 * or all bf16 (kernels/linear.py's Linear at decode-sized batches); and the same over an int8 W stored per output
 * channel, W = q * scale[n] (int8_gemv: kernels/quantized_matmul.py's int8 layers, x fp32, bf16 or fp16). Arithmetic
 * is fp32 throughout.
 * Layout: W [n, k] contiguous, x rows ldx elements apart (unit column stride), out rows ldo apart, bias [n] or NULL.
 * Threads split the output channels into contiguous ranges of ROWS-channel tiles (OpenMP's static schedule), so each
 * streams its own stretch of W from memory once, for every row of x (up to MAX_M of them; more take further passes).
 * A tile walks K in blocks of BLOCK_BYTES a row (of x or W, the wider): ROWS weight rows and MAX_M x rows stay in L1
 * while XROWS x rows at a time run over them, so one load of W feeds XROWS sums and one load of x feeds ROWS; between
 * blocks the sums wait in a [MAX_M][ROWS] array of vectors. A step takes one 64-byte line of each weight row and
 * prefetches into L2 the same line of the tile PREFETCH_BYTES or more on: a fixed distance ahead in the thread's
 * stretch of W, whatever the row length. Prefetching a fixed 512 bytes ahead within each row ran off the end of the
 * short rows of decode models (a bf16 row of 768 is 1.5 KiB) and streamed 20-25% slower (22.7 against 28.5 GB/s,
 * bf16, batch 1, `base` gqa's weights, 2-core Xeon); prefetching into L1 the next tile's rows, 3 KiB ahead for int8
 * rows of 768, streamed int8 at 18.6-19.8 GB/s against 26.4-28.4 into L2 32 KiB ahead (fp32 and bf16 within noise:
 * 26-28 and 24-26 GB/s either way; same run, those weights). One row of x (fp32 or bf16) walks the four weight
 * rows of a block one after another rather than a line of each in turn: on a 2-core EPYC (Zen 4), those weights,
 * alternating in one process, that streamed bf16 at 23.5-24.5 against 22.3-23.6 GB/s and fp32 at 25.2-32.4 against
 * 24.3-29.9 (one of six the other way); at two rows it lost in fp32 (22.6-25.7 against 24.8-30.4), at 16 by half,
 * and int8 at one row (12.1 against 17.1 GB/s), whose four vectors a line then make one chain of dependent adds.
 * One row of x walks each weight row whole rather than BLOCK_BYTES at a time, so a thread's stretch of W is read in
 * address order, and prefetches MEMORY_ROW_AHEAD bytes ahead of the line it reads (a tile or more ahead overshot): from
 * 2 MiB pages (where an engine puts the weights, kernels/cpu_memory.py), `base` gqa's layers called in turn from C,
 * one process, eight rounds, fp32 27.1-28.7 against 25.9-27.0 GB/s (read kernel 31.5-32.5) and 38.3-41.2 against
 * 29.6-31.8 (read 47.7-48.6), bf16 30.5-38.1 against 25.8-31.1; from 4 KiB pages fp32 25.5-27.7 against 23.5-24.7,
 * bf16 24.5-26.2 against 23.7-25.8 (1 and 4 KiB ahead: no better; none: 19.5-35.4, less in most rounds). Before,
 * bf16 alone walked whole rows (24.9-26.8 against 23.3-24.4 GB/s in blocks) and fp32 saw no difference either way.
 * And it runs row after row (rows_in_order), not in 4-row tiles handed out by OpenMP's loop: same sums, and from
 * 2 MiB pages, fp32, eight rounds, 43-49 against 35-43 GB/s where the read kernel reads 44-50, 31-32 against 29-31
 * where it reads 32-33 (a plain row-by-row loop written apart reached the same).
 * Two rows of x walk W the same way (two_rows_in_order), each weight vector loaded once for both: the tiles' sums in
 * their order, 3-6.5% faster steps at batch 2 where the weights sit in the L3 (in one process, twelve rounds:
 * `small` gqa 0.972, mamba2 0.960, `base` bf16 gqa 0.935; `base` fp32 from memory 1.009); at three rows 0.992 and at
 * four 1.06-1.07 slower, so more rows keep the tiles.
 * How far ahead pays depends on where the weights lie. The figures above are from memory (the EPYC's 32 MiB L3 holds
 * no model's step): MEMORY_ROW_AHEAD. Where a step's weights fit in half the last-level cache (row_prefetch_bytes;
 * a 2-core Xeon VM that reports a 480 MiB L3 holds a `small` model's 91 MB in fp32 and `base`'s 200 MB in bf16),
 * CACHED_ROW_AHEAD: the decode step, batch 1, both in one process alternating, twelve rounds (context 256): small
 * fp32 gqa 2.50 -> 2.21 ms, mamba2 3.81 -> 3.25, mla 2.76 -> 2.54 (context 1024: linear 3.59 -> 3.07, mamba 4.75 ->
 * 4.06), every round faster; base bf16 gqa 8.37 -> 8.01 (4 KiB 7.82, 16 KiB 7.92); but base fp32 (400 MB, most of it
 * from memory) 15.2 -> 15.9, slower in every round, as 4 KiB (16.4). Rows of x walked in tiles (batch 2 and more)
 * gained nothing from further (8-32 KiB within 1.5%).
 * That one row adds alternate lines into two sums, not one: one sum waited on each add (4 cycles) and ran at a third
 * of L2's rate. Weights in cache, fp32, 1 row (EPYC): 512 x 512 31 -> 13 µs, 1408 x 512 88 -> 37; from memory no
 * change (20-22 GB/s either way). Four sums measured slower than two (24 and 61 µs).
 * Rows of x walked together (and int8's one) prefetch 8 KiB ahead (at least one tile), not 32: on the EPYC, 4 KiB
 * pages, walking 16 `small` layers' weights in one run, fp32 1 row 24.0 against 22.2-23.0 GB/s (read rate 30-32),
 * bf16 25.5 against 24.6, fp32 4 rows 23.9 against 23.3; `base` layers' weights within 4% either way, never slower;
 * no prefetch 16.6 and into L1 18.5 (those one-row figures walked blocks of rows, before the paragraph above).
 * Loads are unaligned-type loads, as fast as aligned ones on an aligned address: torch allocates 64-byte aligned, so
 * every row of W and of a contiguous x starts on a line when a row is whole lines (every model width). The last
 * k % (one line) columns are summed in scalar. GCC vector types hold LANES floats, one register on any target; the
 * compiler's macros (-march=native) pick LANES, XROWS and dpbf16.
 * bf16: with AVX512-BF16, _mm512_dpbf16_ps multiplies 32 bf16 pairs into 16 fp32 sums as stored; elsewhere x is
 * widened to an fp32 copy once and each weight vector by a 16-bit shift as it is loaded. int8: x is widened to an
 * fp32 copy once, each weight vector sign-extended and converted as it is loaded, and a channel's sums are scaled
 * once at the end. */
/* ISO C mode (-std=c11) turns off fused multiply-add contraction: a * b + c here is one FMA */
#pragma GCC optimize("fp-contract=fast")
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <omp.h>
#include "floats.h"
#include "gemv.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define LANES 16
#define XROWS 4 /* 16 sums, 4 weight vectors and 4 of x in the 32 vector registers */
#else
#define LANES 8
#define XROWS 2 /* 8 sums, 4 weight vectors and 2 of x in the 16 */
#endif
#define ROWS 4
#define CHAINS 2 /* one row of x: sums a weight row keeps (more measured slower: 4 lost 1.6x in L2) */
#define MAX_M 16
#define LINE 64
#define BLOCK_BYTES 1024     /* a block of 16 x rows and 4 weight rows is at most 20 KiB: in L1 on any x86 since 2012 */
#define PREFETCH_BYTES 8192 /* how far ahead in W the prefetches run, at least (whole tiles); see the top */
#define MEMORY_ROW_AHEAD 2048 /* one row of x, W read in address order: how far ahead of each line; see the top */
#define CACHED_ROW_AHEAD 8192 /* the same where a step's weights fit in half the last-level cache; see the top */
#define INLINE static inline __attribute__((always_inline))

typedef float floats_v __attribute__((vector_size(4 * LANES)));
typedef uint16_t halves_v __attribute__((vector_size(2 * LANES)));
typedef uint32_t words_v __attribute__((vector_size(4 * LANES)));
typedef int8_t bytes_v __attribute__((vector_size(LANES)));
typedef int32_t ints_v __attribute__((vector_size(4 * LANES)));

/* how a step multiplies: fp32 W and x; bf16 W widened against an fp32 copy of x; bf16 pairs by dpbf16; int8 W
 * converted against an fp32 copy of x */
enum { PLAIN, WIDEN, DOT, BYTES };
#ifdef __AVX512BF16__
#define BF16_FORMAT DOT
#else
#define BF16_FORMAT WIDEN
#endif

struct gemv {
    const char *x, *w;
    const void *bias, *scales; /* scales: int8's, [n] in s_dtype */
    void *out;
    int64_t k, n, ldx, ldo, row_ahead; /* row_ahead: how far ahead one row of x prefetches */
    int format, dtype, s_dtype;
};

INLINE int w_bytes(int format) { return format == PLAIN ? 4 : format == BYTES ? 1 : 2; }
INLINE int x_bytes(int format) { return format == DOT ? 2 : 4; }
INLINE int64_t vector_elements(int format) { return format == DOT ? 2 * LANES : LANES; }

INLINE floats_v load_floats(const char *p) {
    floats_v v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* LANES bf16 as fp32: a bf16 is the high half of its fp32 */
INLINE floats_v widen(const char *p) {
    halves_v h;
    memcpy(&h, p, sizeof h);
    return (floats_v)(__builtin_convertvector(h, words_v) << 16);
}

/* LANES int8 as fp32: sign-extended in one instruction on x86 (GCC 12 converts a signed byte vector lane by lane) */
INLINE floats_v convert_bytes(const char *p) {
#if defined(__AVX512F__)
    return (floats_v)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (floats_v)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    bytes_v b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ints_v), floats_v);
#endif
}

/* weight columns i.. as the step multiplies them (DOT: 2 * LANES bf16 in the vector's bits) */
INLINE floats_v load_w(const char *w, int64_t i, int format) {
    if (format == WIDEN) return widen(w + 2 * i);
    if (format == BYTES) return convert_bytes(w + i);
    return load_floats(w + w_bytes(format) * i);
}

INLINE floats_v madd(floats_v acc, floats_v w, const char *x, int64_t i, int format) {
#ifdef __AVX512BF16__
    if (format == DOT) return (floats_v)_mm512_dpbf16_ps((__m512)acc, (__m512bh)load_floats(x + 2 * i), (__m512bh)w);
#endif
    return acc + w * load_floats(x + 4 * i);
}

INLINE float sum_lanes(floats_v v) { /* GCC makes this an extract-and-add tree */
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* sums[m][r] += W row w[r] . x row x[m] over columns [k0, k1), a line of each weight row a step (by_row, one row of
 * x: each weight row's lines in turn, into CHAINS sums), prefetching `ahead` bytes on (the next tile's rows); xr and
 * by_row are constants at every call, so the sums live in registers. */
INLINE void run_block(const char *const *w, const char *const *x, floats_v (*sums)[ROWS], int64_t k0, int64_t k1,
                      int xr, int format, int64_t ahead, int by_row) {
    floats_v acc[XROWS][ROWS];
    for (int m = 0; m < xr; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = sums[m][r];
    int64_t step = LINE / w_bytes(format);
    if (by_row) {
        for (int r = 0; r < ROWS; r++) { /* xr is 1: CHAINS sums a row, alternate lines, so adds overlap */
            floats_v chain[CHAINS] = {acc[0][r]};
            int64_t i = k0;
            for (; i + CHAINS * step <= k1; i += CHAINS * step)
                for (int c = 0; c < CHAINS; c++) {
                    __builtin_prefetch(w[r] + w_bytes(format) * (i + c * step) + ahead, 0, 1); /* to L2 */
                    for (int64_t j = i + c * step; j < i + (c + 1) * step; j += vector_elements(format))
                        chain[c] = madd(chain[c], load_w(w[r], j, format), x[0], j, format);
                }
            for (; i < k1; i += step) {
                __builtin_prefetch(w[r] + w_bytes(format) * i + ahead, 0, 1);
                for (int64_t j = i; j < i + step; j += vector_elements(format))
                    chain[0] = madd(chain[0], load_w(w[r], j, format), x[0], j, format);
            }
            for (int c = 1; c < CHAINS; c++) chain[0] += chain[c];
            acc[0][r] = chain[0];
        }
    } else {
        for (int64_t i = k0; i < k1; i += step) {
            for (int r = 0; r < ROWS; r++) __builtin_prefetch(w[r] + w_bytes(format) * i + ahead, 0, 1); /* to L2 */
            for (int64_t j = i; j < i + step; j += vector_elements(format))
                for (int r = 0; r < ROWS; r++) {
                    floats_v wv = load_w(w[r], j, format);
                    for (int m = 0; m < xr; m++) acc[m][r] = madd(acc[m][r], wv, x[m], j, format);
                }
        }
    }
    for (int m = 0; m < xr; m++)
        for (int r = 0; r < ROWS; r++) sums[m][r] = acc[m][r];
}

/* x rows [0, xr) against the block, xr <= XROWS made a constant for run_block; one row of fp32 or bf16 walks W
 * row by row */
INLINE void run_rows(const char *const *w, const char *const *x, floats_v (*sums)[ROWS], int64_t k0, int64_t k1,
                     int xr, int format, int64_t ahead) {
    switch (xr) {
    case 1: run_block(w, x, sums, k0, k1, 1, format, ahead, format != BYTES); break; /* int8: see the top */
#if XROWS > 2
    case 2: run_block(w, x, sums, k0, k1, 2, format, ahead, 0); break;
    case 3: run_block(w, x, sums, k0, k1, 3, format, ahead, 0); break;
#endif
    default: run_block(w, x, sums, k0, k1, XROWS, format, ahead, 0); break;
    }
}

/* weight column i of a row in scalar */
INLINE float load_w1(const char *w, int64_t i, int format) {
    return format == BYTES ? (float)((const int8_t *)w)[i] : load1(w, i, format == PLAIN ? F32 : BF16);
}

/* the sums of a tile's whole lines, plus the last columns in scalar, int8's scale and the bias, rounded into out */
INLINE void finish(const struct gemv *g, const char *const *w, const char *const *x, floats_v (*sums)[ROWS],
                   int64_t m0, int mp, int64_t n0, int64_t tail, int format) {
    int x_dtype = format == DOT ? BF16 : F32;
    for (int m = 0; m < mp; m++)
        for (int r = 0; r < ROWS && n0 + r < g->n; r++) {
            float y = sum_lanes(sums[m][r]);
            for (int64_t i = tail; i < g->k; i++) y += load_w1(w[r], i, format) * load1(x[m], i, x_dtype);
            if (format == BYTES) y *= load1(g->scales, n0 + r, g->s_dtype);
            if (g->bias) y += load1(g->bias, n0 + r, g->dtype);
            store1(g->out, (m0 + m) * g->ldo + n0 + r, y, g->dtype);
        }
}

/* out rows [m0, m0 + mp) at channels [n0, n0 + ROWS); a partial last tile repeats channel n - 1 (in bounds, dropped) */
INLINE void tile(const struct gemv *g, int64_t n0, int64_t m0, int mp, int format) {
    const char *w[ROWS], *x[MAX_M];
    for (int r = 0; r < ROWS; r++) w[r] = g->w + (n0 + r < g->n ? n0 + r : g->n - 1) * g->k * w_bytes(format);
    for (int m = 0; m < mp; m++) x[m] = g->x + (m0 + m) * g->ldx * x_bytes(format);
    floats_v sums[MAX_M][ROWS];
    memset(sums, 0, mp * sizeof sums[0]); /* the rows used: all 16 is 4 KiB a tile, 12 -> 7.5 µs a 64 KiB call */
    int64_t step = LINE / w_bytes(format), whole = g->k - g->k % step;
    int64_t block = BLOCK_BYTES / (x_bytes(format) > w_bytes(format) ? x_bytes(format) : w_bytes(format));
    int in_order = mp == 1 && format != BYTES; /* one row of x: each weight row in one run, see the top */
    if (in_order) block = whole;
    int64_t tile_bytes = ROWS * g->k * w_bytes(format);
    int64_t ahead = in_order ? g->row_ahead : tile_bytes * (1 + (PREFETCH_BYTES - 1) / tile_bytes);
    for (int64_t k0 = 0; k0 < whole; k0 += block) {
        int64_t k1 = k0 + block < whole ? k0 + block : whole;
        for (int m = 0; m < mp; m += XROWS)
            run_rows(w, x + m, sums + m, k0, k1, mp - m < XROWS ? mp - m : XROWS, format, ahead);
    }
    finish(g, w, x, sums, m0, mp, n0, whole, format);
}

/* One row of x: out[r] for rows [n0, n1) of W, one row after another in address order, each whole, alternate lines
 * into two sums (a tile's by_row walk and finish, row by row: the same sums in the same order), prefetching
 * g->row_ahead bytes ahead; see the top. */
INLINE void rows_in_order(const struct gemv *g, int64_t n0, int64_t n1, int format) {
    int64_t step = LINE / w_bytes(format), whole = g->k - g->k % step;
    int x_dtype = format == DOT ? BF16 : F32;
    for (int64_t r = n0; r < n1; r++) {
        const char *w = g->w + r * g->k * w_bytes(format);
        floats_v a = {0}, b = {0};
        int64_t i = 0;
        for (; i + 2 * step <= whole; i += 2 * step) {
            __builtin_prefetch(w + w_bytes(format) * i + g->row_ahead, 0, 1); /* to L2 */
            __builtin_prefetch(w + w_bytes(format) * (i + step) + g->row_ahead, 0, 1);
            for (int64_t j = i; j < i + step; j += vector_elements(format))
                a = madd(a, load_w(w, j, format), g->x, j, format);
            for (int64_t j = i + step; j < i + 2 * step; j += vector_elements(format))
                b = madd(b, load_w(w, j, format), g->x, j, format);
        }
        for (; i < whole; i += step)
            for (int64_t j = i; j < i + step; j += vector_elements(format))
                a = madd(a, load_w(w, j, format), g->x, j, format);
        a += b;
        float y = sum_lanes(a);
        for (int64_t c = whole; c < g->k; c++) y += load_w1(w, c, format) * load1(g->x, c, x_dtype);
        if (g->bias) y += load1(g->bias, r, g->dtype);
        store1(g->out, r, y, g->dtype);
    }
}

/* Two rows of x: out[m][r] for rows [n0, n1) of W, each weight row whole and in address order as one row's walk,
 * each weight vector loaded once for both rows; the same sums as a tile's, in the same order. See the top. */
INLINE void two_rows_in_order(const struct gemv *g, int64_t n0, int64_t n1, int format) {
    enum { mp = 2 };
    int64_t step = LINE / w_bytes(format), whole = g->k - g->k % step;
    int x_dtype = format == DOT ? BF16 : F32;
    const char *x[mp];
    for (int m = 0; m < mp; m++) x[m] = g->x + m * g->ldx * x_bytes(format);
    for (int64_t r = n0; r < n1; r++) {
        const char *w = g->w + r * g->k * w_bytes(format);
        floats_v a[mp];
        for (int m = 0; m < mp; m++) a[m] = (floats_v){0};
        for (int64_t i = 0; i < whole; i += step) {
            __builtin_prefetch(w + w_bytes(format) * i + g->row_ahead, 0, 1); /* to L2 */
            for (int64_t j = i; j < i + step; j += vector_elements(format)) {
                floats_v wv = load_w(w, j, format);
                for (int m = 0; m < mp; m++) a[m] = madd(a[m], wv, x[m], j, format);
            }
        }
        for (int m = 0; m < mp; m++) {
            float y = sum_lanes(a[m]);
            for (int64_t c = whole; c < g->k; c++) y += load_w1(w, c, format) * load1(x[m], c, x_dtype);
            if (g->bias) y += load1(g->bias, r, g->dtype);
            store1(g->out, m * g->ldo + r, y, g->dtype);
        }
    }
}

static void rows_fp32(const struct gemv *g, int64_t n0, int64_t n1) { rows_in_order(g, n0, n1, PLAIN); }
static void rows_bf16(const struct gemv *g, int64_t n0, int64_t n1) { rows_in_order(g, n0, n1, BF16_FORMAT); }

static void tile_fp32(const struct gemv *g, int64_t n0, int64_t m0, int mp) { tile(g, n0, m0, mp, PLAIN); }
static void tile_bf16(const struct gemv *g, int64_t n0, int64_t m0, int mp) { tile(g, n0, m0, mp, BF16_FORMAT); }
static void tile_int8(const struct gemv *g, int64_t n0, int64_t m0, int mp) { tile(g, n0, m0, mp, BYTES); }

typedef void (*tile_fn)(const struct gemv *, int64_t, int64_t, int);

/* rows [n0, n1) of W for m > 1 rows of x: two rows of float x in address order, more (and int8) in tiles */
static void rows_of(const struct gemv *g, int64_t n0, int64_t n1, int64_t m, int format) {
    if (m == 2 && format != BYTES) {
        if (format == PLAIN)
            two_rows_in_order(g, n0, n1, PLAIN);
        else
            two_rows_in_order(g, n0, n1, BF16_FORMAT);
        return;
    }
    tile_fn tile_of = format == PLAIN ? tile_fp32 : format == BYTES ? tile_int8 : tile_bf16;
    for (int64_t n = n0; n < n1; n += ROWS)
        for (int64_t m0 = 0; m0 < m; m0 += MAX_M) tile_of(g, n, m0, m - m0 < MAX_M ? (int)(m - m0) : MAX_M);
}

/* every tile of g (ROWS channels each) for every MAX_M rows of x at a time; one or two rows of fp32 or bf16 x, each
 * thread its share of W's rows in order */
static void run(const struct gemv *g, int64_t m, tile_fn tile_of, int threads) {
    if (m <= 2 && g->format != BYTES) {
        #pragma omp parallel num_threads(threads)
        {
            int64_t n0, n1;
            tile_share(g->n, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
            if (m == 1)
                (g->format == PLAIN ? rows_fp32 : rows_bf16)(g, n0, n1);
            else
                rows_of(g, n0, n1, m, g->format);
        }
        return;
    }
    int64_t tiles = (g->n + ROWS - 1) / ROWS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m0 = 0; m0 < m; m0 += MAX_M) tile_of(g, t * ROWS, m0, m - m0 < MAX_M ? (int)(m - m0) : MAX_M);
}

int64_t row_prefetch_bytes(int64_t step_bytes) {
#ifdef _SC_LEVEL3_CACHE_SIZE
    long last = sysconf(_SC_LEVEL3_CACHE_SIZE); /* 0 or -1 where the system does not say */
#else
    long last = 0;
#endif
    return step_bytes >= 0 && last > 0 && step_bytes <= last / 2 ? CACHED_ROW_AHEAD : MEMORY_ROW_AHEAD;
}

int gemv_widens(int dtype, int int8) { return int8 || (dtype == BF16 && BF16_FORMAT == WIDEN); }

void gemv_part(const void *x, int64_t m, int64_t k, int64_t ldx, int dtype, const void *weight, const void *scales,
               int s_dtype, int64_t n0, int64_t n1, void *out, int64_t ldo, int64_t row_ahead) {
    int format = scales ? BYTES : dtype == F32 ? PLAIN : BF16_FORMAT;
    int out_bytes = dtype == F32 ? 4 : 2, s_bytes = s_dtype == F32 ? 4 : 2;
    /* rows [n0, n1) as a GEMV of their own: each output's sums run as they would in the whole one */
    struct gemv g = {x, (const char *)weight + n0 * k * w_bytes(format), NULL,
                     scales ? (const char *)scales + n0 * s_bytes : NULL, (char *)out + n0 * out_bytes, k, n1 - n0,
                     ldx, ldo, row_ahead, format, dtype, s_dtype};
    if (m == 1 && format != BYTES) {
        (format == PLAIN ? rows_fp32 : rows_bf16)(&g, 0, g.n);
        return;
    }
    rows_of(&g, 0, g.n, m, format);
}

/* x [m, k] (row stride ldx, x_dtype) as a contiguous fp32 copy; NULL out of memory */
static float *widened(const void *x, int64_t m, int64_t k, int64_t ldx, int x_dtype) {
    float *wide = malloc(sizeof(float) * (size_t)(m * k > 0 ? m * k : 1));
    if (wide)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) wide[r * k + i] = load1(x, r * ldx + i, x_dtype);
    return wide;
}

/* x [m, k] (row stride ldx), W [n, k], bias [n] or NULL, out [m, n] (row stride ldo), all dtype (fp32 or bf16); one
 * row of x prefetches row_ahead bytes ahead (row_prefetch_bytes). Returns 0, -1 for a dtype the kernel does not
 * take, -2 out of memory. */
int dense_gemv(const void *x, int64_t m, int64_t k, int64_t ldx, int dtype, const void *weight, int64_t n,
               const void *bias, void *out, int64_t ldo, int64_t row_ahead, int threads) {
    if (dtype != F32 && dtype != BF16) return -1;
    if (m <= 0 || n <= 0) return 0;
    int format = dtype == F32 ? PLAIN : BF16_FORMAT;
    float *wide = NULL;
    if (format == WIDEN) { /* x is small next to W: widen it once rather than once per tile */
        if (!(wide = widened(x, m, k, ldx, BF16))) return -2;
        x = wide;
        ldx = k;
    }
    struct gemv g = {x, weight, bias, NULL, out, k, n, ldx, ldo, row_ahead, format, dtype, F32};
    run(&g, m, dtype == F32 ? tile_fp32 : tile_bf16, threads);
    free(wide);
    return 0;
}

/* x [m, k] (row stride ldx, x_dtype fp32, bf16 or fp16) times int8 q [n, k] with scales [n] (s_dtype), out [m, n] (row
 * stride ldo, x_dtype). Returns 0, -1 for a dtype the kernel does not take, -2 out of memory. */
int int8_gemv(const void *x, int64_t m, int64_t k, int64_t ldx, int x_dtype, const void *q, int64_t n,
              const void *scales, int s_dtype, void *out, int64_t ldo, int threads) {
    if (x_dtype < F32 || x_dtype > F16 || s_dtype < F32 || s_dtype > F16) return -1;
    if (m <= 0 || n <= 0) return 0;
    float *wide = widened(x, m, k, ldx, x_dtype);
    if (!wide) return -2;
    struct gemv g = {(const char *)wide, q, NULL, scales, out, k, n, k, ldo, MEMORY_ROW_AHEAD, BYTES, x_dtype,
                     s_dtype}; /* int8 walks tiles at any m: no row_ahead */
    run(&g, m, tile_int8, threads);
    free(wide);
    return 0;
}

/* dense_gemv over `layers` weights in turn, out[i] = x[i] W[i]^T (x[i] [m, k[i]] and out[i] [m, n[i]] contiguous, all
 * in dtype), called one after another from C as a planned decode step calls its GEMVs: a step's bare linear layers
 * with no Python between them (benchmarks/weight_streaming.py). Returns the first non-zero status, else 0. */
int dense_gemv_layers(const void *const *x, const void *const *weight, void *const *out, const int64_t *k,
                      const int64_t *n, int64_t layers, int64_t m, int dtype, int threads) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < layers; i++) bytes += n[i] * k[i] * (dtype == F32 ? 4 : 2);
    int64_t row_ahead = row_prefetch_bytes(bytes); /* as a planned step's, from the bytes it streams */
    for (int64_t i = 0; i < layers; i++) {
        int status = dense_gemv(x[i], m, k[i], k[i], dtype, weight[i], n[i], NULL, out[i], n[i], row_ahead, threads);
        if (status) return status;
    }
    return 0;
}
