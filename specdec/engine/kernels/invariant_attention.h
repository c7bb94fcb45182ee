/* The batch-invariant attention's call and its work-sharing form (invariant_attention.c), for the
 * per-op entry point and the forward plan (forward_plan.c). */
#ifndef SPECDEC_INVARIANT_ATTENTION_H
#define SPECDEC_INVARIANT_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#define COLUMNS 16 /* keys per transposed block: one per lane */
#define CHUNK 64   /* query positions per work item, at most */

/* keys [16 rows, stride kv_c][D] -> out [D][16] (attention_transpose_pick: NULL for the plain loop) */
typedef void (*transpose_kernel)(const float *k, long kv_c, long D, float *out);
transpose_kernel attention_transpose_pick(long D);

typedef struct {
    const float *q, *k, *v;
    long q_b, q_h, q_n, kv_b, kv_h, kv_c, m_b, m_n, H, N, C, D, group;
    const unsigned char *allowed;
    const int64_t *slots;
    float *out, scale;
    /* The forward plan's packed rows: row (b, n) is token token_of[b * N + n] of q [T][H][D] (q_n
     * its stride, q_h a head's) and of out [T][H][D]; only num_new[b] positions of sequence b
     * are real. NULL, NULL: the strided layouts above, every position real. */
    const int32_t *token_of;
    const int64_t *num_new;
    transpose_kernel transpose;
} attention_call;

int attention_two_phases_fit(const attention_call *a, long B, long KVH, int threads);
size_t attention_shared_score_floats(const attention_call *a, long B);
size_t attention_thread_floats(long D, long C, long group);
void attention_shared(const attention_call *a, long B, long KVH, int two_phases, float *scratch, float *shared_score);

#endif
