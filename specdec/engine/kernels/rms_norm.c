/* Row-wise RMSNorm for the CPU target, optionally after a residual add (specdec/engine/kernels).
 *
 * PyTorch's rms_norm runs as six operators per call on CPU (about 30 us at decode shapes, 61 calls
 * a forward); this is one pass. Each row on its own, its sum of squares in LANES partial sums
 * combined in a fixed order: a row's bits never depend on the rows beside it (the forward's
 * invariance, int8_linear.h). Compiled for AVX-512, AVX2 and the baseline with the same float
 * operations (-ffp-contract=off), so every path gives the same bits.
 *
 *   residual != NULL: x[r] += residual[r] (in place: the residual stream), then
 *   out[r] = x[r] * (1 / sqrtf(mean(x[r]^2) + eps)) * weight
 */
#include <math.h>

#include "row_kernels.h"
#include "vector_paths.h"

#define LANES 16

static inline __attribute__((always_inline)) void norm_row(float *x, const float *residual, const float *weight,
                                                           float *out, long n, float eps) {
    if (residual != 0)
        for (long i = 0; i < n; i++) x[i] += residual[i];
    float part[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) part[j] += x[i + j] * x[i + j];
    for (; i < n; i++) part[i % LANES] += x[i] * x[i];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) part[j] += part[j + width];
    const float inverse = 1.0f / sqrtf(part[0] / (float)n + eps);
    for (long k = 0; k < n; k++) out[k] = x[k] * inverse * weight[k];
}

VECTOR_PATHS(norm_row, norm_kernel, (float *x, const float *residual, const float *weight, float *out, long n, float eps),
             (x, residual, weight, out, n, eps))

norm_kernel rms_norm_row_kernel(void) { return norm_row_pick(); }

/* x, residual, out: [rows][n] contiguous; weight [n]. Rows split over threads when there are many. */
int rms_norm_rows(float *x, const float *residual, const float *weight, float *out, long rows, long n, float eps,
                  int threads) {
    const norm_kernel kernel = norm_row_pick();
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (long r = 0; r < rows; r++)
        kernel(x + r * n, residual ? residual + r * n : 0, weight, out + r * n, n, eps);
    return 0;
}

/* Qwen3's and Gemma 3's per-head norms, in place on the fused projection's rows: each of the H query
 * heads of qkv [T][(H + 2 KVH) D] by q_norm [D], each of the KVH key heads by k_norm (values
 * untouched), before RoPE. One head is a row of the norm above. */
void head_norms_row(norm_kernel norm, float *row, long H, long KVH, long D, const float *q_norm, const float *k_norm,
                    float eps) {
    for (long h = 0; h < H; h++) norm(row + h * D, 0, q_norm, row + h * D, D, eps);
    for (long h = 0; h < KVH; h++) norm(row + (H + h) * D, 0, k_norm, row + (H + h) * D, D, eps);
}

int head_norms(float *qkv, long T, long H, long KVH, long D, const float *q_norm, const float *k_norm, float eps,
               int threads) {
    const norm_kernel kernel = norm_row_pick();
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= 64)
    for (long t = 0; t < T; t++) head_norms_row(kernel, qkv + t * (H + 2 * KVH) * D, H, KVH, D, q_norm, k_norm, eps);
    return 0;
}
