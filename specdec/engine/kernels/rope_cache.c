/* RoPE on the new tokens' queries and keys, and their keys and values written to the KV cache,
 * in one pass (specdec/engine/kernels): on the invariant forward this replaces a dozen PyTorch
 * operators per layer (views, roll, multiply-adds, transposes, two scattered cache writes), about
 * a third of a decode step's time outside the matmuls. Per row, elementwise: a row's bits never
 * depend on the rows beside it.
 *
 * qkv   [T][(H + 2 KVH) D]  one row per new token: queries, keys, values
 * cos, sin [T][D]           the row's rotation (sin's first half negated: HF's rotate-half as a roll)
 * q_out [T][H D]            the rotated queries
 * k, v  the layer's cache [slots][KVH][capacity][D], strides s_slot, s_head, s_col; row t writes
 *       column column[t] of slot slot[t] (rotated key, value)
 */
#include <stdint.h>

#include "row_kernels.h"
#include "vector_paths.h"

static inline __attribute__((always_inline)) void rotate(const float *x, const float *cos, const float *sin, float *out,
                                                         long D) {
    const long half = D / 2;
    for (long i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (long i = half; i < D; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static inline __attribute__((always_inline)) void rope_row(const float *row, long H, long KVH, long D, const float *cos,
                                                           const float *sin, float *q_out, float *k, float *v,
                                                           long head_stride) {
    for (long h = 0; h < H; h++) rotate(row + h * D, cos, sin, q_out + h * D, D);
    for (long h = 0; h < KVH; h++) {
        rotate(row + (H + h) * D, cos, sin, k + h * head_stride, D);
        const float *value = row + (H + KVH + h) * D;
        float *dst = v + h * head_stride;
        for (long i = 0; i < D; i++) dst[i] = value[i];
    }
}

VECTOR_PATHS(rope_row, rope_kernel,
             (const float *row, long H, long KVH, long D, const float *cos, const float *sin, float *q_out, float *k,
              float *v, long head_stride),
             (row, H, KVH, D, cos, sin, q_out, k, v, head_stride))

rope_kernel rope_row_kernel(void) { return rope_row_pick(); }

int rope_and_cache(const float *qkv, long T, long H, long KVH, long D, const float *cos, const float *sin, float *q_out,
                   float *k, float *v, long s_slot, long s_head, long s_col, const int64_t *slot,
                   const int64_t *column, int threads) {
    if (D % 2 != 0) return 1;
    const rope_kernel kernel = rope_row_pick();
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= 64)
    for (long t = 0; t < T; t++) {
        const long at = slot[t] * s_slot + column[t] * s_col;
        kernel(qkv + t * (H + 2 * KVH) * D, H, KVH, D, cos + t * D, sin + t * D, q_out + t * H * D, k + at, v + at, s_head);
    }
    return 0;
}
