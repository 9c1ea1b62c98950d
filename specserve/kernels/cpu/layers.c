// A step's dense decoder layers in one call: per layer RMSNorm (with the pending residual add) -> [q | k | v]
// product (+ bias) -> RoPE with the KV write -> attention -> output product, then RMSNorm -> [gate | up] product ->
// SwiGLU -> down product. The same kernels the op-by-op path calls from Python (ops.c, gemv_i8.c), in the same
// order on the same buffers' values, so the result is that path's bit for bit; what goes is the ~9 Python and
// ctypes round trips a layer (~10 us each), which on a 135M model were as long as the products themselves.
#include <stdint.h>
#include <string.h>

#include "simd.h"

// Other units of the library.
int q_gemv_i8(const int32_t* words, const uint16_t* sm, const float* x_rows, const int32_t* perm, float* out,
              int rows, int n, int k, int words_per_row, int groups_per_row, int bits, int words_per_group,
              int chunks, int threads);
void cpu_rms_norm(const float* x, const float* add, float* sum, const float* w, float* out, int rows, int dim,
                  float eps);
void cpu_rope_cache(const float* q, const float* k, const float* v, int64_t row_stride, int T, int n_heads,
                    int n_kv_heads, int dim, int half, const float* cos_table, const float* sin_table,
                    const int64_t* positions, const int64_t* slots, void* k_data, int64_t k_block_stride,
                    int64_t k_head_stride, int k_bits, void* v_data, int64_t v_block_stride, int64_t v_head_stride,
                    int v_bits, int block_shift, int neox, float* q_out);
int cpu_attention(const float* q, int T, int n_heads, int n_kv_heads, int dim, void* k_data, int64_t k_block_stride,
                  int64_t k_head_stride, int k_bits, void* v_data, int64_t v_block_stride, int64_t v_head_stride,
                  int v_bits, const int64_t* positions, const int64_t* seq_ids, const int32_t* table,
                  const int64_t* hidden, int table_width, int block_shift, float scale, float* out, int threads);
void cpu_silu_mul(const float* x, float* out, int rows, int n);

#define MAX_ROWS 16  // rows one int8 product call takes (quant_cpu.MAX_ROWS)

// A packed matrix as q_gemv_i8 takes it (quant_cpu's call plan).
typedef struct {
    const int32_t* words;
    const uint16_t* sm;
    const int32_t* perm;
    int32_t n, k, words_per_row, groups_per_row, bits, words_per_group, chunks;
} cpu_matrix;

// One layer's weights and KV cache (as cpu_ops' _cache_args: data, block and head strides, row bits).
typedef struct {
    const float* attn_norm;
    const float* ffn_norm;
    const float* qkv_bias;  // NULL: none
    cpu_matrix qkv, o, gate_up, down;
    void* k_data;
    void* v_data;
    int64_t k_block_stride, k_head_stride, v_block_stride, v_head_stride;
    int32_t k_bits, v_bits;
} cpu_layer;

// The step: its rows' ids, the model's shapes, and the buffers. residual [rows, hidden] is updated in place;
// pending [rows, hidden] receives the last sub-layer's output, not yet added (the op-by-op path's stream state).
typedef struct {
    const int64_t* positions;
    const int64_t* rope_positions;  // where RoPE puts each row: positions, or less for a token tree's rows
    const int64_t* hidden_keys;  // NULL, or a token tree's rows' hidden positions (cpu_attention's `hidden`)
    const int64_t* seq_ids;
    const int64_t* slots;
    const int32_t* table;
    const float* cos;
    const float* sin;
    float* residual;
    float* pending;
    float* scratch;  // cpu_layers_scratch(...) floats
    int32_t n_layers, rows, hidden, n_heads, n_kv_heads, dim, half, neox, block_shift, table_width, threads;
    float eps, scale;
} cpu_step;

// y [rows, m->n] = x [rows, m->k] @ W^T, in calls of up to MAX_ROWS rows (as quant_cpu.gemv).
static int product(const cpu_matrix* m, const float* x, float* y, int rows, int threads) {
    for (int start = 0; start < rows; start += MAX_ROWS) {
        const int n_rows = rows - start < MAX_ROWS ? rows - start : MAX_ROWS;
        if (q_gemv_i8(m->words, m->sm, x + (int64_t)start * m->k, m->perm, y + (int64_t)start * m->n, n_rows, m->n,
                      m->k, m->words_per_row, m->groups_per_row, m->bits, m->words_per_group, m->chunks, threads))
            return -1;
    }
    return 0;
}

// Floats of scratch a step of `rows` rows needs for these layers' shapes.
int64_t cpu_layers_scratch(const cpu_layer* layers, const cpu_step* s) {
    const cpu_layer* l = layers;
    const int64_t attn = (int64_t)s->n_heads * s->dim;
    return (int64_t)s->rows * (s->hidden + l->qkv.n + 2 * attn + l->gate_up.n + l->gate_up.n / 2);
}

// Returns 0, or -1 where a kernel could not allocate its scratch (the residual is then partly updated).
int cpu_layers(const cpu_layer* layers, const cpu_step* s) {
    const int rows = s->rows, hidden = s->hidden;
    const int64_t attn_width = (int64_t)s->n_heads * s->dim, kv_width = (int64_t)s->n_kv_heads * s->dim;
    float* h = s->scratch;  // the normed stream
    float* qkv = h + (int64_t)rows * hidden;
    float* q_rot = qkv + (int64_t)rows * layers[0].qkv.n;
    float* attn = q_rot + rows * attn_width;
    float* gate_up = attn + rows * attn_width;
    float* act = gate_up + (int64_t)rows * layers[0].gate_up.n;
    for (int i = 0; i < s->n_layers; ++i) {
        const cpu_layer* l = layers + i;
        if (i == 0)
            cpu_rms_norm(s->residual, NULL, NULL, l->attn_norm, h, rows, hidden, s->eps);
        else  // the previous layer's output joins the stream in its norm
            cpu_rms_norm(s->pending, s->residual, s->residual, l->attn_norm, h, rows, hidden, s->eps);
        if (product(&l->qkv, h, qkv, rows, s->threads)) return -1;
        if (l->qkv_bias)
            for (int r = 0; r < rows; ++r)
                for (int j = 0; j < l->qkv.n; ++j) qkv[(int64_t)r * l->qkv.n + j] += l->qkv_bias[j];
        cpu_rope_cache(qkv, qkv + attn_width, qkv + attn_width + kv_width, rows > 1 ? l->qkv.n : 0, rows,
                       s->n_heads, s->n_kv_heads, s->dim, s->half, s->cos, s->sin, s->rope_positions, s->slots,
                       l->k_data, l->k_block_stride, l->k_head_stride, l->k_bits, l->v_data, l->v_block_stride,
                       l->v_head_stride, l->v_bits, s->block_shift, s->neox, q_rot);
        if (cpu_attention(q_rot, rows, s->n_heads, s->n_kv_heads, s->dim, l->k_data, l->k_block_stride,
                          l->k_head_stride, l->k_bits, l->v_data, l->v_block_stride, l->v_head_stride, l->v_bits,
                          s->positions, s->seq_ids, s->table, s->hidden_keys, s->table_width, s->block_shift, s->scale, attn,
                          s->threads))
            return -1;
        if (product(&l->o, attn, s->pending, rows, s->threads)) return -1;
        cpu_rms_norm(s->pending, s->residual, s->residual, l->ffn_norm, h, rows, hidden, s->eps);
        if (product(&l->gate_up, h, gate_up, rows, s->threads)) return -1;
        cpu_silu_mul(gate_up, act, rows, l->gate_up.n / 2);
        if (product(&l->down, act, s->pending, rows, s->threads)) return -1;
    }
    return 0;
}
