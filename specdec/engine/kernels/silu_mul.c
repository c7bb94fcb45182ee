/* The gated MLP's activation, silu(gate) * up, in one pass over the fused gate|up projection
 * (specdec/engine/kernels): PyTorch takes a chunk, silu and a multiply (three operators) per
 * layer. Elementwise, with our own exponential (fixed_math.h): the same bits on every build.
 *
 * gate_up [T][2 I] (gate then up, as w13 stores them) -> out [T][I] */
#include "fixed_math.h"

static inline __attribute__((always_inline)) void silu_mul_row(const float *gate_up, float *out, long I) {
    for (long i = 0; i < I; i++) out[i] = silu_fixed(gate_up[i]) * gate_up[I + i];
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void row_avx512(const float *g, float *o, long I) { silu_mul_row(g, o, I); }
__attribute__((target("avx2"))) static void row_avx2(const float *g, float *o, long I) { silu_mul_row(g, o, I); }
#endif
static void row_baseline(const float *g, float *o, long I) { silu_mul_row(g, o, I); }

int silu_mul(const float *gate_up, float *out, long T, long I, int threads) {
    void (*kernel)(const float *, float *, long) = row_baseline;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) kernel = row_avx512;
    else if (__builtin_cpu_supports("avx2")) kernel = row_avx2;
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= 64)
    for (long t = 0; t < T; t++) kernel(gate_up + t * 2 * I, out + t * I, I);
    return 0;
}
