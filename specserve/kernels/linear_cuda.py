"""CUDA C matrix-vector kernels for bit-packed quantized weights (QuantWeight), few rows, bf16.

Two kernels; both compute every (output row, activation row) pair with the same instruction
sequence whatever the row count, so a verify step of 8 rows computes bit for bit what 8 one-row
decode steps compute (tests/test_kernels.py checks this), and speculative greedy text equals
plain greedy text.

`gemv_mma` (the default on sm_80+): tensor cores on exact integers. A warp owns 16 output rows
and multiplies them with up to 16 activation rows by mma.sync m16n8k16 (weights as A, bf16):
- a lane loads 16 bytes of each of its two rows per step (a quad of lanes: 64 contiguous bytes)
  and the quad swaps words (quad_transpose) so each lane holds the words its fragments take;
- a 4-bit field (or an 8-bit one below 128, `QuantWeight.u_max`) becomes an exact bf16 integer
  under bf16's exponent of 128 (LOP3) minus 128 (one bf16x2 FMA); wider bytes go through fp32;
- the fp32 partial of each group is scaled once: acc += scale * partial - min * sum(x), the
  activations' group sums computed while staging them;
- activations are staged in shared memory as bf16 (SwiGLU of a [gate | up] input applied
  there), permuted so a lane reads its B fragment in one load.
For the fused decode path (model/transformer.py) it also folds in, by compile-time flags: RMSNorm
of its input (NORM: x * weight staged, 1/rms from per-group sums of squares scales the sums at the
end), SwiGLU of its output (SWIGLU: a tile pairs gate rows with their up rows), the residual add
(ACCUM: out += product, in place) and RoPE with the KV-cache write (ROPE: a tile pairs rotation
partners; `RopeWrite`). On sm_90 it is launched as a programmatic dependent (`_launch_ex`):
weights load before `griddepcontrol.wait`, activations after it. On sm_90+ the blocks of a thread-block
cluster may split K (KC): each stages and multiplies a contiguous share of whole steps, and the cluster's
first block adds the others' sums, in rank order, from their shared memory before its epilogue.
`gemv_q`: CUDA cores. A lane walks whole groups of one row (one 16-byte load), a bit field
becomes the fp32 value 1 + u / 2^bits by moving it under 1.0's exponent, and per group
s * sum(u x) - min * sum(x) is recovered from sum((1 + u / 2^bits) x) and sum(x). It also takes
4-bit groups of 16 and row lengths the MMA kernel's 16-word steps do not divide.

On an H200 (benchmarks/results/kernel_notes.md, v5-v7) one row costs about the same in both
unfused (the MMA kernel: wqkv 3.9, wo 3.9, gate_up 13.9, down 11.6-14.3 us; the output matrix 101 vs
79 us); fused, 8 rows cost the MMA kernel 1.3-1.7x one row instead of the CUDA cores' 3-5x. Float
(bf16) weights stay the default: their 8-row steps run on cuBLAS at ~1.1x one row. Compiled at first use with NVRTC
through torch (`torch.cuda._compile_kernel`), one build per variant (integer width, rows, blocks,
fusion flags). Where that is not available, or for other dtypes, `usable` says no and the Triton
kernels (linear_triton.py) run instead. SPECSERVE_QUANT_KERNEL=core|triton picks another kernel.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any

import torch

from specserve.kernels.linear import MAX_GEMV_ROWS, QuantWeight
from specserve.kernels.rope import RopeWrite

WARPS = 8  # per block

# Types and helpers of both kernels, put where their sources say __COMMON__ (after their #defines).
COMMON = r"""
typedef unsigned short bf16_t;
typedef unsigned long long u64;

__device__ __forceinline__ float lo_bf(unsigned r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float hi_bf(unsigned r) { return __uint_as_float(r & 0xffff0000u); }
__device__ __forceinline__ unsigned to_bf(float f) {  // round to nearest even, as torch does
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float round_bf(float f) { return __uint_as_float(to_bf(f) << 16); }
// both halves of a * b rounded to bf16 once: what round_bf(lo_bf(a) * lo_bf(b)) gives (the fp32 product of two
// bf16 values is exact), in one instruction (the -0 added keeps a product's sign when it is zero)
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}
__device__ __forceinline__ float half_to_float(unsigned h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}
// programmatic dependent launch (sm_90+; no-ops for a grid launched without it)
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_may_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ float silu_mul(float gate, float up) {
    float act = round_bf(__fdividef(gate, 1.0f + __expf(-gate)));
    return round_bf(act * up);
}
// y (+ bias) rounded to bf16, stored as bf16 or as fp32 (logits), or added to the bf16 out (a residual
// stream: rounded as a bf16 tensor addition rounds)
__device__ __forceinline__ void store_out(void* out, const bf16_t* bias, int row, int n, int N, float y) {
#if BIAS
    y += lo_bf(bias[n]);
#endif
#if OUT_F32
    ((float*)out)[(u64)row * N + n] = round_bf(y);
#elif ACCUM
    bf16_t* p = (bf16_t*)out + (u64)row * N + n;
    *p = (bf16_t)to_bf(round_bf(y) + lo_bf(*p));
#else
    ((bf16_t*)out)[(u64)row * N + n] = (bf16_t)to_bf(y);
#endif
}
"""

SOURCE = r"""
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
            unsigned pb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                v[2 * h] = silu_mul(lo_bf(pa[h]), lo_bf(pb[h]));
                v[2 * h + 1] = silu_mul(hi_bf(pa[h]), hi_bf(pb[h]));
            }
#else
#pragma unroll
            for (int h = 0; h < 4; ++h) { v[2 * h] = lo_bf(pa[h]); v[2 * h + 1] = hi_bf(pa[h]); }
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
"""

MMA_SOURCE = r"""
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
#define WARPS (TILES * KSPLIT)
#if KC > 1 && NORM
#error "RMSNorm needs whole rows: no K split across blocks"
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
// staging: activation rows per pass (their loads in flight together). Registers! Eight rows of loads made
// gate_up (RMSNorm, 560 blocks held to one wave) spill: four per pass took its 8-row call from 18.8 to
// 15.2 us (v8); under a bound of 64 registers a thread (the output matrix) two per pass: four made its
// 5-6-row calls ~11 us slower (v11); unbounded (128 a thread: wqkv) and without SiLU staging, all of up
// to 8 rows in one pass. A thread stages one unit of 8 activations per row and pass: two (the rule before
// v11) cost 2- and 3-row steps 0.06 and 0.25 ms of a model step
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
// the element offset of its dim 0 in out (a q head) or in the KV cache (k and v heads)
__device__ __forceinline__ void rope_target(int tok, int head, int pair, const long long* pos, const long long* seq,
                                            const float* cos_t, const float* sin_t, int n_q_heads, int n_kv_heads,
                                            int c_seq, int c_head, float& c, float& s, u64& dst) {
    const long long p = pos[tok];
    c = cos_t[p * (ROPE_HD / 2) + pair];
    s = sin_t[p * (ROPE_HD / 2) + pair];
    const int kvh = head - n_q_heads;
    dst = head < n_q_heads ? (u64)tok * n_q_heads * ROPE_HD + head * ROPE_HD
        : (u64)seq[tok] * c_seq + (u64)(kvh < n_kv_heads ? kvh : kvh - n_kv_heads) * c_head + (u64)p * ROPE_HD;
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
    const long long* __restrict__ seq, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int n_q_heads, int n_kv_heads, int c_seq, int c_head)
{
    extern __shared__ __align__(16) unsigned char smem[];
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
        rope_target(min(2 * t + e, M - 1), head, pair, pos, seq, cos_t, sin_t, n_q_heads, n_kv_heads, c_seq, c_head,
                    rope_c[0][e], rope_s[0][e], rope_dst[0][e]);
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
#pragma unroll
                        for (int h = 0; h < 4; ++h) {
                            v[2 * h] = silu_mul(lo_bf(pa[h]), lo_bf(pb[h]));
                            v[2 * h + 1] = silu_mul(hi_bf(pa[h]), hi_bf(pb[h]));
                        }
#else
#pragma unroll
                        for (int h = 0; h < 4; ++h) { v[2 * h] = lo_bf(pa[h]); v[2 * h + 1] = hi_bf(pa[h]); }
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
            rope_target(tok, head, pair, pos, seq, cos_t, sin_t, n_q_heads, n_kv_heads, c_seq, c_head, c, s, dst_off);
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
"""

SMEM_BYTES = 48 * 1024  # staged activations per block, without opting in to more
MMA_SMEM_BYTES = 200 * 1024  # the tensor-core kernel opts in to more (H100/H200: up to 227 KB per block)

# kernel name -> (source, its compile-time parameters in key order; M, the row count, is the third)
KERNELS = {
    "gemv_q": (SOURCE, ("BITS", "WPG", "M", "RN", "U", "KSPLIT", "SILU", "BIAS", "OUT_F32")),
    "gemv_mma": (MMA_SOURCE, ("BITS", "G", "M", "TILES", "KSPLIT", "D", "SILU", "BIAS", "OUT_F32", "U7", "SWIGLU",
                              "NORM", "ACCUM", "ROPE", "ROPE_HD", "MINB", "KC")),
}


def pick_cuda_blocks(k: int) -> dict[str, int]:
    """Output rows per warp (RN), groups in flight per lane (U), warps splitting K (KSPLIT), from an
    H200 sweep on qwen2.5-coder-1.5b's shapes (benchmarks/kernel_bench.py --sections matrices; RN 2,
    U 1 was best or within 5% for one and eight rows). KSPLIT depends on the shape only, so a row's
    sums run in the same order for any number of rows."""
    return {"RN": 2, "U": 1, "KSPLIT": 2 if k >= 4096 else 1}


def pick_mma_blocks(n: int, k: int, rows: int = 1, clusters: bool = False) -> dict[str, int]:
    """16-row tiles per block (TILES), warps splitting K (KSPLIT), groups in flight per warp (D), blocks of
    a cluster splitting K (KC) and MINB, the blocks per SM the registers must leave room for (0: as many
    as put the grid in one wave, `one_wave_blocks`). KSPLIT, D and KC come from the shape only (and from
    `clusters`: sm_90+ and no RMSNorm folded in), so a row's sums run in the same order for any number of
    rows. down (K = 8960) splits K four ways across a cluster (kernel_notes.md v14): one row costs
    0.2-0.3 us more, 6 / 8 / 16 rows 1.1 / 2.3 / 5.7 us less (v7's 16 warps of one block each stage all
    of K for every row); two tiles a block up to 2 rows, four above. From H200 sweeps (kernel_notes.md v7,
    v8): several rows take more registers than one, and gate_up's 560 blocks then needed a second wave
    (2 rows: 10.9 -> 16.6 us; bounded: 12.4); the output matrix's bound made 8 rows spill (145 -> 227 us)
    until RMSNorm-fused products staged 4 rows per pass (v8: bounded 121 us); at 9-16 rows bounded too
    (two blocks an SM: 140-144 us against 169-170 unbounded, v15). Three tiles per block (gate_up: 374
    blocks, 2.8 per SM, instead of 560, 4.2) balance the SMs better and stage the activations fewer times:
    1 / 8 rows 10.7 / 15.2 -> 9.7 / 12.9 us."""
    n_tiles = -(-n // 16)
    if n_tiles <= 256 and k >= 4096 and clusters:
        return {"TILES": 2 if rows <= 2 else 4, "KSPLIT": 4, "D": 2, "KC": 4, "MINB": 0}
    if n_tiles <= 256:  # few tiles (wqkv, wo, down): one per block, 16 warps splitting K; unbounded (one wave
        return {"TILES": 1, "KSPLIT": 16, "D": 2, "MINB": 1}  # on an H200, and 512 threads would spill under a bound)
    if n_tiles <= 2048:
        return {"TILES": 3, "KSPLIT": 2, "D": 2, "MINB": 0}
    return {"TILES": 8, "KSPLIT": 2, "D": 1, "MINB": 0}


@cache
def _sm_resources(device: int) -> tuple[int, int]:
    """(multiprocessors, shared memory bytes per multiprocessor)."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)


def one_wave_blocks(grid: int, threads: int, smem: int, device: int) -> int:
    """Blocks per SM the kernel's registers must leave room for so that the grid runs in one wave (1
    where it does anyway), but never fewer than 64 registers a thread (the output matrix: 2), nor more
    blocks than the shared memory holds (a bound past that only makes the kernel spill: gate_up's
    staged rows take 41 KB a block at 9 rows, 66 KB at 16)."""
    sms, smem_per_sm = _sm_resources(device)
    if grid <= sms:
        return 1
    by_smem = smem_per_sm // (smem + 1024)  # the driver reserves 1 KB per block
    return max(1, min(-(-grid // sms), 65536 // (64 * threads), by_smem))


_builds: dict[tuple, Future] = {}
_builds_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def kernel_source(key: tuple) -> str:
    """The CUDA C of one variant: (kernel name, its parameters in KERNELS' order) filled in."""
    name, params = key[0], key[1:]
    source, names = KERNELS[name]
    src = source.replace("__COMMON__", COMMON).replace("__WARPS__", str(WARPS))
    for param, val in zip(names, params, strict=True):
        src = src.replace(f"__{param}__", str(int(val)))
    return src


def _build(device: int, key: tuple) -> Any:
    torch.cuda.set_device(device)  # the module is loaded into the context current in this thread
    name = key[0]
    kernel = torch.cuda._compile_kernel(kernel_source(key), name)
    if name == "gemv_mma":
        _allow_smem(kernel, MMA_SMEM_BYTES)
    return kernel


def _allow_smem(kernel: Any, n_bytes: int) -> None:
    """Lets a kernel take more than 48 KB of dynamic shared memory (CUDA asks for an explicit opt-in)."""
    if hasattr(kernel, "set_shared_memory_config"):
        kernel.set_shared_memory_config(n_bytes)
        return
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    max_dynamic_shared_size_bytes = 8  # CUfunction_attribute
    if libcuda.cuFuncSetAttribute(kernel.func, max_dynamic_shared_size_bytes, ctypes.c_int(n_bytes)) != 0:
        raise RuntimeError("cuFuncSetAttribute failed")


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@cache
def _sm90(device: int) -> bool:
    """sm_90 or newer: programmatic dependent launch, thread-block clusters (distributed shared memory)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: int) -> bool:
    """Programmatic dependent launch for the tensor-core kernel: sm_90+ and SPECSERVE_PDL not "0"."""
    return os.environ.get("SPECSERVE_PDL") != "0" and _sm90(device)


def _launch_ex(kernel: Any, grid: int, block: int, args: list, shared_mem: int, dependent: bool,
               cluster: int = 1) -> None:
    """cuLaunchKernelEx. dependent: programmatic stream serialization: the grid may start before the kernel
    ahead of it in the stream ends (it waits in griddepcontrol.wait before touching activations), which
    hides the launch gap and the first weight loads behind that kernel's tail. cluster > 1: consecutive
    blocks form thread-block clusters of that many (the kernel's KC). Graph capture keeps both."""
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attrs = []
    if dependent:
        attrs.append(_LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION))
        attrs[-1].value[0] = 1
    if cluster > 1:
        attrs.append(_LaunchAttribute(id=CLUSTER_DIMENSION))
        attrs[-1].value[:3] = [cluster, 1, 1]
    array = (_LaunchAttribute * max(1, len(attrs)))(*attrs)
    config = _LaunchConfig((grid, 1, 1), (block, 1, 1), shared_mem, torch.cuda.current_stream().cuda_stream,
                           ctypes.cast(array, ctypes.POINTER(_LaunchAttribute)), len(attrs))
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    err = libcuda.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")


def _submit(keys: list[tuple]) -> None:
    global _pool
    with _builds_lock:
        _pool = _pool or ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1))
        device = torch.cuda.current_device()
        for key in keys:
            if key not in _builds:
                _builds[key] = _pool.submit(_build, device, key)


def prebuild(keys: list[tuple]) -> None:
    """Builds the variants (kernel name, then its parameters as in KERNELS) at once."""
    _submit(keys)
    for key in keys:
        _builds[key].result()


def _kernel(key: tuple, sibling: Callable[[int], tuple] | None = None) -> Any:
    """The built variant. Asking for one row count starts the builds of all 16 (NVRTC runs outside
    the GIL): graph capture asks for each row count in turn, and one by one the builds took ~40 s
    of a quantized model's warm-up. sibling(rows): the key the same product takes for that many rows
    (default: this key with only the row count changed)."""
    built = _builds.get(key)  # every call after the first: a dict lookup, no lock
    if built is None:
        sibling = sibling or (lambda rows: (*key[:3], rows, *key[4:]))
        _submit([key] + [sibling(rows) for rows in range(1, 17) if rows != key[3]])
        built = _builds[key]
    return built.result()


def kernel_choice() -> str:
    """SPECSERVE_QUANT_KERNEL: "mma" (tensor cores, the default), "core" (CUDA cores) or "triton"."""
    return os.environ.get("SPECSERVE_QUANT_KERNEL", "mma")


@cache
def _available(name: str) -> bool:
    if not hasattr(torch.cuda, "_compile_kernel"):
        return False
    probe = {"gemv_q": ("gemv_q", 4, 4, 1, 1, 1, 1, False, False, False),
             "gemv_mma": ("gemv_mma", 4, 32, 1, 1, 1, 1, *[False] * 7, 0, 0, 1, 1)}[name]
    try:
        prebuild([probe])  # one small variant, not all 16 row counts
    except Exception:  # no NVRTC, or a compiler that refuses the source: the Triton kernels run instead
        return False
    return True


@cache
def _tensor_cores(device: int) -> bool:
    """bf16 mma.sync and fma.bf16x2 need sm_80 or newer."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def _usable(x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and out_dtype in (torch.bfloat16, torch.float32)
            and (bias is None or bias.dtype == torch.bfloat16) and x.shape[-1] % 8 == 0)


def usable(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out_dtype: torch.dtype) -> str | None:
    """The CUDA kernel that takes this product ("gemv_mma" or "gemv_q"), or None (the Triton ones).

    bf16 activations on CUDA, an input size in whole 8-value steps, a working NVRTC; the tensor-core
    kernel needs groups of 4 or 8 words (4-bit / 32, 8-bit / 16 or 32), whole 16-word steps per row
    and an sm_80 or newer GPU."""
    choice = kernel_choice()
    if choice == "triton" or not _usable(x, bias, out_dtype):
        return None
    wpg = w.group * w.bits // 32
    n_groups = w.shape[1] // w.group
    if (choice == "mma" and wpg in (4, 8) and n_groups % (16 // wpg) == 0 and _tensor_cores(x.device.index or 0)
            and _available("gemv_mma")):
        return "gemv_mma"
    return "gemv_q" if wpg in (2, 4, 8) and _available("gemv_q") else None


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    return x2


def chunk_groups(n_rows: int, k: int, group: int, ksplit: int) -> int:
    """Groups staged at a time: all of K if it fits, else preferably a multiple of the 32 * KSPLIT
    groups one pass of a row set covers (fewer idle lanes)."""
    n_groups = k // group
    fit = SMEM_BYTES // (n_rows * (group + 4) * 4)
    if fit >= n_groups:
        return n_groups
    step = 32 * ksplit
    return max(step, fit // step * step) if fit >= step else max(8, fit // 8 * 8)


def k_share(k: int, group: int, per_step: int, kc: int) -> int:
    """The activations a block of a KC-block cluster stages: its share of whole steps of per_step groups."""
    return -(-(k // group // per_step) // kc) * per_step * group


def mma_chunk(n_rows: int, k: int, group: int, step: int, sums: int = 1) -> tuple[int, int]:
    """Groups staged at a time (a multiple of `step`, the groups the warps of a tile take per round)
    and bytes per staged activation row: groups of bf16 values padded by a quarter (the kernel's GP),
    then one group's bytes more, so the lanes of two rows hit distinct banks. After the rows, `sums`
    arrays of fp32 per-group sums (16 rows): the activations' sums, and with RMSNorm their sums of
    squares."""
    def row_bytes(cg: int) -> int:
        return -(-cg * group * 5 // 2 // 128) * 128 + group * 2

    cg = -(-(k // group) // step) * step
    while cg > step and n_rows * row_bytes(cg) + cg * 64 * sums > MMA_SMEM_BYTES:
        cg -= step
    return cg, row_bytes(cg)


ROWS_PER_LAUNCH = MAX_GEMV_ROWS  # the kernels' largest M: more rows run as slices of this many


def gemv(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, silu_input: bool, out_dtype: torch.dtype,
         blocks: dict[str, int] | None = None, kernel: str | None = None, *, swiglu_output: bool = False,
         norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
         rope: RopeWrite | None = None) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input) times W [N, K]^T -> [.., N] in out_dtype.

    Up to 16 rows per launch; more rows run as 16-row slices into one output, so each row gets the
    same sums as in a one-row call. `kernel`: "gemv_mma" or "gemv_q" (default: what `usable` picks);
    `blocks`: that kernel's blocks. The tensor-core kernel also folds in (bf16 in and out):
    swiglu_output: W = [gate | up] -> silu(gate) * up [.., N / 2], each rounded as silu_input rounds;
    norm (weight, eps): RMSNorm of the input rows first, when `norm_fusable` (rounded as rms_norm);
    add_to: a contiguous [.., N] tensor that the product is added to in place (a residual stream),
    which is returned; rope: W = [q | k | v] heads: returns q rotated [.., n_heads * head_dim], k (rotated)
    and v go into the KV cache at the rows' (sequence, position), rounded as rope_and_cache rounds."""
    lead = x.shape[:-1]
    x2 = _flat_rows(x)
    n_out, k = w.shape
    assert x2.shape[1] == (2 * k if silu_input else k)
    kernel = kernel or usable(x2, w, bias, out_dtype)
    assert kernel, "no CUDA kernel takes this product (see usable)"
    fused = (swiglu_output, norm is not None, add_to is not None, rope is not None)
    assert not any(fused) or (kernel == "gemv_mma" and not silu_input)
    assert not (swiglu_output or add_to is not None or rope is not None) or out_dtype == torch.bfloat16
    if rope is not None:
        assert not swiglu_output and add_to is None and n_out == (rope.n_heads + 2 * rope.n_kv_heads) * rope.head_dim
        assert rope.head_dim % 16 == 0 and 2 * rope.cos.shape[-1] == rope.head_dim and rope.k_cache.stride(2) == \
            rope.head_dim and rope.k_cache.stride(3) == 1 and rope.k_cache.stride() == rope.v_cache.stride()
        n_out = rope.n_heads * rope.head_dim
    if swiglu_output:
        assert bias is None and add_to is None and n_out % 16 == 0
        n_out //= 2
    assert norm is None or (norm_fusable(w) and norm[0].dtype == torch.bfloat16)
    if add_to is not None:
        assert add_to.is_contiguous() and add_to.dtype == torch.bfloat16 and add_to.numel() == x2.shape[0] * n_out
        out = add_to.view(x2.shape[0], n_out)
    else:
        out = torch.empty((x2.shape[0], n_out), dtype=out_dtype, device=x.device)
    for i in range(0, x2.shape[0], ROWS_PER_LAUNCH):
        end = i + ROWS_PER_LAUNCH
        _launch(kernel, x2[i:end], w, bias, silu_input, out[i:end], blocks, fused, norm,
                rope.rows(i, end) if rope is not None else None)
    return out.view(*lead, n_out)


def norm_fusable(w: QuantWeight) -> bool:
    """The tensor-core kernel stages all of K at once for 16 rows (RMSNorm needs whole rows)."""
    cfg = pick_mma_blocks(*w.shape)
    cg, _ = mma_chunk(ROWS_PER_LAUNCH, w.shape[1], w.group, cfg["D"] * cfg["KSPLIT"] * 512 // (w.group * w.bits), 2)
    return cg * w.group >= w.shape[1]


def _launch(kernel: str, x2: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, silu_input: bool,
            out: torch.Tensor, blocks: dict[str, int] | None, fused: tuple[bool, ...] = (False, False, False, False),
            norm: tuple[torch.Tensor, float] | None = None, rope: RopeWrite | None = None) -> None:
    """One launch over 1..16 rows x2 [rows, K or 2K] into out [rows, N] (N / 2 with SwiGLU, q's width with
    RoPE; both row-contiguous). fused: the tensor-core kernel's (SwiGLU output, RMSNorm input, add to out,
    RoPE and KV write)."""
    n_rows = x2.shape[0]
    n_out, k = w.shape
    flags = (silu_input, bias is not None, out.dtype == torch.float32)
    if kernel == "gemv_mma":
        per_step = 512 // (w.group * w.bits)  # groups in a lane's 16-byte load
        sums = 2 if fused[1] else 1
        seven_bits = w.bits == 8 and w.u_max < 128
        rope_flags = ({"neox": 1, "interleaved": 2}[rope.style], rope.head_dim) if rope is not None else (0, 0)
        n_tiles = -(-n_out // 16)
        device = x2.device.index or 0

        def variant(rows: int) -> tuple[tuple, dict[str, int], int, int, int, int]:
            """The key, blocks, grid, staged groups, bytes per staged row and shared memory for `rows` rows."""
            clusters = _sm90(device) and not fused[1]  # RMSNorm takes whole rows
            cfg = {**pick_mma_blocks(n_out, k, rows, clusters), **(blocks or {})}
            cfg["KC"] = cfg.get("KC", 1) if clusters else 1
            grid = -(-n_tiles // cfg["TILES"]) * cfg["KC"]
            threads = 32 * cfg["TILES"] * cfg["KSPLIT"]
            cg, row_bytes = mma_chunk(rows, k_share(k, w.group, per_step, cfg["KC"]), w.group,
                                      cfg["D"] * cfg["KSPLIT"] * per_step, sums)
            reduce_bytes = threads * (2 if rows > 8 else 1) * 16 if cfg["KSPLIT"] > 1 or cfg["KC"] > 1 else 0
            smem = max(rows * row_bytes + cg * 64 * sums, reduce_bytes)
            minb = cfg["MINB"] or one_wave_blocks(grid, threads, smem, device)
            return (("gemv_mma", w.bits, w.group, rows, cfg["TILES"], cfg["KSPLIT"], cfg["D"], *flags, seven_bits,
                     *fused[:3], *rope_flags, minb, cfg["KC"]), cfg, grid, cg, row_bytes, smem)

        key, cfg, grid, cg, row_bytes, smem = variant(n_rows)
        warps = cfg["TILES"] * cfg["KSPLIT"]
        launch = _kernel(key, lambda rows: variant(rows)[0])
        norm_w, eps = norm if norm is not None else (x2, 0.0)
        eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]  # fp32 bits: the launcher passes floats as double
        no_rope = [x2, x2, x2, x2, x2, x2, 0, 0, 0, 0]
        extra = [cg, row_bytes, norm_w, eps_bits, *(rope.args() if rope is not None else no_rope)]
        limit = MMA_SMEM_BYTES
    else:
        cfg = blocks or pick_cuda_blocks(k)
        cg = chunk_groups(n_rows, k, w.group, cfg["KSPLIT"])
        smem = max(n_rows * cg * (w.group + 4) * 4, WARPS * cfg["RN"] * n_rows * 4)
        launch = _kernel(("gemv_q", w.bits, w.group * w.bits // 32, n_rows, cfg["RN"], cfg["U"], cfg["KSPLIT"],
                          *flags))
        warps = WARPS
        grid = -(-n_out // (WARPS // cfg["KSPLIT"] * cfg["RN"]))
        extra = [cg]
        limit = SMEM_BYTES
    assert smem <= limit, "activations too wide to stage"
    args = [x2, w.words, w.sm, bias if bias is not None else x2, out, n_out, k, x2.stride(0), *extra]
    pdl = kernel == "gemv_mma" and pdl_enabled(x2.device.index or 0)
    if pdl or (kernel == "gemv_mma" and cfg["KC"] > 1):
        _launch_ex(launch, grid, 32 * warps, args, smem, pdl, cfg["KC"])
    else:
        launch(grid=(grid, 1, 1), block=(32 * warps, 1, 1), args=args, shared_mem=smem)
