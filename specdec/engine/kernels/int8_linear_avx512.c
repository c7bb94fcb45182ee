/* The AVX-512 VNNI path of the int8 linear layers (numerics and layout: int8_linear.h).
 *
 * vpdpbusd multiplies 64 unsigned bytes (16 columns x 4 inputs of the packed weight, stored
 * + 128) by 4 signed activation codes broadcast to every lane, and adds each lane's 4 products
 * to an int32: 64 multiply-adds per instruction. One weight vector feeds ROWS_PER_STEP rows while
 * it is in a register, so verifying 8 rows reads the weight as decoding 1 row does. The + 128
 * comes back out exactly: each block's int32 dot starts from -128 * sum(its activation codes). */
#include "int8_linear.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma")
#include <immintrin.h>
#include <string.h>

#define ROWS_PER_STEP 8

static inline __attribute__((always_inline)) __m512i broadcast_codes(const int8_t *codes) {
    int32_t four;
    memcpy(&four, codes, 4);
    return _mm512_set1_epi32(four);
}

static inline __attribute__((always_inline)) void rows_step(const quantized_rows *x, const packed_weight *w, long tile,
                                                            long m0, const int rows, const int format, float *out,
                                                            long out_stride, long columns) {
    const long k = x->k, blocks = x->blocks, quads = k / 4;
    const uint8_t *weight = w->packed + tile * quads * QUAD_BYTES(format);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS_PER_STEP];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i dot[ROWS_PER_STEP]; /* signed codes: from -128 * sum (the weights' + 128 out, exactly) */
        for (int r = 0; r < rows; r++)
            dot[r] = format == FORMAT_Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(x->unbias[(m0 + r) * blocks + b]);
        if (format == FORMAT_Q4_1) { /* a 64-byte load is two quads: low nibbles, then high */
            for (int pair = 0; pair < QBLOCK / 8; pair++) {
                const __m512i both = _mm512_loadu_si512(weight + (b * (QBLOCK / 8) + pair) * 64);
                const __m512i first = _mm512_and_si512(both, low);
                const __m512i second = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
                for (int r = 0; r < rows; r++) {
                    const int8_t *codes = x->codes + (m0 + r) * k + b * QBLOCK + pair * 8;
                    dot[r] = _mm512_dpbusd_epi32(dot[r], first, broadcast_codes(codes));
                    dot[r] = _mm512_dpbusd_epi32(dot[r], second, broadcast_codes(codes + 4));
                }
            }
        } else {
            for (int q = 0; q < QBLOCK / 4; q++) {
                const __m512i wv = _mm512_loadu_si512(weight + (b * (QBLOCK / 4) + q) * 64);
                for (int r = 0; r < rows; r++)
                    dot[r] = _mm512_dpbusd_epi32(dot[r], wv, broadcast_codes(x->codes + (m0 + r) * k + b * QBLOCK + q * 4));
            }
        }
        const long wb = (tile * blocks + b) * TILE_N;
        for (int r = 0; r < rows; r++) {
            const long xb = (m0 + r) * blocks + b;
            const __m512 a_s = _mm512_set1_ps(x->scale[xb]);
            if (format == FORMAT_ROW) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), a_s, acc[r]);
            } else if (format == FORMAT_Q8_0) {
                const __m512 scale = _mm512_mul_ps(a_s, _mm512_loadu_ps(w->block_scale + wb));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
            } else {
                const __m512 scale = _mm512_mul_ps(a_s, _mm512_loadu_ps(w->block_scale + wb));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x->offset_scale[xb]), _mm512_loadu_ps(w->block_offset + wb), acc[r]);
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

/* Instantiated per (format, rows) so that the accumulators live in registers. */
#define STEP_CASES(format)                                                                                             \
    switch (rows) {                                                                                                    \
    case 8: rows_step(x, w, tile, m0, 8, format, out, out_stride, columns); break;                                     \
    case 7: rows_step(x, w, tile, m0, 7, format, out, out_stride, columns); break;                                     \
    case 6: rows_step(x, w, tile, m0, 6, format, out, out_stride, columns); break;                                     \
    case 5: rows_step(x, w, tile, m0, 5, format, out, out_stride, columns); break;                                     \
    case 4: rows_step(x, w, tile, m0, 4, format, out, out_stride, columns); break;                                     \
    case 3: rows_step(x, w, tile, m0, 3, format, out, out_stride, columns); break;                                     \
    case 2: rows_step(x, w, tile, m0, 2, format, out, out_stride, columns); break;                                     \
    default: rows_step(x, w, tile, m0, 1, format, out, out_stride, columns); break;                                    \
    }

void tile_avx512_vnni(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    for (long m0 = 0; m0 < x->rows; m0 += ROWS_PER_STEP) {
        const int rows = (int)(x->rows - m0 < ROWS_PER_STEP ? x->rows - m0 : ROWS_PER_STEP);
        if (w->format == FORMAT_ROW) {
            STEP_CASES(FORMAT_ROW)
        } else if (w->format == FORMAT_Q8_0) {
            STEP_CASES(FORMAT_Q8_0)
        } else {
            STEP_CASES(FORMAT_Q4_1)
        }
    }
}

/* quantize_row (int8_linear.c) in 512-bit registers, a block of 32 inputs in two: the maximum, the
 * product by 127 / amax, the rounding (+ and - 1.5 * 2^23), the clamp and the integer sum are each
 * exact or correctly rounded, so the codes and scales equal the scalar reference's. */
void quantize_row_avx512(const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale) {
    const __m512 magic = _mm512_set1_ps(12582912.0f), top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    for (long b = 0; b < k / QBLOCK; b++) {
        const __m512 lo = _mm512_loadu_ps(x + b * QBLOCK), hi = _mm512_loadu_ps(x + b * QBLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 factor = _mm512_set1_ps(inv);
        __m512 q_lo = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(lo, factor), magic), magic);
        __m512 q_hi = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(hi, factor), magic), magic);
        q_lo = _mm512_max_ps(_mm512_min_ps(q_lo, top), bottom);
        q_hi = _mm512_max_ps(_mm512_min_ps(q_hi, top), bottom);
        const __m512i i_lo = _mm512_cvtps_epi32(q_lo), i_hi = _mm512_cvtps_epi32(q_hi); /* integral: exact */
        _mm_storeu_si128((__m128i *)(codes + b * QBLOCK), _mm512_cvtsepi32_epi8(i_lo));
        _mm_storeu_si128((__m128i *)(codes + b * QBLOCK + 16), _mm512_cvtsepi32_epi8(i_hi));
        const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(i_lo, i_hi));
        scale[b] = amax / 127.0f;
        unbias[b] = -128 * total;
        offset_scale[b] = scale[b] * (float)total;
    }
}
#else /* not x86-64: the library still links; int8_isa_supported never offers this path */
void quantize_row_avx512(const float *x, long k, int8_t *codes, float *scale, int32_t *unbias, float *offset_scale) {
    (void)x, (void)k, (void)codes, (void)scale, (void)unbias, (void)offset_scale;
}
void tile_avx512_vnni(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    tile_reference(x, w, tile, out, out_stride, columns);
}
#endif
