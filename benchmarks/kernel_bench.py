"""Decode-path speed on CUDA, per kernel and per model, for the bf16 and q8 weight formats.

    python benchmarks/kernel_bench.py [--out DIR] [--sections model,logits,profile,matrices]

model:    pp512, tg128, and a verify step of 8 rows against a decode step (graph replay,
          GPU time, and a full runner.forward with host work), per weight format.
logits:   kernels on vs the torch references (SPECSERVE_NO_TRITON=1) on one model, per format,
          and q8 against bf16: relative error and greedy-token agreement (teacher-forced).
profile:  per-kernel GPU time of one decode step (torch.profiler over graph replays).
matrices: each projection alone (cuBLAS bf16 vs Triton bf16 vs Triton q8), weights rotated
          through more than the L2 so each call reads from HBM.
Random weights in qwen2.5-coder-1.5b's shapes. Prints tables; writes JSON and text to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_bench import bench_decode, bench_prefill, copy_bandwidth  # noqa: E402
from specserve.engine.batch import Batch  # noqa: E402
from specserve.engine.runner import LocalRunner  # noqa: E402
from specserve.kernels import linear_triton  # noqa: E402
from specserve.kernels.activation import silu_mul  # noqa: E402
from specserve.kernels.linear import quantize_q8  # noqa: E402
from specserve.model.random_init import SHAPES, random_weights  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
CFG = SHAPES[MODEL]
DEV = torch.device("cuda")
RESULTS: dict[str, object] = {}


def graph_us(fn: Callable[[], object], calls: int, reps: int = 30) -> float:
    """Median GPU microseconds per fn() call, from replays of a graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return replay_us(g, reps) / calls


def replay_us(g: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def graph_at(runner: LocalRunner, rows: int, base: int = 600) -> torch.cuda.CUDAGraph:
    """The captured graph for `rows` rows, its inputs set to rows at positions base.. of sequence 0."""
    graph, static_in, _ = runner.graphs.graphs[rows]
    static_in[0] = torch.arange(rows, device=DEV) * 7 + 3
    static_in[1] = torch.arange(base, base + rows, device=DEV)
    static_in[2] = 0
    return graph


def make_runner(fmt: str, n_ctx: int = 1024) -> LocalRunner:
    weights = random_weights(CFG, torch.bfloat16, DEV)
    return LocalRunner.from_weights(CFG, weights, n_ctx=n_ctx, weight_format=fmt)


def step_ms(runner: LocalRunner, n_rows: int, base: int = 600, reps: int = 40) -> float:
    """Median wall ms of runner.forward for n_rows new rows at context `base` (host work included)."""
    times = []
    for _ in range(reps):
        runner.kv_truncate(0, base)
        batch = Batch()
        batch.add_sequence([(7 * i + 3) % CFG.vocab_size for i in range(n_rows)], base, 0, "all")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = runner.forward(batch)
        logits.argmax(-1).tolist()  # the sampler's sync
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def section_model() -> None:
    rows = []
    for fmt, triton_gemv in (("bf16", "0"), ("bf16", "1"), ("q8", "1")):
        os.environ["SPECSERVE_TRITON_GEMV"] = triton_gemv  # read at capture: graphs keep the choice
        runner = make_runner(fmt)
        t0 = time.perf_counter()
        runner.warmup(17)
        warm_s = time.perf_counter() - t0
        pp = bench_prefill(runner, 512, 3)
        tg = bench_decode(runner, 128)
        runner.kv_truncate(0, 0)
        b = Batch()
        b.add_sequence(list(range(600)), 0, 0, "last")
        runner.forward(b)
        gpu = {r: replay_us(graph_at(runner, r)) for r in (1, 2, 4, 8, 16)}
        wall1, wall8 = step_ms(runner, 1), step_ms(runner, 8)
        r = {"format": fmt, "triton_gemv_bf16": triton_gemv, "weight_GB": runner.weights.n_bytes() / 1e9,
             "warmup_s": round(warm_s, 1),
             "pp512": round(pp), "tg128": round(tg, 1), "gpu_us": {k: round(v, 1) for k, v in gpu.items()},
             "verify8_over_decode_gpu": round(gpu[8] / gpu[1], 3), "wall_ms_1": round(wall1, 3),
             "wall_ms_8": round(wall8, 3), "verify8_over_decode_wall": round(wall8 / wall1, 3)}
        rows.append(r)
        print(json.dumps(r), flush=True)
        del runner
        torch.cuda.empty_cache()
    RESULTS["model"] = rows


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
    for fmt in ("bf16", "q8"):
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
    errs = [rel(a, b) for a, b in zip(kept["q8"][0], kept["bf16"][0], strict=True)]
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(kept["q8"][0], kept["bf16"][0], strict=True))
    res["q8_vs_bf16"] = {"max_rel_err": round(max(errs), 5), "argmax_agree": f"{agree}/{len(errs)}",
                         "greedy_tokens_same": kept["q8"][1] == kept["bf16"][1]}
    print(json.dumps(res), flush=True)
    RESULTS["logits"] = res


def section_profile(out_dir: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    summary = {}
    for fmt in ("bf16", "q8"):
        runner = make_runner(fmt)
        runner.warmup(8)
        runner.kv_truncate(0, 0)
        b = Batch()
        b.add_sequence(list(range(600)), 0, 0, "last")
        runner.forward(b)
        for rows in (1, 8):
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
            for k in kern[:8]:
                print(f"   {k[1]:8.1f} us  x{k[2]:<4d} {k[0][:80]}", flush=True)
        del runner
        torch.cuda.empty_cache()
    RESULTS["profile"] = summary


def bench_matrix(name: str, ws: list[torch.Tensor], silu: bool, m: int) -> dict[str, object]:
    """One projection: cuBLAS bf16 (with torch-side SwiGLU where fused elsewhere), Triton bf16, Triton q8."""
    n, k = ws[0].shape
    qs = [quantize_q8(w) for w in ws]
    x = torch.randn(m, 2 * k if silu else k, device=DEV).to(torch.bfloat16)
    it = [0]

    def nxt() -> int:
        it[0] = (it[0] + 1) % len(ws)
        return it[0]

    def cublas() -> torch.Tensor:
        return F.linear(silu_mul(x) if silu else x, ws[nxt()])

    def tri_bf16() -> torch.Tensor:
        return linear_triton.gemv(x, ws[nxt()], None, None, silu, torch.bfloat16)

    def tri_q8() -> torch.Tensor:
        q = qs[nxt()]
        return linear_triton.gemv(x, q.q, q.scale, None, silu, torch.bfloat16)

    r: dict[str, object] = {"matrix": name, "N": n, "K": k, "rows": m}
    for label, fn, nbytes in (("cublas_bf16", cublas, n * k * 2), ("triton_bf16", tri_bf16, n * k * 2),
                              ("triton_q8", tri_q8, qs[0].n_bytes())):
        try:
            fn()  # tunes outside the graph
            us = graph_us(fn, len(ws) * 2)
            r[label + "_us"] = round(us, 2)
            r[label + "_TBps"] = round(nbytes / us / 1e6, 2)
        except Exception as exc:  # one variant failing must not hide the others
            r[label + "_us"] = f"error: {exc!r}"[:200]
    return r


def section_matrices() -> None:
    shapes = {"wqkv": (1792, 1536, False), "wo": (1536, 1536, False), "gate_up": (17920, 1536, False),
              "down": (1536, 8960, True), "output": (151936, 1536, False)}
    rows_out = []
    for name, (n, k, silu) in shapes.items():
        copies = max(1, -(-300_000_000 // (n * k * 2)))  # > L2 (60 MB), several times
        ws = [(torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        for m in (1, 8):
            r = bench_matrix(name, ws, silu, m)
            rows_out.append(r)
            print(json.dumps(r), flush=True)
        del ws
        torch.cuda.empty_cache()
    best = {f"{bm}:{key}": str(t.cache.get(key)) for bm, t in linear_triton._TUNED.items() for key in t.cache}
    RESULTS["matrices"] = rows_out
    RESULTS["tuned_configs"] = best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--sections", default="model,logits,profile,matrices")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    RESULTS["gpu"] = torch.cuda.get_device_name(DEV)
    RESULTS["copy_bandwidth_TBps"] = round(copy_bandwidth(DEV) / 1e12, 3)
    print("copy bandwidth TB/s", RESULTS["copy_bandwidth_TBps"], flush=True)
    for sec in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if sec == "profile":
                section_profile(out_dir)
            else:
                {"model": section_model, "logits": section_logits, "matrices": section_matrices}[sec]()
        except Exception:
            traceback.print_exc()
            RESULTS[f"{sec}_error"] = traceback.format_exc()[-2000:]
        print(f"[{sec}: {time.perf_counter() - t0:.0f} s]", flush=True)
        (out_dir / "kernel_bench.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
