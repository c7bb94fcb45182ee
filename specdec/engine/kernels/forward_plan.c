/* The native forward: a quantized Llama-family target's whole forward in one call
 * (specdec/engine/models/native_forward.py builds the plan and the step).
 *
 * Why: the per-op forward (engine/models/llama.py on the kernels of this folder) makes about 270
 * ctypes calls, 960 PyTorch operators and 150 OpenMP parallel regions for one decode row, and at
 * these sizes that overhead, not the arithmetic, was most of a step (10-11 ms where the weights
 * stream in 4-5). Here one call runs every layer inside ONE parallel region: each pass is an
 * orphaned `omp for` of the team, separated by the team's barriers only; no memory is allocated
 * per step (the plan keeps its scratch), and no PyTorch operator runs inside.
 *
 * The same kernels as the per-op path, on the same rows, in the same order of float operations
 * (int8_linear.h's numerics, row_kernels.h, invariant_attention.h), so the native forward's
 * logits and hidden taps equal the per-op forward's bit for bit (tests/engine/test_native_forward.py):
 * the per-op path stays the oracle. The passes are fused where a row's result feeds only the next
 * pass of the same row: the residual add, the norm and the activation quantization feeding a
 * projection are one pass; silu, the multiply and the quantization feeding the down projection
 * another; RoPE and the KV write a third.
 *
 * Rows are packed: T tokens of B sequences, token t of sequence b at row token_of[b * N + n]
 * (n < num_new[b]); attention reads each sequence's slot of the cache under its [N][C] mask. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "int8_linear.h"
#include "invariant_attention.h"
#include "row_kernels.h"

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    const float *qkv_bias, *o_bias;    /* [(H + 2 KVH) D], [hidden], or NULL */
    const float *q_norm, *k_norm;      /* [head_dim] per-head norms before RoPE (Qwen3, Gemma 3), or NULL */
    const float *attn_out_norm, *mlp_out_norm; /* Gemma's sandwich: the attention's and MLP's outputs normed, or NULL */
    long local;                        /* a sliding-window layer: the local mask and RoPE table (Gemma 3) */
    packed_weight wqkv, wo, w13, w2;
} plan_layer;

typedef struct {
    int isa;
    long layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    float eps, embed_scale, attention_scale; /* embed_scale 0: none; attention_scale: the per-op path's D ** -0.5 */
    int gelu;                                /* Gemma's tanh-GELU gate instead of SiLU */
    const float *embed;     /* [vocab][hidden] float32 */
    const float *final_norm;
    const float *rope_cos, *rope_sin; /* [rope_positions][head_dim], sin's first half negated */
    long rope_positions;
    const float *local_cos, *local_sin; /* the local layers' table (their own RoPE base), or NULL */
    long local_positions;
    packed_weight lm_head;
    const plan_layer *layer; /* [layers] */
    /* scratch, grown by forward_plan_run, freed by forward_plan_free */
    void *scratch;
    size_t scratch_bytes;
} forward_plan;

typedef struct {
    long T, B, N, C; /* packed tokens; sequences, their widest row count, the mask's columns */
    const int64_t *tokens, *positions, *slot, *column; /* [T]: id, RoPE position, cache slot and column */
    const int32_t *token_of;                           /* [B * N]: packed token of (b, n), -1 for padding */
    const int64_t *num_new, *seq_slot;                 /* [B] */
    const unsigned char *mask;                         /* [B][N][C] may attend */
    const unsigned char *local_mask;                   /* [B][N][C] the local layers' (windowed), or NULL */
    float *k_cache, *v_cache;                          /* [layers][slots][KVH][capacity][D] */
    long s_layer, s_slot, s_head, s_col;               /* the cache's strides, elements */
    long logits_rows;                                  /* tokens whose logits are wanted */
    const int64_t *logits_token;                       /* [logits_rows] packed token */
    float *logits;                                     /* [logits_rows][vocab] */
    long taps;                                         /* layers whose output is kept */
    const int64_t *tap_layer;                          /* [taps], in the order asked */
    float *hidden;                                     /* [T][taps * hidden] (packed) */
} forward_step;

/* Bytes of scratch one step needs, laid out by carve(). */
typedef struct {
    float *x, *qkv, *q, *attn, *proj, *gate_up, *row;
    quantized_rows quant;
    float *attention, *shared_score;
    size_t attention_per_thread;
} step_buffers;

static size_t round_up(size_t bytes) { return (bytes + 63) / 64 * 64; }

static size_t carve(const forward_plan *p, const forward_step *s, int threads, const attention_call *call, int two_phases,
                    char *base, step_buffers *out) {
    const long T = s->T, H = p->hidden, D = p->head_dim, I = p->intermediate;
    const long qkv_width = (p->heads + 2 * p->kv_heads) * D, widest = H > I ? H : I;
    const long k_max = widest > p->heads * D ? widest : p->heads * D, rows = T > s->logits_rows ? T : s->logits_rows;
    const long padded = (rows + PAD_ROWS - 1) / PAD_ROWS * PAD_ROWS, blocks = k_max / QBLOCK;
    const size_t per_thread = attention_thread_floats(D, s->C, p->heads / p->kv_heads);
    const size_t shared = two_phases ? attention_shared_score_floats(call, s->B) : 1;
    size_t at = 0;
#define TAKE(field, type, count)                                                                                       \
    do {                                                                                                               \
        if (base) out->field = (type *)(base + at);                                                                    \
        at += round_up(sizeof(type) * (size_t)(count));                                                                \
    } while (0)
    TAKE(x, float, T * H);
    TAKE(qkv, float, T * qkv_width);
    TAKE(q, float, T * p->heads * D);
    TAKE(attn, float, T * p->heads * D);
    TAKE(proj, float, T * H);
    TAKE(gate_up, float, T * 2 * I);
    TAKE(row, float, threads * widest * 2);
    TAKE(quant.codes, int8_t, padded * k_max);
    TAKE(quant.scale, float, rows * blocks);
    TAKE(quant.unbias, int32_t, rows * blocks);
    TAKE(quant.offset_scale, float, rows * blocks);
    TAKE(attention, float, threads * per_thread);
    TAKE(shared_score, float, shared);
#undef TAKE
    out->attention_per_thread = per_thread;
    return at;
}

static int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The activations of `rows` rows of width k in the shared quantized buffer. */
static quantized_rows quantized_view(const step_buffers *buf, long rows, long k) {
    const quantized_rows q = {rows, k, k / QBLOCK, buf->quant.codes, buf->quant.scale, buf->quant.unbias,
                              buf->quant.offset_scale};
    return q;
}

static void quantize_one(const float *row, const quantized_rows *q, long r) {
    quantize_row(row, q->k, q->codes + r * q->k, q->scale + r * q->blocks, q->unbias + r * q->blocks,
                 q->offset_scale + r * q->blocks);
}

/* Row r of the quantized activations: row's codes, or zeros for a padding row (r >= q->rows: the AMX
 * path reads 16 rows at a time, and the buffer is shared by widths). Loops over padded_rows(q). */
static void quantize_or_clear(const float *row, const quantized_rows *q, long r) {
    if (r < q->rows)
        quantize_one(row, q, r);
    else
        memset(q->codes + r * q->k, 0, (size_t)q->k);
}

static long padded_rows(const quantized_rows *q) { return (q->rows + PAD_ROWS - 1) / PAD_ROWS * PAD_ROWS; }

/* x [T][H] += residual (when given), normed into the quantized rows: the input of a projection. */
static void norm_and_quantize(const forward_plan *p, const step_buffers *buf, norm_kernel norm, float *x,
                              const float *residual, const float *weight, long T) {
    const long H = p->hidden;
    const quantized_rows q = quantized_view(buf, T, H);
    float *normed = buf->row + (long)thread_index() * 2 * (H > p->intermediate ? H : p->intermediate);
#pragma omp for schedule(static)
    for (long t = 0; t < padded_rows(&q); t++) {
        if (t < T) norm(x + t * H, residual ? residual + t * H : NULL, weight, normed, H, p->eps);
        quantize_or_clear(normed, &q, t);
    }
}

/* Gemma's sandwich: x [T][H] += the norm of out (an attention's or MLP's output), as x + norm(out). */
static void sandwich(const forward_plan *p, const step_buffers *buf, norm_kernel norm, float *x, const float *out,
                     const float *weight, long T) {
    const long H = p->hidden;
    float *normed = buf->row + (long)thread_index() * 2 * (H > p->intermediate ? H : p->intermediate);
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
        norm((float *)out + t * H, NULL, weight, normed, H, p->eps);
        for (long j = 0; j < H; j++) x[t * H + j] += normed[j];
    }
}

static void run_layers(const forward_plan *p, const forward_step *s, const step_buffers *buf, const attention_call *call,
                       int two_phases) {
    const long T = s->T, H = p->hidden, D = p->head_dim, I = p->intermediate, HD = p->heads * D;
    const long qkv_width = (p->heads + 2 * p->kv_heads) * D;
    const tile_kernel kernel = int8_kernel_for(p->isa);
    const norm_kernel norm = rms_norm_row_kernel();
    const rope_kernel rope = rope_row_kernel();
    const silu_kernel activation = p->gelu ? gelu_mul_row_kernel() : silu_mul_row_kernel();
    float *const x = buf->x;
    float *scratch = buf->attention + buf->attention_per_thread * (size_t)thread_index();
    if (p->isa == ISA_AMX) amx_begin(); /* tile state is per thread */

#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
        const float *e = p->embed + s->tokens[t] * H;
        float *row = x + t * H;
        if (p->embed_scale != 0.0f)
            for (long i = 0; i < H; i++) row[i] = e[i] * p->embed_scale;
        else
            memcpy(row, e, sizeof(float) * H);
    }
    int pending = 0; /* the last layer's MLP output (proj) not yet added to x */
    for (long l = 0; l < p->layers; l++) {
        const plan_layer *L = &p->layer[l];
        float *k_layer = s->k_cache + l * s->s_layer, *v_layer = s->v_cache + l * s->s_layer;
        /* attention: norm, q|k|v, RoPE and the cache write, the invariant attention, o */
        const quantized_rows q_h = quantized_view(buf, T, H), q_hd = quantized_view(buf, T, HD),
                             q_i = quantized_view(buf, T, I);
        norm_and_quantize(p, buf, norm, x, pending ? buf->proj : NULL, L->attn_norm, T);
        int8_tiles_shared(kernel, &q_h, &L->wqkv, L->qkv_bias, buf->qkv, qkv_width);
        const float *cos = L->local ? p->local_cos : p->rope_cos, *sin = L->local ? p->local_sin : p->rope_sin;
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const long at = s->slot[t] * s->s_slot + s->column[t] * s->s_col, pos = s->positions[t];
            float *row = buf->qkv + t * qkv_width;
            if (L->q_norm != NULL) head_norms_row(norm, row, p->heads, p->kv_heads, D, L->q_norm, L->k_norm, p->eps);
            rope(row, p->heads, p->kv_heads, D, cos + pos * D, sin + pos * D, buf->q + t * HD, k_layer + at, v_layer + at,
                 s->s_head);
        }
        attention_call layer_call = *call;
        layer_call.k = k_layer;
        layer_call.v = v_layer;
        if (L->local) layer_call.allowed = s->local_mask;
        attention_shared(&layer_call, s->B, p->kv_heads, two_phases, scratch, buf->shared_score);
#pragma omp for schedule(static)
        for (long t = 0; t < padded_rows(&q_hd); t++) quantize_or_clear(buf->attn + t * HD, &q_hd, t);
        int8_tiles_shared(kernel, &q_hd, &L->wo, L->o_bias, buf->proj, H);
        /* MLP: residual add and norm, gate|up, silu * up, down */
        if (L->attn_out_norm != NULL) { /* Gemma: x += norm(attention); then the MLP's norm */
            sandwich(p, buf, norm, x, buf->proj, L->attn_out_norm, T);
            norm_and_quantize(p, buf, norm, x, NULL, L->mlp_norm, T);
        } else {
            norm_and_quantize(p, buf, norm, x, buf->proj, L->mlp_norm, T);
        }
        int8_tiles_shared(kernel, &q_h, &L->w13, NULL, buf->gate_up, 2 * I);
        float *activated = buf->row + (long)thread_index() * 2 * (H > I ? H : I);
#pragma omp for schedule(static)
        for (long t = 0; t < padded_rows(&q_i); t++) {
            if (t < T) activation(buf->gate_up + t * 2 * I, activated, I);
            quantize_or_clear(activated, &q_i, t);
        }
        int8_tiles_shared(kernel, &q_i, &L->w2, NULL, buf->proj, H);
        pending = 1;
        if (L->mlp_out_norm != NULL) { /* Gemma: x += norm(MLP) */
            sandwich(p, buf, norm, x, buf->proj, L->mlp_out_norm, T);
            pending = 0;
        }
        for (long i = 0; i < s->taps; i++) {
            if (s->tap_layer[i] != l) continue;
#pragma omp for schedule(static)
            for (long t = 0; t < T; t++) {
                float *row = x + t * H;
                if (pending)
                    for (long j = 0; j < H; j++) row[j] += buf->proj[t * H + j];
                memcpy(s->hidden + (t * s->taps + i) * H, row, sizeof(float) * H);
            }
            pending = 0;
        }
    }
    /* the last norm and the lm_head, on the tokens whose logits are wanted */
    const quantized_rows q_out = quantized_view(buf, s->logits_rows, H);
    float *normed = buf->row + (long)thread_index() * 2 * (H > I ? H : I);
#pragma omp for schedule(static)
    for (long r = 0; r < padded_rows(&q_out); r++) {
        if (r < s->logits_rows) {
            float *row = x + s->logits_token[r] * H;
            if (pending)
                for (long j = 0; j < H; j++) row[j] += buf->proj[s->logits_token[r] * H + j];
            norm(row, NULL, p->final_norm, normed, H, p->eps);
        }
        quantize_or_clear(normed, &q_out, r);
    }
    if (s->logits_rows > 0) int8_tiles_shared(kernel, &q_out, &p->lm_head, NULL, s->logits, p->vocab);
    if (p->isa == ISA_AMX) amx_end();
}

/* Runs one step. Returns 0, or: 1 a path this CPU lacks, 2 a bad shape, 3 out of memory. */
int forward_plan_run(forward_plan *p, const forward_step *s, int threads) {
    if (!int8_isa_supported(p->isa)) return 1;
    if (s->T <= 0 || s->B <= 0 || p->heads % p->kv_heads != 0 || p->head_dim % 2 != 0) return 2;
    for (long t = 0; t < s->T; t++)
        if (s->positions[t] < 0 || s->positions[t] >= p->rope_positions || s->tokens[t] < 0 || s->tokens[t] >= p->vocab ||
            (p->local_cos != NULL && s->positions[t] >= p->local_positions))
            return 2;
    for (long l = 0; l < p->layers; l++)
        if (p->layer[l].local && (s->local_mask == NULL || p->local_cos == NULL)) return 2;
    if (threads < 1) threads = 1;
    const attention_call call = {NULL, NULL, NULL, 0, p->head_dim, p->heads * p->head_dim, s->s_slot, s->s_head, s->s_col,
                                 s->N * s->C, s->C, p->heads, s->N, s->C, p->head_dim, p->heads / p->kv_heads, s->mask,
                                 s->seq_slot, NULL, 0.0f, s->token_of, s->num_new, attention_transpose_pick(p->head_dim)};
    const int two_phases = attention_two_phases_fit(&call, s->B, p->kv_heads, threads);
    step_buffers buf;
    const size_t bytes = carve(p, s, threads, &call, two_phases, NULL, &buf);
    if (bytes > p->scratch_bytes) {
        free(p->scratch);
        p->scratch = aligned_alloc(64, bytes);
        p->scratch_bytes = p->scratch ? bytes : 0;
        if (p->scratch == NULL) return 3;
    }
    carve(p, s, threads, &call, two_phases, p->scratch, &buf);
    attention_call with_buffers = call;
    with_buffers.q = buf.q;
    with_buffers.out = buf.attn;
    with_buffers.scale = p->attention_scale;
#pragma omp parallel num_threads(threads)
    run_layers(p, s, &buf, &with_buffers, two_phases);
    return 0;
}

void forward_plan_free(forward_plan *p) {
    free(p->scratch);
    p->scratch = NULL;
    p->scratch_bytes = 0;
}
