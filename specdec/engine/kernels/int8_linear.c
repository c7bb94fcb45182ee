/* The int8 linear layers' driver: CPU-feature dispatch (picked once, at load), activation
 * quantization, weight packing and the threaded loop over column tiles; and the plain C
 * reference that defines the numerics (int8_linear.h). Built without ISA flags: the SIMD paths
 * live in their own files, each compiled for its ISA by a target pragma, and are called only
 * where the CPU has it. */
#include <stdlib.h>
#include <string.h>

#include "int8_linear.h"
#include "vector_paths.h"

/* ---- dispatch ------------------------------------------------------------------------------ */
static int cpu_has(int isa) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (isa == ISA_AMX)
        return cpu_has(ISA_AVX512_VNNI) && __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile") &&
               amx_request();
    if (isa == ISA_AVX512_VNNI)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return isa == ISA_REFERENCE;
}

/* Whether this CPU runs the path (tests compare every path it can run against the reference). */
int int8_isa_supported(int isa) { return isa >= ISA_REFERENCE && isa <= ISA_AMX && cpu_has(isa); }

/* The fastest path this CPU runs. */
int int8_best_isa(void) {
    for (int isa = ISA_AMX; isa > ISA_REFERENCE; isa--)
        if (cpu_has(isa)) return isa;
    return ISA_REFERENCE;
}

/* What the packed bytes of signed codes carry on top of the code, per path (int8_linear.h). */
int int8_pack_bias(int isa) { return isa == ISA_AVX512_VNNI || isa == ISA_AMX ? 128 : 0; }

static tile_kernel kernel_for(int isa) {
    switch (isa) {
    case ISA_AMX: return tile_amx;
    case ISA_AVX512_VNNI: return tile_avx512_vnni;
    case ISA_AVX2: return tile_avx2;
    default: return tile_reference;
    }
}

/* ---- packing ------------------------------------------------------------------------------- */
/* codes [n][k] (int8 for ROW and Q8_0; 0..15 for Q4_1) -> out [tiles][k / 4][16][4] (Q4_1:
 * [tiles][k / 8][16][4], two codes a byte). */
int int8_pack(const int8_t *codes, long n, long k, int format, int isa, uint8_t *out) {
    if (k % QBLOCK != 0 || n <= 0) return 1;
    const long tiles = (n + TILE_N - 1) / TILE_N, quads = k / 4;
    const int bias = format == FORMAT_Q4_1 ? 0 : int8_pack_bias(isa);
    for (long t = 0; t < tiles; t++)
        for (long q = 0; q < quads; q++)
            for (long c = 0; c < TILE_N; c++) {
                const long col = t * TILE_N + c;
                for (int j = 0; j < 4; j++) {
                    const int code = col < n ? codes[col * k + q * 4 + j] : 0;
                    if (format == FORMAT_Q4_1) {
                        uint8_t *dst = out + t * (k / 4) * QUAD_BYTES(format) + ((q / 2) * TILE_N + c) * 4 + j;
                        *dst = q % 2 ? (uint8_t)(*dst | code << 4) : (uint8_t)(code & 0x0F);
                    } else {
                        out[((t * quads + q) * TILE_N + c) * 4 + j] = (uint8_t)(code + bias);
                    }
                }
            }
    return 0;
}

/* ---- activation quantization (shared by every path, so every path sees the same codes) ----- */
/* Round half to even for |v| < 2^22 in the default rounding mode, as nearbyintf does, without a
 * libm call per element (the sum is exact; -ffp-contract=off keeps the compiler from folding it). */
static inline float round_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

static inline __attribute__((always_inline)) void quantize_row_body(const float *x, long k, int8_t *codes, float *scale,
                                                                    int32_t *unbias, float *offset_scale) {
    for (long b = 0; b < k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.0f;
        for (int j = 0; j < QBLOCK; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < QBLOCK; j++) {
            float q = round_even(xb[j] * inv);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            codes[b * QBLOCK + j] = (int8_t)q;
            total += (int32_t)q;
        }
        scale[b] = amax / 127.0f;
        unbias[b] = -128 * total;
        offset_scale[b] = scale[b] * (float)total;
    }
}

/* The quantization of a row compiled for each vector width (vector_paths.h): a maximum, a product,
 * a rounding by adding and subtracting 1.5 * 2^23, a clamp and an integer sum, each exact or
 * correctly rounded on its own, so every width gives the reference's codes and scales. It ran
 * scalar before (this file is built for baseline x86-64), a sixth of a 16-row step. */
typedef void (*quantize_kernel)(const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale);
VECTOR_PATHS(quantize_row_body, quantize_kernel,
             (const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale),
             (x, k, codes, scale, unbias, offset_scale))

static quantize_kernel quantize_picked;

static quantize_kernel quantize_pick(void) {
    /* AVX-512 VNNI's CPU flags include everything quantize_row_avx512 uses (F, BW, VL) */
    return cpu_has(ISA_AVX512_VNNI) ? quantize_row_avx512 : quantize_row_body_pick();
}

void quantize_row(const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale) {
    quantize_kernel kernel = quantize_picked;
    if (kernel == NULL) quantize_picked = kernel = quantize_pick(); /* the same pick from every thread */
    kernel(x, k, codes, scale, unbias, offset_scale);
}

/* The reference's own quantization (tests compare the vector paths' codes with it). */
void quantize_row_reference(const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale) {
    quantize_row_body_baseline(x, k, codes, scale, unbias, offset_scale);
}

/* One row quantized by the path every call takes (picked) or by the plain C reference (tests). */
int int8_quantize_row(int picked, const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale) {
    if (k % QBLOCK != 0) return 2;
    (picked ? quantize_row : quantize_row_reference)(x, k, codes, scale, unbias, offset_scale);
    return 0;
}

/* ---- the reference path: the numerics written out (int8_linear.h) --------------------------- */
void tile_reference(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    const long quads = w->k / 4, blocks = x->blocks;
    const int is_signed = w->format != FORMAT_Q4_1; /* packed with no bias for this path: int8 codes */
    const uint8_t *base = w->packed + tile * quads * QUAD_BYTES(w->format);
    for (long m = 0; m < x->rows; m++)
        for (long c = 0; c < columns; c++) {
            float acc = 0.0f;
            for (long b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (long q = b * (QBLOCK / 4); q < (b + 1) * (QBLOCK / 4); q++)
                    for (int j = 0; j < 4; j++) {
                        const int32_t code = is_signed ? (int8_t)base[(q * TILE_N + c) * 4 + j] : q4_code(base, q * 4 + j, c);
                        dot += code * x->codes[m * x->k + q * 4 + j];
                    }
                const float a_s = x->scale[m * blocks + b];
                const long wb = (tile * blocks + b) * TILE_N + c;
                if (w->format == FORMAT_ROW) {
                    acc = __builtin_fmaf((float)dot, a_s, acc);
                } else if (w->format == FORMAT_Q8_0) {
                    acc = __builtin_fmaf((float)dot, a_s * w->block_scale[wb], acc);
                } else {
                    acc = __builtin_fmaf((float)dot, a_s * w->block_scale[wb], acc);
                    acc = __builtin_fmaf(x->offset_scale[m * blocks + b], w->block_offset[wb], acc);
                }
            }
            if (w->format == FORMAT_ROW) acc = acc * w->column_scale[tile * TILE_N + c];
            out[m * out_stride + c] = acc;
        }
}

/* ---- the call ------------------------------------------------------------------------------ */
/* Rows are taken ROW_CHUNK at a time against every column tile: enough for any verification
 * batch (each weight read once), while a long prefill keeps its activation codes in L2. */
#define ROW_CHUNK 128

tile_kernel int8_kernel_for(int isa) { return kernel_for(isa); }

/* Work-sharing pieces: called inside an enclosing parallel region (the forward plan's one team,
 * or int8_linear's own), each an orphaned `omp for` ending at its barrier; outside any region
 * they run on the calling thread alone. */

/* rows.codes etc. of x [rows.rows][k] (stride x_stride). */
void int8_quantize_rows_shared(const float *x, long x_stride, const quantized_rows *rows) {
#pragma omp for schedule(static)
    for (long r = 0; r < rows->rows; r++)
        quantize_row(x + r * x_stride, rows->k, rows->codes + r * rows->k, rows->scale + r * rows->blocks,
                     rows->unbias + r * rows->blocks, rows->offset_scale + r * rows->blocks);
}

/* y [rows][n] (stride y_stride) = the quantized rows times w; bias [n] (or NULL) added per column,
 * as `y + bias` adds it. The caller's thread holds AMX tile state when isa is ISA_AMX. */
void int8_tiles_shared(tile_kernel kernel, const quantized_rows *rows, const packed_weight *w, const float *bias,
                       float *y, long y_stride) {
    for (long r0 = 0; r0 < rows->rows; r0 += ROW_CHUNK) {
        const long chunk = rows->rows - r0 < ROW_CHUNK ? rows->rows - r0 : ROW_CHUNK;
        const quantized_rows part = {chunk, rows->k, rows->blocks, rows->codes + r0 * rows->k, rows->scale + r0 * rows->blocks,
                                     rows->unbias + r0 * rows->blocks, rows->offset_scale + r0 * rows->blocks};
        /* dynamic: a thread the OS preempts (a stub's response, the server's gRPC on the same
         * cores) leaves its tiles to the others instead of stalling the region at its barrier.
         * Which thread computes a tile changes nothing in its bits. */
#pragma omp for schedule(guided)
        for (long t = 0; t < w->tiles; t++) {
            const long columns = w->n - t * TILE_N < TILE_N ? w->n - t * TILE_N : TILE_N;
            float *out = y + r0 * y_stride + t * TILE_N;
            kernel(&part, w, t, out, y_stride, columns);
            if (bias != NULL)
                for (long m = 0; m < chunk; m++)
                    for (long c = 0; c < columns; c++) out[m * y_stride + c] += bias[t * TILE_N + c];
        }
    }
}

/* y [m][n] (stride y_stride) = x [m][k] (stride x_stride) times the packed weight.
 * scales as in packed_weight; threads split the column tiles. Returns 0, or an error code. */
int int8_linear(int isa, int format, const uint8_t *packed, long n, long k, const float *column_scale,
                const float *block_scale, const float *block_offset, const float *x, long m, long x_stride, float *y,
                long y_stride, int threads) {
    if (!int8_isa_supported(isa)) return 1;
    if (k % QBLOCK != 0 || m < 0 || n <= 0) return 2;
    if (m == 0) return 0;
    const long blocks = k / QBLOCK;
    const long padded = (m + PAD_ROWS - 1) / PAD_ROWS * PAD_ROWS;
    quantized_rows rows = {m, k, blocks, calloc((size_t)(padded * k), 1), malloc(sizeof(float) * m * blocks),
                           malloc(sizeof(int32_t) * m * blocks), malloc(sizeof(float) * m * blocks)};
    if (!rows.codes || !rows.scale || !rows.unbias || !rows.offset_scale) {
        free(rows.codes), free(rows.scale), free(rows.unbias), free(rows.offset_scale);
        return 3;
    }
    packed_weight w = {format, n, k, (n + TILE_N - 1) / TILE_N, packed, column_scale, block_scale, block_offset};
    tile_kernel kernel = kernel_for(isa);
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (m * n * k >= 1L << 18)
    {
        if (isa == ISA_AMX) amx_begin(); /* tile state is per thread */
        int8_quantize_rows_shared(x, x_stride, &rows);
        int8_tiles_shared(kernel, &rows, &w, NULL, y, y_stride);
        if (isa == ISA_AMX) amx_end();
    }
    free(rows.codes), free(rows.scale), free(rows.unbias), free(rows.offset_scale);
    return 0;
}
