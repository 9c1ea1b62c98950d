// The small ops of a CPU decode step, one call each instead of torch's 5-15 small ops (each of which costs a few
// microseconds of dispatch on a 135M model's 576-wide rows): RMSNorm with the residual add, RoPE with the KV-cache
// write, attention of a few query rows over the cache, SwiGLU. fp32 throughout, rounding as the torch references
// do where the order is the same (elementwise ops; the library is built with -ffp-contract=off so `a * b - c * d`
// stays two roundings and a subtraction); reductions (RMSNorm's mean, attention's sums) add in another order.
// Vector operations from simd.h (AVX-512 or AVX2).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"
#include "pool.h"
#include "simd.h"

// out = rms_norm(x + add) * w per row, and sum = x + add (add, sum: NULL for a plain norm). As rms_norm_ref:
// s * (1 / sqrt(mean(s^2) + eps)), then * w.
void cpu_rms_norm(const float* x, const float* add, float* sum, const float* w, float* out, int rows, int dim,
                  float eps) {
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + (int64_t)r * dim;
        const float* ar = add ? add + (int64_t)r * dim : NULL;
        float* sr = sum ? sum + (int64_t)r * dim : NULL;
        vf sq = v_zero();
        for (int i = 0; i < dim; i += VL) {
            vf v = v_load_n(xr + i, dim - i);
            if (ar) {
                v = v_add(v, v_load_n(ar + i, dim - i));
                v_store_n(sr + i, dim - i, v);
            }
            sq = v_fmadd(v, v, sq);
        }
        const float inv = 1.0f / sqrtf(v_reduce_add(sq) / (float)dim + eps);
        const float* src = sr ? sr : xr;
        for (int i = 0; i < dim; i += VL) {
            const vf v = v_mul(v_load_n(src + i, dim - i), v_set1(inv));
            v_store_n(out + (int64_t)r * dim + i, dim - i, v_mul(v, v_load_n(w + i, dim - i)));
        }
    }
}

// One head of `dim` values rotated by cos/sin (half values each) into dst, as rope.apply_rope: neox pairs i with
// i + half, interleaved 2i with 2i + 1; values past 2 * half are copied.
static void rotate(const float* src, float* dst, const float* c, const float* s, int dim, int half, int neox) {
    for (int i = 0; i < half; ++i) {
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x1 = src[a], x2 = src[b];
        dst[a] = x1 * c[i] - x2 * s[i];
        dst[b] = neox ? x2 * c[i] + x1 * s[i] : x1 * s[i] + x2 * c[i];
    }
    for (int i = 2 * half; i < dim; ++i) dst[i] = src[i];
}

// Where a paged cache keeps its rows: [blocks, heads, 1 << block_shift, row] in storage elements (floats, halves,
// or bytes when packed: kv_rows.h).
typedef struct {
    void* data;
    int64_t block_stride, head_stride;
    int bits;
} kv_cache;

static inline int64_t kv_row_at(const kv_cache* c, int64_t slot, int head, int block_shift, int dim) {
    return (slot >> block_shift) * c->block_stride + (int64_t)head * c->head_stride +
           (slot & ((1 << block_shift) - 1)) * kv_row_width(dim, c->bits);
}

// For each of T tokens (rows of a [q | k | v] product, row_stride floats apart): q's heads rotated into q_out
// [T, n_heads, dim]; k's rotated and v's copied into the paged caches at slot slots[t]: block
// slots[t] >> block_shift, row the slot's low bits (encoded where a cache is packed).
void cpu_rope_cache(const float* q, const float* k, const float* v, int64_t row_stride, int T, int n_heads,
                    int n_kv_heads, int dim, int half, const float* cos_table, const float* sin_table,
                    const int64_t* positions, const int64_t* slots, void* k_data, int64_t k_block_stride,
                    int64_t k_head_stride, int k_bits, void* v_data, int64_t v_block_stride, int64_t v_head_stride,
                    int v_bits, int block_shift, int neox, float* q_out) {
    const kv_cache kc = {k_data, k_block_stride, k_head_stride, k_bits};
    const kv_cache vc = {v_data, v_block_stride, v_head_stride, v_bits};
    float rotated[512];  // one head (head sizes are at most 256)
    for (int t = 0; t < T; ++t) {
        const int64_t pos = positions[t];
        const float* c = cos_table + pos * half;
        const float* s = sin_table + pos * half;
        for (int h = 0; h < n_heads; ++h)
            rotate(q + t * row_stride + h * dim, q_out + ((int64_t)t * n_heads + h) * dim, c, s, dim, half, neox);
        for (int h = 0; h < n_kv_heads; ++h) {
            rotate(k + t * row_stride + h * dim, rotated, c, s, dim, half, neox);
            kv_store_row(rotated, kc.data, kv_row_at(&kc, slots[t], h, block_shift, dim), dim, k_bits);
            kv_store_row(v + t * row_stride + h * dim, vc.data, kv_row_at(&vc, slots[t], h, block_shift, dim), dim,
                         v_bits);
        }
    }
}

typedef struct {
    const float* q;
    kv_cache k, v;
    const int64_t* positions;
    const int64_t* seq_ids;
    const int32_t* table;  // [seqs, table_width]: pool block of each of a sequence's blocks
    const int64_t* hidden;  // NULL, or per token: bit j hides position positions[t] - j (a token tree's branches)
    float* out;
    int n_heads, n_kv_heads, dim, table_width, block_shift;  // a block holds 1 << block_shift positions
    float scale;
    int failed;  // a thread could not allocate its scores
    const int* run_starts;  // item i // n_kv_heads covers tokens run_starts[i] .. run_starts[i + 1] - 1 (one sequence)
} attention_job;

static __thread float* score_buf = NULL;
static __thread int64_t score_size = 0;
static __thread float* k_rows_buf = NULL;  // a packed cache's rows of one (sequence, head), decoded
static __thread int64_t k_rows_size = 0;
static __thread float* v_rows_buf = NULL;
static __thread int64_t v_rows_size = 0;

// A thread's buffer of at least n floats (kept and grown, with room for later steps); NULL if out of memory.
static float* grown(float** buf, int64_t* size, int64_t n) {
    if (n > *size) {
        free(*buf);
        *size = 0;
        *buf = malloc(sizeof(float) * (size_t)(n + 65536));
        if (*buf == NULL) return NULL;
        *size = n + 65536;
    }
    return *buf;
}

// Rows 0..len-1 of one head of a sequence (through its blocks), decoded into out [len, dim].
static void decode_rows(const kv_cache* c, const int32_t* blocks, int block_shift, int64_t head, int len, int dim,
                        float* out) {
    const int64_t width = kv_row_width(dim, c->bits), elem = kv_elem_bytes(c->bits);
    for (int j = 0; j < len; ++j) {
        const uint8_t* row = (const uint8_t*)c->data +
                             ((int64_t)blocks[j >> block_shift] * c->block_stride + head +
                              (j & ((1 << block_shift) - 1)) * width) * elem;
        kv_decode_row(row, out + (int64_t)j * dim, dim, c->bits);
    }
}

// The rows of one head from position j0 to the end of its block: in the decoded copy where the cache is packed
// (dense), else in the block itself.
static inline const float* block_rows(const kv_cache* c, const float* dense, const int32_t* blocks, int block_shift,
                                      int64_t head, int j0, int dim) {
    if (dense) return dense + (int64_t)j0 * dim;
    return (const float*)c->data + (int64_t)blocks[j0 >> block_shift] * c->block_stride + head;
}

// Items are (run, kv head) pairs, a run being up to RUN_TOKENS consecutive tokens of one sequence (a prompt chunk's
// tokens; a decode step's are runs of one): for each token and q head of the kv head's group, softmax(scale * q . k_j)
// over the sequence's positions 0..position, times v. Position j is row j's low bits of block table[seq][j >> shift],
// whose rows of one head are contiguous: the loops walk a block's rows at a time, and a run's tokens all read a block
// while it is in cache (a long prompt's keys came from memory once a token before). The adds of one dot product or
// one output value form a chain: scores are computed KEYS keys at a time and a head's values 8 vectors at a time, so
// independent chains fill the FMA units; each value's sum keeps its order (a token's bits do not depend on its run:
// its partial sums wait in `out` between blocks).
// DIM: the head size, a compile-time constant for the common 64 and 128 (the loops over it unroll), else a->dim.
#define KEYS 8  // keys whose scores are computed together
#define RUN_TOKENS 32  // most tokens of one sequence an item takes

// The softmax's sum over a token tree's row as its path alone would give it, bit for bit: its visible weights moved
// next to each other (the hidden ones are the last 64 positions' at most), summed in the same lanes, put back.
// (The values' weighted sum needs no such care: a hidden weight is 0 and adds nothing.)
static vf tree_row_total(float* sc, int len, uint64_t hidden) {
    const int from = len > 64 ? len - 64 : 0;
    float tail[64];
    memcpy(tail, sc + from, sizeof(float) * (size_t)(len - from));
    int n = from;
    for (int j = from; j < len; ++j)
        if (!(hidden >> (len - 1 - j) & 1)) sc[n++] = sc[j];
    vf total = v_zero();
    for (int j = 0; j < n; j += VL) total = v_add(total, v_maskz(v_tail(n - j), v_load_n(sc + j, n - j)));
    memcpy(sc + from, tail, sizeof(float) * (size_t)(len - from));
    return total;
}

// Scores sc[j0 .. j0 + jn) of one q head over a block's keys kb (rows of dim values).
static inline __attribute__((always_inline)) void block_scores(const float* qg, const float* kb, float* sc, int jn,
                                                               int dim, float scale) {
    int j = 0;
    for (; j + KEYS <= jn; j += KEYS) {  // KEYS keys' dot products at once: independent add chains
        vf d[KEYS];
        for (int u = 0; u < KEYS; ++u) d[u] = v_zero();
        for (int i = 0; i < dim; i += VL) {
            const vf qv = v_load_n(qg + i, dim - i);
            for (int u = 0; u < KEYS; ++u)
                d[u] = v_fmadd(qv, v_load_n(kb + (int64_t)(j + u) * dim + i, dim - i), d[u]);
        }
        for (int u = 0; u < KEYS; ++u) sc[j + u] = v_reduce_add(d[u]) * scale;
    }
    for (; j < jn; ++j) {
        vf d = v_zero();
        for (int i = 0; i < dim; i += VL)
            d = v_fmadd(v_load_n(qg + i, dim - i), v_load_n(kb + (int64_t)j * dim + i, dim - i), d);
        sc[j] = v_reduce_add(d) * scale;
    }
}

// sc[0 .. len) of one q head: the softmax's weights (unnormalized; returns 1 / their sum), a tree row's hidden keys 0.
static float softmax_weights(float* sc, int len, uint64_t hidden) {
    vf top = v_set1(-INFINITY);
    for (int j = 0; j < len; j += VL) top = v_mask_max(top, v_tail(len - j), top, v_load_n(sc + j, len - j));
    if (hidden) {  // another branch's keys (a token tree's): the max is the rest's, and exp(-1000) is 0 in fp32
        float most = -INFINITY;
        for (int j = 0; j < len; ++j)
            if (!(len - 1 - j < 64 && hidden >> (len - 1 - j) & 1)) most = sc[j] > most ? sc[j] : most;
        for (int back = 1; back < 64 && back < len; ++back)
            if (hidden >> back & 1) sc[len - 1 - back] = most - 1000.0f;
        top = v_set1(most);
    }
    const vf best = v_set1(v_reduce_max(top));
    vf total = v_zero();
    for (int j = 0; j < len; j += VL) {
        const vf e = v_maskz(v_tail(len - j), v_exp_neg(v_sub(v_load_n(sc + j, len - j), best)));
        v_store_n(sc + j, len - j, e);
        total = v_add(total, e);
    }
    if (hidden) total = tree_row_total(sc, len, hidden);
    return 1.0f / v_reduce_add(total);
}

// acc[0 .. vecs) += the weights sc[0 .. jn) times a block's values vb, lanes i0.. of each row, in key order.
static inline __attribute__((always_inline)) void weigh_values(vf* acc, const float* sc, const float* vb, int jn,
                                                               int dim, int i0, int vecs) {
    for (int j = 0; j < jn; ++j) {
        const vf s = v_set1(sc[j]);
        const float* row = vb + (int64_t)j * dim + i0;
        for (int u = 0; u < vecs; ++u) acc[u] = v_fmadd(s, v_load_n(row + u * VL, dim - i0 - u * VL), acc[u]);
    }
}

static inline __attribute__((always_inline)) void attention_range(attention_job* a, int start, int end,
                                                                  const int DIM) {
    const int dim = DIM ? DIM : a->dim, group = a->n_heads / a->n_kv_heads;
    float inv[RUN_TOKENS * 256];  // per token of the run and q head of the group: 1 / the softmax's sum
    for (int item = start; item < end; ++item) {
        const int run = item / a->n_kv_heads, kvh = item % a->n_kv_heads;
        const int t0 = a->run_starts[run], nt = a->run_starts[run + 1] - t0;
        int len_max = 0;  // the run's longest context (packed rows are decoded that far, once for the run)
        for (int r = 0; r < nt; ++r) {
            const int len = (int)a->positions[t0 + r] + 1;
            len_max = len > len_max ? len : len_max;
        }
        const int32_t* blocks = a->table + a->seq_ids[t0] * a->table_width;
        const int64_t rows = (int64_t)len_max * dim;
        float* k_dense = a->k.bits ? grown(&k_rows_buf, &k_rows_size, rows) : NULL;
        float* v_dense = a->v.bits ? grown(&v_rows_buf, &v_rows_size, rows) : NULL;
        if (grown(&score_buf, &score_size, (int64_t)nt * group * len_max) == NULL ||
            (a->k.bits && k_dense == NULL) || (a->v.bits && v_dense == NULL)) {
            __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        const int64_t k_head = (int64_t)kvh * a->k.head_stride, v_head = (int64_t)kvh * a->v.head_stride;
        if (k_dense) decode_rows(&a->k, blocks, a->block_shift, k_head, len_max, dim, k_dense);
        if (v_dense) decode_rows(&a->v, blocks, a->block_shift, v_head, len_max, dim, v_dense);
        const int bsize = 1 << a->block_shift;
        // score rows: token r's q head g at score_buf + (r * group + g) * len_max
        for (int j0 = 0; j0 < len_max; j0 += bsize) {
            const float* kb = block_rows(&a->k, k_dense, blocks, a->block_shift, k_head, j0, dim);
            for (int r = 0; r < nt; ++r) {
                const int len = (int)a->positions[t0 + r] + 1;
                if (j0 >= len) continue;
                const int jn = len - j0 < bsize ? len - j0 : bsize;
                const float* q = a->q + ((int64_t)(t0 + r) * a->n_heads + (int64_t)kvh * group) * dim;
                for (int g = 0; g < group; ++g)
                    block_scores(q + g * dim, kb, score_buf + ((int64_t)r * group + g) * len_max + j0, jn, dim,
                                 a->scale);
            }
        }
        for (int r = 0; r < nt; ++r) {
            const int len = (int)a->positions[t0 + r] + 1;
            const uint64_t hidden = a->hidden ? (uint64_t)a->hidden[t0 + r] : 0;
            for (int g = 0; g < group; ++g)
                inv[r * group + g] = softmax_weights(score_buf + ((int64_t)r * group + g) * len_max, len, hidden);
        }
        for (int i0 = 0; i0 < dim; i0 += 8 * VL) {  // 8 vectors of a head's values at a time, in registers
            const int vecs = dim - i0 >= 8 * VL ? 8 : (dim - i0 + VL - 1) / VL;
            if (nt == 1) {  // one token (a decode row): its sums stay in registers over all blocks
                const int len = len_max;
                float* o = a->out + ((int64_t)t0 * a->n_heads + (int64_t)kvh * group) * dim + i0;
                for (int g = 0; g < group; ++g) {
                    vf acc[8];
                    for (int u = 0; u < vecs; ++u) acc[u] = v_zero();
                    for (int j0 = 0; j0 < len; j0 += bsize) {
                        const float* vb = block_rows(&a->v, v_dense, blocks, a->block_shift, v_head, j0, dim);
                        const int jn = len - j0 < bsize ? len - j0 : bsize;
                        weigh_values(acc, score_buf + (int64_t)g * len_max + j0, vb, jn, dim, i0, vecs);
                    }
                    for (int u = 0; u < vecs; ++u)
                        v_store_n(o + (int64_t)g * dim + u * VL, dim - i0 - u * VL, v_mul(acc[u], v_set1(inv[g])));
                }
                continue;
            }
            for (int j0 = 0; j0 < len_max; j0 += bsize) {  // a block's values for every token of the run
                const float* vb = block_rows(&a->v, v_dense, blocks, a->block_shift, v_head, j0, dim);
                for (int r = 0; r < nt; ++r) {
                    const int len = (int)a->positions[t0 + r] + 1;
                    if (j0 >= len) continue;
                    const int jn = len - j0 < bsize ? len - j0 : bsize, last = j0 + bsize >= len;
                    float* o = a->out + ((int64_t)(t0 + r) * a->n_heads + (int64_t)kvh * group) * dim + i0;
                    for (int g = 0; g < group; ++g) {
                        float* og = o + (int64_t)g * dim;
                        vf acc[8];
                        for (int u = 0; u < vecs; ++u)  // (the sums so far wait in out between blocks)
                            acc[u] = j0 ? v_load_n(og + u * VL, dim - i0 - u * VL) : v_zero();
                        weigh_values(acc, score_buf + ((int64_t)r * group + g) * len_max + j0, vb, jn, dim, i0, vecs);
                        for (int u = 0; u < vecs; ++u)
                            v_store_n(og + u * VL, dim - i0 - u * VL,
                                      last ? v_mul(acc[u], v_set1(inv[r * group + g])) : acc[u]);
                    }
                }
            }
        }
    }
}

static void attention_items(void* p, int start, int end) {
    attention_job* a = (attention_job*)p;
    if (a->dim == 64)
        attention_range(a, start, end, 64);
    else if (a->dim == 128)
        attention_range(a, start, end, 128);
    else
        attention_range(a, start, end, 0);
}

// out [T, n_heads, dim] = attention of q [T, n_heads, dim] (contiguous) over the paged caches
// [blocks, kv heads, 1 << block_shift, row] (fp32 rows of dim values, or packed rows: kv_rows.h):
// token t reads sequence seq_ids[t] at positions 0..positions[t] through its row of the block table; q head h reads
// kv head h / (n_heads / n_kv_heads); hidden (or NULL): bit j of hidden[t] hides position positions[t] - j from token
// t (a token tree's other branches). Returns 0, or -1 when scratch for the scores could not be allocated (out is
// then incomplete).
int cpu_attention(const float* q, int T, int n_heads, int n_kv_heads, int dim, void* k_data, int64_t k_block_stride,
                  int64_t k_head_stride, int k_bits, void* v_data, int64_t v_block_stride, int64_t v_head_stride,
                  int v_bits, const int64_t* positions, const int64_t* seq_ids, const int32_t* table,
                  const int64_t* hidden, int table_width, int block_shift, float scale, float* out, int threads) {
    if (n_heads / n_kv_heads > 256) return -1;  // more q heads a kv head than any model has
    // runs of up to RUN_TOKENS consecutive tokens of one sequence
    // (the caller's thread keeps the array for later steps: no allocation a layer on the decode path)
    static __thread int* run_buf = NULL;
    static __thread int run_size = 0;
    if (T + 1 > run_size) {
        free(run_buf);
        run_size = 0;
        run_buf = malloc(sizeof(int) * (size_t)(T + 1 + 1024));
        if (run_buf == NULL) return -1;
        run_size = T + 1 + 1024;
    }
    int* run_starts = run_buf;
    int n_runs = 0;
    for (int t = 0; t < T; ++t)
        if (t == 0 || seq_ids[t] != seq_ids[t - 1] || t - run_starts[n_runs - 1] >= RUN_TOKENS)
            run_starts[n_runs++] = t;
    run_starts[n_runs] = T;
    attention_job a = {q,
                       {k_data, k_block_stride, k_head_stride, k_bits},
                       {v_data, v_block_stride, v_head_stride, v_bits},
                       positions,
                       seq_ids,
                       table,
                       hidden,
                       out,
                       n_heads,
                       n_kv_heads,
                       dim,
                       table_width,
                       block_shift,
                       scale,
                       0,
                       run_starts};
    // a token's heads over a short cache are a few microseconds: share out only what outweighs a wake-up
    const int64_t work = (int64_t)T * n_heads * (positions[T - 1] + 1) * dim;
    pool_run(work < (1 << 18) ? 1 : threads, n_runs * n_kv_heads, 1, attention_items, &a);
    return a.failed ? -1 : 0;
}

// out [rows, n] = silu(gate) * up of x [rows, 2n] = [gate | up], as F.silu(gate) * up: gate / (1 + exp(-gate)).
void cpu_silu_mul(const float* x, float* out, int rows, int n) {
    for (int r = 0; r < rows; ++r) {
        const float* g = x + (int64_t)r * 2 * n;
        const float* u = g + n;
        for (int i = 0; i < n; i += VL) {
            const vf gv = v_load_n(g + i, n - i);
            // exp(-|g|) keeps the argument <= 0; for g < 0, 1 + exp(-g) = (1 + e) / e with e = exp(g)
            const vf e = v_exp_neg(v_sub(v_zero(), v_abs(gv)));
            const vmask neg = v_cmp(gv, v_zero(), _CMP_LT_OQ);
            const vf one = v_set1(1.0f);
            const vf denom = v_mask_div(v_add(one, e), neg, v_add(one, e), e);
            const vf silu = v_div(gv, denom);
            v_store_n(out + (int64_t)r * n + i, n - i, v_mul(silu, v_load_n(u + i, n - i)));
        }
    }
}

// The lanes of a and b for which `pred` holds, as the low VL bits of an int.
#if VL == 16
#define V_CMP_BITS(a, b, pred) ((int)_mm512_cmp_ps_mask(a, b, pred))
#else
#define V_CMP_BITS(a, b, pred) _mm256_movemask_ps(_mm256_cmp_ps(a, b, pred))
#endif

// out[r] = torch.argmax of row r of x [rows, n]: the first index of the row's largest value, or of its first NaN
// where it holds one. A greedy step reads one row of ~50k logits; torch's loop took ~70 us for it.
void cpu_argmax(const float* x, int rows, int n, int64_t* out) {
    for (int r = 0; r < rows; ++r) {
        const float* row = x + (int64_t)r * n;
        vf best = v_set1(-INFINITY);
        int unordered = 0;
        int i = 0;
        for (; i + VL <= n; i += VL) {
            const vf v = v_load(row + i);
            unordered |= V_CMP_BITS(v, v, _CMP_UNORD_Q);
            best = v_max(best, v);
        }
        float top = v_reduce_max(best);
        for (int j = i; j < n; ++j) {
            unordered |= row[j] != row[j];
            top = row[j] > top ? row[j] : top;
        }
        int64_t at = -1;
        if (unordered) {  // NaN wins, as in torch
            for (int j = 0; j < n && at < 0; ++j)
                if (row[j] != row[j]) at = j;
        } else {
            const vf t = v_set1(top);
            for (i = 0; i + VL <= n && at < 0; i += VL) {
                const int hits = V_CMP_BITS(v_load(row + i), t, _CMP_EQ_OQ);
                if (hits) at = i + __builtin_ctz((unsigned)hits);
            }
            for (int j = i; j < n && at < 0; ++j)
                if (row[j] == top) at = j;
        }
        out[r] = at < 0 ? 0 : at;  // (n == 0 only)
    }
}
