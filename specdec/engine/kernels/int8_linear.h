/* Row-invariant weight-only int8 linear layers for the CPU target (specdec/engine/kernels/__init__.py).
 *
 * y[m, n] = sum_k x[m, k] w[n, k] for M activation rows against an int8-coded weight, with a
 * cost that stays flat in M at verification sizes: each call streams each weight tile once and
 * multiplies it by every row while it is in L1 (rows x columns tiled in registers, threads split
 * over output columns only, never over K).
 *
 * Numerics, the same on every ISA path, so a row's output bits never depend on the rows beside it,
 * on M, on the thread count or on the ISA:
 * - each activation row is quantized on its own, in blocks of QBLOCK = 32 inputs (llama.cpp's Q8
 *   activations): scale a_s = amax / 127, codes round-half-even(x * (127 / amax)), |code| <= 127;
 * - the integer dot product of a block is exact (int32, any order);
 * - the float part is a fixed sequence per (row, column): blocks in order, one fmaf each.
 *   ROW   (int8, one scale per output column):  acc = fmaf((float)dot_b, a_s[b], acc); y = acc * w_s[n]
 *   Q8_0  (GGUF, one scale per 32 inputs):     acc = fmaf((float)dot_b, a_s[b] * w_s[n, b], acc)
 *   Q4_1  (GGUF, w = d * q + m, q in 0..15):   acc = fmaf((float)dot_b, a_s[b] * d[n, b], acc);
 *                                              acc = fmaf(a_s[b] * (float)sum_b(codes), m[n, b], acc)
 * The plain C reference (int8_linear_ref.c) writes this sequence out; the SIMD paths must give
 * its bits exactly (tests/engine/test_int8_kernels.py compares every path the CPU can run).
 *
 * Packed weight: columns in tiles of TILE_N = 16 (N padded with zero columns), inputs in quads:
 * byte [tile][k / 4][column % 16][k % 4], the layout vpdpbusd reads (16 int32 lanes, 4 bytes
 * each). Signed codes (ROW, Q8_0) are stored + `bias` (128 for the AVX-512 and AMX paths, whose
 * unsigned operand they are; 0 for the AVX2 path and the reference). Q4_1 codes (0..15) keep the
 * file's density, two to a byte: byte [tile][k / 8][column % 16][k % 4] holds quad 2p in its low
 * nibble and quad 2p + 1 in its high one (p = k / 8), so one 64-byte load gives two quads' vectors
 * after a mask and a shift (q4_code() reads one).
 * Per-block weight scales (Q8_0's w_s, Q4_1's d and m): float [tile][K / 32][16].
 */
#ifndef SPECDEC_INT8_LINEAR_H
#define SPECDEC_INT8_LINEAR_H

#include <stdint.h>

#define QBLOCK 32
#define TILE_N 16

enum weight_format { FORMAT_ROW = 0, FORMAT_Q8_0 = 1, FORMAT_Q4_1 = 2 };
enum isa { ISA_REFERENCE = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AMX = 3 };

/* Activation codes are allocated for a multiple of PAD_ROWS rows, the padding zero (AMX reads 16 rows). */
#define PAD_ROWS 16

/* Bytes of a packed weight row-tile per 4 inputs: 64, or 32 for Q4_1's nibbles. */
#define QUAD_BYTES(format) ((format) == FORMAT_Q4_1 ? TILE_N * 2 : TILE_N * 4)

/* Q4_1's code for input k of column c in a tile's packed bytes. */
static inline uint8_t q4_code(const uint8_t *tile_bytes, long k, long c) {
    const uint8_t byte = tile_bytes[((k / 8) * TILE_N + c) * 4 + k % 4];
    return (k / 4) % 2 ? byte >> 4 : byte & 0x0F;
}

/* The activations of one call, quantized once and shared by every column tile. */
typedef struct {
    long rows, k, blocks;  /* blocks = k / QBLOCK */
    int8_t *codes;         /* [rows][k] */
    float *scale;          /* [rows][blocks] a_s */
    int32_t *unbias;       /* [rows][blocks] -128 * the sum of the block's codes: the + 128 the AVX-512 and AMX
                            * paths' packed signed weights carry, taken back out of their exact int32 dots
                            * (the AVX-512 path starts each block's dot from it) */
    float *offset_scale;   /* [rows][blocks] a_s * (float)sum (Q4_1's offset term) */
} quantized_rows;

/* The weight of one layer as the kernels read it. */
typedef struct {
    int format;
    long n, k, tiles;          /* tiles = ceil(n / TILE_N) */
    const uint8_t *packed;     /* [tiles][k / 4][16][4], Q4_1: [tiles][k / 8][16][4] (nibbles) */
    const float *column_scale; /* ROW: [tiles * 16] */
    const float *block_scale;  /* Q8_0, Q4_1: [tiles][k / 32][16] */
    const float *block_offset; /* Q4_1: [tiles][k / 32][16] */
} packed_weight;

/* One column tile of every row: out[m * out_stride + c] for c < columns (<= 16). */
typedef void (*tile_kernel)(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride,
                            long columns);

void tile_reference(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns);
void tile_avx2(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns);
void tile_avx512_vnni(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns);
void tile_amx(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns);

/* The path's tile kernel, and the work-sharing pieces of a call (int8_linear.c): inside an enclosing
 * parallel region each is an orphaned `omp for` with its barrier. */
tile_kernel int8_kernel_for(int isa);
int int8_isa_supported(int isa);
void quantize_row(const float *x, long k, int8_t *codes, float *scale, int32_t *sum, float *offset_scale);
void quantize_row_avx512(const float *x, long k, int8_t *codes, float *scale, int32_t *sum, float *offset_scale);
void quantize_row_reference(const float *x, long k, int8_t *codes, float *scale, int32_t *sum, float *offset_scale);
void int8_quantize_rows_shared(const float *x, long x_stride, const quantized_rows *rows);
void int8_tiles_shared(tile_kernel kernel, const quantized_rows *rows, const packed_weight *w, const float *bias,
                       float *y, long y_stride);

/* AMX: permission from the kernel (once per process), and each thread's tile state around a call. */
int amx_request(void);
void amx_begin(void);
void amx_end(void);

#endif
