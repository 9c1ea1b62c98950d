// x @ W^T for bit-packed group-quantized W (QuantWeight: W = scale * u - min per group), 4- or 8-bit fields,
// 1..16 rows of x, with the activations rounded to int8 and multiplied by AVX-512 VNNI (vpdpbusd: unsigned
// weight bytes times signed activation bytes, four products added into each 32-bit lane).
//
// Layout. Sixteen words of a weight row (a chunk) are loaded at once. For 8-bit fields a word is already four
// unsigned bytes; for 4-bit fields `w & 0x0F0F0F0F` holds fields 0, 2, 4, 6 of each word as bytes and
// `(w >> 4) & 0x0F0F0F0F` fields 1, 3, 5, 7. The activations are put in the same byte order once per call, so
// one vpdpbusd (8-bit) or two (4-bit) give each lane the integer dot product of its word with its activations.
//
// Scales. All k of a word lie in one weight group, and each word's k get one activation scale dx (their
// largest |x| / 127), so a lane's integer sum needs one factor, scale * dx, when it becomes fp32. The min term
// takes the sum of the same rounded activations (dx * sum of q), so the result is W times the rounded x,
// whose error is W's size: with exact sums the error of the scale * u term would stand alone, and u * scale
// is larger than W (by the whole min; Q8_0's u carry an offset of 128). Output rows are shared out over
// `threads` threads (pool.h). The caller splits more rows.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"

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

// Rounds one row of activations (perm: k of each [chunk, field, lane] slot, -1 past K) to int8 in the kernel's
// byte order (xq: [chunks, regs, 16 lanes, 4 bytes]), with each lane's scale (dx) and the sum of its rounded
// activations (xs = dx * sum of q).
static void quantize_row(const float* x, const int32_t* perm, int chunks, int fields, int8_t* xq, float* dx,
                         float* xs) {
    const __m512 one = _mm512_set1_ps(1.0f), q_max = _mm512_set1_ps(127.0f);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    const int regs = fields / 4;
    for (int c = 0; c < chunks; ++c) {
        __m512 v[8];
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < fields; ++i) {
            const __m512i idx = _mm512_loadu_si512(perm + ((int64_t)c * fields + i) * 16);
            const __mmask16 inside = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
            v[i] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), inside, idx, x, 4);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
        }
        const __m512 d = _mm512_div_ps(amax, q_max);
        // 1 / d as a true division (no reciprocal estimate), so the rounding is what a reference computes
        const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ), one, d);
        _mm512_storeu_ps(dx + (int64_t)c * 16, d);
        __m512i q_sum = _mm512_setzero_si512();
        for (int r = 0; r < regs; ++r) {
            __m512i packed = _mm512_setzero_si512();
            for (int b = 0; b < 4; ++b) {
                const int field = regs == 2 ? 2 * b + r : b;  // which field byte b of this register holds
                // round to nearest even (the default MXCSR mode), |q| <= 127 since |v| <= amax
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[field], inv));
                q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                q_sum = _mm512_add_epi32(q_sum, q);
                packed = _mm512_or_si512(packed, _mm512_slli_epi32(_mm512_and_si512(q, byte), 8 * b));
            }
            _mm512_storeu_si512(xq + ((int64_t)c * regs + r) * 64, packed);
        }
        _mm512_storeu_ps(xs + (int64_t)c * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q_sum), d));
    }
}

typedef struct {
    const int32_t* words;
    const uint16_t* sm;
    const int8_t* xq;
    const float* dx;
    const float* xs;
    float* out;
    int rows, n, words_per_row, groups_per_row, regs, words_per_group, chunks;
} job;

// One chunk of one weight row against ROWS activation rows: the integer dot products per lane, scaled by
// scale * dx, into acc; min * (rounded activations' sum) into acc_min (a second chain: the adds do not wait on
// each other). wv: the chunk's words (zero past the row), h: its groups' (scale, min) halves (zero past the row).
static inline __attribute__((always_inline)) void chunk(const job* a, int c, __m512i wv, __m256i h,
                                                        __m512i scale_idx, __m512i min_idx, __m512* acc,
                                                        __m512* acc_min, const int ROWS, const int REGS) {
    const int64_t q_row = (int64_t)a->chunks * REGS * 64, f_row = (int64_t)a->chunks * 16;
    const __m512 smv = _mm512_cvtph_ps(h);
    const __m512 scale = _mm512_permutexvar_ps(scale_idx, smv), mins = _mm512_permutexvar_ps(min_idx, smv);
    const __m512i nibble = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i lo = REGS == 2 ? _mm512_and_si512(wv, nibble) : wv;
    const __m512i hi = REGS == 2 ? _mm512_and_si512(_mm512_srli_epi32(wv, 4), nibble) : wv;
    for (int m = 0; m < ROWS; ++m) {
        const int8_t* q = a->xq + m * q_row + (int64_t)c * REGS * 64;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));
        if (REGS == 2) dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(q + 64));
        const int64_t f = m * f_row + (int64_t)c * 16;
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_loadu_ps(a->dx + f)), acc[m]);
        acc_min[m] = _mm512_fmadd_ps(mins, _mm512_loadu_ps(a->xs + f), acc_min[m]);
    }
}

// Output rows [r0, r1) for ROWS activation rows and REGS activation registers a chunk (2: 4-bit, 1: 8-bit),
// both compile-time constants once inlined. Whole chunks load without masks; only the last may be partial.
static inline __attribute__((always_inline)) void rows_of(const job* a, int r0, int r1, const int ROWS,
                                                          const int REGS) {
    const int wpg = a->words_per_group, groups_per_chunk = 16 / wpg, whole = a->words_per_row / 16;
    int scale_lane[16], min_lane[16];
    for (int l = 0; l < 16; ++l) {
        scale_lane[l] = 2 * (l / wpg);
        min_lane[l] = 2 * (l / wpg) + 1;
    }
    const __m512i scale_idx = _mm512_loadu_si512(scale_lane), min_idx = _mm512_loadu_si512(min_lane);
    const __mmask16 h_whole = (__mmask16)((1u << (2 * groups_per_chunk)) - 1);
    const int left = a->words_per_row - 16 * whole, groups_left = a->groups_per_row - groups_per_chunk * whole;
    const __mmask16 w_tail = (__mmask16)((1u << left) - 1), h_tail = (__mmask16)((1u << (2 * groups_left)) - 1);
    for (int r = r0; r < r1; ++r) {
        __m512 acc[ROWS], acc_min[ROWS];
        for (int m = 0; m < ROWS; ++m) acc[m] = acc_min[m] = _mm512_setzero_ps();
        const int32_t* wr = a->words + (int64_t)r * a->words_per_row;
        const uint16_t* sr = a->sm + (int64_t)r * a->groups_per_row * 2;
        for (int c = 0; c < whole; ++c) {
            // a chunk is one cache line of words: fetch the line PREFETCH bytes ahead (the next rows of this
            // thread's block), and its scales; decode streams the weights from memory once a token
            _mm_prefetch((const char*)(wr + 16 * c) + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char*)(sr + 2 * groups_per_chunk * c) + PREFETCH / 4, _MM_HINT_T0);
            const __m256i h = _mm256_maskz_loadu_epi16(h_whole, sr + 2 * groups_per_chunk * c);
            chunk(a, c, _mm512_loadu_si512(wr + 16 * c), h, scale_idx, min_idx, acc, acc_min, ROWS, REGS);
        }
        if (left)
            chunk(a, whole, _mm512_maskz_loadu_epi32(w_tail, wr + 16 * whole),
                  _mm256_maskz_loadu_epi16(h_tail, sr + 2 * groups_per_chunk * whole), scale_idx, min_idx, acc,
                  acc_min, ROWS, REGS);
        for (int m = 0; m < ROWS; ++m)
            a->out[(int64_t)m * a->n + r] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[m], acc_min[m]));
    }
}

#define ROWS_CASE(R)                              \
    case R:                                       \
        if (a->regs == 2)                         \
            rows_of(a, r0, r1, R, 2);             \
        else                                      \
            rows_of(a, r0, r1, R, 1);             \
        break;

static void run_rows(void* p, int r0, int r1) {
    const job* a = (const job*)p;
    switch (a->rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15)
        ROWS_CASE(16)
    }
}

// Returns 0, or -1 when the scratch could not be allocated (out is then unset).
int q_gemv_i8(const int32_t* words, const uint16_t* sm, const float* x_rows, const int32_t* perm, float* out,
              int rows, int n, int k, int words_per_row, int groups_per_row, int bits, int words_per_group,
              int chunks, int threads) {
    const int fields = 32 / bits, regs = fields / 4;
    const int64_t q_row = (int64_t)chunks * regs * 64, f_row = (int64_t)chunks * 16;
    int8_t* xq = scratch((size_t)rows * (q_row + 2 * f_row * sizeof(float)));
    if (xq == NULL) return -1;
    float* dx = (float*)(xq + rows * q_row);
    float* xs = dx + rows * f_row;
    for (int m = 0; m < rows; ++m)
        quantize_row(x_rows + (int64_t)m * k, perm, chunks, fields, xq + m * q_row, dx + m * f_row, xs + m * f_row);
    job a = {words, sm, xq, dx, xs, out, rows, n, words_per_row, groups_per_row, regs, words_per_group, chunks};
    pool_run(threads, n, pool_block(n, threads, 16), run_rows, &a);
    return 0;
}
