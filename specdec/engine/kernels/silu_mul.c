/* The gated MLP's activation, silu(gate) * up (or Gemma's gelu_tanh(gate) * up), in one pass over the fused gate|up projection
 * (specdec/engine/kernels): PyTorch takes a chunk, silu and a multiply (three operators) per
 * layer. Elementwise, with our own exponential (fixed_math.h): the same bits on every build.
 *
 * gate_up [T][2 I] (gate then up, as w13 stores them) -> out [T][I] */
#include "fixed_math.h"
#include "row_kernels.h"
#include "vector_paths.h"

static inline __attribute__((always_inline)) void silu_mul_row(const float *gate_up, float *out, long I) {
    for (long i = 0; i < I; i++) out[i] = silu_fixed(gate_up[i]) * gate_up[I + i];
}

static inline __attribute__((always_inline)) void gelu_mul_row(const float *gate_up, float *out, long I) {
    for (long i = 0; i < I; i++) out[i] = gelu_tanh_fixed(gate_up[i]) * gate_up[I + i];
}

VECTOR_PATHS(silu_mul_row, silu_kernel, (const float *gate_up, float *out, long I), (gate_up, out, I))
VECTOR_PATHS(gelu_mul_row, silu_kernel, (const float *gate_up, float *out, long I), (gate_up, out, I))

silu_kernel silu_mul_row_kernel(void) { return silu_mul_row_pick(); }
silu_kernel gelu_mul_row_kernel(void) { return gelu_mul_row_pick(); }

/* gelu: Gemma's tanh-GELU gate instead of SiLU. */
int silu_mul(const float *gate_up, float *out, long T, long I, int gelu, int threads) {
    const silu_kernel kernel = gelu ? gelu_mul_row_pick() : silu_mul_row_pick();
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= 64)
    for (long t = 0; t < T; t++) kernel(gate_up + t * 2 * I, out + t * I, I);
    return 0;
}
