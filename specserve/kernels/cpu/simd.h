// The vector operations the CPU kernels are written in, so that each kernel exists once for both instruction
// sets build.py compiles for: AVX-512 with VNNI (VL = 16 lanes) and AVX2 with FMA and F16C (VL = 8). The weight
// layouts keep their unit, a chunk of 16 words (one cache line): CHUNK_VECS vectors of VL lanes each. A helper's
// AVX-512 form is the intrinsic itself; its AVX2 form computes the same (differences are said where they are).
// Rounding is the same on both: fp32 ops round to nearest even (the default MXCSR mode), divisions are true
// divisions, and the library is built with -ffp-contract=off, so only v_fmadd / v_fnmadd fuse.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vmask;
#define VOP(op) _mm512_##op
#define VSI(op) _mm512_##op##_si512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
typedef __m256i vmask;  // all ones in a lane that is in, zero elsewhere
#define VOP(op) _mm256_##op
#define VSI(op) _mm256_##op##_si256
#else
#error "the CPU kernels need AVX-512 (F, BW, VL, VNNI) or AVX2 with FMA and F16C"
#endif

#define CHUNK_VECS (16 / VL)  // vectors a chunk of 16 words takes

// Operations with the same name on both.
static inline vf v_zero(void) { return VOP(setzero_ps)(); }
static inline vf v_set1(float x) { return VOP(set1_ps)(x); }
static inline vf v_load(const float* p) { return VOP(loadu_ps)(p); }
static inline void v_store(float* p, vf v) { VOP(storeu_ps)(p, v); }
static inline vf v_add(vf a, vf b) { return VOP(add_ps)(a, b); }
static inline vf v_sub(vf a, vf b) { return VOP(sub_ps)(a, b); }
static inline vf v_mul(vf a, vf b) { return VOP(mul_ps)(a, b); }
static inline vf v_div(vf a, vf b) { return VOP(div_ps)(a, b); }
static inline vf v_max(vf a, vf b) { return VOP(max_ps)(a, b); }
static inline vf v_fmadd(vf a, vf b, vf c) { return VOP(fmadd_ps)(a, b, c); }    // a * b + c, one rounding
static inline vf v_fnmadd(vf a, vf b, vf c) { return VOP(fnmadd_ps)(a, b, c); }  // c - a * b, one rounding
static inline vf v_from_int(vi v) { return VOP(cvtepi32_ps)(v); }
static inline vi vi_from_float(vf v) { return VOP(cvtps_epi32)(v); }  // rounds to nearest even (MXCSR's mode)
static inline vi vi_zero(void) { return VSI(setzero)(); }
static inline vi vi_set1(int32_t x) { return VOP(set1_epi32)(x); }
static inline vi vi_load(const void* p) { return VSI(loadu)((const vi*)p); }
static inline void vi_store(void* p, vi v) { VSI(storeu)((vi*)p, v); }
static inline vi vi_and(vi a, vi b) { return VSI(and)(a, b); }
static inline vi vi_or(vi a, vi b) { return VSI(or)(a, b); }
static inline vi vi_add(vi a, vi b) { return VOP(add_epi32)(a, b); }
static inline vi vi_min(vi a, vi b) { return VOP(min_epi32)(a, b); }
static inline vi vi_max(vi a, vi b) { return VOP(max_epi32)(a, b); }
static inline vi vi_slli(vi a, int n) { return VOP(slli_epi32)(a, n); }
static inline vi vi_srli(vi a, int n) { return VOP(srli_epi32)(a, n); }
static inline vi vi_srlv(vi a, vi n) { return VOP(srlv_epi32)(a, n); }

// The first `left` lanes (all for left >= VL; AVX2: none for left <= 0, AVX-512 takes left >= 0).
static inline vmask v_tail(int left) {
#if VL == 16
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);  // left >= 0
#else
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#endif
}

// Loads and stores of the first `left` values (zeros in the other lanes), touching no memory past them. AVX2's
// masked moves are slow (stores above all), so a whole vector takes the plain one.
static inline vf v_load_n(const float* p, int left) {
#if VL == 16
    return _mm512_maskz_loadu_ps(v_tail(left), p);
#else
    return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, v_tail(left));
#endif
}

static inline void v_store_n(float* p, int left, vf v) {
#if VL == 16
    _mm512_mask_storeu_ps(p, v_tail(left), v);
#else
    if (left >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, v_tail(left), v);
#endif
}

static inline vi vi_load_n(const int32_t* p, int left) {
#if VL == 16
    return _mm512_maskz_loadu_epi32(v_tail(left), p);
#else
    return left >= 8 ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskload_epi32((const int*)p, v_tail(left));
#endif
}

// a PRED b lane by lane (PRED: _CMP_GT_OQ, _CMP_LT_OQ, ...; an immediate, so a macro)
#if VL == 16
#define v_cmp(a, b, pred) _mm512_cmp_ps_mask(a, b, pred)
#else
#define v_cmp(a, b, pred) _mm256_castps_si256(_mm256_cmp_ps(a, b, pred))
#endif

// a where m is set, else 0.
static inline vf v_maskz(vmask m, vf a) {
#if VL == 16
    return _mm512_maskz_mov_ps(m, a);
#else
    return _mm256_and_ps(_mm256_castsi256_ps(m), a);
#endif
}

// a / b where m is set, else 0.
static inline vf v_maskz_div(vmask m, vf a, vf b) {
#if VL == 16
    return _mm512_maskz_div_ps(m, a, b);
#else
    return _mm256_and_ps(_mm256_castsi256_ps(m), _mm256_div_ps(a, b));
#endif
}

// v_mask_div, v_mask_max: a / b, max(a, b) where m is set, else src.
#if VL == 16
#define V_MASKED(op) \
    static inline vf v_mask_##op(vf src, vmask m, vf a, vf b) { return _mm512_mask_##op##_ps(src, m, a, b); }
#else
#define V_MASKED(op)                                                                  \
    static inline vf v_mask_##op(vf src, vmask m, vf a, vf b) {                       \
        return _mm256_blendv_ps(src, _mm256_##op##_ps(a, b), _mm256_castsi256_ps(m)); \
    }
#endif
V_MASKED(div)
V_MASKED(max)
#undef V_MASKED

static inline vf v_abs(vf a) {
#if VL == 16
    return _mm512_abs_ps(a);
#else
    return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
#endif
}

// The sum (the max) of the lanes, in a fixed order, the same for every call: AVX2 halves, then pairs, then one.
#if VL == 16
static inline float v_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float v_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
#else
#define V_REDUCE(name, op)                                                                \
    static inline float name(vf a) {                                                      \
        __m128 s = _mm_##op##_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); \
        s = _mm_##op##_ps(s, _mm_movehl_ps(s, s));                                        \
        return _mm_cvtss_f32(_mm_##op##_ss(s, _mm_movehdup_ps(s)));                       \
    }
V_REDUCE(v_reduce_add, add)
V_REDUCE(v_reduce_max, max)
#undef V_REDUCE
#endif

// Lanes with idx >= 0 read base[idx], the others are 0.
static inline vf v_gather(const float* base, vi idx) {
#if VL == 16
    const __mmask16 inside = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), inside, idx, base, 4);
#else
    const __m256 inside = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(-1)));
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, idx, inside, 4);
#endif
}

// The float of each lane's low 4 bits (a 4-bit weight field; the higher bits may hold anything).
static inline vf v_low4(vi a) {
#if VL == 16
    // a permute reads only an index's low 4 bits: the nibble picks its own float
    return _mm512_permutexvar_ps(a, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
#else
    return _mm256_cvtepi32_ps(_mm256_and_si256(a, _mm256_set1_epi32(15)));
#endif
}

// The table one vector's lanes pick their group's scale and min from: the fp16 (scale, min) pairs of the groups
// at p as floats, `groups` of them (any more are not read), zero past them. It holds 8 groups on AVX-512 and 4 on
// AVX2, so a vector's lanes span at most that many (2 words a group or more: groups of 16 or 32).
static inline vf v_load_sm(const uint16_t* p, int groups) {
#if VL == 16
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << (2 * groups)) - 1), p));
#else
    const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(groups), _mm_setr_epi32(0, 1, 2, 3));
    // a (scale, min) pair is one 32-bit word
    return _mm256_cvtph_ps(groups >= 4 ? _mm_loadu_si128((const __m128i*)p) : _mm_maskload_epi32((const int*)p, mask));
#endif
}

// Entry idx of the table, lane by lane (idx < 16 on AVX-512, < 8 on AVX2).
static inline vf v_pick(vf t, vi idx) {
#if VL == 16
    return _mm512_permutexvar_ps(idx, t);
#else
    return _mm256_permutevar8x32_ps(t, idx);
#endif
}

// Where lane l of a chunk (16 words, words_per_group >= 2 a group) finds its group's scale and min in its
// vector's table, which v_load_sm reads from the vector's first group, first[s]: entries scale_lane[l], min_lane[l].
static inline void sm_lanes(int words_per_group, int* scale_lane, int* min_lane, int* first) {
    for (int s = 0; s < CHUNK_VECS; ++s) first[s] = VL * s / words_per_group;
    for (int l = 0; l < 16; ++l) {
        scale_lane[l] = 2 * (l / words_per_group - first[l / VL]);
        min_lane[l] = scale_lane[l] + 1;
    }
}

// Per 32-bit lane: the 8 products of unsigned weight bytes (<= 15: 4-bit fields) and signed activation bytes,
// lo with q_lo and hi with q_hi, summed exactly. AVX2's maddubs adds byte pairs into int16 with saturation,
// exact here: the sum of two pairs is at most 4 * 15 * 127 in size.
static inline vi dot_nibbles(vi lo, vi q_lo, vi hi, vi q_hi) {
#if VL == 16
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, q_lo), hi, q_hi);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, q_lo), _mm256_maddubs_epi16(hi, q_hi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// Per 32-bit lane: the 4 products of unsigned weight bytes (any, 8-bit fields) and signed activation bytes,
// summed exactly. On AVX2 a byte pair's sum (up to 2 * 255 * 127) would saturate int16 in maddubs, so the bytes
// widen to 16 bits (even and odd ones apart) and madd adds their products into 32 bits.
static inline vi dot_bytes(vi u, vi q) {
#if VL == 16
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, q);
#else
    const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0xFF)), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i q_even = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8), q_odd = _mm256_srai_epi16(q, 8);
    return _mm256_add_epi32(_mm256_madd_epi16(u_even, q_even), _mm256_madd_epi16(u_odd, q_odd));
#endif
}

// p * 2^n for integral n <= 0. AVX2 builds 2^n from its exponent bits, so it gives 0 where n <= -127 (the
// AVX-512 scalef rounds to denormals there first): exp below ~1e-38, nothing a softmax or silu keeps.
static inline vf v_ldexp(vf p, vf n) {
#if VL == 16
    return _mm512_scalef_ps(p, n);
#else
    const __m256i e = _mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-127.0f)));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)));
#endif
}

// Rounded to the nearest integer, ties to even.
static inline vf v_round(vf a) {
#if VL == 16
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}

// exp(x) for x <= 0 as 2^n * e^f, |f| <= ln2 / 2, e^f by its Taylor series to f^7 (truncation < 1e-8 relative);
// 0 for the far negative x, as exp underflows.
static inline vf v_exp_neg(vf x) {
    const vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf f = v_fnmadd(n, v_set1(0.693145751953125f), x);  // ln2 in two parts: n * hi is exact
    f = v_fnmadd(n, v_set1(1.42860682030941723212e-6f), f);
    vf p = v_set1(1.0f / 5040);
    p = v_fmadd(p, f, v_set1(1.0f / 720));
    p = v_fmadd(p, f, v_set1(1.0f / 120));
    p = v_fmadd(p, f, v_set1(1.0f / 24));
    p = v_fmadd(p, f, v_set1(1.0f / 6));
    p = v_fmadd(p, f, v_set1(0.5f));
    p = v_fmadd(p, f, v_set1(1.0f));
    p = v_fmadd(p, f, v_set1(1.0f));
    return v_ldexp(p, v_max(n, v_set1(-200.0f)));
}
