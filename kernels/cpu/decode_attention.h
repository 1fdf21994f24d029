/* Decode attention's parts (kernels/cpu/decode_attention.c), for the kernels that run it inside a parallel region of
 * their own (kernels/cpu/attention_half.c): a plan of tasks, each task's partial, each head's merge. */
#ifndef ARCHZOO_DECODE_ATTENTION_H
#define ARCHZOO_DECODE_ATTENTION_H
#include <stdint.h>

/* keys per step: their scores, softmax and values for every head of a group; 64 rather than 32 lets a tile's
 * prefetches of the next run twice as far ahead (decode_attention.c's top has the figures) */
#define TILE 64
#define MAX_HEADS 128  /* query heads per KV head (MLA: all heads share one latent) */
#define MAX_DIM 1024

/* Where the keys and values live (decode_attention.c's top says how a key is found) */
typedef struct {
    const void *k, *v;
    int64_t k_block, k_pos, k_head, v_block, v_pos, v_head;
    const void *ks, *vs; /* one-byte rows' scales (NULL: float rows in dtype) */
    int64_t ks_block, ks_pos, ks_head, vs_block, vs_pos, vs_head;
    int64_t ks_part; /* a key row's second scale, this far from its first (used past column k_split) */
    int k_split;     /* key columns under a row's first scale: dk, or the latent's width */
    int64_t block_size;
    int64_t stride, ring; /* keys walked every stride-th position; a ring's rows (0: none) */
    int heads, kv_heads, kv_per_task, dk, dv, dtype;
    int fp8; /* rows are float8 e4m3 (1) or int8 (0) */
} Cache;

/* One call's tasks and their partials */
typedef struct {
    Cache c;
    const int32_t *table, *seq_lens, *starts;
    int64_t table_stride, sinks;
    int batch, splits, chunks, task_heads;
    int64_t tasks;
    float *partial, *partial_max, *partial_sum, *queries;
} Plan;

int64_t attention_floats(const Cache *c, int batch, int splits);
int attention_plan(Plan *p, const Cache *c, const int32_t *table, int64_t table_stride, const int32_t *seq_lens,
                   const int32_t *starts, int64_t sinks, int batch, int splits, float *floats);
/* a contiguous cache's plan: sequence b's keys in the slot slots[b] (written as the block table, `table`, one entry
 * a sequence), the first seq_lens[b] of them */
int attention_plan_slots(Plan *p, const Cache *c, const int64_t *slots, int32_t *table, const int32_t *seq_lens,
                         int batch, int splits, float *floats);
void attention_query(const Plan *p, int b, int h, const void *q_row, float scale);
void attention_task(const Plan *p, int64_t task, float *work);
void attention_merge(const Plan *p, int b, int h, void *out, int64_t out_b, int64_t out_h);
#endif
