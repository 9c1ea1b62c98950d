
#define BITS __BITS__
#define G __G__
#define M __M__
#define TILES __TILES__
#define KSPLIT __KSPLIT__
#define D __D__
#define U7 __U7__                // 8-bit fields all below 128
#define SILU __SILU__            // SwiGLU of a [gate | up] input, applied while staging it
#define SWIGLU __SWIGLU__        // SwiGLU of a [gate | up] output: out = silu(gate) * up, N / 2 wide
#define NORM __NORM__            // RMSNorm of the input rows (weights norm_w), applied while staging them
#define ACCUM __ACCUM__          // out += the product (bf16, in place: a residual stream)
#define ROPE __ROPE__            // W = [q | k | v] heads of ROPE_HD: RoPE (1 neox, 2 interleaved), q to out, k and
#define ROPE_HD __ROPE_HD__      // v into the KV cache
#define BIAS __BIAS__
#define OUT_F32 __OUT_F32__
#define MINB __MINB__            // blocks per SM the registers must allow (launch bounds)
#define KC __KC__                // blocks of a thread-block cluster splitting K: each a contiguous share of whole
                                 // steps, their sums added in rank order through distributed shared memory
#define EXPERTS __EXPERTS__      // 0, or mixture-of-experts pairs (one row each, M 1): block row y is pair y, which
                                 // multiplies x row y / EXPERTS by expert ids[y]'s N rows of the stacked matrix;
                                 // without EXPERTS block row y is the y-th slice of M rows (many slices, one launch)
#define WARPS (TILES * KSPLIT)
#if KC > 1 && NORM
#error "RMSNorm needs whole rows: no K split across blocks"
#endif
#if EXPERTS && (M != 1 || NORM || ACCUM || ROPE)
#error "expert pairs take one row each and no RMSNorm, residual add or RoPE"
#endif
#define PER (32 / BITS)          // bit fields per word
#define WPG (G * BITS / 32)      // words per group and row: 4 or 8
#define WPL (WPG / 4)            // of them read by one lane: 1 or 2
#define VPL (G / 4)              // activations per lane and group: 8 or 4
#define NMMA (G / 16)            // k16 products per group
#define GP (G + VPL)             // staged activations per group: one lane's fragment of padding, so the
                                 // scattered stores of staging spread over all banks
#define NB (M > 8 ? 2 : 1)       // blocks of 8 activation rows
#define SG (16 / WPG)            // groups per step: a lane loads 16 bytes of a row per step
// staging: activation rows per pass (their loads in flight together), as many as the registers take without
// spilling: two under a bound of 64 registers a thread (the output matrix); four past 8 rows, with SiLU
// staging, or with RMSNorm under a bound (eight rows of loads made gate_up, held to one wave, spill); else
// all of up to 8 (unbounded, 128 a thread: wqkv). A thread stages one unit of 8 activations per row and
// pass: two units made small steps slower
#define REGS (65536 / (32 * WARPS * MINB))
#define MU (REGS <= 64 ? (M < 2 ? M : 2) : M > 8 || SILU || (REGS < 128 && NORM) ? (M < 4 ? M : 4) : (M < 8 ? M : 8))

__COMMON__
// bit fields s and s + PER / 2 of w as two exact bf16 integers (first in the low half)
__device__ __forceinline__ unsigned field_pair(unsigned w, int s) {
    unsigned r;
#if BITS == 4 || U7
    // under bf16's exponent of 128 a field u < 128 reads 128 + u; one fma takes the 128 off again
    unsigned t;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;"
        : "=r"(t) : "r"(w >> (BITS * s)), "r"(BITS == 4 ? 0x000F000Fu : 0x007F007Fu), "r"(0x43004300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(0x3F803F80u), "r"(0xC300C300u));
#else
    // a byte under fp32's exponent of 2^23 reads 2^23 + u; bf16 holds every integer up to 256
    const float a = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + s)) - 8388608.0f;
    const float b = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7442 + s)) - 8388608.0f;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
#endif
    return r;
}
// The 4 lanes of a quad hold 4 consecutive 16-byte units of a row (lane j: unit j); afterwards lane t
// holds word t of every unit (v[j]: word t of unit j), the words its MMA fragments take.
__device__ __forceinline__ void quad_transpose(unsigned (&v)[4], int t) {
    unsigned a = (t & 2) ? v[0] : v[2], b = (t & 2) ? v[1] : v[3];
    a = __shfl_xor_sync(0xffffffffu, a, 2);
    b = __shfl_xor_sync(0xffffffffu, b, 2);
    if (t & 2) { v[0] = a; v[1] = b; } else { v[2] = a; v[3] = b; }
    a = (t & 1) ? v[0] : v[1];
    b = (t & 1) ? v[2] : v[3];
    a = __shfl_xor_sync(0xffffffffu, a, 1);
    b = __shfl_xor_sync(0xffffffffu, b, 1);
    if (t & 1) { v[0] = a; v[2] = b; } else { v[1] = a; v[3] = b; }
}
__device__ __forceinline__ void load_sm(const unsigned* p, unsigned (&v)[SG]) {
#if SG == 4
    const uint4 q = __ldg((const uint4*)p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
#else
    const uint2 q = __ldg((const uint2*)p);
    v[0] = q.x; v[1] = q.y;
#endif
}
__device__ __forceinline__ void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#if KC > 1
// every non-exited thread of the cluster arrives before any goes on (shared memory writes made visible)
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// p's float4 in the shared memory of block `rank` of this cluster
__device__ __forceinline__ float4 load_cluster(const float* p, unsigned rank) {
    unsigned remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote));
    return v;
}
#endif
#if ROPE
// the cos and sin of rotation pair `pair` at token tok's position, and where that token's `head` goes:
// the element offset of its dim 0 in out (a q head) or in the KV cache (k and v heads: block slot >> c_shift,
// row slot's low c_shift bits of it)
__device__ __forceinline__ void rope_target(int tok, int head, int pair, const long long* pos, const long long* slot,
                                            const float* cos_t, const float* sin_t, int n_q_heads, int n_kv_heads,
                                            int c_block, int c_head, int c_shift, float& c, float& s, u64& dst) {
    const long long p = pos[tok];
    c = cos_t[p * (ROPE_HD / 2) + pair];
    s = sin_t[p * (ROPE_HD / 2) + pair];
    const int kvh = head - n_q_heads;
    dst = head < n_q_heads ? (u64)tok * n_q_heads * ROPE_HD + head * ROPE_HD
        : (u64)(slot[tok] >> c_shift) * c_block + (u64)(kvh < n_kv_heads ? kvh : kvh - n_kv_heads) * c_head
          + (u64)(slot[tok] & ((1 << c_shift) - 1)) * ROPE_HD;
}
#endif
// where the k-th activation of a group is staged: lane t = (k % WPG) % 4 reads VPL of them, in the
// order its field pairs feed the MMA's k slots (field i of word j holds k = i * WPG + j)
__device__ __forceinline__ int staged_pos(int k) {
    const int j = k % WPG, i = k / WPG;
    const int t = j % 4, omega = j / 4, s = i % (PER / 2), e = i / (PER / 2);
    return t * VPL + 2 * (omega * (PER / 2) + s) + e;
}

// One warp computes 16 output rows (a tile) over every KSPLIT-th step of SG groups of K as bf16
// tensor-core products of exact integers (m16n8k16, weights as A, activation rows as B); after each
// group the fp32 partial of every (row, activation row) is scaled: acc += scale * partial - min * sum(x).
// Per step a lane loads 16 bytes of each of its two rows (the quad's 4 lanes: 64 contiguous bytes)
// and the quad exchanges words so each lane holds its fragments' words.
// Block: TILES tiles x KSPLIT warps. Activations are staged in shared memory as bf16, CG groups
// at a time, permuted so each lane reads its B fragment in one load; their per-group sums beside.
extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB) gemv_mma(
    const bf16_t* __restrict__ x, const unsigned* __restrict__ w, const unsigned* __restrict__ sm,
    const bf16_t* __restrict__ bias, void* __restrict__ out, int N, int K, int stride_x, int CG, int row_bytes,
    const bf16_t* __restrict__ norm_w, int eps_bits, const long long* __restrict__ pos,
    const long long* __restrict__ slot, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int n_q_heads, int n_kv_heads, int c_block,
    int c_head, int c_shift,
    const long long* __restrict__ ids)
{
    extern __shared__ __align__(16) unsigned char smem[];
#if EXPERTS
    // the pair's expert id is the routing kernel's output: read after the wait (no weight loads ahead of it)
    grid_dependency_wait();
    {
        const u64 pair = blockIdx.y, expert = (u64)ids[pair];
        w += expert * N * (K / G) * WPG;
        sm += expert * N * (K / G);
        x += pair / EXPERTS * stride_x;
        out = (char*)out + pair * (SWIGLU ? N / 2 : N) * (OUT_F32 ? 4 : 2);
    }
#else
    {  // slice y: rows y * M .. y * M + M - 1 of x, out, and (RoPE) of pos and slot; the same sums as its own launch
        const u64 first = (u64)blockIdx.y * M;
        x += first * stride_x;
        out = (char*)out + first * (SWIGLU ? N / 2 : ROPE ? n_q_heads * ROPE_HD : N) * (OUT_F32 ? 4 : 2);
        pos += first;
        slot += first;
    }
#endif
    bf16_t* xs = (bf16_t*)smem;                        // [M][row_bytes / 2]: groups of GP
    float* xsum = (float*)(smem + M * row_bytes);      // [CG][16]
#if NORM
    float* xsq = xsum + CG * 16;                       // [CG][16]: sums of squares of the raw inputs
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = warp % KSPLIT;
    const int row_groups = K / G;  // a weight row's groups
#if KC > 1
    // this block's share of K: whole steps, rank r taking the r-th run of ceil(steps / KC)
    const unsigned rank = cluster_rank();
    const int tile = (blockIdx.x / KC) * TILES + warp / KSPLIT;
    const int per_rank = (row_groups / SG + KC - 1) / KC * SG;
    const int g_begin = min((int)rank * per_rank, row_groups);
    const int n_groups = min(per_rank, row_groups - g_begin);
    x += g_begin * G;
#else
    const int tile = blockIdx.x * TILES + warp / KSPLIT;
    const int g_begin = 0, n_groups = row_groups;
#endif
    const int n_steps = n_groups / SG;
#if SWIGLU
    // a tile's rows g and g + 8 are gate row n = 8 tile + g and its up row N / 2 + n: a lane holds both
    const int n_half = N / 2;
    const bool active = tile * 8 < n_half;
    const int ra = min(tile * 8 + g, n_half - 1), rb = n_half + ra;  // rows past N / 2: not stored
#elif ROPE
    // a tile holds 8 rotation pairs of one head: rows g and g + 8 are dims i and its partner (neox:
    // i + ROPE_HD / 2, interleaved: i + 1) of pair i = 8 (tile % tiles per head) + g, so a lane rotates them
    const bool active = tile * 16 < N;
    const int head = tile / (ROPE_HD / 16), pair = (tile % (ROPE_HD / 16)) * 8 + g;
    const int ra = head * ROPE_HD + (ROPE == 1 ? pair : 2 * pair), rb = ra + (ROPE == 1 ? ROPE_HD / 2 : 1);
#else
    const bool active = tile * 16 < N;
    const int ra = min(tile * 16 + g, N - 1), rb = min(tile * 16 + g + 8, N - 1);  // rows past N: not stored
#endif
    const uint4* wa = (const uint4*)(w + ((u64)ra * row_groups + g_begin) * WPG) + t;
    const uint4* wb = (const uint4*)(w + ((u64)rb * row_groups + g_begin) * WPG) + t;
    const unsigned* sa = sm + (u64)ra * row_groups + g_begin;
    const unsigned* sb = sm + (u64)rb * row_groups + g_begin;

    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nb][e] = 0.0f;
    uint4 wva[D], wvb[D];
    unsigned sva[D][SG], svb[D][SG];
#define LOAD(d, st)                                   \
    if (active && (st) < n_steps) {                   \
        wva[d] = __ldg(wa + (u64)(st) * 4);           \
        wvb[d] = __ldg(wb + (u64)(st) * 4);           \
        load_sm(sa + (st) * SG, sva[d]);              \
        load_sm(sb + (st) * SG, svb[d]);              \
    }
    // the warp's q-th step is q * KSPLIT + kw; slot d holds the steps q = d (mod D); CG is a
    // multiple of D * KSPLIT * SG groups, so a chunk starts on slot 0
#pragma unroll
    for (int d = 0; d < D; ++d) LOAD(d, d * KSPLIT + kw)
    // Launched as a programmatic dependent (PDL), this grid may start while the kernel before it still
    // runs: only weights (never written) are read before this wait; activations, outputs after it.
    grid_dependency_wait();
#if ROPE && NB == 1
    // where this lane's rotated values go, and their cos / sin, fetched now, used in the epilogue (with two
    // blocks of 8 rows the registers they take cost more than the latency they hide: fetched there)
    float rope_c[NB][2], rope_s[NB][2];
    u64 rope_dst[NB][2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
        rope_target(min(2 * t + e, M - 1), head, pair, pos, slot, cos_t, sin_t, n_q_heads, n_kv_heads, c_block,
                    c_head, c_shift, rope_c[0][e], rope_s[0][e], rope_dst[0][e]);
#endif

    for (int c0 = 0; c0 < n_groups; c0 += CG) {
        const int cg = min(CG, n_groups - c0);
        __syncthreads();  // the previous chunk is no longer read
        // stage: a thread takes a unit of 8 consecutive activations, the same unit of MU rows per pass (their
        // loads issued first; the norm weights read once for all rows); the G / 8 threads of a group sum it
        // in a fixed order
        const int upr = cg * (G / 8);  // units per row
        for (int ub = 0; ub < upr; ub += 32 * WARPS) {
            const int uu = ub + threadIdx.x;
            const bool ok_u = uu < upr;
            const int kk = ok_u ? uu * 8 : 0;
            // staged_pos(kk % G + h) = staged_pos(kk % G) + staged_pos(h): h's part folds to a constant
            const int pos0 = (kk / G) * GP + staged_pos(kk % G);
            const bf16_t* src = x + c0 * G + kk;
#if NORM
            uint4 gn = make_uint4(0u, 0u, 0u, 0u);
            if (ok_u) gn = __ldg((const uint4*)(norm_w + c0 * G + kk));
            const unsigned pw[4] = {gn.x, gn.y, gn.z, gn.w};
#endif
#pragma unroll 1
            for (int m0 = 0; m0 < M; m0 += MU) {
                uint4 ga[MU];
#if SILU
                uint4 gb[MU];
#endif
#pragma unroll
                for (int mm = 0; mm < MU; ++mm)
                    if (ok_u && m0 + mm < M) {
                        ga[mm] = *(const uint4*)(src + (u64)(m0 + mm) * stride_x);
#if SILU
                        gb[mm] = *(const uint4*)(src + (u64)(m0 + mm) * stride_x + K);
#endif
                    }
#pragma unroll
                for (int mm = 0; mm < MU; ++mm) {
                    const int m = m0 + mm;
                    const bool ok = ok_u && m < M;
                    float part = 0.0f, sq = 0.0f;
                    if (ok) {
                        const unsigned pa[4] = {ga[mm].x, ga[mm].y, ga[mm].z, ga[mm].w};
                        float v[8];
#if SILU
                        const unsigned pb[4] = {gb[mm].x, gb[mm].y, gb[mm].z, gb[mm].w};
                        silu_mul_bf16x8(pa, pb, v);
#else
                        bf16x8(pa, v);
#if NORM
                        // RMSNorm: x * weight is staged (rounded to bf16) and 1 / rms(x) scales the row's
                        // sums at the end, from per-group sums of squares: no pass over x before staging
#pragma unroll
                        for (int h = 0; h < 4; ++h) {
                            sq = __fmaf_rn(v[2 * h + 1], v[2 * h + 1], __fmaf_rn(v[2 * h], v[2 * h], sq));
                            const unsigned xw = mul_bf16x2(pa[h], pw[h]);
                            v[2 * h] = lo_bf(xw);
                            v[2 * h + 1] = hi_bf(xw);
                        }
#endif
#endif
                        bf16_t* dst = xs + m * (row_bytes / 2) + pos0;
#pragma unroll
                        for (int h = 0; h < 8; ++h) {
                            dst[staged_pos(h)] = (bf16_t)(__float_as_uint(v[h]) >> 16);
                            part += v[h];
                        }
                    }
#pragma unroll
                    for (int off = 1; off < G / 8; off <<= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
                    if (ok && kk % G == 0) xsum[(kk / G) * 16 + m] = part;
#if NORM
#pragma unroll
                    for (int off = 1; off < G / 8; off <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
                    if (ok && kk % G == 0) xsq[(kk / G) * 16 + m] = sq;
#endif
                }
            }
        }
        __syncthreads();
        if (!active) continue;
        const int s0 = c0 / SG, s_end = (c0 + cg) / SG;
        for (int q = s0 / KSPLIT; q * KSPLIT + kw < s_end; q += D) {
#pragma unroll
            for (int d = 0; d < D; ++d) {
                const int st = (q + d) * KSPLIT + kw;
                if (st < s_end) {
                    unsigned va[4] = {wva[d].x, wva[d].y, wva[d].z, wva[d].w};
                    unsigned vb[4] = {wvb[d].x, wvb[d].y, wvb[d].z, wvb[d].w};
                    quad_transpose(va, t);
                    quad_transpose(vb, t);
#pragma unroll
                    for (int i = 0; i < SG; ++i) {
                        const int lg = st * SG + i - c0;
                        unsigned fa[VPL / 2], fb[VPL / 2];
#pragma unroll
                        for (int o = 0; o < WPL; ++o)
#pragma unroll
                            for (int s = 0; s < PER / 2; ++s) {
                                fa[o * (PER / 2) + s] = field_pair(va[i * WPL + o], s);
                                fb[o * (PER / 2) + s] = field_pair(vb[i * WPL + o], s);
                            }
                        const float s_a = half_to_float(sva[d][i] & 0xffffu), m_a = half_to_float(sva[d][i] >> 16);
                        const float s_b = half_to_float(svb[d][i] & 0xffffu), m_b = half_to_float(svb[d][i] >> 16);
#pragma unroll
                        for (int nb = 0; nb < NB; ++nb) {
                            const int tok = nb * 8 + g;
                            unsigned bx[VPL / 2];
#if G == 32
                            uint4 bv = make_uint4(0u, 0u, 0u, 0u);
                            if (tok < M) bv = *(const uint4*)(xs + tok * (row_bytes / 2) + lg * GP + t * VPL);
                            bx[0] = bv.x; bx[1] = bv.y; bx[2] = bv.z; bx[3] = bv.w;
#else
                            uint2 bv = make_uint2(0u, 0u);
                            if (tok < M) bv = *(const uint2*)(xs + tok * (row_bytes / 2) + lg * GP + t * VPL);
                            bx[0] = bv.x; bx[1] = bv.y;
#endif
                            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                            for (int j = 0; j < NMMA; ++j)
                                mma(part, fa[2 * j], fb[2 * j], fa[2 * j + 1], fb[2 * j + 1], bx[2 * j], bx[2 * j + 1]);
                            const float2 xsm = *(const float2*)(xsum + lg * 16 + nb * 8 + 2 * t);
                            acc[nb][0] = fmaf(-m_a, xsm.x, fmaf(s_a, part[0], acc[nb][0]));
                            acc[nb][1] = fmaf(-m_a, xsm.y, fmaf(s_a, part[1], acc[nb][1]));
                            acc[nb][2] = fmaf(-m_b, xsm.x, fmaf(s_b, part[2], acc[nb][2]));
                            acc[nb][3] = fmaf(-m_b, xsm.y, fmaf(s_b, part[3], acc[nb][3]));
                        }
                    }
                    LOAD(d, st + D * KSPLIT)
                }
            }
        }
    }
    grid_dependents_may_launch();  // the next kernel's prologue (its first weight loads) may overlap this tail
#if NORM
    // 1 / rms of each activation row from its group sums of squares, added in group order by lane `row`
    // (the same sums for any row count), then handed to the lanes holding that row's tokens
    float rstd[NB][2];
    {
        const int row = min(lane, M - 1);
        float ss = 0.0f;
        for (int q = 0; q < n_groups; ++q) ss += xsq[q * 16 + row];
        const float r = 1.0f / sqrtf(ss / K + __int_as_float(eps_bits));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) rstd[nb][e] = __shfl_sync(0xffffffffu, r, min(nb * 8 + 2 * t + e, M - 1));
    }
#endif
#if KSPLIT > 1
    __syncthreads();  // the staged activations are no longer read: their space takes the partial sums
    float* red = (float*)smem;  // [WARPS][32][NB * 4]
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(warp * 32 + lane) * NB * 4 + nb * 4 + e] = acc[nb][e];
    __syncthreads();
    if (kw != 0) return;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float total = 0.0f;
            for (int p = 0; p < KSPLIT; ++p) total += red[((warp + p) * 32 + lane) * NB * 4 + nb * 4 + e];
            acc[nb][e] = total;
        }
#endif
#if KC > 1
    // the cluster's K shares: each block leaves its sums in its own shared memory, rank 0 adds the others'
    // in rank order (the same order for any row count) and stores; the rest wait until it has read them
    {
#if KSPLIT == 1
        __syncthreads();  // the staged activations are no longer read
#endif
        float* mine = (float*)smem + (warp * 32 + lane) * NB * 4;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            *(float4*)(mine + nb * 4) = make_float4(acc[nb][0], acc[nb][1], acc[nb][2], acc[nb][3]);
        cluster_sync();
        if (rank == 0) {
            for (unsigned r = 1; r < KC; ++r)
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    const float4 v = load_cluster(mine + nb * 4, r);
                    acc[nb][0] += v.x; acc[nb][1] += v.y; acc[nb][2] += v.z; acc[nb][3] += v.w;
                }
        }
        cluster_sync();
        if (rank != 0) return;
    }
#endif
    if (!active) return;
#if NORM
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nb][e] = __fmul_rn(acc[nb][e], rstd[nb][e & 1]);  // never fused with a bias
#endif
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#if SWIGLU
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // acc[nb][e]: gate, acc[nb][e + 2]: up; rounded as a gate_up output is
            const int n = tile * 8 + g, tok = nb * 8 + 2 * t + e;
            if (n < n_half && tok < M)
                ((bf16_t*)out)[(u64)tok * n_half + n] = (bf16_t)to_bf(silu_mul(round_bf(acc[nb][e]),
                                                                              round_bf(acc[nb][e + 2])));
        }
#elif ROPE
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // acc[nb][e]: dim ra, acc[nb][e + 2]: dim rb, of token tok
            const int tok = nb * 8 + 2 * t + e;
            if (tok >= M) continue;
#if BIAS
            const float x1 = round_bf(acc[nb][e] + lo_bf(bias[ra])), x2 = round_bf(acc[nb][e + 2] + lo_bf(bias[rb]));
#else
            const float x1 = round_bf(acc[nb][e]), x2 = round_bf(acc[nb][e + 2]);
#endif
            const int d1 = ra - head * ROPE_HD, d2 = rb - head * ROPE_HD;
#if NB == 1
            const float c = rope_c[nb][e], s = rope_s[nb][e];
            const u64 dst_off = rope_dst[nb][e];
#else
            float c, s;
            u64 dst_off;
            rope_target(tok, head, pair, pos, slot, cos_t, sin_t, n_q_heads, n_kv_heads, c_block, c_head, c_shift, c,
                        s, dst_off);
#endif
            // explicit roundings: every variant (row count) rotates alike, whatever the compiler would fuse
            const float r1 = __fmaf_rn(x1, c, __fmul_rn(-x2, s)), r2 = __fmaf_rn(x2, c, __fmul_rn(x1, s));
            const bool is_v = head >= n_q_heads + n_kv_heads;
            bf16_t* dst = (head < n_q_heads ? (bf16_t*)out : is_v ? v_cache : k_cache) + dst_off;
            dst[d1] = (bf16_t)to_bf(is_v ? x1 : r1);
            dst[d2] = (bf16_t)to_bf(is_v ? x2 : r2);
        }
#else
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = tile * 16 + g + (e >> 1) * 8, tok = nb * 8 + 2 * t + (e & 1);
            if (n < N && tok < M) store_out(out, bias, tok, n, N, acc[nb][e]);
        }
#endif
}
