"""CUDA C matrix-vector kernel for bit-packed quantized weights (QuantWeight), 1..16 rows, bf16.

Per weight it costs one shift, one logic op (LOP3) and one FMA per activation row:

- a block of 8 warps stages the activations in shared memory once, as fp32 (SwiGLU of a
  [gate | up] input applied there, rounded as torch rounds it), padded so that lanes reading
  16 bytes each hit distinct banks; the first weights are already in flight meanwhile;
- each warp computes RN output rows; KSPLIT warps share a row set and split its groups; a
  lane walks its groups (16..32 weights: one 16-byte load in the 4-bit / 32 and 8-bit / 16
  layouts) with U groups in flight;
- a bit field becomes the fp32 value 1 + u / 2^bits by moving it under 1.0's exponent (no
  conversion instruction); per group, s * sum(u x) - min * sum(x) is recovered from
  sum((1 + u / 2^bits) x) and sum(x), so scales touch each group once, not each weight;
- a lane owns the same groups whatever the row count and every (output row, activation row)
  pair runs the same instruction sequence, so a verify step of 8 rows computes bit for bit
  what 8 one-row decode steps compute (tests/test_kernels.py checks this).

On an H200 (benchmarks/results/kernel_notes.md, v4) one row runs at bf16's speed per matrix or
better with 2.1x fewer bytes (the output matrix at 3.7-4 TB/s); several rows are arithmetic-bound
on CUDA cores (8 rows: 3-5x one row), which is why float weights stay the default.
Triton versions of this kernel (linear_triton.py, the fallback) stayed at a third of the
bandwidth. Compiled at first use with NVRTC through torch (`torch.cuda._compile_kernel`), one
build per variant (integer width, rows, blocks, fusion flags). Where that is not available, or
for other dtypes, `usable` says no and the Triton kernels run instead.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any

import torch

from specserve.kernels.linear import QuantWeight

WARPS = 8  # per block

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
#define PER (32 / BITS)
#define G (PER * WPG)
#define GS (G + 4)  // floats per staged group: 16 bytes of padding keep lanes on distinct banks
#define MASK ((1u << BITS) - 1u)
#define TOP (23 - BITS)
#define WARPS __WARPS__

typedef unsigned short bf16_t;
typedef unsigned long long u64;

__device__ __forceinline__ float lo_bf(unsigned r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float hi_bf(unsigned r) { return __uint_as_float(r & 0xffff0000u); }
__device__ __forceinline__ unsigned to_bf(float f) {  // round to nearest even, as torch does
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float round_bf(float f) { return __uint_as_float(to_bf(f) << 16); }
__device__ __forceinline__ float half_to_float(unsigned h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}
__device__ __forceinline__ float silu_mul(float gate, float up) {
    float act = round_bf(gate / (1.0f + __expf(-gate)));
    return round_bf(act * up);
}
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
                for (int m = 0; m < M; ++m) {
                    float y = acc[r][m];
#if BIAS
                    y += lo_bf(bias[n]);
#endif
#if OUT_F32
                    ((float*)out)[(u64)m * N + n] = round_bf(y);
#else
                    ((bf16_t*)out)[(u64)m * N + n] = (bf16_t)to_bf(y);
#endif
                }
            }
        }
    }
}
"""

SMEM_BYTES = 48 * 1024  # staged activations per block, without opting in to more


def pick_cuda_blocks(k: int) -> dict[str, int]:
    """Output rows per warp (RN), groups in flight per lane (U), warps splitting K (KSPLIT), from an
    H200 sweep on qwen2.5-coder-1.5b's shapes (benchmarks/kernel_bench.py --sections matrices; RN 2,
    U 1 was best or within 5% for one and eight rows). KSPLIT depends on the shape only, so a row's
    sums run in the same order for any number of rows."""
    return {"RN": 2, "U": 1, "KSPLIT": 2 if k >= 4096 else 1}


_builds: dict[tuple, Future] = {}
_builds_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _build(device: int, key: tuple) -> Any:
    torch.cuda.set_device(device)  # the module is loaded into the context current in this thread
    src = SOURCE.replace("__WARPS__", str(WARPS))
    for name, val in zip(("BITS", "WPG", "M", "RN", "U", "KSPLIT", "SILU", "BIAS", "OUT_F32"), key, strict=True):
        src = src.replace(f"__{name}__", str(int(val)))
    return torch.cuda._compile_kernel(src, "gemv_q")


def _submit(keys: list[tuple]) -> None:
    global _pool
    with _builds_lock:
        _pool = _pool or ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1))
        device = torch.cuda.current_device()
        for key in keys:
            if key not in _builds:
                _builds[key] = _pool.submit(_build, device, key)


def prebuild(keys: list[tuple]) -> None:
    """Builds the variants (bits, words per group, rows, RN, U, KSPLIT, silu, bias, fp32 out) at once."""
    _submit(keys)
    for key in keys:
        _builds[key].result()


def _kernel(bits: int, wpg: int, m: int, rn: int, u: int, ksplit: int, silu: bool, bias: bool, out_f32: bool) -> Any:
    """The built variant. Asking for one row count starts the builds of all 16 (NVRTC runs outside
    the GIL): graph capture asks for each row count in turn, and one by one the builds took ~40 s
    of a quantized model's warm-up."""
    key = (bits, wpg, m, rn, u, ksplit, silu, bias, out_f32)
    built = _builds.get(key)  # every call after the first: a dict lookup, no lock
    if built is None:
        _submit([key] + [(bits, wpg, rows, *key[3:]) for rows in range(1, 17) if rows != m])
        built = _builds[key]
    return built.result()


@cache
def _available() -> bool:
    if os.environ.get("SPECSERVE_QUANT_KERNEL") == "triton" or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    try:
        prebuild([(4, 4, 1, 1, 1, 1, False, False, False)])  # one small variant, not all 16 row counts
    except Exception:  # no NVRTC, or a compiler that refuses the source: the Triton kernels run instead
        return False
    return True


def usable(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    """bf16 activations on CUDA, an input size in whole 8-value steps, and a working NVRTC."""
    k = w.shape[1]
    return (x.is_cuda and x.dtype == torch.bfloat16 and out_dtype in (torch.bfloat16, torch.float32)
            and (bias is None or bias.dtype == torch.bfloat16) and w.group * w.bits // 32 in (2, 4, 8)
            and k % 8 == 0 and _available())


def chunk_groups(n_rows: int, k: int, group: int, ksplit: int) -> int:
    """Groups staged at a time: all of K if it fits, else preferably a multiple of the 32 * KSPLIT
    groups one pass of a row set covers (fewer idle lanes)."""
    n_groups = k // group
    fit = SMEM_BYTES // (n_rows * (group + 4) * 4)
    if fit >= n_groups:
        return n_groups
    step = 32 * ksplit
    return max(step, fit // step * step) if fit >= step else max(8, fit // 8 * 8)


def gemv(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, silu_input: bool, out_dtype: torch.dtype,
         blocks: dict[str, int] | None = None) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input) times W [N, K]^T -> [.., N] in out_dtype, 1..16 rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    n_out, k = w.shape
    assert 1 <= n_rows <= 16 and x2.shape[1] == (2 * k if silu_input else k)
    cfg = blocks or pick_cuda_blocks(k)
    kernel = _kernel(w.bits, w.group * w.bits // 32, n_rows, cfg["RN"], cfg["U"], cfg["KSPLIT"], silu_input,
                     bias is not None, out_dtype == torch.float32)
    cg = chunk_groups(n_rows, k, w.group, cfg["KSPLIT"])
    smem = max(n_rows * cg * (w.group + 4) * 4, WARPS * cfg["RN"] * n_rows * 4)
    assert smem <= SMEM_BYTES, "activations too wide to stage"
    out = torch.empty((n_rows, n_out), dtype=out_dtype, device=x.device)
    rows_per_block = WARPS // cfg["KSPLIT"] * cfg["RN"]
    kernel(grid=(-(-n_out // rows_per_block), 1, 1), block=(32 * WARPS, 1, 1),
           args=[x2, w.words, w.sm, bias if bias is not None else x2, out, n_out, k, x2.stride(0), cg],
           shared_mem=smem)
    return out.view(*lead, n_out)
