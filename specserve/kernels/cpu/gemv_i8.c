// x @ W^T for bit-packed group-quantized W (QuantWeight: W = scale * u - min per group), 4- or 8-bit fields,
// 1..16 rows of x, with the activations rounded to int8 and multiplied as integers: unsigned weight bytes times
// signed activation bytes, four products added into each 32-bit lane (simd.h's dot_nibbles and dot_bytes:
// vpdpbusd on AVX-512 VNNI, exact 16-bit multiply-adds on AVX2).
//
// Layout. Sixteen words of a weight row (a chunk) are loaded at once. For 8-bit fields a word is already four
// unsigned bytes; for 4-bit fields `w & 0x0F0F0F0F` holds fields 0, 2, 4, 6 of each word as bytes and
// `(w >> 4) & 0x0F0F0F0F` fields 1, 3, 5, 7. The activations are put in the same byte order once per call, so
// one dot product (8-bit) or a pair (4-bit) give each lane the integer dot product of its word with its
// activations. A chunk is one AVX-512 vector or two AVX2 ones.
//
// Scales. All k of a word lie in one weight group, and each word's k get one activation scale dx (their
// largest |x| / 127), so a lane's integer sum needs one factor, scale * dx, when it becomes fp32. The min term
// takes the sum of the same rounded activations (dx * sum of q), so the result is W times the rounded x,
// whose error is W's size: with exact sums the error of the scale * u term would stand alone, and u * scale
// is larger than W (by the whole min; Q8_0's u carry an offset of 128). Output rows are shared out over
// `threads` threads (pool.h). The caller splits more rows.
//
// Grouped (AVX-512, 4 words a group: 4-bit fields in groups of 32, 8-bit in groups of 16, the K-quants and
// Q4_0/Q4_1): a block of 64 words (16 groups) is transposed in registers so that lane i of vector j holds word
// j of group i. A lane's integer dot products then cover its whole group, and the conversion to fp32 and the
// scaling happen once a group instead of once a word: most of the per-row work of a verify step. The
// activations come in that order with one scale per group (quantize_grouped); q_i8_grouped says which
// layout a call takes.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed.h"
#include "pool.h"
#include "simd.h"

#define PREFETCH 2048  // bytes ahead in a weight row's stream

// Per-thread scratch that only grows: a call allocates nothing once the largest shapes have been seen.
static __thread void* scratch_buf = NULL;
static __thread size_t scratch_size = 0;

static void* scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_buf);
        scratch_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_size = scratch_buf ? bytes : 0;
    }
    return scratch_buf;
}

// fields activations of one slot (vector) in the kernel's byte order: register r of `regs` holds fields
// 2b + r (4-bit) or b (8-bit) in byte b; returns the sum of the rounded values per lane.
static inline vi pack_fields(const vf* v, vf inv, int fields, int8_t* xq) {
    const vi byte = vi_set1(0xFF);
    const int regs = fields / 4;
    vi q_sum = vi_zero();
    for (int r = 0; r < regs; ++r) {
        vi packed = vi_zero();
        for (int b = 0; b < 4; ++b) {
            // round to nearest even (the default MXCSR mode), |q| <= 127 since |v| <= amax
            vi q = vi_from_float(v_mul(v[regs == 2 ? 2 * b + r : b], inv));
            q = vi_max(vi_min(q, vi_set1(127)), vi_set1(-127));
            q_sum = vi_add(q_sum, q);
            packed = vi_or(packed, vi_slli(vi_and(q, byte), 8 * b));
        }
        vi_store(xq + r * 64, packed);
    }
    return q_sum;
}

// Rounds one row of activations (perm: k of each [chunk, field, lane] slot, -1 past K) to int8 in the kernel's
// byte order (xq: [chunks, regs, 16 lanes, 4 bytes]), with each lane's scale (dx) and the sum of its rounded
// activations (xs = dx * sum of q).
// share: lanes (words) that take one scale, their group's (1, or a group's 4 or 8 words: AVX2's spans).
static void quantize_row(const float* x, const int32_t* perm, int chunks, int fields, int share, int8_t* xq,
                         float* dx, float* xs) {
    const vf one = v_set1(1.0f), q_max = v_set1(127.0f);
    const int regs = fields / 4;
    for (int c = 0; c < chunks; ++c) {
        for (int lane = 0; lane < 16; lane += VL) {  // each lane is rounded on its own
            vf v[8];
            vf amax = v_zero();
            for (int i = 0; i < fields; ++i) {
                v[i] = v_gather(x, vi_load(perm + ((int64_t)c * fields + i) * 16 + lane));
                amax = v_max(amax, v_abs(v[i]));
            }
#if VL == 8
            if (share >= 4) {  // a group's 4 words are 4 lanes of a 128-bit half, its 8 the whole vector
                amax = v_max(amax, _mm256_permute_ps(amax, 0xB1));
                amax = v_max(amax, _mm256_permute_ps(amax, 0x4E));
            }
            if (share == 8) amax = v_max(amax, _mm256_permute2f128_ps(amax, amax, 1));
#else
            (void)share;
#endif
            const vf d = v_div(amax, q_max);
            // 1 / d as a true division (no reciprocal estimate), so the rounding is what a reference computes
            const vf inv = v_maskz_div(v_cmp(d, v_zero(), _CMP_GT_OQ), one, d);
            v_store(dx + (int64_t)c * 16 + lane, d);
            const vi q_sum = pack_fields(v, inv, fields, xq + (int64_t)c * regs * 64 + 4 * lane);
            v_store(xs + (int64_t)c * 16 + lane, v_mul(v_from_int(q_sum), d));
        }
    }
}

#if VL == 16
#define GROUPED_WPG 4  // words a group in the grouped layout
#endif

// The layout the int8 kernel takes a format in: 0 a scale a word, 1 AVX-512's grouped blocks, 2 AVX2's spans
// (spans.h); 1 and 2 round the activations with one scale a weight group.
int q_i8_grouped(int words_per_group) {
#ifdef GROUPED_WPG
    return words_per_group == GROUPED_WPG;
#else
    return words_per_group == 4 || words_per_group == 8 ? 2 : 0;
#endif
}

#ifdef GROUPED_WPG
// The grouped layout of a row of `groups` groups: whole blocks of 16 groups, and a last partial block if it holds
// 8 groups or more; fewer are left as chunks of 16 words (lanes = words, each with its group's activation
// scale), since a block of a few groups costs as much as a full one.
static inline void grouped_shape(int groups, int* blocks, int* tail_chunks) {
    const int rest = groups % 16;
    *blocks = groups / 16 + (rest >= 8);
    *tail_chunks = rest >= 8 ? 0 : (GROUPED_WPG * rest + 15) / 16;
}

// Rounds one row of activations to int8 in the grouped order (perm: k of each [block, word j, field, lane] slot,
// then of each [tail chunk, field, lane] one, -1 past K; xq: [blocks, 4 words, regs, 64 bytes] then [tail chunks,
// regs, 64 bytes]) with one scale per weight group (dx: its largest |x| / 127, in each of its lanes) and the sums
// of the rounded activations (xs = dx * sum of q, per lane).
static void quantize_grouped(const float* x, const int32_t* perm, int groups, int fields, int8_t* xq, float* dx,
                             float* xs) {
    const vf one = v_set1(1.0f), q_max = v_set1(127.0f);
    const int regs = fields / 4, slots = GROUPED_WPG * fields;
    int blocks, tail_chunks;
    grouped_shape(groups, &blocks, &tail_chunks);
    for (int blk = 0; blk < blocks; ++blk) {
        const int32_t* pb = perm + (int64_t)blk * slots * 16;
        vf amax = v_zero();
        for (int s = 0; s < slots; ++s) amax = v_max(amax, v_abs(v_gather(x, vi_load(pb + 16 * s))));
        const vf d = v_div(amax, q_max);
        const vf inv = v_maskz_div(v_cmp(d, v_zero(), _CMP_GT_OQ), one, d);  // a true division, as quantize_row
        vi q_sum = vi_zero();
        for (int j = 0; j < GROUPED_WPG; ++j) {
            vf v[8];
            for (int i = 0; i < fields; ++i) v[i] = v_gather(x, vi_load(pb + (j * fields + i) * 16));
            q_sum = vi_add(q_sum, pack_fields(v, inv, fields, xq + ((int64_t)blk * GROUPED_WPG + j) * regs * 64));
        }
        v_store(dx + 16 * blk, d);
        v_store(xs + 16 * blk, v_mul(v_from_int(q_sum), d));
    }
    const int32_t* pt = perm + (int64_t)blocks * slots * 16;
    for (int c = 0; c < tail_chunks; ++c) {
        vf v[8];
        vf amax = v_zero();
        for (int i = 0; i < fields; ++i) {
            v[i] = v_gather(x, vi_load(pt + ((int64_t)c * fields + i) * 16));
            amax = v_max(amax, v_abs(v[i]));
        }
        // a group's 4 words are 4 lanes of one 128-bit lane: the max of the four, in each
        amax = v_max(amax, _mm512_permute_ps(amax, 0xB1));
        amax = v_max(amax, _mm512_permute_ps(amax, 0x4E));
        const vf d = v_div(amax, q_max);
        const vf inv = v_maskz_div(v_cmp(d, v_zero(), _CMP_GT_OQ), one, d);
        const vi q_sum = pack_fields(v, inv, fields, xq + ((int64_t)blocks * GROUPED_WPG + c) * regs * 64);
        v_store(dx + 16 * (blocks + c), d);
        v_store(xs + 16 * (blocks + c), v_mul(v_from_int(q_sum), d));
    }
}

// The words of block blk of a row (zero past the row's `left` words from the block's start), transposed: t[j]'s
// lane i is word j of the block's group i.
static inline __attribute__((always_inline)) void load_block(const int32_t* w, int left, vi* t) {
    vi v[4];
    for (int q = 0; q < 4; ++q) {
        const int n = left - 16 * q;
        v[q] = n >= 16 ? vi_load(w + 16 * q) : vi_load_n(w + 16 * q, n > 0 ? n : 0);
    }
    for (int j = 0; j < 4; ++j) {
        const vi lo = _mm512_setr_epi32(j, 4 + j, 8 + j, 12 + j, 16 + j, 20 + j, 24 + j, 28 + j, 0, 0, 0, 0, 0, 0, 0, 0);
        const vi hi = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, j, 4 + j, 8 + j, 12 + j, 16 + j, 20 + j, 24 + j, 28 + j);
        t[j] = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(v[0], lo, v[1]),
                                       _mm512_permutex2var_epi32(v[2], hi, v[3]));
    }
}
#endif

typedef struct {
    packed_product p;
    const int8_t* xq;  // the rounded activations, dx their scales, xs dx * their sums (quantize_row)
    const float *dx, *xs;
    int regs;
} job;

// Row r's weight words and its groups' (scale, min) pairs.
static inline const int32_t* row_words(const job* a, int r) { return a->p.words + (int64_t)r * a->p.words_per_row; }
static inline const uint16_t* row_sm(const job* a, int r) { return a->p.sm + (int64_t)r * a->p.groups_per_row * 2; }

#if VL == 8
#include "spans.h"
#endif

// One vector (s) of a chunk of one weight row against ROWS activation rows: the integer dot products per lane,
// scaled by scale * dx, into acc; min * (rounded activations' sum) into acc_min (a second chain: the adds do not
// wait on each other). wv: the vector's words (zero past the row), sm: its groups' (scale, min) table.
static inline __attribute__((always_inline)) void chunk(const job* a, int c, int s, vi wv, vf sm, vi scale_idx,
                                                        vi min_idx, vf* acc, vf* acc_min, const int ROWS,
                                                        const int REGS) {
    const int64_t q_row = (int64_t)a->p.chunks * REGS * 64, f_row = (int64_t)a->p.chunks * 16;
    const vf scale = v_pick(sm, scale_idx), mins = v_pick(sm, min_idx);
    const vi nibble = vi_set1(0x0F0F0F0F);
    const vi lo = REGS == 2 ? vi_and(wv, nibble) : wv;
    const vi hi = REGS == 2 ? vi_and(vi_srli(wv, 4), nibble) : wv;
    for (int m = 0; m < ROWS; ++m) {
        const int8_t* q = a->xq + m * q_row + (int64_t)c * REGS * 64 + 4 * VL * s;
        const vi dot = REGS == 2 ? dot_nibbles(lo, vi_load(q), hi, vi_load(q + 64)) : dot_bytes(lo, vi_load(q));
        const int64_t f = m * f_row + (int64_t)c * 16 + VL * s;
        acc[m] = v_fmadd(v_from_int(dot), v_mul(scale, v_load(a->dx + f)), acc[m]);
        acc_min[m] = v_fmadd(mins, v_load(a->xs + f), acc_min[m]);
    }
}

// Output rows [r0, r1) for ROWS activation rows and REGS activation registers a chunk (2: 4-bit, 1: 8-bit),
// both compile-time constants once inlined. Whole chunks load without masks; only the last may be partial.
static inline __attribute__((always_inline)) void rows_of(const job* a, int r0, int r1, const int ROWS,
                                                          const int REGS) {
    const int wpg = a->p.words_per_group, groups_per_chunk = 16 / wpg, whole = a->p.words_per_row / 16;
    int scale_lane[16], min_lane[16], first[CHUNK_VECS];
    sm_lanes(wpg, scale_lane, min_lane, first);
    vi scale_idx[CHUNK_VECS], min_idx[CHUNK_VECS];
    for (int s = 0; s < CHUNK_VECS; ++s) {
        scale_idx[s] = vi_load(scale_lane + VL * s);
        min_idx[s] = vi_load(min_lane + VL * s);
    }
    const int left = a->p.words_per_row - 16 * whole, groups_left = a->p.groups_per_row - groups_per_chunk * whole;
    for (int r = r0; r < r1; ++r) {
        vf acc[CHUNK_VECS][ROWS], acc_min[CHUNK_VECS][ROWS];
        for (int s = 0; s < CHUNK_VECS; ++s)
            for (int m = 0; m < ROWS; ++m) acc[s][m] = acc_min[s][m] = v_zero();
        const int32_t* wr = row_words(a, r);
        const uint16_t* sr = row_sm(a, r);
        for (int c = 0; c < whole; ++c) {
            // a chunk is one cache line of words: fetch the line PREFETCH bytes ahead (the next rows of this
            // thread's block), and its scales; decode streams the weights from memory once a token
            _mm_prefetch((const char*)(wr + 16 * c) + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char*)(sr + 2 * groups_per_chunk * c) + PREFETCH / 4, _MM_HINT_T0);
            for (int s = 0; s < CHUNK_VECS; ++s)
                chunk(a, c, s, vi_load(wr + 16 * c + VL * s),
                      v_load_sm(sr + 2 * (groups_per_chunk * c + first[s]), groups_per_chunk - first[s]),
                      scale_idx[s], min_idx[s], acc[s], acc_min[s], ROWS, REGS);
        }
        if (left)
            for (int s = 0; s < CHUNK_VECS; ++s)
                chunk(a, whole, s, vi_load_n(wr + 16 * whole + VL * s, left - VL * s),
                      v_load_sm(sr + 2 * (groups_per_chunk * whole + first[s]), groups_left - first[s]),
                      scale_idx[s], min_idx[s], acc[s], acc_min[s], ROWS, REGS);
        for (int m = 0; m < ROWS; ++m) {
            vf t = v_sub(acc[0][m], acc_min[0][m]);
            for (int s = 1; s < CHUNK_VECS; ++s) t = v_add(t, v_sub(acc[s][m], acc_min[s][m]));
            a->p.out[(int64_t)m * a->p.n + r] = v_reduce_add(t);
        }
    }
}

#ifdef GROUPED_WPG
// rows_of for the grouped layout: per block and activation row, the 4 words' dot products add up in each
// group's lane (two chains), then one conversion, one scale and one min term a group; a tail of fewer than 8
// groups goes a word a lane, as rows_of does.
static inline __attribute__((always_inline)) void rows_grouped(const job* a, int r0, int r1, const int ROWS,
                                                               const int REGS) {
    int blocks, tail_chunks;
    grouped_shape(a->p.groups_per_row, &blocks, &tail_chunks);
    const int64_t tail_q = (int64_t)blocks * GROUPED_WPG * REGS * 64;
    const int64_t q_row = tail_q + (int64_t)tail_chunks * REGS * 64, f_row = (int64_t)(blocks + tail_chunks) * 16;
    const vi nibble = vi_set1(0x0F0F0F0F);
    int scale_lane[16], min_lane[16], first[CHUNK_VECS];
    sm_lanes(GROUPED_WPG, scale_lane, min_lane, first);
    const vi scale_idx = vi_load(scale_lane), min_idx = vi_load(min_lane);
    for (int r = r0; r < r1; ++r) {
        vf acc[ROWS], acc_min[ROWS];
        for (int m = 0; m < ROWS; ++m) acc[m] = acc_min[m] = v_zero();
        const int32_t* wr = row_words(a, r);
        const uint16_t* sr = row_sm(a, r);
        for (int blk = 0; blk < blocks; ++blk) {
            for (int line = 0; line < 4; ++line)  // the block's 4 cache lines, PREFETCH bytes ahead
                _mm_prefetch((const char*)(wr + 64 * blk + 16 * line) + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char*)(sr + 32 * blk) + PREFETCH / 4, _MM_HINT_T0);
            vi t[GROUPED_WPG], lo[GROUPED_WPG], hi[GROUPED_WPG];
            load_block(wr + 64 * blk, a->p.words_per_row - 64 * blk, t);
            const int g_left = a->p.groups_per_row - 16 * blk;
            const int32_t* pair_ptr = (const int32_t*)(sr + 32 * blk);  // (scale, min) as one word a group
            const vi pairs = g_left >= 16 ? vi_load(pair_ptr) : vi_load_n(pair_ptr, g_left);
            const vf scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
            const vf mins = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(vi_srli(pairs, 16)));
            for (int j = 0; j < GROUPED_WPG; ++j) {
                lo[j] = REGS == 2 ? vi_and(t[j], nibble) : t[j];
                hi[j] = REGS == 2 ? vi_and(vi_srli(t[j], 4), nibble) : t[j];
            }
            for (int m = 0; m < ROWS; ++m) {
                const int8_t* q = a->xq + m * q_row + (int64_t)blk * GROUPED_WPG * REGS * 64;
                vi even = vi_zero(), odd = vi_zero();
                for (int j = 0; j < GROUPED_WPG; ++j) {
                    if (REGS == 2) {
                        even = _mm512_dpbusd_epi32(even, lo[j], vi_load(q + 128 * j));
                        odd = _mm512_dpbusd_epi32(odd, hi[j], vi_load(q + 128 * j + 64));
                    } else if (j % 2 == 0) {
                        even = _mm512_dpbusd_epi32(even, lo[j], vi_load(q + 64 * j));
                    } else {
                        odd = _mm512_dpbusd_epi32(odd, lo[j], vi_load(q + 64 * j));
                    }
                }
                const int64_t f = m * f_row + 16 * blk;
                acc[m] = v_fmadd(v_from_int(vi_add(even, odd)), v_mul(scale, v_load(a->dx + f)), acc[m]);
                acc_min[m] = v_fmadd(mins, v_load(a->xs + f), acc_min[m]);
            }
        }
        for (int c = 0; c < tail_chunks; ++c) {
            const int left = a->p.words_per_row - 64 * blocks - 16 * c, g0 = 16 * blocks + GROUPED_WPG * c;
            const vi wv = vi_load_n(wr + 64 * blocks + 16 * c, left < 16 ? left : 16);
            const int g_n = a->p.groups_per_row - g0;
            const vf sm = v_load_sm(sr + 2 * g0, g_n < 4 ? g_n : 4);
            const vf scale = v_pick(sm, scale_idx), mins = v_pick(sm, min_idx);
            const vi lo = REGS == 2 ? vi_and(wv, nibble) : wv;
            const vi hi = REGS == 2 ? vi_and(vi_srli(wv, 4), nibble) : wv;
            for (int m = 0; m < ROWS; ++m) {
                const int8_t* q = a->xq + m * q_row + tail_q + (int64_t)c * REGS * 64;
                const vi dot = REGS == 2 ? dot_nibbles(lo, vi_load(q), hi, vi_load(q + 64)) : dot_bytes(lo, vi_load(q));
                const int64_t f = m * f_row + 16 * (blocks + c);
                acc[m] = v_fmadd(v_from_int(dot), v_mul(scale, v_load(a->dx + f)), acc[m]);
                acc_min[m] = v_fmadd(mins, v_load(a->xs + f), acc_min[m]);
            }
        }
        for (int m = 0; m < ROWS; ++m) a->p.out[(int64_t)m * a->p.n + r] = v_reduce_add(v_sub(acc[m], acc_min[m]));
    }
}
#endif

#ifdef GROUPED_WPG
#define ROWS_GROUPED(R, REGS)                                             \
    if (a->p.words_per_group == GROUPED_WPG) {                           \
        rows_grouped(a, r0, r1, R, REGS);                                 \
        break;                                                            \
    }
#else
#define ROWS_GROUPED(R, REGS)                                             \
    if (a->p.words_per_group == 4) {                                      \
        rows_spans(a, r0, r1, R, REGS, 4);                                \
        break;                                                            \
    }                                                                     \
    if (a->p.words_per_group == 8) {                                      \
        rows_spans(a, r0, r1, R, REGS, 8);                                \
        break;                                                            \
    }
#endif
#define ROWS_CASE(R)                              \
    case R:                                       \
        if (a->regs == 2) {                       \
            ROWS_GROUPED(R, 2)                    \
            rows_of(a, r0, r1, R, 2);             \
        } else {                                  \
            ROWS_GROUPED(R, 1)                    \
            rows_of(a, r0, r1, R, 1);             \
        }                                         \
        break;

static void run_rows(void* p, int r0, int r1) {
    const job* a = (const job*)p;
    switch (a->p.rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15)
        ROWS_CASE(16)
    }
}

// Returns 0, or -1 when the scratch could not be allocated (out is then unset).
int q_gemv_i8(const int32_t* words, const uint16_t* sm, const float* x_rows, const int32_t* perm, float* out,
              int rows, int n, int k, int words_per_row, int groups_per_row, int bits, int words_per_group,
              int chunks, int threads) {
    const int fields = 32 / bits, regs = fields / 4, grouped = q_i8_grouped(words_per_group);
    int64_t q_row = (int64_t)chunks * regs * 64, f_row = (int64_t)chunks * 16;  // chunks of 16 words
#ifdef GROUPED_WPG
    if (grouped) {  // blocks of 64 words (4 slots each), then the tail's chunks
        int blocks, tail_chunks;
        grouped_shape(groups_per_row, &blocks, &tail_chunks);
        q_row = ((int64_t)blocks * GROUPED_WPG + tail_chunks) * regs * 64;
        f_row = (int64_t)(blocks + tail_chunks) * 16;
    }
#endif
    int64_t g_row = 0;  // spans: the per-group scales and sums a row
#ifndef GROUPED_WPG
    if (grouped) {  // whole spans of activations, the padding zero
        g_row = (int64_t)span_count(groups_per_row) * SPAN_GROUPS;
        q_row = g_row * words_per_group / 16 * regs * 64;
    }
#endif
    int8_t* xq = scratch((size_t)rows * (q_row + 2 * (f_row + g_row) * sizeof(float)));
    if (xq == NULL) return -1;
    float* dx = (float*)(xq + rows * q_row);
    float* xs = dx + rows * f_row;
    float* dxg = xs + rows * f_row;
    float* xsg = dxg + rows * g_row;
    for (int m = 0; m < rows; ++m) {
        const float* x = x_rows + (int64_t)m * k;
        int8_t* xq_m = xq + m * q_row;
#ifdef GROUPED_WPG
        if (grouped) {
            quantize_grouped(x, perm, groups_per_row, fields, xq_m, dx + m * f_row, xs + m * f_row);
            continue;
        }
#endif
        quantize_row(x, perm, chunks, fields, grouped ? words_per_group : 1, xq_m, dx + m * f_row, xs + m * f_row);
#ifndef GROUPED_WPG
        if (grouped) {
            const int64_t filled = (int64_t)chunks * regs * 64;
            memset(xq_m + filled, 0, q_row - filled);
            span_scales(dx + m * f_row, xs + m * f_row, groups_per_row, words_per_group, dxg + m * g_row,
                        xsg + m * g_row);
        }
#endif
    }
    if (g_row) dx = dxg, xs = xsg;
    job a = {{words, sm, out, rows, n, words_per_row, groups_per_row, words_per_group, chunks}, xq, dx, xs, regs};
    pool_run(threads, n, pool_block(n, threads, 16), run_rows, &a);
    return 0;
}
