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
 * Every reduction runs in a fixed order: each score q . k over the head dimension in order, d
 * after d (16 columns at a time, one per vector lane, from a transposed block of keys shared by
 * every query row of the kv head: no horizontal sums); the softmax max, the exponent sum
 * and the weighted sum of values column after column (a masked column's weight is exactly 0 and
 * adds nothing to the sum; its values are never read). Rows run in parallel (OpenMP); a row is
 * never split; work items are (sequence, kv head, up to CHUNK query positions). The exponential
 * is our own (fixed_math.h): libm's expf, one call per column, was most of a verification step's
 * attention time.
 *
 * q   [B, H, N, D]   strides q_b, q_h, q_n; D contiguous
 * k,v [slots, KVH, C, D] strides kv_b, kv_h, kv_c (the same for k and v); D contiguous; row b
 *                    reads slot slots[b] (the KV cache itself: no gathered copy), or b if slots is NULL
 * allowed [B, N, C]  bytes (0 / 1), strides m_b, m_n; C contiguous
 * out [B, N, H, D]   contiguous (the layout the output projection reads)
 * Head h reads kv head h / (H / KVH) (grouped-query attention).
 *
 * The work item is compiled for AVX-512, AVX2 and the baseline, picked from the CPU's flags, with
 * the same bits on each (vector_paths.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fixed_math.h"
#include "invariant_attention.h"
#include "vector_paths.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define ROWS 8      /* query rows scored together against one block of keys */

/* Where query row (b, h, n) is read and its output written: the strided [B, H, N, D] and
 * [B, N, H, D] layouts, or, with token_of, packed tokens [T][H][D] for both (the forward plan). */
static inline __attribute__((always_inline)) const float *query_row(const attention_call *a, long b, long h, long n) {
    return a->token_of ? a->q + (long)a->token_of[b * a->N + n] * a->q_n + h * a->q_h
                       : a->q + b * a->q_b + h * a->q_h + n * a->q_n;
}

static inline __attribute__((always_inline)) float *output_row(const attention_call *a, long b, long h, long n) {
    const long row = a->token_of ? (long)a->token_of[b * a->N + n] : b * a->N + n;
    return a->out + (row * a->H + h) * a->D;
}


/* 16 keys (rows of D floats, stride kv_c) to keys[d][16], a 16 x 16 block at a time in registers:
 * the scores' transposition was most of a one-row step's attention time done one float at a time.
 * A move of data only: the scores' operations and their order are unchanged. */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void transpose_keys_avx512(const float *k, long kv_c, long D, float *keys) {
    for (long d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16], t[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(k + j * kv_c + d0);
        for (int j = 0; j < 16; j += 2) {
            t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
            t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
        }
        for (int j = 0; j < 16; j += 4) {
            r[j] = _mm512_shuffle_ps(t[j], t[j + 2], 0x44);
            r[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], 0xEE);
            r[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0x44);
            r[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
        }
        for (int h = 0; h < 16; h += 8)
            for (int j = 0; j < 4; j++) {
                t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0x88);
                t[h + j + 4] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0xDD);
            }
        for (int j = 0; j < 8; j++) {
            r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
            r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
        }
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(keys + (d0 + i) * COLUMNS, r[i]);
    }
}
#endif

transpose_kernel attention_transpose_pick(long D) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (D % 16 == 0 && __builtin_cpu_supports("avx512f")) return transpose_keys_avx512;
#endif
    (void)D;
    return NULL; /* the loop in score_columns */
}

/* Scores of every query row of kv head g of sequence b at positions n0..n1-1 (its `group` query
 * heads; row r is head g * group + r / positions, position n0 + r % positions) against columns
 * c_begin..c_end-1 (c_begin a multiple of COLUMNS): score[r * C + c]. keys: scratch [D][COLUMNS]. */
static inline __attribute__((always_inline)) void score_columns(const attention_call *a, long b, long g, long n0, long n1,
                                                                long c_begin, long c_end, float *keys, float *score,
                                                                const long D) {
    const long C = a->C, positions = n1 - n0, rows = a->group * positions;
    const long slot = a->slots ? (long)a->slots[b] : b;
    const float *kr = a->k + slot * a->kv_b + g * a->kv_h;
    for (long c0 = c_begin; c0 < c_end; c0 += COLUMNS) {
        const long width = c_end - c0 < COLUMNS ? c_end - c0 : COLUMNS;
        if (width == COLUMNS && a->transpose != NULL)
            a->transpose(kr + c0 * a->kv_c, a->kv_c, D, keys);
        else
            for (long d = 0; d < D; d++)
                for (long j = 0; j < COLUMNS; j++) keys[d * COLUMNS + j] = j < width ? kr[(c0 + j) * a->kv_c + d] : 0.0f;
        for (long r0 = 0; r0 < rows; r0 += ROWS) { /* ROWS independent chains hide the add latency */
            const long count = rows - r0 < ROWS ? rows - r0 : ROWS;
            const float *qr[ROWS];
            for (long i = 0; i < ROWS; i++) {
                const long r = r0 + (i < count ? i : 0), h = g * a->group + r / positions, n = n0 + r % positions;
                qr[i] = query_row(a, b, h, n);
            }
            float lane[ROWS][COLUMNS] = {{0}};
            for (long d = 0; d < D; d++)
                for (long i = 0; i < ROWS; i++)
                    for (long j = 0; j < COLUMNS; j++) lane[i][j] += qr[i][d] * keys[d * COLUMNS + j];
            for (long i = 0; i < count; i++)
                for (long j = 0; j < width; j++) score[(r0 + i) * C + c0 + j] = lane[i][j] * a->scale;
        }
    }
}

/* The weighted sum of values of R rows at once (R independent chains: one row's sums ran at the
 * latency of its adds). Each row's own operations in its own order, as one row alone: its exponent
 * total column after column, and for an allowed column its value row times its weight added to its
 * accumulators; a masked column adds nothing and its values are never used. */
#define FINISH_ROWS 4

static inline __attribute__((always_inline)) void accumulate_rows(const attention_call *a, const float *vr, long C,
                                                                  const int R, float *const *sr,
                                                                  const unsigned char *const *mask, float *const *o,
                                                                  const long D) {
    float acc[FINISH_ROWS][D];
    float total[FINISH_ROWS];
    for (int i = 0; i < R; i++) {
        total[i] = 0.0f;
        for (long d = 0; d < D; d++) acc[i][d] = 0.0f;
    }
    for (long c = 0; c < C; c++) {
        const float *vc = vr + c * a->kv_c;
        for (int i = 0; i < R; i++) {
            total[i] += sr[i][c];
            if (!mask[i][c]) continue;
            const float weight = sr[i][c];
            for (long d = 0; d < D; d++) acc[i][d] += weight * vc[d];
        }
    }
    for (int i = 0; i < R; i++) {
        const float inv = total[i] > 0.0f ? 1.0f / total[i] : 0.0f; /* a row with no column gets zeros */
        for (long d = 0; d < D; d++) o[i][d] = acc[i][d] * inv;
    }
}

/* Softmax over the allowed columns and the weighted sum of values, rows r_begin..r_end-1 of the
 * same (b, g, n0..n1) group, from their scores. Scratch: allowed [C] (acc: unused, kept for the
 * callers' layout). */
static inline __attribute__((always_inline)) void finish_rows(const attention_call *a, long b, long g, long n0, long n1,
                                                              long r_begin, long r_end, float *score, float *acc,
                                                              float *allowed, const long D) {
    (void)acc;
    const long C = a->C, positions = n1 - n0;
    const long slot = a->slots ? (long)a->slots[b] : b;
    const float *vr = a->v + slot * a->kv_b + g * a->kv_h;
    for (long r0 = r_begin; r0 < r_end; r0 += FINISH_ROWS) {
        const int R = (int)(r_end - r0 < FINISH_ROWS ? r_end - r0 : FINISH_ROWS);
        float *sr[FINISH_ROWS], *o[FINISH_ROWS];
        const unsigned char *mask[FINISH_ROWS];
        for (int i = 0; i < R; i++) {
            const long r = r0 + i, h = g * a->group + r / positions, n = n0 + r % positions;
            mask[i] = a->allowed + b * a->m_b + n * a->m_n;
            sr[i] = score + r * C;
            o[i] = output_row(a, b, h, n);
            for (long c = 0; c < C; c++) allowed[c] = (float)mask[i][c]; /* float, so the selects below vectorize */
            float best = -INFINITY;
            for (long c = 0; c < C; c++) best = allowed[c] != 0.0f && sr[i][c] > best ? sr[i][c] : best;
            for (long c = 0; c < C; c++) sr[i][c] = allowed[c] != 0.0f ? exp_fixed(sr[i][c] - best) : 0.0f;
        }
        switch (R) {
        case 4: accumulate_rows(a, vr, C, 4, sr, mask, o, D); break;
        case 3: accumulate_rows(a, vr, C, 3, sr, mask, o, D); break;
        case 2: accumulate_rows(a, vr, C, 2, sr, mask, o, D); break;
        default: accumulate_rows(a, vr, C, 1, sr, mask, o, D); break;
        }
    }
}

/* The common head size compiled with D fixed (accumulators in registers; the same operations). */
static inline __attribute__((always_inline)) void scores(const attention_call *a, long b, long g, long n0, long n1,
                                                         long c_begin, long c_end, float *keys, float *score) {
    a->D == 64 ? score_columns(a, b, g, n0, n1, c_begin, c_end, keys, score, 64)
               : score_columns(a, b, g, n0, n1, c_begin, c_end, keys, score, a->D);
}

static inline __attribute__((always_inline)) void finish(const attention_call *a, long b, long g, long n0, long n1,
                                                         long r_begin, long r_end, float *score, float *acc,
                                                         float *allowed) {
    a->D == 64 ? finish_rows(a, b, g, n0, n1, r_begin, r_end, score, acc, allowed, 64)
               : finish_rows(a, b, g, n0, n1, r_begin, r_end, score, acc, allowed, a->D);
}

typedef void (*score_kernel)(const attention_call *a, long b, long g, long n0, long n1, long c_begin, long c_end,
                             float *keys, float *score);
typedef void (*finish_kernel)(const attention_call *a, long b, long g, long n0, long n1, long r_begin, long r_end,
                              float *score, float *acc, float *allowed);
VECTOR_PATHS(scores, score_kernel,
             (const attention_call *a, long b, long g, long n0, long n1, long c_begin, long c_end, float *keys,
              float *score),
             (a, b, g, n0, n1, c_begin, c_end, keys, score))
VECTOR_PATHS(finish, finish_kernel,
             (const attention_call *a, long b, long g, long n0, long n1, long r_begin, long r_end, float *score,
              float *acc, float *allowed),
             (a, b, g, n0, n1, r_begin, r_end, score, acc, allowed))

/* 1 + the last column any row n0..n1-1 of sequence b may attend to (0: none). */
static long columns_in_use(const attention_call *a, long b, long n0, long n1) {
    long used = 0;
    for (long n = n0; n < n1; n++) {
        const unsigned char *mask = a->allowed + b * a->m_b + n * a->m_n;
        long c = a->C;
        while (c > used && !mask[c - 1]) c--;
        used = c;
    }
    return used;
}

/* The real query positions of sequence b (rows past them are padding, never computed). */
static inline long positions_of(const attention_call *a, long b) { return a->num_new ? (long)a->num_new[b] : a->N; }

/* Two phases when the (sequence, kv head) groups are too few to keep every thread busy (decode
 * at one sequence: 3 groups on 2 threads): first the scores, split by column blocks, then the
 * rows, split by row. A row's scores and its reductions are the same operations either way. */
#define TWO_PHASE_BYTES (8L << 20) /* the score buffer of every row at once, at most */

int attention_two_phases_fit(const attention_call *a, long B, long KVH, int threads) {
    for (long b = 0; b < B; b++)
        if (positions_of(a, b) != a->N) return 0; /* padding rows: the chunked items skip them */
    return B * KVH < 2L * threads && (long)sizeof(float) * B * a->H * a->N * a->C <= TWO_PHASE_BYTES;
}

size_t attention_shared_score_floats(const attention_call *a, long B) {
    return (size_t)(B * a->H * a->N * (a->C > 0 ? a->C : 1));
}

size_t attention_thread_floats(long D, long C, long group) {
    return (size_t)(D * COLUMNS + C * group * CHUNK + D + C + 64);
}

/* The attention inside an enclosing parallel region (orphaned `omp for`s with their barriers).
 * scratch: this thread's attention_thread_floats(D, C, group) floats; shared_score: every
 * thread's same buffer of attention_shared_score_floats() when attention_two_phases_fit. */
void attention_shared(const attention_call *a, long B, long KVH, int two_phases, float *scratch, float *shared_score) {
    const score_kernel score_fn = scores_pick();
    const finish_kernel finish_fn = finish_pick();
    const long C = a->C, N = a->N, D = a->D;
    float *keys = scratch, *acc = keys + D * COLUMNS, *allowed_f = acc + D, *score = allowed_f + (C > 0 ? C : 1);
    if (two_phases) {
        const long rows = a->group * N, groups = B * KVH;
        const long blocks = (C + COLUMNS - 1) / COLUMNS, per_item = (blocks + 3) / 4; /* up to 4 column ranges a group */
        const long ranges = per_item > 0 ? (blocks + per_item - 1) / per_item : 0;
#pragma omp for schedule(dynamic) /* see int8_linear.c: preempted threads */
        for (long item = 0; item < groups * ranges; item++) {
            const long group = item / ranges, c_begin = (item % ranges) * per_item * COLUMNS;
            const long c_end = c_begin + per_item * COLUMNS < C ? c_begin + per_item * COLUMNS : C;
            score_fn(a, group / KVH, group % KVH, 0, N, c_begin, c_end, keys, shared_score + group * rows * C);
        }
        const long row_items = (rows + FINISH_ROWS - 1) / FINISH_ROWS;
#pragma omp for schedule(dynamic) /* see int8_linear.c: preempted threads */
        for (long item = 0; item < groups * row_items; item++) {
            const long group = item / row_items, r = (item % row_items) * FINISH_ROWS;
            const long r_end = r + FINISH_ROWS < rows ? r + FINISH_ROWS : rows;
            finish_fn(a, group / KVH, group % KVH, 0, N, r, r_end, shared_score + group * rows * C, acc, allowed_f);
        }
        return;
    }
    /* positions per item: at most CHUNK, and small enough that every thread gets work */
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_num_threads();
#endif
    long chunk = N < CHUNK ? N : CHUNK;
    while (chunk > 1 && B * KVH * ((N + chunk - 1) / chunk) < 2L * threads) chunk = (chunk + 1) / 2;
    const long chunks = (N + chunk - 1) / chunk, items = B * KVH * chunks;
#pragma omp for schedule(dynamic) /* see int8_linear.c: preempted threads */
    for (long item = 0; item < items; item++) {
        const long b = item / (KVH * chunks), g = (item / chunks) % KVH, n0 = (item % chunks) * chunk;
        const long real = positions_of(a, b);
        if (n0 >= real) continue;
        const long n1 = n0 + chunk < real ? n0 + chunk : real;
        /* Only the columns up to the item's last allowed one: a causal prompt chunk's
         * rows skip the columns after them, a short sequence beside long ones the
         * columns past its end. The columns cut are masked for every row of the item:
         * their weights were exact zeros that changed no sum, so the bits are the same. */
        attention_call item_call = *a;
        item_call.C = columns_in_use(a, b, n0, n1);
        score_fn(&item_call, b, g, n0, n1, 0, item_call.C, keys, score);
        finish_fn(&item_call, b, g, n0, n1, 0, a->group * (n1 - n0), score, acc, allowed_f);
    }
}

int invariant_attention(const float *q, long q_b, long q_h, long q_n,
                        const float *k, const float *v, long kv_b, long kv_h, long kv_c,
                        const int64_t *slots, const unsigned char *allowed, long m_b, long m_n,
                        float *out, long B, long H, long KVH, long N, long C, long D,
                        float scale, int threads) {
    if (H % KVH != 0) return 1;
    const attention_call a = {q, k, v, q_b, q_h, q_n, kv_b, kv_h, kv_c, m_b, m_n, H, N, C, D, H / KVH, allowed, slots, out,
                              scale, NULL, NULL, attention_transpose_pick(D)};
    if (threads < 1) threads = 1;
    const int two_phases = attention_two_phases_fit(&a, B, KVH, threads);
    const size_t per_thread = attention_thread_floats(D, C, a.group);
    float *scratch = malloc(sizeof(float) * per_thread * threads);
    float *shared_score = two_phases ? malloc(sizeof(float) * attention_shared_score_floats(&a, B)) : NULL;
    if (scratch == NULL || (two_phases && shared_score == NULL)) {
        free(scratch), free(shared_score);
        return 2;
    }
    const long items = two_phases ? 2 : B * KVH * N; /* one item: no team */
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        attention_shared(&a, B, KVH, two_phases, scratch + per_thread * me, shared_score);
    }
    free(scratch), free(shared_score);
    return 0;
}
