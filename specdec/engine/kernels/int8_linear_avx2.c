/* The AVX2 path of the int8 linear layers, for x86-64 CPUs without AVX-512 VNNI (numerics and
 * layout: int8_linear.h; the packed codes carry no bias here).
 *
 * vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pair sums. Signed codes
 * times signed codes go through it as |a| times sign(a) * w (llama.cpp's trick): with |a|, |w|
 * <= 127 a pair sum is at most 32,258 and never saturates, so the int32 dot is exact. Q4_1's
 * codes (0..15) are unsigned already. A 16-column tile is two 8-lane halves. */
#include "int8_linear.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <string.h>


#define ROWS_PER_STEP 2

static inline __attribute__((always_inline)) __m256i dot4(__m256i weight, __m256i codes, int format) {
    const __m256i pairs = format == FORMAT_Q4_1 ? _mm256_maddubs_epi16(weight, codes)
                                                : _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(weight, codes));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void rows_step(const quantized_rows *x, const packed_weight *w, long tile,
                                                            long m0, const int rows, const int format, float *out,
                                                            long out_stride, long columns) {
    const long k = x->k, blocks = x->blocks, quads = k / 4;
    const uint8_t *weight = w->packed + tile * quads * QUAD_BYTES(format);
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[ROWS_PER_STEP][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256i dot[ROWS_PER_STEP][2];
        for (int r = 0; r < rows; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        for (int q = 0; q < QBLOCK / 4; q++) {
            __m256i lo, hi; /* columns 0..7 and 8..15 of quad q */
            if (format == FORMAT_Q4_1) { /* quads 2p and 2p + 1 share bytes: low nibbles, then high */
                const uint8_t *pair = weight + (b * (QBLOCK / 8) + q / 2) * 64;
                lo = _mm256_loadu_si256((const __m256i *)pair), hi = _mm256_loadu_si256((const __m256i *)(pair + 32));
                if (q % 2) lo = _mm256_srli_epi16(lo, 4), hi = _mm256_srli_epi16(hi, 4);
                lo = _mm256_and_si256(lo, low), hi = _mm256_and_si256(hi, low);
            } else {
                const uint8_t *quad = weight + (b * (QBLOCK / 4) + q) * 64;
                lo = _mm256_loadu_si256((const __m256i *)quad), hi = _mm256_loadu_si256((const __m256i *)(quad + 32));
            }
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, x->codes + (m0 + r) * k + b * QBLOCK + q * 4, 4);
                const __m256i codes = _mm256_set1_epi32(four);
                dot[r][0] = _mm256_add_epi32(dot[r][0], dot4(lo, codes, format));
                dot[r][1] = _mm256_add_epi32(dot[r][1], dot4(hi, codes, format));
            }
        }
        const long wb = (tile * blocks + b) * TILE_N;
        for (int r = 0; r < rows; r++) {
            const long xb = (m0 + r) * blocks + b;
            const __m256 a_s = _mm256_set1_ps(x->scale[xb]);
            for (int h = 0; h < 2; h++) {
                const __m256 dotf = _mm256_cvtepi32_ps(dot[r][h]);
                if (format == FORMAT_ROW) {
                    acc[r][h] = _mm256_fmadd_ps(dotf, a_s, acc[r][h]);
                } else {
                    const __m256 scale = _mm256_mul_ps(a_s, _mm256_loadu_ps(w->block_scale + wb + 8 * h));
                    acc[r][h] = _mm256_fmadd_ps(dotf, scale, acc[r][h]);
                    if (format == FORMAT_Q4_1)
                        acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(x->offset_scale[xb]),
                                                    _mm256_loadu_ps(w->block_offset + wb + 8 * h), acc[r][h]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float y[TILE_N];
        for (int h = 0; h < 2; h++) {
            __m256 v = acc[r][h];
            if (format == FORMAT_ROW) v = _mm256_mul_ps(v, _mm256_loadu_ps(w->column_scale + tile * TILE_N + 8 * h));
            _mm256_storeu_ps(y + 8 * h, v);
        }
        memcpy(out + (m0 + r) * out_stride, y, sizeof(float) * columns);
    }
}

void tile_avx2(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    for (long m0 = 0; m0 < x->rows; m0 += ROWS_PER_STEP) {
        const int rows = (int)(x->rows - m0 < ROWS_PER_STEP ? x->rows - m0 : ROWS_PER_STEP);
        if (w->format == FORMAT_ROW)
            rows == 2 ? rows_step(x, w, tile, m0, 2, FORMAT_ROW, out, out_stride, columns)
                      : rows_step(x, w, tile, m0, 1, FORMAT_ROW, out, out_stride, columns);
        else if (w->format == FORMAT_Q8_0)
            rows == 2 ? rows_step(x, w, tile, m0, 2, FORMAT_Q8_0, out, out_stride, columns)
                      : rows_step(x, w, tile, m0, 1, FORMAT_Q8_0, out, out_stride, columns);
        else
            rows == 2 ? rows_step(x, w, tile, m0, 2, FORMAT_Q4_1, out, out_stride, columns)
                      : rows_step(x, w, tile, m0, 1, FORMAT_Q4_1, out, out_stride, columns);
    }
}
#else /* not x86-64: the library still links; int8_isa_supported never offers this path */
void tile_avx2(const quantized_rows *x, const packed_weight *w, long tile, float *out, long out_stride, long columns) {
    tile_reference(x, w, tile, out, out_stride, columns);
}
#endif
