/* Batch-invariant attention for the CPU target (specdec/engine/kernels/__init__.py).
 *
 * One query row's output depends only on that row's query and on the keys and values of the
 * columns it may attend to, taken in column order: never on how many rows share the call, how
 * many columns the call spans, or which columns between them are masked. So a token verified
 * inside a draft tree (its ancestors at tree columns, siblings masked in between) gets bitwise
 * the output it gets when decoded alone (its ancestors committed to consecutive columns), and
 * with batch-invariant linear kernels the whole forward is invariant: greedy speculation then
 * equals the baseline by construction.
 *
 * Every reduction runs in a fixed order: the dot products over the head dimension in LANES
 * independent partial sums combined the same way every time; the softmax max, the exponent sum
 * and the weighted sum of values column after column, masked columns skipped (not added as
 * zeros). Rows run in parallel (OpenMP); a row is never split.
 *
 * q   [B, H, N, D]   strides q_b, q_h, q_n; D contiguous
 * k,v [B, KVH, C, D] strides kv_b, kv_h, kv_c (the same for k and v); D contiguous
 * allowed [B, N, C]  bytes (0 / 1), strides m_b, m_n; C contiguous
 * out [B, H, N, D]   contiguous
 * Head h reads kv head h / (H / KVH) (grouped-query attention).
 */
#include <math.h>
#include <stdlib.h>

#define LANES 16

static float dot(const float *a, const float *b, long n) {
    float part[LANES] = {0};
    long d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[d + j] * b[d + j];
    for (; d < n; d++) part[d % LANES] += a[d] * b[d];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) part[j] += part[j + width];
    return part[0];
}

int invariant_attention(const float *q, long q_b, long q_h, long q_n,
                        const float *k, const float *v, long kv_b, long kv_h, long kv_c,
                        const unsigned char *allowed, long m_b, long m_n,
                        float *out, long B, long H, long KVH, long N, long C, long D,
                        float scale, int threads) {
    if (H % KVH != 0) return 1;
    const long group = H / KVH, rows = B * H * N;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *score = malloc(sizeof(float) * (C > 0 ? C : 1));
        float *acc = malloc(sizeof(float) * (D > 0 ? D : 1));
        if (score == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long row = 0; row < rows; row++) {
            if (score == NULL || acc == NULL) continue;
            const long b = row / (H * N), h = (row / N) % H, n = row % N;
            const float *qr = q + b * q_b + h * q_h + n * q_n;
            const float *kr = k + b * kv_b + (h / group) * kv_h;
            const float *vr = v + b * kv_b + (h / group) * kv_h;
            const unsigned char *mask = allowed + b * m_b + n * m_n;
            float *o = out + ((b * H + h) * N + n) * D;
            float best = -INFINITY;
            for (long c = 0; c < C; c++) {
                if (!mask[c]) continue;
                score[c] = dot(qr, kr + c * kv_c, D) * scale;
                if (score[c] > best) best = score[c];
            }
            for (long d = 0; d < D; d++) acc[d] = 0.0f;
            float total = 0.0f;
            for (long c = 0; c < C; c++) {
                if (!mask[c]) continue;
                const float weight = expf(score[c] - best);
                const float *vc = vr + c * kv_c;
                total += weight;
                for (long d = 0; d < D; d++) acc[d] += weight * vc[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f; /* a row with no column gets zeros */
            for (long d = 0; d < D; d++) o[d] = acc[d] * inv;
        }
        free(score);
        free(acc);
    }
    return failed ? 2 : 0;
}
