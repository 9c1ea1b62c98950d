// x @ W^T for bit-packed group-quantized W (QuantWeight: W = scale * u - min per group), 1..16 rows of x.
// Sixteen words of a row (a chunk) are loaded at once; bit field i of those words holds, lane by lane, one u
// each, and the activations are first put in the same order (xp: [rows, chunks, fields, 16], zero past K), so a
// field costs a shift, an and, a convert and one fma per row. Each lane's sum is scaled by its group's scale and
// its activations' sum (xs: [rows, chunks, 16]) by the group's min; the lanes are added at the end. Vector
// operations from simd.h (a chunk is one AVX-512 vector or two AVX2 ones). Output rows are shared out over
// `threads` threads (pool.h). The caller splits more rows.
#include <stdint.h>

#include "packed.h"
#include "pool.h"
#include "simd.h"

typedef struct {
    packed_product p;
    const float *xp, *xs;  // the activations in the kernel's order, and their sums per lane
    int bits;
} job;

static void run_rows(void* p, int r0, int r1) {
    const job* a = (const job*)p;
    const int bits = a->bits, fields = 32 / bits, rows = a->p.rows, chunks = a->p.chunks;
    const int groups_per_chunk = 16 / a->p.words_per_group;
    const vi field_mask = vi_set1((1 << bits) - 1);
    int scale_lane[16], min_lane[16], first[CHUNK_VECS];
    sm_lanes(a->p.words_per_group, scale_lane, min_lane, first);
    vi scale_idx[CHUNK_VECS], min_idx[CHUNK_VECS];
    for (int s = 0; s < CHUNK_VECS; ++s) {
        scale_idx[s] = vi_load(scale_lane + VL * s);
        min_idx[s] = vi_load(min_lane + VL * s);
    }
    for (int r = r0; r < r1; ++r) {
        vf total[CHUNK_VECS][16];
        for (int s = 0; s < CHUNK_VECS; ++s)
            for (int m = 0; m < rows; ++m) total[s][m] = v_zero();
        const int32_t* wr = a->p.words + (int64_t)r * a->p.words_per_row;
        const uint16_t* sr = a->p.sm + (int64_t)r * a->p.groups_per_row * 2;
        for (int c = 0; c < chunks; ++c) {
            const int left = a->p.words_per_row - 16 * c;
            const int groups_left = a->p.groups_per_row - groups_per_chunk * c;
            const int groups = groups_left < groups_per_chunk ? groups_left : groups_per_chunk;
            for (int s = 0; s < CHUNK_VECS; ++s) {
                const vi wv = vi_load_n(wr + 16 * c + VL * s, left - VL * s);
                const vf smv = v_load_sm(sr + 2 * (groups_per_chunk * c + first[s]), groups - first[s]);
                const vf scale = v_pick(smv, scale_idx[s]), mins = v_pick(smv, min_idx[s]);
                vf u[8];
                if (bits == 4) {
                    for (int i = 0; i < fields; ++i) u[i] = v_low4(vi_srlv(wv, vi_set1(4 * i)));
                } else {
                    for (int i = 0; i < fields; ++i)
                        u[i] = v_from_int(vi_and(vi_srlv(wv, vi_set1(bits * i)), field_mask));
                }
                for (int m = 0; m < rows; ++m) {
                    const float* x = a->xp + ((int64_t)m * chunks + c) * fields * 16 + VL * s;
                    // Two chains of fmas, not one: the fields' products do not wait on each other.
                    vf even = v_mul(u[0], v_load(x));
                    vf odd = v_mul(u[1], v_load(x + 16));
                    for (int i = 2; i < fields; i += 2) {
                        even = v_fmadd(u[i], v_load(x + 16 * i), even);
                        odd = v_fmadd(u[i + 1], v_load(x + 16 * (i + 1)), odd);
                    }
                    const vf xsum = v_load(a->xs + ((int64_t)m * chunks + c) * 16 + VL * s);
                    total[s][m] = v_fmadd(v_add(even, odd), scale, total[s][m]);
                    total[s][m] = v_fnmadd(mins, xsum, total[s][m]);
                }
            }
        }
        for (int m = 0; m < rows; ++m) {
            vf t = total[0][m];
            for (int s = 1; s < CHUNK_VECS; ++s) t = v_add(t, total[s][m]);
            a->p.out[(int64_t)m * a->p.n + r] = v_reduce_add(t);
        }
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
    job a = {{words, sm, out, rows, n, words_per_row, groups_per_row, words_per_group, chunks}, xp, xs, bits};
    pool_run(threads, n, pool_block(n, threads, 16), run_rows, &a);
}
