"""Decode-path speed on CUDA, per kernel and per model, for bf16 and GGUF-quantized weights.

    python benchmarks/kernel_bench.py [-o FILE] [--sections model,logits,profile,matrices,prefill,fused,probe]

model:    pp512, tg128, and a verify step of 8 rows against a decode step (graph replay,
          GPU time, and a full runner.forward with host work), per weight format.
logits:   kernels on vs the torch references (SPECSERVE_NO_TRITON=1) on one model, per format,
          and gguf_like (random weights quantized in the real Q4_K_M file's layout) against bf16:
          relative error and greedy-token agreement (teacher-forced).
profile:  per-kernel GPU time of one decode step (torch.profiler over graph replays).
matrices: each projection alone (cuBLAS bf16, Triton bf16, and the quantized kernels over a
          sweep of blocks), weights rotated through more than the L2 so each call reads from HBM.
prefill:  pp512 per weight format, and the top kernels of a 512-row forward.
fused:    each product of the fused decode path (RMSNorm, RoPE + KV write, SwiGLU, residual add folded
          into the tensor-core kernel) over a sweep of its blocks.
probe:    a few fused products once each, to run under a profiler (ncu).
Random weights in qwen2.5-coder-1.5b's shapes (random_model.py). Prints a table per section; writes JSON
(after every section) to -o, default kernel_bench.json in the cache's benchmarks folder (bench_output.py),
and the profile section's per-kernel tables beside it.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from bench_output import output_path, print_table, write_json
from random_model import (
    CFG,
    DEV,
    StandInTokenizer,
    graph_at,
    graph_us,
    make_runner,
    replay_us,
    step_gpu_us,
    step_ms,
)

from specserve.cli.measure import bench_decode, bench_prefill, copy_bandwidth
from specserve.engine.local_runner import LocalRunner
from specserve.kernels import quant_cuda
from specserve.kernels.activation import silu_mul
from specserve.kernels.cuda import block_shapes, build
from specserve.kernels.linear import QuantWeight
from specserve.kernels.rope import RopeWrite, rope_cos_sin
from specserve.model.batch import Batch

RESULTS: dict[str, object] = {}


def section_model() -> None:
    rows = []
    for fmt, triton_gemv, quant_kernel, pdl in (("float", "1", "mma", "1"), ("gguf_like", "1", "core", "1"),
                                                ("gguf_like", "1", "mma", "0"), ("gguf_like", "1", "mma", "1")):
        os.environ["SPECSERVE_TRITON_GEMV"] = triton_gemv  # read at capture: graphs keep the choice
        os.environ["SPECSERVE_QUANT_KERNEL"] = quant_kernel
        os.environ["SPECSERVE_PDL"] = pdl
        runner = make_runner(fmt)
        t0 = time.perf_counter()
        runner.warmup(17)
        warm_s = time.perf_counter() - t0
        pp = bench_prefill(runner, 512, 3)
        tg = bench_decode(runner, StandInTokenizer(), 128)
        gpu = step_gpu_us(runner)
        wall1, wall8 = step_ms(runner, 1), step_ms(runner, 8)
        r = {"format": fmt, "triton_gemv_bf16": triton_gemv, "quant_kernel": quant_kernel, "pdl": pdl,
             "weight_GB": runner.weights.n_bytes() / 1e9,
             "warmup_s": round(warm_s, 1),
             "pp512": round(pp), "tg128": round(tg, 1), "gpu_us": {k: round(v, 1) for k, v in gpu.items()},
             "verify8_over_decode_gpu": round(gpu[8] / gpu[1], 3), "wall_ms_1": round(wall1, 3),
             "wall_ms_8": round(wall8, 3), "verify8_over_decode_wall": round(wall8 / wall1, 3)}
        rows.append(r)
        del runner
        torch.cuda.empty_cache()
    RESULTS["model"] = rows
    print_table([{**r, **{f"us {n}": us for n, us in r["gpu_us"].items()}} for r in rows],
                ["format", "quant_kernel", "pdl", "pp512", "tg128", *(f"us {n}" for n in rows[0]["gpu_us"]),
                 "verify8_over_decode_gpu", "verify8_over_decode_wall"])


def greedy_logits(runner: LocalRunner, forced: list[int] | None, n: int = 8) -> tuple[list[torch.Tensor], list[int]]:
    runner.kv_truncate(0, 0)
    b = Batch()
    b.add_sequence([(13 * i + 1) % CFG.vocab_size for i in range(40)], 0, 0, "last")
    out, toks = [], []
    logits = runner.forward(b)
    for i in range(n):
        out.append(logits[-1].float().clone())
        tok = int(logits[-1].argmax())
        toks.append(tok)
        b = Batch()
        b.add(forced[i] if forced else tok, runner.seq_len[0], 0, logits=True)
        logits = runner.forward(b)
    # a verify-shaped step: 8 rows at once
    b = Batch()
    b.add_sequence([(5 * i + 2) % CFG.vocab_size for i in range(8)], runner.seq_len[0], 0, "all")
    out += [row.float().clone() for row in runner.forward(b)]
    return out, toks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def section_logits() -> None:
    res = {}
    kept: dict[str, tuple[list[torch.Tensor], list[int]]] = {}
    for fmt in ("float", "gguf_like"):
        runner = make_runner(fmt)
        fast = greedy_logits(runner, None)
        os.environ["SPECSERVE_NO_TRITON"] = "1"
        runner.graphs = None  # eager torch references from here
        ref = greedy_logits(runner, fast[1])
        os.environ.pop("SPECSERVE_NO_TRITON")
        errs = [rel(a, b) for a, b in zip(fast[0], ref[0], strict=True)]
        agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(fast[0], ref[0], strict=True))
        res[f"{fmt}_kernels_vs_torch"] = {"max_rel_err": round(max(errs), 5), "argmax_agree": f"{agree}/{len(errs)}"}
        kept[fmt] = fast
        del runner
        torch.cuda.empty_cache()
    errs = [rel(a, b) for a, b in zip(kept["gguf_like"][0], kept["float"][0], strict=True)]
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(kept["gguf_like"][0], kept["float"][0], strict=True))
    res["gguf_like_vs_float"] = {"max_rel_err": round(max(errs), 5), "argmax_agree": f"{agree}/{len(errs)}",
                           "greedy_tokens_same": kept["gguf_like"][1] == kept["float"][1]}
    print_table([{"comparison": name, **v} for name, v in res.items()],
                ["comparison", "max_rel_err", "argmax_agree", "greedy_tokens_same"])
    RESULTS["logits"] = res


def section_prefill() -> None:
    """pp512 per weight format, and the top kernels of one 512-row forward."""
    from torch.profiler import ProfilerActivity, profile

    res = {}
    for fmt in ("float", "gguf_like"):
        runner = make_runner(fmt)
        pp = bench_prefill(runner, 512, 3)
        runner.kv_truncate(0, 0)
        b = Batch()
        b.add_sequence(list(range(512)), 0, 0, "last")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            runner.forward(b)
            torch.cuda.synchronize()
        events = prof.key_averages()
        top = sorted(events, key=lambda e: -e.device_time_total)[:8]
        top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
        res[fmt] = {"pp512": round(pp), "top": [(e.key[:60], round(e.device_time_total), e.count) for e in top],
                    "top_self_cpu_us": [(e.key[:60], round(e.self_cpu_time_total), e.count) for e in top_cpu]}
        print(f"{fmt}: pp512 {pp:.0f} tok/s; GPU us of the top kernels of a 512-row forward:", flush=True)
        for name, us, count in res[fmt]["top"]:
            print(f"   {us:8d} us  x{count:<4d} {name}", flush=True)
        del runner
        torch.cuda.empty_cache()
    RESULTS["prefill"] = res


def section_profile(out_dir: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    summary = {}
    for fmt in ("float", "gguf_like"):
        runner = make_runner(fmt)
        runner.warmup(8)
        runner.kv_truncate(0, 0)
        b = Batch()
        b.add_sequence(list(range(600)), 0, 0, "last")
        runner.forward(b)
        for rows in (1, 2, 8):
            g = graph_at(runner, rows)
            g.replay()
            torch.cuda.synchronize()
            n_rep = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n_rep):
                    g.replay()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
            (out_dir / f"profile_{fmt}_{rows}rows.txt").write_text(table)
            kern = [(e.key, e.device_time_total / n_rep, e.count // n_rep) for e in prof.key_averages()
                    if e.device_time_total > 0]
            kern.sort(key=lambda k: -k[1])
            total = sum(k[1] for k in kern)
            summary[f"{fmt}_{rows}"] = {"kernel_us_total": round(total, 1), "launches": sum(k[2] for k in kern),
                                        "top": [(k[0][:60], round(k[1], 1), k[2]) for k in kern[:8]]}
            print(f"profile {fmt} rows={rows}: {total:.0f} us of kernels, {summary[f'{fmt}_{rows}']['launches']}"
                  f" launches, graph replay {replay_us(g):.0f} us", flush=True)
            for k in kern[:12]:
                print(f"   {k[1]:8.1f} us  x{k[2]:<4d} {k[0][:80]}", flush=True)
        del runner
        torch.cuda.empty_cache()
    RESULTS["profile"] = summary


# Projections of qwen2.5-coder-1.5b as its Q4_K_M file holds them: (N, K, SwiGLU input, bits, group).
# Q4_K packs into 4 bits with groups of 32, Q6_K into 8 bits with groups of 16; wqkv mixes Q4_K (q, k)
# and Q6_K (v) in half of the layers (8 bits, 16) and is all Q4_K in the others.
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


def section_matrices(matrix_set: str = "qwen2.5-coder-1.5b") -> None:
    """Each projection alone: bf16 (cuBLAS, Triton) vs the quantized kernels over a sweep of blocks."""
    rows_out = []
    for name, (n, k, silu, bits, group) in MATRIX_SETS[matrix_set].items():
        qs = Rotation(quant_copies(n, k, bits, group, 128 if matrix_set == "qwen3moe" else 32))
        fl = Rotation([(torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
                       for _ in range(max(1, -(-300_000_000 // (n * k * 2))))])
        for m in (1, 8):
            rows_out.append(bench_matrix(name, n, k, silu, m, qs, fl))
        del qs, fl
        torch.cuda.empty_cache()
    RESULTS["matrices" if matrix_set == "qwen2.5-coder-1.5b" else f"matrices_{matrix_set}"] = rows_out
    timings = ("cublas_bf16", "triton_bf16", "triton", "cuda", "mma", "best_gemv_mma")
    print_table([{**r, **{t: r[t].get("us") for t in timings if isinstance(r.get(t), dict)},
                  "best blocks": r.get("best_gemv_mma", {}).get("blocks")} for r in rows_out],
                ["matrix", "rows", "bits", "group", "MB", *timings, "best blocks"])


# The fused path's products (decode / verify over packed weights): what each folds in.
FUSED = {"wqkv": "norm+rope", "wqkv_mixed": "norm+rope", "wo": "add", "gate_up": "norm+swiglu", "down_q4k": "add",
         "down_q6k": "add", "output": "norm+logits"}
FUSED_SWEEP = [(1, 16, 2), (1, 8, 2), (1, 8, 3), (1, 4, 2), (1, 4, 3), (1, 4, 4), (2, 4, 2), (2, 2, 2), (2, 2, 3),
               (4, 2, 2), (8, 2, 1), (4, 1, 2), (2, 1, 3), (1, 2, 3), (1, 12, 2)]


def fused_call(name: str, m: int, qs: Rotation, k: int) -> Callable[[dict[str, int] | None], object]:
    """One product of the fused path as the model runs it (norm weights, residual, KV caches of qwen2.5-coder-1.5b)."""
    what = FUSED[name]
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    norm = ((torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16), 1e-6) if "norm" in what else None
    rope = None
    if "rope" in what:
        cos, sin = rope_cos_sin(CFG.head_dim, CFG.rope_base, 1024, device=DEV)
        caches = torch.zeros(2, 2, CFG.n_kv_heads, 1024, CFG.head_dim, device=DEV, dtype=torch.bfloat16)
        pos = torch.arange(600, 600 + m, device=DEV)
        rope = RopeWrite(cos, sin, pos, torch.zeros_like(pos), caches[0], caches[1], CFG.n_heads,
                                     CFG.n_kv_heads, CFG.rope_style)
    n_out = qs.items[0].shape[0]
    residual = torch.zeros(m, n_out, device=DEV, dtype=torch.bfloat16) if what == "add" else None
    out_dtype = torch.float32 if "logits" in what else torch.bfloat16

    def call(blocks: dict[str, int] | None = None) -> object:
        return quant_cuda.gemv(x, qs(), None, False, out_dtype, blocks, kernel="gemv_mma",
                                swiglu_output="swiglu" in what, norm=norm, add_to=residual, rope=rope)
    return call


def section_fused(rows: tuple[int, ...] = (1, 2, 8), sweep: bool = True) -> None:
    """The fused path's products alone (RMSNorm, RoPE + KV write, SwiGLU, residual add folded in) at
    each row count, default blocks with and without the register bound, and (sweep) other blocks."""
    rows_out = []
    for name, (n, k, _silu, bits, group) in MATRICES.items():
        qs = Rotation(quant_copies(n, k, bits, group))
        calls = {m: fused_call(name, m, qs, k) for m in rows}
        cfgs = [None] + ([{"TILES": t, "KSPLIT": ks, "D": d} for t, ks, d in FUSED_SWEEP] if sweep else [])
        t0 = time.perf_counter()
        minb1 = [{**block_shapes.pick_mma_blocks(n, k, m), "MINB": 1} for m in calls]
        prebuild_calls([lambda c=c, b=b: c(b) for c in calls.values() for b in cfgs + minb1])
        built_s = time.perf_counter() - t0
        for m, call in calls.items():
            r: dict[str, object] = {"matrix": name, "fused": FUSED[name], "rows": m,
                                    "MB": round(qs.items[0].n_bytes() / 1e6, 2), "built_s": round(built_s, 1),
                                    "default_blocks": block_shapes.pick_mma_blocks(n, k, m)}
            for b in cfgs:
                label = "default" if b is None else f"t{b['TILES']}k{b['KSPLIT']}d{b['D']}"
                r[label] = timed(lambda b=b, c=call: c(b), 2 * len(qs.items), qs.items[0].n_bytes()).get("us")
            one_block = {**block_shapes.pick_mma_blocks(n, k, m), "MINB": 1}  # registers unbounded
            r["default_minb1"] = timed(lambda c=call, b=one_block: c(b), 2 * len(qs.items),
                                       qs.items[0].n_bytes()).get("us")
            with mock.patch.dict(os.environ, {"SPECSERVE_PDL": "0"}):  # each launch after the last one ends
                r["default_no_pdl"] = timed(call, 2 * len(qs.items), qs.items[0].n_bytes()).get("us")
            rows_out.append(r)
        del qs
        torch.cuda.empty_cache()
    RESULTS["fused"] = rows_out
    print_table([{**r, **best_swept(r)} for r in rows_out],
                ["matrix", "fused", "rows", "default", "default_minb1", "default_no_pdl", "best swept", "best us"])


def best_swept(row: dict[str, object]) -> dict[str, object]:
    """The fastest of a fused row's swept block shapes (labelled t<TILES>k<KSPLIT>d<D>)."""
    swept = {label: us for label, us in row.items() if label.startswith("t") and isinstance(us, float)}
    if not swept:
        return {}
    label = min(swept, key=lambda k: swept[k])
    return {"best swept": label, "best us": swept[label]}


PROBE = ("wo", "gate_up", "down_q4k")


def section_probe() -> None:
    """Each of PROBE's fused products once per row count (1, 8), default blocks, for a profiler:
    ncu -k regex:gemv_mma python benchmarks/kernel_bench.py --sections probe."""
    for name in PROBE:
        n, k, _silu, bits, group = MATRICES[name]
        qs = Rotation(quant_copies(n, k, bits, group))
        calls = [fused_call(name, m, qs, k) for m in (1, 8)]
        for c in calls:
            c()
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=None, help="JSON file (default: kernel_bench.json in the cache's "
                    "benchmarks folder); the profile section's tables go beside it")
    ap.add_argument("--sections", default="model,logits,profile,matrices")
    ap.add_argument("--fused-rows", default="1,2,8", help="row counts of the fused section")
    ap.add_argument("--no-sweep", action="store_true", help="fused section: default blocks only")
    ap.add_argument("--matrix-set", default="qwen2.5-coder-1.5b", choices=sorted(MATRIX_SETS),
                    help="matrices section: whose shapes (qwen3moe: moe_bench's dense products, q8)")
    args = ap.parse_args()
    out = output_path(args.output, "kernel_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    RESULTS["gpu"] = torch.cuda.get_device_name(DEV)
    RESULTS["copy_bandwidth_TBps"] = round(copy_bandwidth(DEV) / 1e12, 3)
    print("copy bandwidth TB/s", RESULTS["copy_bandwidth_TBps"], flush=True)
    for sec in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if sec == "profile":
                section_profile(out.parent)
            else:
                {"model": section_model, "logits": section_logits,
                 "matrices": lambda: section_matrices(args.matrix_set),
                 "prefill": section_prefill, "probe": section_probe,
                 "fused": lambda: section_fused(tuple(int(r) for r in args.fused_rows.split(",")),
                                                not args.no_sweep)}[sec]()
        except Exception:
            traceback.print_exc()
            RESULTS[f"{sec}_error"] = traceback.format_exc()[-2000:]
        print(f"[{sec}: {time.perf_counter() - t0:.0f} s]", flush=True)
        write_json(out, RESULTS)


if __name__ == "__main__":
    main()
