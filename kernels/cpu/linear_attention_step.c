/* One decode token of causal linear attention with a normalizer (Katharopoulos et al. 2020; the reference is
 * kernels/linear_attention.py's linear_attention_step_ref) on a state cache's rows, in place: for sequence i and head
 * h, with S = state[slots[i], h] [dk, dv] and z = normalizer[slots[i], h] [dk], both fp32,
 *   S += k v^T,  z += k,  out = (q S) / (q . z + eps).
 * q, k [B, H, dk] and v [B, H, dv] are fp32, contiguous and already feature-mapped; out [B, H, dv] fp32. One pass
 * over S: a row is updated and read back for the numerator while in L1. The module's path read each sequence's state
 * out of the cache, made a new S, copied it back and wrote the cache again: five passes over 128 KiB a layer
 * (`small`: 8 heads of 64 x 64). Threads split the (sequence, head) pairs. ISO C mode (-std=c11) keeps k * v + S as
 * two roundings, as torch's separate product and sum are. */
#include <stdint.h>

int linear_attention_step(const float *q, const float *k, const float *v, float *state, int64_t state_slot,
                          int64_t state_head, float *normalizer, int64_t normalizer_slot, int64_t normalizer_head,
                          const int64_t *slots, int batch, int heads, int dk, int dv, float eps, float *out,
                          int threads) {
    if (batch < 0 || heads < 1 || dk < 1 || dv < 1 || dv > 4096) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < (int64_t)batch * heads; task++) {
        int64_t i = task / heads, h = task % heads;
        float *s = state + slots[i] * state_slot + h * state_head;
        float *z = normalizer + slots[i] * normalizer_slot + h * normalizer_head;
        const float *qh = q + task * dk, *kh = k + task * dk, *vh = v + task * dv;
        float numerator[4096], denominator = 0.0f;
        for (int c = 0; c < dv; c++) numerator[c] = 0.0f;
        for (int r = 0; r < dk; r++) {
            float *row = s + (int64_t)r * dv, kr = kh[r], qr = qh[r];
            for (int c = 0; c < dv; c++) {
                row[c] = row[c] + kr * vh[c];
                numerator[c] += qr * row[c];
            }
            z[r] = z[r] + kr;
            denominator += qr * z[r];
        }
        for (int c = 0; c < dv; c++) out[task * dv + c] = numerator[c] / (denominator + eps);
    }
    return 0;
}
