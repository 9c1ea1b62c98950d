// gemv_i8.c's AVX2 grouped layout, spans: 8 weight groups of 4 or 8 words (32 or 64 words, whole chunks, in the
// ordinary chunk order). Each group's integer dot products are summed into one int32 by horizontal adds, so the
// conversion to fp32, the scaling and the min term happen once a group instead of once a word (the per-word fp32
// work was most of an AVX2 product's time). The activations of a group share one scale (as the AVX-512 blocks
// and llama.cpp's q8 activations do), and their scales and sums sit in each span's 8 floats in the order the
// horizontal adds leave the group sums in (span_slot). Included by gemv_i8.c, after its job type.
#pragma once

#define SPAN_GROUPS 8

static inline int span_count(int groups) { return (groups + SPAN_GROUPS - 1) / SPAN_GROUPS; }

// The float of group j (of a span) in the span's 8: with 4 words a group the adds leave even groups in the low
// half and odd ones in the high half; with 8 the natural order.
static inline int span_slot(int j, int words_per_group) {
    return words_per_group == 4 ? (j % 2) * 4 + j / 2 : j;
}

// Per-group activation scales (dxg) and scaled sums (xsg), [spans, 8] in span_slot order, from quantize_row's
// per-lane ones (every lane of a group holds its group's scale); zero for the padding groups of the last span.
static void span_scales(const float* dx, const float* xs, int groups, int words_per_group, float* dxg, float* xsg) {
    const int n = span_count(groups) * SPAN_GROUPS;
    for (int g = 0; g < n; ++g) {
        const int at = SPAN_GROUPS * (g / SPAN_GROUPS) + span_slot(g % SPAN_GROUPS, words_per_group);
        float sum = 0.0f;
        for (int i = 0; g < groups && i < words_per_group; ++i) sum += xs[g * words_per_group + i];
        dxg[at] = g < groups ? dx[g * words_per_group] : 0.0f;
        xsg[at] = sum;
    }
}

// A span's (scale, min) pairs as two vectors in span_slot order, zero past `groups`.
static inline void span_sm(const uint16_t* p, int groups, int words_per_group, vf* scale, vf* mins) {
    __m256i pairs = groups >= SPAN_GROUPS ? _mm256_loadu_si256((const __m256i*)p)
                                          : _mm256_maskload_epi32((const int*)p, v_tail(groups));
    if (words_per_group == 4) pairs = _mm256_permutevar8x32_epi32(pairs, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    // each 128-bit half: its 4 scales, then its 4 mins; then the scales of both halves, then the mins
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12,
                                           13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(pairs, split), 0xD8);
    *scale = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    *mins = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

// The 8 group sums of a span from its per-word dot products d (a vector each 8 words), in span_slot order.
static inline vi span_sums(const vi* d, const int WPG) {
    const vi low = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    if (WPG == 4) return low;  // [g0 g2 g4 g6 | g1 g3 g5 g7]
    const vi high = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
    // each half of low holds one half of groups 0-3's words, of high groups 4-7's
    return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

// Per 32-bit lane: the 4 products of signed weight bytes c (|c| <= 128: size, their absolute values) and signed
// activation bytes q, summed exactly: maddubs takes the sizes as unsigned and q with c's signs (pairs at most
// 2 * 128 * 127, no saturation). Half the operations of dot_bytes' widening.
static inline vi dot_centred(vi size, vi c, vi q) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(size, _mm256_sign_epi8(q, c)), _mm256_set1_epi16(1));
}

// Output rows [r0, r1) in spans for ROWS activation rows, REGS activation registers a chunk and WPG words a group
// (compile-time constants once inlined). a->dx and a->xs are the span scales (span_scales), a->xq is padded with
// zeros to whole spans.
static inline __attribute__((always_inline)) void rows_spans(const job* a, int r0, int r1, const int ROWS,
                                                             const int REGS, const int WPG) {
    const int spans = span_count(a->p.groups_per_row), span_words = SPAN_GROUPS * WPG;
    const int64_t q_row = (int64_t)spans * (span_words / 16) * REGS * 64, g_row = (int64_t)spans * SPAN_GROUPS;
    const vi nibble = vi_set1(0x0F0F0F0F);
    for (int r = r0; r < r1; ++r) {
        const int32_t* wr = row_words(a, r);
        const uint16_t* sr = row_sm(a, r);
        vf acc[ROWS], acc_min[ROWS];
        for (int m = 0; m < ROWS; ++m) acc[m] = acc_min[m] = v_zero();
        for (int sp = 0; sp < spans; ++sp) {
            const int w0 = sp * span_words, left = a->p.words_per_row - w0;
            for (int line = 0; line < span_words / 16; ++line)  // the span's cache lines, PREFETCH bytes ahead
                _mm_prefetch((const char*)(wr + w0 + 16 * line) + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char*)(sr + 2 * SPAN_GROUPS * sp) + PREFETCH / 4, _MM_HINT_T0);
            vf scale, mins;
            span_sm(sr + 2 * SPAN_GROUPS * sp, a->p.groups_per_row - SPAN_GROUPS * sp, WPG, &scale, &mins);
            // 8-bit fields: lo holds the bytes centred on 0 (u - 128, signed), hi their sizes; W = scale * (u - 128)
            // - (min - 128 * scale), so the min term takes min - 128 * scale
            if (REGS == 1) mins = v_fnmadd(v_set1(128.0f), scale, mins);
            vi lo[8], hi[8];
            for (int v = 0; v < WPG; ++v) {
                const vi wv = left >= 8 * (v + 1) ? vi_load(wr + w0 + 8 * v) : vi_load_n(wr + w0 + 8 * v, left - 8 * v);
                lo[v] = REGS == 2 ? vi_and(wv, nibble) : _mm256_xor_si256(wv, _mm256_set1_epi8((char)0x80));
                hi[v] = REGS == 2 ? vi_and(vi_srli(wv, 4), nibble) : _mm256_sign_epi8(lo[v], lo[v]);
            }
            for (int m = 0; m < ROWS; ++m) {
                const int8_t* q = a->xq + m * q_row + (int64_t)(w0 / 16) * REGS * 64;
                vi d[8];
                for (int v = 0; v < WPG; ++v) {
                    const int8_t* qv = q + (v / 2) * REGS * 64 + 32 * (v % 2);
                    d[v] = REGS == 2 ? dot_nibbles(lo[v], vi_load(qv), hi[v], vi_load(qv + 64))
                                     : dot_centred(hi[v], lo[v], vi_load(qv));
                }
                const int64_t f = m * g_row + SPAN_GROUPS * sp;
                acc[m] = v_fmadd(v_from_int(span_sums(d, WPG)), v_mul(scale, v_load(a->dx + f)), acc[m]);
                acc_min[m] = v_fmadd(mins, v_load(a->xs + f), acc_min[m]);
            }
        }
        for (int m = 0; m < ROWS; ++m) a->p.out[(int64_t)m * a->p.n + r] = v_reduce_add(v_sub(acc[m], acc_min[m]));
    }
}
