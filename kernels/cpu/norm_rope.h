/* RMSNorm and rotary's parts (kernels/cpu/norm_rope.c), for the kernels that run them inside a parallel region of
 * their own (kernels/cpu/attention_half.c). */
#ifndef ARCHZOO_NORM_ROPE_H
#define ARCHZOO_NORM_ROPE_H
#include <stdint.h>

#define MAX_HALF 512 /* rotary: head_dim <= 1024 */

int rms_norm(const void *x, int64_t rows, int64_t dim, int64_t ldx, int dtype, const void *weight, float eps,
             void *out);
/* the cosines and sines of one position's angles (fp32 position x frequency), rounded to dtype as torch's are */
void rotary_angles(float position, const float *inv_freq, int64_t half, int dtype, float *cosines, float *sines);
/* one head's row of 2 * half elements rotated (rotate-half layout) with those, in dtype */
void rotary_row(const void *in, void *out, const float *cosines, const float *sines, int64_t half, int dtype);
#endif
