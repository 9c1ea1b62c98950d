
#define BITS __BITS__
#define WPG __WPG__
#define M __M__
#define RN __RN__
#define U __U__
#define KSPLIT __KSPLIT__
#define SILU __SILU__
#define BIAS __BIAS__
#define OUT_F32 __OUT_F32__
#define ACCUM 0
#define PER (32 / BITS)
#define G (PER * WPG)
#define GS (G + 4)  // floats per staged group: 16 bytes of padding keep lanes on distinct banks
#define MASK ((1u << BITS) - 1u)
#define TOP (23 - BITS)
#define WARPS __WARPS__

__COMMON__
// bit field i of w as the fp32 value 1 + u / 2^BITS
__device__ __forceinline__ float field(unsigned w, int i) {
    const int shift = BITS * i - TOP;
    const unsigned t = shift >= 0 ? (w >> shift) : (w << -shift);
    return __uint_as_float((t & (MASK << TOP)) | 0x3F800000u);
}
__device__ __forceinline__ void load_words(const unsigned* p, unsigned* w) {
#if WPG == 2
    const uint2 v = __ldg((const uint2*)p);
    w[0] = v.x; w[1] = v.y;
#else
#pragma unroll
    for (int q = 0; q < WPG / 4; ++q) {
        const uint4 v = __ldg((const uint4*)p + q);
        w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
    }
#endif
}
// the words and (scale, min) of U groups t0, t0 + step, .. of RN rows
__device__ __forceinline__ void load_batch(const unsigned* w, const unsigned* sm, int n0, int N, int n_groups, int c0,
                                           int t0, int cg, int step, unsigned (&wv)[U][RN][WPG],
                                           unsigned (&smv)[U][RN]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int t = t0 + step * u;
#pragma unroll
        for (int r = 0; r < RN; ++r) {
            const u64 row = (u64)(n0 + r < N ? n0 + r : N - 1) * n_groups + c0;  // rows past N: not stored
            if (t < cg) {
                load_words(w + (row + t) * WPG, wv[u][r]);
                smv[u][r] = __ldg(sm + row + t);
            }
        }
    }
}
// the WPG staged activations of one bit field
__device__ __forceinline__ void read_x(const float* p, float* xv) {
#if WPG == 2
    const float2 v = *(const float2*)p;
    xv[0] = v.x; xv[1] = v.y;
#else
#pragma unroll
    for (int q = 0; q < WPG / 4; ++q) {
        const float4 v = *((const float4*)p + q);
        xv[4 * q] = v.x; xv[4 * q + 1] = v.y; xv[4 * q + 2] = v.z; xv[4 * q + 3] = v.w;
    }
#endif
}

// Block: WARPS warps = WARPS / KSPLIT row sets of RN output rows; the KSPLIT warps of a set split
// the groups of K. Activations are staged in shared memory as fp32 (SwiGLU applied once per block),
// CG groups at a time.
extern "C" __global__ void __launch_bounds__(32 * WARPS) gemv_q(
    const bf16_t* __restrict__ x, const unsigned* __restrict__ w, const unsigned* __restrict__ sm,
    const bf16_t* __restrict__ bias, void* __restrict__ out, int N, int K, int stride_x, int CG)
{
    extern __shared__ float xs[];  // [M][CG][GS]; reused for the cross-warp sums at the end
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kw = warp % KSPLIT;
    const int n0 = (blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT) * RN;
    const int n_groups = K / G;
    float acc[RN][M];
#pragma unroll
    for (int r = 0; r < RN; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

    // lane (lane, kw) owns the groups g = lane + 32 kw (mod 32 KSPLIT) whatever the chunking, so its
    // sums run in the same order for any number of rows
    const int step = 32 * KSPLIT;
    unsigned wv[U][RN][WPG];
    unsigned smv[U][RN];
    for (int c0 = 0; c0 < n_groups; c0 += CG) {
        const int cg = CG < n_groups - c0 ? CG : n_groups - c0;
        int t0 = (lane + 32 * kw - c0 % step + step) % step;
        // the first weights are in flight while the activations are staged
        if (n0 < N && t0 < cg) load_batch(w, sm, n0, N, n_groups, c0, t0, cg, step, wv, smv);
        __syncthreads();
        for (int e = threadIdx.x * 8; e < M * cg * G; e += 32 * WARPS * 8) {  // 8 activations per step
            const int m = e / (cg * G), kk = e % (cg * G);
            const bf16_t* src = x + (u64)m * stride_x + c0 * G + kk;
            const uint4 a = *(const uint4*)src;
            unsigned pa[4] = {a.x, a.y, a.z, a.w};
            float v[8];
#if SILU
            const uint4 b = *(const uint4*)(src + K);
            const unsigned pb[4] = {b.x, b.y, b.z, b.w};
            silu_mul_bf16x8(pa, pb, v);
#else
            bf16x8(pa, v);
#endif
            float* dst = xs + (m * CG + kk / G) * GS + kk % G;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                float4 f;
                f.x = v[4 * q]; f.y = v[4 * q + 1]; f.z = v[4 * q + 2]; f.w = v[4 * q + 3];
                *((float4*)dst + q) = f;
            }
        }
        __syncthreads();
        if (n0 >= N) continue;
        while (t0 < cg) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = t0 + step * u;
                if (t < cg) {
                    float part[RN][M], x_sum[M];
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        x_sum[m] = 0.0f;
#pragma unroll
                        for (int r = 0; r < RN; ++r) part[r][m] = 0.0f;
                    }
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        float xv[M][WPG];
#pragma unroll
                        for (int m = 0; m < M; ++m) read_x(xs + (m * CG + t) * GS + i * WPG, xv[m]);
#pragma unroll
                        for (int j = 0; j < WPG; ++j) {
#pragma unroll
                            for (int m = 0; m < M; ++m) x_sum[m] += xv[m][j];
#pragma unroll
                            for (int r = 0; r < RN; ++r) {
                                const float f = field(wv[u][r][j], i);
#pragma unroll
                                for (int m = 0; m < M; ++m) part[r][m] = fmaf(f, xv[m][j], part[r][m]);
                            }
                        }
                    }
#pragma unroll
                    for (int r = 0; r < RN; ++r) {
                        const float s = half_to_float(smv[u][r] & 0xffffu), mn = half_to_float(smv[u][r] >> 16);
#pragma unroll
                        for (int m = 0; m < M; ++m)
                            acc[r][m] += s * ((part[r][m] - x_sum[m]) * (float)(1 << BITS)) - mn * x_sum[m];
                    }
                }
            }
            t0 += step * U;
            if (t0 < cg) load_batch(w, sm, n0, N, n_groups, c0, t0, cg, step, wv, smv);
        }
    }
#pragma unroll
    for (int r = 0; r < RN; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
#if KSPLIT > 1
    __syncthreads();  // the staged activations are no longer read: their space takes the partial sums
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RN; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) xs[(warp * RN + r) * M + m] = acc[r][m];
    }
    __syncthreads();
    if (kw != 0) return;
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RN; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float total = 0.0f;
                for (int q = 0; q < KSPLIT; ++q) total += xs[((warp + q) * RN + r) * M + m];
                acc[r][m] = total;
            }
    }
#endif
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RN; ++r) {
            const int n = n0 + r;
            if (n < N) {
#pragma unroll
                for (int m = 0; m < M; ++m) store_out(out, bias, m, n, N, acc[r][m]);
            }
        }
    }
}
