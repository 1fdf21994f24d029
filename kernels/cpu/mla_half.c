/* An MLA layer's half of a decode block (DeepSeek-V2's multi-head latent attention, absorbed: the query folded
 * through W_UK so keys stay in the latent space, W_UV applied after the attention) in one OpenMP parallel region
 * (kernels/cpu/ops.cpp's mla_block; kernels/cpu_blocks.py says when it runs). Each thread normalises x itself and
 * takes whole heads of q (GEMV rows, rotary on the rotary part, the fold through that head's W_UK) or the latent
 * projection (GEMV rows, the latent's RMSNorm, rotary on the key's rotary part, the cache write); after decode
 * attention over the latent cache, whole heads of W_UV, then tiles of o with the residual. The composed half ran
 * ~25 torch ops between its kernels (two einsums, two cats, views) and three GEMV regions: a `small` MLA half took
 * 409 µs against 242 for GQA's on less weight. The folds sum in fp32 and round to the dtype once, where torch's
 * einsum (a batched matmul) sums in its own order: results differ from the modules' path in the last bits. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "floats.h"
#include "gemv.h"
#include "norm_rope.h"

/* out[r] = dtype(sum_n q[n] w[n][r]) over n < nope: one head's query folded through its W_UK [nope, rank] (rows
 * `ld` elements apart), every product summed in fp32 */
static void fold(const void *q, const void *w, int64_t ld, int64_t nope, int64_t rank, int dtype, float *acc,
                 void *out) {
    memset(acc, 0, sizeof(float) * rank);
    for (int64_t n = 0; n < nope; n++) {
        float qn = load1(q, n, dtype);
        const char *row = (const char *)w + n * ld * (dtype == F32 ? 4 : 2);
        for (int64_t r = 0; r < rank; r++) acc[r] += qn * load1(row, r, dtype);
    }
    for (int64_t r = 0; r < rank; r++) store1(out, r, acc[r], dtype);
}

/* x [batch, width] (contiguous, fp32 or bf16) + o(absorbed MLA): wq [heads * (nope + rope), width], wkv_a
 * [rank + rope, width], kv_norm [rank], wkv_b [heads * (nope + v_dim), rank], wo [width, heads * v_dim], all in
 * dtype; positions [batch]; inv_freq [rope / 2]; the latent cache [slots, 1, rows, rank + rope] at element strides
 * (slot, row), of cache_rows rows; this step's latent row goes to row rows[b] of slot slots[b] (checked by the
 * caller), and sequence b attends to its slot's first lengths[b] rows in `splits` key splits. out [batch, width].
 * row_ahead: gemv_part's. Returns 0, -1 for sizes beyond the kernels, -2 out of memory. */
int mla_half(const void *x, int64_t batch, int64_t width, int dtype, const void *norm, float eps, const void *wq,
             const void *wkv_a, const void *kv_norm, float kv_eps, const void *wkv_b, const void *wo,
             const int64_t *positions, const float *inv_freq, void *cache, int64_t slot_stride, int64_t row_stride,
             int64_t cache_rows, const int64_t *slots, const int64_t *rows, const int32_t *lengths, float scale,
             int64_t heads, int64_t nope, int64_t rope, int64_t rank, int64_t v_dim, int splits, void *out,
             int64_t row_ahead, int threads) {
    if ((dtype != F32 && dtype != BF16) || rope % 2 || rope / 2 > MAX_HALF || rank + rope > MAX_DIM || batch < 1 ||
        heads > MAX_HEADS)
        return -1;
    int64_t elem = dtype == F32 ? 4 : 2, half = rope / 2, q_row = nope + rope, kv_row = rank + rope;
    int widen = gemv_widens(dtype, 0);
    Cache c = {cache, cache, slot_stride, row_stride, 0, slot_stride, row_stride, 0, NULL, NULL, 0, 0, 0, 0, 0, 0, 0,
               (int)kv_row, cache_rows, 1, 0, (int)heads, 1, 1, (int)kv_row, (int)rank, dtype, 0};
    /* shared: q and the latent projection as projected, the attention's output, W_UV's, the slots as a block
     * table, the plan; per thread: x normalised (and its fp32 copy), the attention's or W_UV's output as fp32, a
     * tile's rows, cosines and sines, one head's folded query */
    int64_t q_bytes = aligned(batch * heads * q_row * elem), kv_bytes = aligned(batch * kv_row * elem);
    int64_t att_bytes = aligned(batch * heads * rank * elem), v_bytes = aligned(batch * heads * v_dim * elem);
    int64_t plan_bytes = aligned(sizeof(float) * attention_floats(&c, (int)batch, splits));
    int64_t shared_bytes = q_bytes + kv_bytes + att_bytes + v_bytes + aligned(sizeof(int32_t) * batch) + plan_bytes;
    int64_t h_bytes = aligned(batch * width * elem), wide_bytes = aligned(sizeof(float) * batch * width);
    int64_t wide_att = aligned(sizeof(float) * batch * heads * (rank > v_dim ? rank : v_dim));
    int64_t work_bytes = aligned(sizeof(float) * TILE * (kv_row + rank));
    int64_t angle_bytes = aligned(sizeof(float) * batch * half);
    int64_t fold_bytes = aligned(sizeof(float) * rank) + aligned(kv_row * elem);
    int64_t thread_bytes = h_bytes + wide_bytes + wide_att + work_bytes + 2 * angle_bytes + fold_bytes;
    char *memory = aligned_alloc(64, shared_bytes + threads * thread_bytes);
    if (!memory) return -2;
    char *q_raw = memory, *kv_raw = q_raw + q_bytes, *att = kv_raw + kv_bytes, *values = att + att_bytes;
    int32_t *table = (int32_t *)(values + v_bytes);
    float *plan_floats = (float *)((char *)table + aligned(sizeof(int32_t) * batch));
    Plan plan;
    if (attention_plan_slots(&plan, &c, slots, table, lengths, (int)batch, splits, plan_floats)) {
        free(memory);
        return -1;
    }
    Share o_shares[threads]; /* out_proj's rows, claimed as they are done (claims.h) */
    shares_init(o_shares, width, 4, threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        char *h = memory + shared_bytes + t * thread_bytes;
        float *h_wide = (float *)(h + h_bytes), *wide = (float *)((char *)h_wide + wide_bytes);
        float *work = (float *)((char *)wide + wide_att), *cosines = (float *)((char *)work + work_bytes);
        float *sines = (float *)((char *)cosines + angle_bytes), *acc = (float *)((char *)sines + angle_bytes);
        char *query = (char *)acc + aligned(sizeof(float) * rank);
        rms_norm(x, batch, width, width, dtype, norm, eps, h);
        if (widen)
            for (int64_t i = 0; i < batch * width; i++) h_wide[i] = load1(h, i, dtype);
        const void *h_in = widen ? (const void *)h_wide : h;
        for (int64_t b = 0; b < batch; b++)
            rotary_angles((float)positions[b], inv_freq, half, dtype, cosines + b * half, sines + b * half);
        /* units: the latent projection, then q's heads; a thread takes a contiguous run of them */
        for (int64_t u = (heads + 1) * t / n; u < (heads + 1) * (t + 1) / n; u++) {
            if (u == 0) {
                gemv_part(h_in, batch, width, width, dtype, wkv_a, NULL, 0, 0, kv_row, kv_raw, kv_row, row_ahead);
                for (int64_t b = 0; b < batch; b++) {
                    char *row = kv_raw + b * kv_row * elem, *latent = query;
                    rms_norm(row, 1, rank, rank, dtype, kv_norm, kv_eps, latent);
                    rotary_row(row + rank * elem, latent + rank * elem, cosines + b * half, sines + b * half, half,
                               dtype);
                    memcpy((char *)cache + (slots[b] * slot_stride + rows[b] * row_stride) * elem, latent,
                           kv_row * elem);
                }
                continue;
            }
            int64_t head = u - 1;
            gemv_part(h_in, batch, width, width, dtype, wq, NULL, 0, head * q_row, (head + 1) * q_row, q_raw,
                      heads * q_row, row_ahead);
            for (int64_t b = 0; b < batch; b++) {
                const char *q = q_raw + (b * heads + head) * q_row * elem;
                const char *w_uk = (const char *)wkv_b + head * (nope + v_dim) * rank * elem;
                fold(q, w_uk, rank, nope, rank, dtype, acc, query);
                rotary_row(q + nope * elem, query + rank * elem, cosines + b * half, sines + b * half, half, dtype);
                attention_query(&plan, (int)b, (int)head, query, scale);
            }
        }
        prefetch_share(wo, width, heads * v_dim * elem, t, n); /* o's, while they attend */
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < plan.tasks; task++) attention_task(&plan, task, work);
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++)
            attention_merge(&plan, (int)(bh / heads), (int)(bh % heads), att, heads * rank, rank);
        /* W_UV: whole heads, each a GEMV of the head's attention output against its v_dim rows */
        if (widen)
            for (int64_t i = 0; i < batch * heads * rank; i++) wide[i] = load1(att, i, dtype);
#pragma omp for schedule(static)
        for (int64_t head = 0; head < heads; head++)
            gemv_part(widen ? (const void *)(wide + head * rank) : att + head * rank * elem, batch, rank, heads * rank,
                      dtype, (const char *)wkv_b + (head * (nope + v_dim) + nope) * rank * elem, NULL, 0, 0, v_dim,
                      values + head * v_dim * elem, heads * v_dim, row_ahead);
        /* o: rows claimed as each thread is done (claims.h), then the residual in dtype */
        if (widen)
            for (int64_t i = 0; i < batch * heads * v_dim; i++) wide[i] = load1(values, i, dtype);
        gemv_residual_share(widen ? (const void *)wide : values, batch, heads * v_dim, heads * v_dim, dtype, wo, NULL,
                            0, width, x, out, row_ahead, o_shares, t, threads);
    }
    free(memory);
    return 0;
}
