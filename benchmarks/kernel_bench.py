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
from bench_output import output_path, print_table, write_json
from product_timing import MATRICES, MATRIX_SETS, Rotation, bench_matrix, prebuild_calls, quant_copies, timed
from random_model import (
    CFG,
    DEV,
    StandInTokenizer,
    graph_at,
    make_runner,
    replay_us,
    step_gpu_us,
    step_ms,
)

from specserve.cli.measure import bench_decode, bench_prefill, copy_bandwidth
from specserve.engine.local_runner import LocalRunner
from specserve.kernels import quant_cuda
from specserve.kernels import settings as kernel_settings
from specserve.kernels.cuda import block_shapes
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
        kernel_settings.reload()
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
        kernel_settings.reload()
        runner.graphs = None  # eager torch references from here
        ref = greedy_logits(runner, fast[1])
        os.environ.pop("SPECSERVE_NO_TRITON")
        kernel_settings.reload()
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
        caches = torch.zeros(2, 128, CFG.n_kv_heads, 16, CFG.head_dim, device=DEV, dtype=torch.bfloat16)
        pos = torch.arange(600, 600 + m, device=DEV)
        rope = RopeWrite(cos, sin, pos, pos + 1024, caches[0], caches[1], CFG.n_heads, CFG.n_kv_heads,
                         CFG.rope_style)
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
