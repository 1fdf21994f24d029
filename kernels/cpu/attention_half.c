/* An attention layer's half of a decode block, x + o(attention(RMSNorm(x))), in one OpenMP parallel region
 * (kernels/cpu/ops.cpp's attention_block; kernels/cpu_blocks.py says when it runs). The same parts as the composed
 * half (RMSNorm, the q, k, v GEMVs, rotary, the cache writes, decode attention, the o GEMV and the residual), each
 * output computed as there, bit for bit, but with the threads kept between them: each thread normalises x itself,
 * then takes whole heads of q, k and v (each head's GEMV rows, its rotary and its cache write, no wait between), so
 * the only waits are before the attention, after it, and after its merge. The composed half ran five parallel
 * regions with the norm, rotary, cache writes and glue serial between them: on a 2-core EPYC, `base` bf16, a
 * thread's time went 27% to waiting, against 33% to the GEMV tiles. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "floats.h"
#include "gemv.h"
#include "norm_rope.h"

enum { WQ, WK, WV, WO };

/* x [batch, width] (contiguous, dtype fp32 or bf16) + o(attention): weights[WQ..WO] [rows, width] in dtype, or
 * int8 with scales[i] (s_dtypes[i]) not NULL; weights[WK] and [WV] NULL for a layer that reads another layer's cache.
 * positions [batch]; inv_freq [head_dim / 2]; caches [slots, kv_heads, rows, head_dim] at element strides
 * cache_strides (k's slot, head, row, then v's), of cache_rows rows; this step's key and value go to row rows[b] of
 * slot slots[b] (checked by the caller), and sequence b attends to its slot's first lengths[b] rows in `splits` key
 * splits. out [batch, width] in dtype; row_ahead: gemv_part's. Returns 0, -1 for sizes beyond the kernels, -2 out
 * of memory. */
int attention_half(const void *x, int64_t batch, int64_t width, int dtype, const void *norm, float eps,
                   const void *const *weights, const void *const *scales, const int *s_dtypes, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, const int64_t *positions, const float *inv_freq,
                   void *k_cache, void *v_cache, const int64_t *cache_strides, int64_t cache_rows,
                   const int64_t *slots, const int64_t *rows, const int32_t *lengths, float scale, int splits,
                   void *out, int64_t row_ahead, int threads) {
    if ((dtype != F32 && dtype != BF16) || head_dim % 2 || head_dim / 2 > MAX_HALF || batch < 1)
        return -1;
    int64_t elem = dtype == F32 ? 4 : 2, half = head_dim / 2, q_width = heads * head_dim;
    int64_t kv_width = kv_heads * head_dim;
    int writes = weights[WK] != NULL, widen[4];
    for (int i = 0; i < 4; i++) widen[i] = weights[i] && gemv_widens(dtype, scales[i] != NULL);
    Cache c = {k_cache, v_cache, cache_strides[0], cache_strides[2], cache_strides[1], cache_strides[3],
               cache_strides[5], cache_strides[4], NULL, NULL, 0, 0, 0, 0, 0, 0, 0, (int)head_dim, cache_rows, 1, 0,
               (int)heads, (int)kv_heads, 1, (int)head_dim, (int)head_dim, dtype, 0};
    /* shared: q before and after rotary, k and v, the attention's output, the slots as a block table, the plan;
     * per thread: x normalised (and its fp32 copy), the attention's output as fp32, a tile's rows, cosines and
     * sines, one rotated key */
    int64_t q_bytes = aligned(batch * q_width * elem), kv_bytes = aligned(batch * kv_width * elem);
    int64_t plan_bytes = aligned(sizeof(float) * attention_floats(&c, (int)batch, splits));
    int64_t shared_bytes = 3 * q_bytes + 2 * kv_bytes + aligned(sizeof(int32_t) * batch) + plan_bytes;
    int64_t h_bytes = aligned(batch * width * elem), wide_bytes = aligned(sizeof(float) * batch * width);
    int64_t att_wide_bytes = aligned(sizeof(float) * batch * q_width);
    int64_t work_bytes = aligned(sizeof(float) * TILE * 2 * head_dim);
    int64_t angle_bytes = aligned(sizeof(float) * batch * half);
    int64_t thread_bytes = h_bytes + wide_bytes + att_wide_bytes + work_bytes + 2 * angle_bytes +
                           aligned(head_dim * elem);
    char *memory = aligned_alloc(64, shared_bytes + threads * thread_bytes);
    if (!memory) return -2;
    char *q_raw = memory, *q_rot = q_raw + q_bytes, *att = q_rot + q_bytes, *k_raw = att + q_bytes;
    char *v_raw = k_raw + kv_bytes;
    int32_t *table = (int32_t *)(v_raw + kv_bytes);
    float *plan_floats = (float *)((char *)table + aligned(sizeof(int32_t) * batch));
    Plan plan;
    if (attention_plan_slots(&plan, &c, slots, table, lengths, (int)batch, splits, plan_floats)) {
        free(memory);
        return -1;
    }
    /* q's heads, then k's and v's, and o's rows: each thread claims them as it is done (claims.h) */
    Share unit_shares[threads], o_shares[threads];
    shares_init(unit_shares, heads + (writes ? 2 * kv_heads : 0), 1, threads);
    shares_init(o_shares, width, 4, threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        char *mine = memory + shared_bytes + t * thread_bytes;
        char *h = mine;
        float *h_wide = (float *)(h + h_bytes), *att_wide = (float *)((char *)h_wide + wide_bytes);
        float *work = (float *)((char *)att_wide + att_wide_bytes), *cosines = (float *)((char *)work + work_bytes);
        float *sines = (float *)((char *)cosines + angle_bytes);
        char *rotated = (char *)sines + angle_bytes;
        rms_norm(x, batch, width, width, dtype, norm, eps, h);
        if (widen[WQ] || widen[WK] || widen[WV])
            for (int64_t i = 0; i < batch * width; i++) h_wide[i] = load1(h, i, dtype);
        for (int64_t b = 0; b < batch; b++)
            rotary_angles((float)positions[b], inv_freq, half, dtype, cosines + b * half, sines + b * half);
        int64_t u, u_end;
        while (claim(unit_shares, t, threads, 1, 1, &u, &u_end)) {
            int kind = u < heads ? WQ : u < heads + kv_heads ? WK : WV;
            int64_t head = kind == WQ ? u : kind == WK ? u - heads : u - heads - kv_heads;
            int64_t ld = kind == WQ ? q_width : kv_width;
            char *raw = kind == WQ ? q_raw : kind == WK ? k_raw : v_raw;
            gemv_part(widen[kind] ? (const void *)h_wide : h, batch, width, width, dtype, weights[kind], scales[kind],
                      s_dtypes[kind], head * head_dim, (head + 1) * head_dim, raw, ld, row_ahead);
            for (int64_t b = 0; b < batch; b++) {
                char *row = raw + (b * ld + head * head_dim) * elem;
                if (kind == WQ) {
                    char *q = q_rot + (b * q_width + head * head_dim) * elem;
                    rotary_row(row, q, cosines + b * half, sines + b * half, half, dtype);
                    attention_query(&plan, (int)b, (int)head, q, scale);
                    continue;
                }
                const int64_t *s = cache_strides + (kind == WK ? 0 : 3);
                char *cache = (char *)(kind == WK ? k_cache : v_cache) +
                              (slots[b] * s[0] + head * s[1] + rows[b] * s[2]) * elem;
                if (kind == WK) {
                    rotary_row(row, rotated, cosines + b * half, sines + b * half, half, dtype);
                    row = rotated;
                }
                memcpy(cache, row, head_dim * elem);
            }
        }
        prefetch_share(weights[WO], width, q_width * (scales[WO] ? 1 : elem), t, n); /* o's, while they attend */
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < plan.tasks; task++) attention_task(&plan, task, work);
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++)
            attention_merge(&plan, (int)(bh / heads), (int)(bh % heads), att, q_width, head_dim);
        /* o: rows claimed as each thread is done (claims.h), then the residual in dtype */
        if (widen[WO])
            for (int64_t i = 0; i < batch * q_width; i++) att_wide[i] = load1(att, i, dtype);
        gemv_residual_share(widen[WO] ? (const void *)att_wide : att, batch, q_width, q_width, dtype, weights[WO],
                            scales[WO], s_dtypes[WO], width, x, out, row_ahead, o_shares, t, threads);
    }
    free(memory);
    return 0;
}
