/* The row-wise kernels of the invariant forward (rms_norm.c, rope_cache.c, silu_mul.c), each the
 * widest vector path this CPU runs (vector_paths.h): called by their own per-op entry points and
 * by the forward plan (forward_plan.c), so both perform the same operations on a row. */
#ifndef SPECDEC_ROW_KERNELS_H
#define SPECDEC_ROW_KERNELS_H

#include <stdint.h>

/* residual != NULL: x += residual (in place) first; out = x * (1 / sqrtf(mean(x^2) + eps)) * weight */
typedef void (*norm_kernel)(float *x, const float *residual, const float *weight, float *out, long n, float eps);
norm_kernel rms_norm_row_kernel(void);
/* the per-head query and key norms of one qkv row, in place (Qwen3, Gemma 3) */
void head_norms_row(norm_kernel norm, float *row, long H, long KVH, long D, const float *q_norm, const float *k_norm,
                    float eps);

/* One token: RoPE on its H query heads (-> q_out [H][D]) and KVH key heads (-> k [h * head_stride]),
 * its values copied to v [h * head_stride]; row [(H + 2 KVH) D], cos and sin [D]. */
typedef void (*rope_kernel)(const float *row, long H, long KVH, long D, const float *cos, const float *sin, float *q_out,
                            float *k, float *v, long head_stride);
rope_kernel rope_row_kernel(void);

/* out [I] = silu(gate_up[:I]) * gate_up[I:] */
typedef void (*silu_kernel)(const float *gate_up, float *out, long I);
silu_kernel silu_mul_row_kernel(void);
silu_kernel gelu_mul_row_kernel(void); /* out [I] = gelu_tanh(gate_up[:I]) * gate_up[I:] (fixed_math.h) */

#endif
