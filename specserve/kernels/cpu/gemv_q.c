// x @ W^T for bit-packed group-quantized W (QuantWeight: W = scale * u - min per group), 1..16 rows of x,
// on AVX-512. Sixteen words of a row are loaded at once; bit field i of those words holds, lane by lane, one
// u each, and the activations are first put in the same order (xp: [rows, chunks, fields, 16], zero past K),
// so a field costs a shift, an and, a convert and one fma per row. Each lane's sum is scaled by its group's
// scale and its activations' sum (xs: [rows, chunks, 16]) by the group's min; the lanes are added at the end.
// Output rows are shared out over `threads` threads (pool.h). The caller splits more rows.
#include <immintrin.h>
#include <stdint.h>

#include "pool.h"

typedef struct {
    const int32_t* words;
    const uint16_t* sm;
    const float* xp;
    const float* xs;
    float* out;
    int rows, n, words_per_row, groups_per_row, bits, words_per_group, chunks;
} job;

static void run_rows(void* p, int r0, int r1) {
    const job* a = (const job*)p;
    const int bits = a->bits, fields = 32 / bits, rows = a->rows, chunks = a->chunks;
    const int groups_per_chunk = 16 / a->words_per_group;
    const __m512i field_mask = _mm512_set1_epi32((1 << bits) - 1);
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int scale_lane[16], min_lane[16];
    for (int l = 0; l < 16; ++l) {
        scale_lane[l] = 2 * (l / a->words_per_group);
        min_lane[l] = 2 * (l / a->words_per_group) + 1;
    }
    const __m512i scale_idx = _mm512_loadu_si512(scale_lane), min_idx = _mm512_loadu_si512(min_lane);
    for (int r = r0; r < r1; ++r) {
        __m512 total[16];
        for (int m = 0; m < rows; ++m) total[m] = _mm512_setzero_ps();
        const int32_t* wr = a->words + (int64_t)r * a->words_per_row;
        const uint16_t* sr = a->sm + (int64_t)r * a->groups_per_row * 2;
        for (int c = 0; c < chunks; ++c) {
            const int left = a->words_per_row - 16 * c;
            const __mmask16 wmask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            const __m512i wv = _mm512_maskz_loadu_epi32(wmask, wr + 16 * c);
            const int groups_left = a->groups_per_row - groups_per_chunk * c;
            const int halves = 2 * (groups_left < groups_per_chunk ? groups_left : groups_per_chunk);
            const __m256i h =
                _mm256_maskz_loadu_epi16((__mmask16)((1u << halves) - 1), sr + 2 * groups_per_chunk * c);
            const __m512 smv = _mm512_cvtph_ps(h);
            const __m512 scale = _mm512_permutexvar_ps(scale_idx, smv);
            const __m512 mins = _mm512_permutexvar_ps(min_idx, smv);
            __m512 u[8];
            if (bits == 4) {  // a permute reads only an index's low 4 bits: the nibble picks its own float
                for (int i = 0; i < fields; ++i)
                    u[i] = _mm512_permutexvar_ps(_mm512_srlv_epi32(wv, _mm512_set1_epi32(4 * i)), nibbles);
            } else {
                for (int i = 0; i < fields; ++i)
                    u[i] = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srlv_epi32(wv, _mm512_set1_epi32(bits * i)), field_mask));
            }
            for (int m = 0; m < rows; ++m) {
                const float* x = a->xp + ((int64_t)m * chunks + c) * fields * 16;
                // Two chains of fmas, not one: the fields' products do not wait on each other.
                __m512 even = _mm512_mul_ps(u[0], _mm512_loadu_ps(x));
                __m512 odd = _mm512_mul_ps(u[1], _mm512_loadu_ps(x + 16));
                for (int i = 2; i < fields; i += 2) {
                    even = _mm512_fmadd_ps(u[i], _mm512_loadu_ps(x + 16 * i), even);
                    odd = _mm512_fmadd_ps(u[i + 1], _mm512_loadu_ps(x + 16 * (i + 1)), odd);
                }
                const __m512 xsum = _mm512_loadu_ps(a->xs + ((int64_t)m * chunks + c) * 16);
                total[m] = _mm512_fmadd_ps(_mm512_add_ps(even, odd), scale, total[m]);
                total[m] = _mm512_fnmadd_ps(mins, xsum, total[m]);
            }
        }
        for (int m = 0; m < rows; ++m) a->out[(int64_t)m * a->n + r] = _mm512_reduce_add_ps(total[m]);
    }
}

void q_gemv(const int32_t* words, const uint16_t* sm, const float* x_rows, const int32_t* perm, float* scratch,
            float* out, int rows, int n, int k, int words_per_row, int groups_per_row, int bits, int words_per_group,
            int chunks, int threads) {
    const int fields = 32 / bits;
    // The activations in the kernel's order (perm: k of each slot, -1 past K), and their sums per lane.
    float* xp = scratch;
    float* xs = scratch + (int64_t)rows * chunks * fields * 16;
    for (int m = 0; m < rows; ++m) {
        const float* xr = x_rows + (int64_t)m * k;
        float* dst = xp + (int64_t)m * chunks * fields * 16;
        for (int64_t s = 0; s < (int64_t)chunks * fields * 16; ++s) dst[s] = perm[s] >= 0 ? xr[perm[s]] : 0.0f;
        for (int c = 0; c < chunks; ++c) {
            float* sum = xs + ((int64_t)m * chunks + c) * 16;
            for (int l = 0; l < 16; ++l) {
                float t = 0.0f;
                for (int i = 0; i < fields; ++i) t += dst[((int64_t)c * fields + i) * 16 + l];
                sum[l] = t;
            }
        }
    }
    job a = {words, sm, xp, xs, out, rows, n, words_per_row, groups_per_row, bits, words_per_group, chunks};
    pool_run(threads, n, pool_block(n, threads, 16), run_rows, &a);
}
