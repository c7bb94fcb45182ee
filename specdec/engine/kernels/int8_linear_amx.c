/* The AMX path of the int8 linear layers (numerics and layout: int8_linear.h), for CPUs with
 * AMX-INT8 (Xeon since Sapphire Rapids). Same packed weight as the AVX-512 path: the packed
 * 16-column tile is exactly AMX's B operand (rows = input quads, 64 bytes = 16 columns x 4).
 *
 * tdpbsud multiplies 16 rows of 32 signed activation codes (one block) by the unsigned packed
 * weight (+ 128 for signed codes) into 16 x 16 exact int32 sums: 8,192 multiply-adds per
 * instruction, against 64 for vpdpbusd. The block sums then take the AVX-512 path's epilogue,
 * operation for operation, so the bits are the same. Rows go 16 at a time (the activation codes
 * are zero-padded to a multiple of 16 rows; padding rows are computed and never stored).
 * Below AMX_MIN_ROWS rows the AVX-512 VNNI micro-kernel runs instead: a decode step is bound by
 * the weight's bytes, and there tile loads and stores only add work. */
#define _GNU_SOURCE /* syscall() */
#include "int8_linear.h"

#if defined(__x86_64__)
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma")
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16
#define AMX_MIN_ROWS 12 /* measured: at 4 rows AMX took 1.35x the AVX-512 time, at 8 the same, at 16 0.82x */
#define MAX_BLOCKS 64 /* K up to 2,048 on this path; wider layers take the AVX-512 one */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out AMX state only on request, once per process. */
int amx_request(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* tmm0: int32 sums [16 rows][16 columns]; tmm1: codes [16 rows][32 bytes]; tmm2: weight [8 quads][64 bytes];
 * tmm3..5 the same for a second block.
 * A constant in memory: built on the stack, GCC dropped the stores ldtilecfg reads (it does not
 * see the instruction read them). */
static const tile_config CONFIG __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {TILE_N * 4, QBLOCK, TILE_N * 4, TILE_N * 4, QBLOCK, TILE_N * 4},
    .rows = {AMX_ROWS, AMX_ROWS, QBLOCK / 4, AMX_ROWS, AMX_ROWS, QBLOCK / 4},
};

void amx_begin(void) { _tile_loadconfig(&CONFIG); }

void amx_end(void) { _tile_release(); }

static inline __attribute__((always_inline)) void rows16(const quantized_rows *x, const packed_weight *w, long tile,
                                                         long m0, const int format, float *out, long out_stride,
                                                         long columns) {
    const long k = x->k, blocks = x->blocks, quads = k / 4;
    const int rows = (int)(x->rows - m0 < AMX_ROWS ? x->rows - m0 : AMX_ROWS);
    const uint8_t *weight = w->packed + tile * quads * QUAD_BYTES(format);
    uint8_t unpacked[QBLOCK / 4][TILE_N * 4] __attribute__((aligned(64))); /* Q4_1: one block's quads, a byte each */
    /* every block's products first, then every block's epilogue: a vector load right after the
     * tile store that wrote it stalls, so the two phases are kept apart */
    int32_t sums[MAX_BLOCKS][AMX_ROWS][TILE_N] __attribute__((aligned(64)));
    for (long b = 0; b < blocks; b++) {
        const int t = (int)(b & 1);
        const uint8_t *block = weight + b * (QBLOCK / 4) * TILE_N * 4;
        if (format == FORMAT_Q4_1) {
            for (int pair = 0; pair < QBLOCK / 8; pair++) {
                const __m512i both = _mm512_loadu_si512(weight + (b * (QBLOCK / 8) + pair) * 64);
                _mm512_store_si512(unpacked[2 * pair], _mm512_and_si512(both, _mm512_set1_epi8(0x0F)));
                _mm512_store_si512(unpacked[2 * pair + 1], _mm512_and_si512(_mm512_srli_epi16(both, 4), _mm512_set1_epi8(0x0F)));
            }
            block = unpacked[0];
        }
        if (t == 0) {
            _tile_zero(0);
            _tile_loadd(1, x->codes + m0 * k + b * QBLOCK, k);
            _tile_loadd(2, block, TILE_N * 4);
            _tile_dpbsud(0, 1, 2);
            _tile_stored(0, sums[b], TILE_N * 4);
        } else {
            _tile_zero(3);
            _tile_loadd(4, x->codes + m0 * k + b * QBLOCK, k);
            _tile_loadd(5, block, TILE_N * 4);
            _tile_dpbsud(3, 4, 5);
            _tile_stored(3, sums[b], TILE_N * 4);
        }
    }
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        const long wb = (tile * blocks + b) * TILE_N;
        __m512 block_scale = _mm512_setzero_ps(), block_offset = _mm512_setzero_ps();
        if (format != FORMAT_ROW) block_scale = _mm512_loadu_ps(w->block_scale + wb);
        if (format == FORMAT_Q4_1) block_offset = _mm512_loadu_ps(w->block_offset + wb);
        for (int r = 0; r < rows; r++) {
            const long xb = (m0 + r) * blocks + b;
            const __m512i dot = _mm512_load_si512(sums[b][r]);
            const __m512 a_s = _mm512_set1_ps(x->scale[xb]);
            if (format == FORMAT_ROW) {
                const __m512i exact = _mm512_add_epi32(dot, _mm512_set1_epi32(x->unbias[xb]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), a_s, acc[r]);
            } else if (format == FORMAT_Q8_0) {
                const __m512i exact = _mm512_add_epi32(dot, _mm512_set1_epi32(x->unbias[xb]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(a_s, block_scale), acc[r]);
            } else {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a_s, block_scale), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x->offset_scale[xb]), block_offset, acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << columns) - 1u);
    for (int r = 0; r < rows; r++) {
        __m512 y = acc[r];
        if (format == FORMAT_ROW) y = _mm512_mul_ps(y, _mm512_loadu_ps(w->column_scale + tile * TILE_N));
        _mm512_mask_storeu_ps(out + (m0 + r) * out_stride, keep, y);
    }
}

void tile_amx(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    if (x->rows < AMX_MIN_ROWS || x->blocks > MAX_BLOCKS) {
        tile_avx512_vnni(x, w, tile, out, out_stride, columns);
        return;
    }
    for (long m0 = 0; m0 < x->rows; m0 += AMX_ROWS) {
        if (w->format == FORMAT_ROW)
            rows16(x, w, tile, m0, FORMAT_ROW, out, out_stride, columns);
        else if (w->format == FORMAT_Q8_0)
            rows16(x, w, tile, m0, FORMAT_Q8_0, out, out_stride, columns);
        else
            rows16(x, w, tile, m0, FORMAT_Q4_1, out, out_stride, columns);
    }
}
#else /* not x86-64: the library still links; int8_isa_supported never offers this path */
int amx_request(void) { return 0; }
void amx_begin(void) {}
void amx_end(void) {}
void tile_amx(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    tile_reference(x, w, tile, out, out_stride, columns);
}
#endif
