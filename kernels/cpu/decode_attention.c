/* Decode attention on CPU: one new query per sequence over its cached keys, read in place.
 *
 * One routine serves every cache layout the engine has: a key n of sequence b lives at
 *   base + block_table[b][n / block_size] * stride_block + (n % block_size) * stride_pos + kv_head * stride_head
 * so a paged pool is [blocks, block_size, kv_heads, dim] in any stride order (the engine's is head-major), a
 * contiguous cache is [slots, kv_heads, rows, dim] seen as one block per slot, and an MLA latent cache passes the same rows as keys and values (value = first dv columns).
 * A strided span (a dilated window) reads every stride-th position, and a ring of `ring` rows keeps position n in
 * row n % ring (ring 0: no ring).
 * Each (sequence, KV head, split of the keys) task loads every key and value row once for the whole group of query
 * heads that share it (GQA without repeating K/V), keeps an online softmax in fp32, and a second pass merges the
 * splits by their log-sum-exp (flash-decoding). Rows are converted to fp32 one at a time, so 16-bit caches are
 * read as they are, and so are one-byte caches (the engine's kv_dtype "int8" and "fp8"): an int8 or float8 e4m3 row
 * times its scale, which lives in a tensor of its own, one per row, in the query's dtype (an MLA latent row has two:
 * its first k_split columns, the latent, under one and the rotary key part under the other). A tile's softmax weights
 * take exp8 (kernels/cpu/vector_exp.h, ~2e-7 relative error), 8 at a time: one expf call per score was a third of a
 * GQA step's time (kernel alone, 8 query heads over 2 KV heads x 2048 keys, fp32, 2-core EPYC: 389 -> 326 µs at
 * batch 4, 110 -> 96 at batch 1; MHA 1.06x; MLA, whose 8 heads share a 288-wide row, no change). The next tile's
 * rows are prefetched a row at a time during this tile's dot products, sums are FMAs, and the value sums keep their
 * columns in registers over a tile: fp32, 2048 keys, six layers' caches walked in turn (from memory), same run: MHA
 * 8 heads at batch 4 2279 -> 1685 µs (14.7 -> 19.9 GB/s), GQA 8/2 heads at batch 4 641 -> 470, at batch 1 112 -> 106.
 * The heads of a group run in blocks (HEAD_BLOCK: 4 with AVX-512's 32 registers, 2 with 16): a block's dot products
 * take 4 keys at once, so each key vector loaded serves every head of the block and each query vector every key, and
 * its value sums take 4 vectors of columns for every head of the block from one load of each value vector; the four
 * dot products of a head are reduced together by halves in registers (summed lane by lane, each went through
 * memory). `small` decode steps, batch 4, 2048 keys, 2-core Xeon, three processes each, ms: MLA (8 heads on one
 * 160-wide latent) 8.85-9.00 -> 7.48-8.10, MQA 5.94-6.35 -> 5.49-6.01, GQA 7.63-8.49 either way, MHA 19.2 either
 * way (its groups of one read as much as they compute: memory-bound).
 * The next tile's rows are asked for across every head's dot products, not all during the first head's (a GQA
 * group's four heads made them a burst in a quarter of the tile's work), a tile is 64 keys, not 32, and a tile's
 * softmax weights are summed eight lanes at a time: fp32, 2048 keys, twelve layers' caches walked in turn, old and
 * new in alternating processes, 2-core EPYC, µs a call: GQA 8/2 heads batch 1 130-183 against 184-200, batch 4
 * 527-664 against 647-769, MQA 98-152 against 119-175, MHA batch 4 (1024 keys) 806-1006 against 882-1058. Built at
 * first use by kernels/cpu_decode.py with the compiler flags written there.
 */
/* ISO C mode (-std=c11) turns off fused multiply-add contraction: the dot products and value sums here are FMAs */
#pragma GCC optimize("fp-contract=fast")
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "floats.h"
#include "vector_exp.h"


/* a row of n elements as fp32; an fp32 row is used in place, a 16-bit one is converted into buf
 * (bf16 is the top half of an fp32: a shift, vectorised; built with -fno-strict-aliasing for the cast) */
static inline const float *row_f32(const void *p, int64_t offset, int n, int dtype, float *buf) {
    if (dtype == F32) return (const float *)p + offset;
    if (dtype == BF16) {
        const uint16_t *src = (const uint16_t *)p + offset;
        uint32_t *bits = (uint32_t *)buf;
        for (int i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
    } else {
        const _Float16 *src = (const _Float16 *)p + offset;
        for (int i = 0; i < n; i++) buf[i] = (float)src[i];
    }
    return buf;
}

/* v8: 8 fp32 lanes at any 4-byte alignment, from vector_exp.h */


/* A float8 e4m3 value (torch.float8_e4m3fn: exponent bias 7, no infinities) as fp32, by moving its bits: a normal
 * number's exponent is rebiased to 127 and its 3 mantissa bits go to the top of fp32's 23; a subnormal is m * 2^-9.
 * Branch-free, so a row converts in vector registers (a 256-entry table costs a load per element). The NaN pattern
 * S.1111.111 reads as 480: quantized rows never hold it (clamped to 448). */
static inline float fp8_e4m3(uint8_t b) {
    uint32_t exponent = (b >> 3) & 15, mantissa = b & 7, sign = (uint32_t)(b & 128) << 24;
    uint32_t bits = sign | (exponent + 120) << 23 | mantissa << 20, small_bits;
    float normal, small = (float)mantissa * (1.0f / 512.0f);
    memcpy(&normal, &bits, 4);
    memcpy(&small_bits, &small, 4);
    small_bits |= sign;
    memcpy(&small, &small_bits, 4);
    return exponent ? normal : small;
}

/* Element offsets of the rows of positions first, first + stride, ... (n of them) of one KV head: consecutive
 * positions walk the block table a block at a time (no division per row: with 16-token blocks it was a fifth of a
 * bf16 step); a strided or ring span divides per row. */
static void row_offsets(const Cache *c, int64_t stride_block, int64_t stride_pos, int64_t stride_head,
                        const int32_t *table_row, int kv_head, int64_t first, int n, int64_t *offsets) {
    if (c->stride != 1 || c->ring) {
        for (int t = 0; t < n; t++) {
            int64_t position = first + t * c->stride, row = c->ring ? position % c->ring : position;
            offsets[t] = table_row[row / c->block_size] * stride_block + (row % c->block_size) * stride_pos +
                         kv_head * stride_head;
        }
        return;
    }
    int64_t entry = first / c->block_size, in_block = first % c->block_size;
    int64_t base = table_row[entry] * stride_block + kv_head * stride_head;
    for (int t = 0; t < n; t++) {
        offsets[t] = base + in_block * stride_pos;
        if (++in_block == c->block_size && t + 1 < n) { /* the table has no entry past the sequence's last block */
            in_block = 0;
            base = table_row[++entry] * stride_block + kv_head * stride_head;
        }
    }
}

/* Where one tensor of rows lives: its base and (block, position, head) element strides. */
typedef struct {
    const void *base;
    int64_t block, pos, head;
} Rows;

/* Rows [first, first + n) of one KV head as fp32 pointers: in place for an fp32 cache, converted into buf
 * (n rows of `width`) otherwise; one-byte rows (scales.base not NULL), int8 or fp8, times their scales: columns
 * before `split` times a row's first scale, the rest times its second, `part` elements further on. */
static void tile_rows(const Cache *c, Rows rows_at, Rows scales, int split, int64_t part, const int32_t *table_row,
                      int kv, int64_t first, int n, int width, float *buf, const float **rows) {
    int64_t offsets[TILE];
    row_offsets(c, rows_at.block, rows_at.pos, rows_at.head, table_row, kv, first, n, offsets);
    if (!scales.base) {
        for (int t = 0; t < n; t++) rows[t] = row_f32(rows_at.base, offsets[t], width, c->dtype, buf + (int64_t)t * width);
        return;
    }
    int64_t scale_offsets[TILE];
    row_offsets(c, scales.block, scales.pos, scales.head, table_row, kv, first, n, scale_offsets);
    for (int t = 0; t < n; t++) {
        const int8_t *src = (const int8_t *)rows_at.base + offsets[t];
        float scale = load1(scales.base, scale_offsets[t], c->dtype), *row = buf + (int64_t)t * width;
        float rest = split < width ? load1(scales.base, scale_offsets[t] + part, c->dtype) : scale;
        int head = split < width ? split : width;
        if (c->fp8) {
            for (int i = 0; i < head; i++) row[i] = scale * fp8_e4m3((uint8_t)src[i]);
            for (int i = head; i < width; i++) row[i] = rest * fp8_e4m3((uint8_t)src[i]);
        } else {
            for (int i = 0; i < head; i++) row[i] = scale * (float)src[i];
            for (int i = head; i < width; i++) row[i] = rest * (float)src[i];
        }
        rows[t] = row;
    }
}

/* Asks L2 for one row of keys and its row of values ahead of use (offsets from row_offsets; a latent row is both). A
 * tile's rows are asked for one at a time as the tile before runs its dot products, not all at its start: a burst
 * of 512 requests waited on itself and then left memory idle while the tile computed. Into L1 no faster. Inlined: a
 * call in the dot products' loop spills their vector registers. */
static inline __attribute__((always_inline)) void prefetch_row(const Cache *c, int64_t k_offset, int64_t v_offset) {
    int elem = c->ks ? 1 : c->dtype == F32 ? 4 : 2;
    const char *k = (const char *)c->k + elem * k_offset, *v = (const char *)c->v + elem * v_offset;
    for (int byte = 0; byte < c->dk * elem; byte += 64) __builtin_prefetch(k + byte, 0, 1);
    if (v != k)
        for (int byte = 0; byte < c->dv * elem; byte += 64) __builtin_prefetch(v + byte, 0, 1);
}

/* Asks for the next tile's rows up to the share `done` of `total` score steps: the requests spread over every head's
 * dot products of the tile, not all in the first head's. Returns the rows asked for so far (multiplied out: a
 * division a call was ~1000 cycles a tile). */
static inline __attribute__((always_inline)) int fetch_paced(const Cache *c, const int64_t *next_k,
                                                             const int64_t *next_v, int fetched, int n_next, int done,
                                                             int total) {
    for (; fetched < n_next && fetched * total < n_next * done; fetched++)
        prefetch_row(c, next_k[fetched], next_v[fetched]);
    return fetched;
}

#ifdef __AVX512F__
#define LANES 16
#define HEAD_BLOCK 4 /* heads a block of dot products or value sums shares each load with: 16 sums in 32 registers */
#else
#define LANES 8
#define HEAD_BLOCK 2 /* 8 sums in 16 registers */
#endif
#define VALUE_VECTORS 4 /* value columns a head block keeps in registers over a tile: 4 vectors */
typedef float lanes_v __attribute__((vector_size(4 * LANES)));

static inline __attribute__((always_inline)) lanes_v load_lanes(const float *p) {
    lanes_v v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[j] = the sum of v[j]'s lanes, the four reduced together by halves in registers (summed one lane at a time,
 * each vector went through memory: most of a tile's time at head_dim 64) */
static inline __attribute__((always_inline)) void sum4(const lanes_v *v, float *out) {
#if LANES == 16
    lanes_v ab = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(v[0], v[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    lanes_v cd = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(v[2], v[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    lanes_v quads = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    quads += __builtin_shufflevector(quads, quads, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    quads += __builtin_shufflevector(quads, quads, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = quads[0], out[1] = quads[4], out[2] = quads[8], out[3] = quads[12];
#else
    lanes_v ab = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(v[0], v[1], 4, 5, 6, 7, 12, 13, 14, 15);
    lanes_v cd = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(v[2], v[3], 4, 5, 6, 7, 12, 13, 14, 15);
    lanes_v pairs = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                    __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    pairs += __builtin_shufflevector(pairs, pairs, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = pairs[0], out[1] = pairs[2], out[2] = pairs[4], out[3] = pairs[6];
#endif
}

/* scores[g][t + j] = q[g] . k[j] for hb heads (q rows dk apart, from head g0) and the first `keys` of 4 key rows (a
 * tile's last keys repeat its last row, not stored): each key vector loaded once for the hb heads, each query vector
 * once for the 4 keys (hb is a constant at every call, so the hb x 4 sums stay in registers). Every score is summed
 * the same way wherever its key falls in a tile. */
static inline __attribute__((always_inline)) void dot_block(const float *q, int hb, const float *const *k, int keys,
                                                            int dk, float (*scores)[TILE], int g0, int t) {
    lanes_v acc[HEAD_BLOCK][4];
    for (int h = 0; h < hb; h++)
        for (int j = 0; j < 4; j++) acc[h][j] = (lanes_v){0};
    int whole = dk - dk % LANES;
    for (int d = 0; d < whole; d += LANES) {
        lanes_v kv[4];
        for (int j = 0; j < 4; j++) kv[j] = load_lanes(k[j] + d);
        for (int h = 0; h < hb; h++) {
            lanes_v qv = load_lanes(q + (int64_t)h * dk + d);
            for (int j = 0; j < 4; j++) acc[h][j] += qv * kv[j];
        }
    }
    for (int h = 0; h < hb; h++) {
        float sums[4];
        sum4(acc[h], sums);
        for (int j = 0; j < keys; j++) {
            for (int d = whole; d < dk; d++) sums[j] += q[(int64_t)h * dk + d] * k[j][d];
            scores[g0 + h][t + j] = sums[j];
        }
    }
}

/* acc rows of hb heads (dv apart) += sum over the tile's n rows of p[g][t] * v[t], columns [d0, d0 + width): each
 * value vector loaded once for the hb heads; every sum adds the rows in order, as one head's walk would */
static inline __attribute__((always_inline)) void value_block(float *acc, int hb, const float (*p)[TILE],
                                                              const float *const *v, int n, int dv, int d0,
                                                              int vectors) {
    lanes_v a[HEAD_BLOCK][VALUE_VECTORS];
    for (int h = 0; h < hb; h++)
        for (int c = 0; c < vectors; c++) a[h][c] = load_lanes(acc + (int64_t)h * dv + d0 + c * LANES);
    for (int t = 0; t < n; t++) {
        lanes_v vv[VALUE_VECTORS];
        for (int c = 0; c < vectors; c++) vv[c] = load_lanes(v[t] + d0 + c * LANES);
        for (int h = 0; h < hb; h++) {
            float w = p[h][t];
            for (int c = 0; c < vectors; c++) a[h][c] += w * vv[c];
        }
    }
    for (int h = 0; h < hb; h++)
        for (int c = 0; c < vectors; c++) memcpy(acc + (int64_t)h * dv + d0 + c * LANES, &a[h][c], sizeof a[h][c]);
}

/* An empty partial: no keys yet, so weight 0 in the merge. */
static void reset_partial(int task_heads, int dv, float *out_task, float *max_task, float *sum_task) {
    for (int h = 0; h < task_heads; h++) {
        max_task[h] = -INFINITY;
        sum_task[h] = 0.0f;
        memset(out_task + (int64_t)h * dv, 0, sizeof(float) * dv);
    }
}

/* Adds keys start, start + stride, ... before end of one sequence to the partial of the query heads of KV heads
 * kv0 .. kv0 + kv_per_task
 * (q: [those heads][dk] fp32, pre-scaled): the unnormalised output out[heads][dv] (sum of exp(score - max) * value)
 * and each head's max and sum, kept by an online softmax. work: TILE * (dk + dv) floats for converting 16-bit rows. */
static void attend_split(const Cache *c, const int32_t *table_row, int kv0, int64_t start, int64_t end,
                         const float *q_task, float *out_task, float *max_task, float *sum_task, float *work) {
    float scores[MAX_HEADS][TILE];
    const float *krows[TILE], *vrows[TILE];
    const int dk = c->dk, dv = c->dv, group = c->heads / c->kv_heads;
    const int64_t step = TILE * c->stride;
    for (int64_t first = start; first < end; first += step) {
        int64_t left = (end - first + c->stride - 1) / c->stride; /* keys from `first` on */
        int n = (int)(left < TILE ? left : TILE);
        int64_t next = first + step < end ? (end - first - step + c->stride - 1) / c->stride : 0;
        int n_next = (int)(next < TILE ? next : TILE); /* keys of the next tile, whose rows this one prefetches */
        int64_t next_k[TILE], next_v[TILE];
        for (int kv = kv0; kv < kv0 + c->kv_per_task; kv++) {  /* each KV head's group on this tile, in turn */
        const float *q = q_task + (int64_t)(kv - kv0) * group * dk;
        float *out = out_task + (int64_t)(kv - kv0) * group * dv;
        float *max_out = max_task + (kv - kv0) * group, *sum_out = sum_task + (kv - kv0) * group;
        tile_rows(c, (Rows){c->k, c->k_block, c->k_pos, c->k_head}, (Rows){c->ks, c->ks_block, c->ks_pos, c->ks_head},
                  c->k_split, c->ks_part, table_row, kv, first, n, dk, work, krows);
        if (n_next) {
            row_offsets(c, c->k_block, c->k_pos, c->k_head, table_row, kv, first + step, n_next, next_k);
            row_offsets(c, c->v_block, c->v_pos, c->v_head, table_row, kv, first + step, n_next, next_v);
        }
        int fetched = 0; /* rows of the next tile asked for so far */
        for (int g0 = 0; g0 < group; g0 += HEAD_BLOCK) {  /* scores: HEAD_BLOCK heads x 4 keys at a time */
            int hb = group - g0 < HEAD_BLOCK ? group - g0 : HEAD_BLOCK;
            const float *qg = q + (int64_t)g0 * dk;
            for (int t = 0; t < n; t += 4) {
                int keys = n - t < 4 ? n - t : 4;
                const float *k4[4];
                for (int j = 0; j < 4; j++) k4[j] = krows[t + (j < keys ? j : keys - 1)];
                fetched = fetch_paced(c, next_k, next_v, fetched, n_next, g0 * n + (t + keys) * hb, group * n);
                switch (hb) { /* hb a constant inside, so the sums stay in registers */
                case 1: dot_block(qg, 1, k4, keys, dk, scores, g0, t); break;
#if HEAD_BLOCK > 2
                case 2: dot_block(qg, 2, k4, keys, dk, scores, g0, t); break;
                case 3: dot_block(qg, 3, k4, keys, dk, scores, g0, t); break;
#endif
                default: dot_block(qg, HEAD_BLOCK, k4, keys, dk, scores, g0, t); break;
                }
            }
        }
        for (int g = 0; g < group; g++) {  /* online softmax over the tile */
            float *s = scores[g], tile_max = -INFINITY, tile_sum = 0.0f;
            for (int t = 0; t < n; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
            float new_max = tile_max > max_out[g] ? tile_max : max_out[g];
            float rescale = expf(max_out[g] - new_max);
            v8 sums = splat(0.0f); /* whole 8s summed by lane, the last part lane by lane */
            for (int t = 0; t < n; t += 8) { /* 8 lanes at a time: expf per score was ~a third of a step */
                v8 weights = exp8(*(v8 *)(s + t) - new_max); /* lanes past n read and write the tile's spare room */
                *(v8 *)(s + t) = weights;
                if (t + 8 <= n)
                    sums += weights;
                else
                    for (int lane = 0; t + lane < n; lane++) tile_sum += weights[lane];
            }
            tile_sum += ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
            sum_out[g] = sum_out[g] * rescale + tile_sum;
            max_out[g] = new_max;
            float *acc = out + (int64_t)g * dv;
            for (int d = 0; d < dv; d++) acc[d] *= rescale;
        }
        /* a value row has one scale (a latent's value is its first dv columns, under the first) */
        tile_rows(c, (Rows){c->v, c->v_block, c->v_pos, c->v_head}, (Rows){c->vs, c->vs_block, c->vs_pos, c->vs_head},
                  dv, 0, table_row, kv, first, n, dv, work + TILE * dk, vrows);
        for (int g0 = 0; g0 < group; g0 += HEAD_BLOCK) {  /* values: HEAD_BLOCK heads x 4 vectors of columns */
            int hb = group - g0 < HEAD_BLOCK ? group - g0 : HEAD_BLOCK;
            float *acc = out + (int64_t)g0 * dv;
            const float(*p)[TILE] = scores + g0;
            int d = 0;
            for (; d + VALUE_VECTORS * LANES <= dv; d += VALUE_VECTORS * LANES)
                switch (hb) {
                case 1: value_block(acc, 1, p, vrows, n, dv, d, VALUE_VECTORS); break;
#if HEAD_BLOCK > 2
                case 2: value_block(acc, 2, p, vrows, n, dv, d, VALUE_VECTORS); break;
                case 3: value_block(acc, 3, p, vrows, n, dv, d, VALUE_VECTORS); break;
#endif
                default: value_block(acc, HEAD_BLOCK, p, vrows, n, dv, d, VALUE_VECTORS); break;
                }
            for (; d + LANES <= dv; d += LANES)
                for (int h = 0; h < hb; h++) value_block(acc + (int64_t)h * dv, 1, p + h, vrows, n, dv, d, 1);
            for (int h = 0; h < hb; h++)
                for (int e = d; e < dv; e++)
                    for (int t = 0; t < n; t++) acc[(int64_t)h * dv + e] += p[h][t] * vrows[t][e];
        }
        }
    }
}

/* The tasks of one call over c: (sequence, chunk of kv_per_task KV heads, split of the keys); their partials
 * [task][task_heads] and the scaled queries [batch][heads][dk] in `floats` (attention_floats of them). Returns -1
 * for sizes beyond the kernel. */
int attention_plan(Plan *p, const Cache *c, const int32_t *table, int64_t table_stride, const int32_t *seq_lens,
                   const int32_t *starts, int64_t sinks, int batch, int splits, float *floats) {
    if (c->kv_heads < 1 || c->heads % c->kv_heads || c->heads / c->kv_heads > MAX_HEADS || c->dk > MAX_DIM ||
        c->dv > MAX_DIM || splits < 1 || c->kv_per_task < 1 || c->kv_heads % c->kv_per_task || c->k_split < 1 ||
        c->k_split > c->dk || c->stride < 1 || c->ring < 0 || (c->stride > 1 && sinks))
        return -1;
    int chunks = c->kv_heads / c->kv_per_task, task_heads = c->heads / c->kv_heads * c->kv_per_task;
    int64_t tasks = (int64_t)batch * chunks * splits;
    *p = (Plan){*c, table, seq_lens, starts, table_stride, sinks, batch, splits, chunks, task_heads, tasks, floats,
                NULL, NULL, NULL};
    p->partial_max = floats + tasks * task_heads * c->dv;
    p->partial_sum = p->partial_max + tasks * task_heads;
    p->queries = p->partial_sum + tasks * task_heads;
    return 0;
}

int attention_plan_slots(Plan *p, const Cache *c, const int64_t *slots, int32_t *table, const int32_t *seq_lens,
                         int batch, int splits, float *floats) {
    for (int b = 0; b < batch; b++) table[b] = (int32_t)slots[b];
    return attention_plan(p, c, table, 1, seq_lens, NULL, 0, batch, splits, floats);
}

int64_t attention_floats(const Cache *c, int batch, int splits) {
    int64_t task_heads = c->heads / c->kv_heads * c->kv_per_task;
    int64_t tasks = (int64_t)batch * (c->kv_heads / c->kv_per_task) * splits;
    return tasks * task_heads * (c->dv + 2) + (int64_t)batch * c->heads * c->dk;
}

/* query head h of sequence b, dk elements of q_row in the cache's dtype, times scale into the plan as fp32 */
void attention_query(const Plan *p, int b, int h, const void *q_row, float scale) {
    float *query = p->queries + ((int64_t)b * p->c.heads + h) * p->c.dk;
    for (int d = 0; d < p->c.dk; d++) query[d] = scale * load1(q_row, d, p->c.dtype);
}

/* one task's partial; work: TILE * (dk + dv) floats of the calling thread's */
void attention_task(const Plan *p, int64_t task, float *work) {
    const Cache *c = &p->c;
    int split = (int)(task % p->splits), chunk = (int)(task / p->splits % p->chunks);
    int b = (int)(task / p->splits / p->chunks), task_heads = p->task_heads;
    /* the visible keys, numbered 0..count-1: the sinks [0, sink_count), then the span's positions span,
     * span + stride, ... before len */
    int64_t len = p->seq_lens[b], span = p->starts ? p->starts[b] : 0, sink_count = p->sinks < span ? p->sinks : span;
    int64_t count = sink_count + (len > span ? (len - 1 - span) / c->stride + 1 : 0);
    int64_t per_split = (count + p->splits - 1) / p->splits;
    int64_t first = split * per_split, last = first + per_split < count ? first + per_split : count;
    float *m = p->partial_max + task * task_heads, *l = p->partial_sum + task * task_heads;
    float *o = p->partial + task * task_heads * c->dv;
    const float *q_task = p->queries + ((int64_t)b * c->heads + chunk * task_heads) * c->dk;
    const int32_t *table_row = p->table + b * p->table_stride;
    reset_partial(task_heads, c->dv, o, m, l); /* an empty split (a short sequence) keeps weight 0 */
    if (first < sink_count) /* the part of this split among the sinks */
        attend_split(c, table_row, chunk * c->kv_per_task, first, last < sink_count ? last : sink_count, q_task, o, m,
                     l, work);
    if (last > sink_count) /* the part in the span */
        attend_split(c, table_row, chunk * c->kv_per_task,
                     span + ((first > sink_count ? first : sink_count) - sink_count) * c->stride,
                     span + (last - sink_count - 1) * c->stride + 1, q_task, o, m, l, work);
}

/* head h of sequence b: its splits merged by their log-sum-exp into out[b * out_b + h * out_h ...] (the cache's
 * dtype); split 0 always holds a key (seq_lens >= 1) */
void attention_merge(const Plan *p, int b, int h, void *out, int64_t out_b, int64_t out_h) {
    int dv = p->c.dv, task_heads = p->task_heads, splits = p->splits;
    float top = -INFINITY, total = 0.0f, acc[MAX_DIM];
    int64_t first_row = ((int64_t)b * p->chunks + h / task_heads) * splits * task_heads + h % task_heads;
    for (int s = 0; s < splits; s++) {
        float m = p->partial_max[first_row + (int64_t)s * task_heads];
        top = m > top ? m : top;
    }
    memset(acc, 0, sizeof(float) * dv);
    for (int s = 0; s < splits; s++) {
        int64_t row = first_row + (int64_t)s * task_heads;
        if (p->partial_sum[row] == 0.0f) continue;
        float w = expf(p->partial_max[row] - top);
        total += w * p->partial_sum[row];
        for (int d = 0; d < dv; d++) acc[d] += w * p->partial[row * dv + d];
    }
    for (int d = 0; d < dv; d++) store1(out, b * out_b + h * out_h + d, acc[d] / total, p->c.dtype);
}

int decode_attention(const void *q, int64_t q_b, int64_t q_h, const void *k, int64_t k_block, int64_t k_pos,
                     int64_t k_head, const void *v, int64_t v_block, int64_t v_pos, int64_t v_head,
                     const void *ks, int64_t ks_block, int64_t ks_pos, int64_t ks_head,
                     const void *vs, int64_t vs_block, int64_t vs_pos, int64_t vs_head,
                     const int32_t *table, int64_t table_stride, int64_t block_size, const int32_t *seq_lens,
                     const int32_t *starts, int64_t sinks, int64_t stride, int64_t ring, int batch, int heads,
                     int kv_heads, int kv_per_task, int dk, int dv,
                     float scale, int splits, void *out, int64_t out_b, int64_t out_h, int dtype, int threads,
                     int fp8_rows, int64_t ks_part, int k_split) {
    Cache c = {k, v, k_block, k_pos, k_head, v_block, v_pos, v_head, ks, vs, ks_block, ks_pos, ks_head, vs_block,
               vs_pos, vs_head, ks_part, k_split, block_size, stride, ring, heads, kv_heads, kv_per_task, dk, dv,
               dtype, fp8_rows};
    Plan p;
    if (kv_heads < 1 || splits < 1 || kv_per_task < 1 || kv_heads % kv_per_task) return -1;
    int64_t work_floats = (int64_t)TILE * (dk + dv);
    float *floats = malloc(sizeof(float) * attention_floats(&c, batch, splits));
    float *workspace = malloc(sizeof(float) * threads * work_floats); /* one tile buffer per thread */
    if (!floats || !workspace || attention_plan(&p, &c, table, table_stride, seq_lens, starts, sinks, batch, splits,
                                                floats)) {
        free(floats);
        free(workspace);
        return -1;
    }
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++) attention_query(&p, b, h, (const char *)q + (b * q_b + h * q_h) *
                                                        (dtype == F32 ? 4 : 2), scale);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < p.tasks; task++)
        attention_task(&p, task, workspace + omp_get_thread_num() * work_floats);
    for (int b = 0; b < batch; b++)
        for (int h = 0; h < heads; h++) attention_merge(&p, b, h, out, out_b, out_h);
    free(floats);
    free(workspace);
    return 0;
}
