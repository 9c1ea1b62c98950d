"""Timing one quantized product alone: its weight in copies rotated through more than the L2 (each call reads
HBM), graph-replayed calls, and the shapes and block sweeps of kernel_bench.py's matrices section."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from random_model import DEV, graph_us

from specserve.kernels import quant_cuda
from specserve.kernels.backend import kernels_for
from specserve.kernels.cuda import block_shapes, build
from specserve.kernels.quant_weight import QuantWeight

MATRICES = {"wqkv": (2048, 1536, False, 4, 32), "wqkv_mixed": (2048, 1536, False, 8, 16),
            "wo": (1536, 1536, False, 4, 32), "gate_up": (17920, 1536, False, 4, 32),
            "down_q4k": (1536, 8960, True, 4, 32), "down_q6k": (1536, 8960, True, 8, 16),
            "output": (151936, 1536, False, 8, 16)}
# Qwen3-30B-A3B's dense products in q8 (moe_bench's model: the attention and the output head around the experts).
MOE_MATRICES = {"wqkv": (5120, 2048, False, 8, 32), "wo": (2048, 4096, False, 8, 32),
                "output": (151936, 2048, False, 8, 32)}
MATRIX_SETS = {"qwen2.5-coder-1.5b": MATRICES, "qwen3moe": MOE_MATRICES}
# CUDA kernel: (output rows per warp, groups in flight per lane, warps splitting K) per row count.
SWEEP = {1: [(2, 1, 1), (2, 1, 2)], 8: [(2, 1, 1)]}
# Tensor-core kernel: (16-row tiles per block, warps splitting K, groups in flight per warp).
# A fourth number: blocks of a cluster splitting K (KC; sm_90+).
MMA_SWEEP = [(1, 8, 2), (1, 16, 2), (2, 4, 2), (2, 4, 3), (4, 2, 2), (8, 2, 1), (1, 4, 2), (1, 4, 3), (2, 2, 2),
             (4, 1, 2), (8, 1, 1), (3, 2, 2), (2, 2, 1), (1, 8, 2, 2), (2, 4, 2, 2), (2, 4, 2, 4), (4, 4, 2, 4),
             (1, 16, 2, 2), (4, 2, 2, 2)]


def quant_copies(n: int, k: int, bits: int, group: int, q8_range: int = 32) -> list[QuantWeight]:
    """Copies of a random packed matrix; 8-bit values in [-q8_range, q8_range) (Q6_K's fit in 7 bits, Q8_0's
    need 128, which the kernels treat apart)."""
    per = n * k * (bits / 8 + 4 / group)
    copies = max(1, -(-300_000_000 // int(per)))  # > L2 (60 MB), several times
    out = []
    for _ in range(copies):
        q = torch.randint(0, 16, (n, k), dtype=torch.int8, device=DEV) if bits == 4 else \
            torch.randint(-q8_range, q8_range, (n, k), dtype=torch.int8, device=DEV)
        scale = torch.rand(n, k // group, device=DEV) * 0.01
        out.append(QuantWeight.from_ints(q, scale, scale * 4 if bits == 4 else None, group))
        assert out[-1].bits == bits
    return out


def timed(fn: Callable[[], object], n_calls: int, nbytes: int) -> dict[str, float | str]:
    try:
        fn()
        us = graph_us(fn, n_calls)
        return {"us": round(us, 2), "TBps": round(nbytes / us / 1e6, 2)}
    except Exception as exc:  # one variant failing must not hide the others
        return {"us": f"error: {exc!r}"[:300]}


class Rotation:
    """Cycles through copies of a weight so that each call reads it from HBM, not the L2."""

    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def __call__(self) -> object:
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def prebuild_calls(calls: list[Callable[[], object]]) -> None:
    """Builds the variants these calls launch, all at once: the calls run first with a stand-in for
    the built kernel that records its key, and a launch that does nothing."""
    keys: list[tuple] = []
    stand_in = lambda key, sibling=None: keys.append(key)  # noqa: E731
    no_launch = lambda *args: None  # noqa: E731
    with mock.patch.object(build, "kernel", stand_in), mock.patch.object(build, "launch", no_launch):
        for c in calls:
            c()
    build.prebuild(sorted(set(keys)))


def bench_matrix(name: str, n: int, k: int, silu: bool, m: int, qs: Rotation, fl: Rotation) -> dict[str, object]:
    from specserve.kernels import linear_triton  # imports triton: here, so that --help runs anywhere

    x = torch.randn(m, 2 * k if silu else k, device=DEV).to(torch.bfloat16)
    calls = 2 * len(qs.items)
    qw = qs.items[0]
    qbytes = qw.n_bytes()

    def tri() -> torch.Tensor:
        return linear_triton.gemv(x, qs(), None, silu, torch.bfloat16)

    def cuda(blocks: dict[str, int] | None = None, kernel: str = "gemv_q") -> torch.Tensor:
        return quant_cuda.gemv(x, qs(), None, silu, torch.bfloat16, blocks=blocks, kernel=kernel)

    variants = [(f"rn{rn}u{u}k{ks}", "gemv_q", {"RN": rn, "U": u, "KSPLIT": ks}) for rn, u, ks in SWEEP[m]]
    variants += [(f"mma_t{tl}k{ks}d{d}" + (f"c{kc[0]}" if kc else ""), "gemv_mma",
                  {"TILES": tl, "KSPLIT": ks, "D": d, **({"KC": kc[0]} if kc else {})}) for tl, ks, d, *kc in MMA_SWEEP]
    prebuild_calls([cuda, lambda: cuda(kernel="gemv_mma")]
                   + [lambda b=blocks, kn=kernel: cuda(b, kn) for _, kernel, blocks in variants])
    r: dict[str, object] = {"matrix": name, "N": n, "K": k, "rows": m, "bits": qw.bits, "group": qw.group,
                            "MB": round(qbytes / 1e6, 2)}
    silu_mul = kernels_for(x.device).silu_mul
    r["cublas_bf16"] = timed(lambda: F.linear(silu_mul(x) if silu else x, fl()), 2 * len(fl.items), n * k * 2)
    r["triton_bf16"] = timed(lambda: linear_triton.gemv(x, fl(), None, silu, torch.bfloat16),
                             2 * len(fl.items), n * k * 2)
    r["triton"] = timed(tri, calls, qbytes)
    r["cuda"] = timed(cuda, calls, qbytes)
    r["cuda_blocks"] = block_shapes.pick_cuda_blocks(k)
    r["mma"] = timed(lambda: cuda(kernel="gemv_mma"), calls, qbytes)
    r["mma_blocks"] = block_shapes.pick_mma_blocks(n, k, m, clusters=True)  # (sm_90: clusters allowed)
    best: dict[str, tuple[str, float]] = {}
    for label, kernel, blocks in variants:
        us = timed(lambda b=blocks, kn=kernel: cuda(b, kn), calls, qbytes).get("us")
        r[label] = us
        if isinstance(us, float) and (kernel not in best or us < best[kernel][1]):
            best[kernel] = (label, us)
    for kernel, (label, us) in best.items():
        r[f"best_{kernel}"] = {"blocks": label, "us": us, "TBps": round(qbytes / us / 1e6, 2)}
    return r
