"""Where a serving step's GPU time goes: decode steps of many sequences, one row each, on CUDA.

    python benchmarks/batch_profile.py [--rows 64,256] [--context 600] [--formats gguf_like,float] [-o FILE]

Random weights in qwen2.5-coder-1.5b's shapes (random_model.py) on a paged pool of `max(rows)` sequences, each
holding a `--context`-token prompt; then, per row count, the captured decode graph of that many sequences (the one
`specserve serve` replays at that many clients): its GPU time (median replay) and torch.profiler's per-kernel
table, summed into matrices (cuBLAS / tensor-core products), attention and the rest. Prints a table per step and
writes JSON (bench_output.py; default batch_profile.json in the cache's benchmarks folder).
"""

from __future__ import annotations

import argparse

import torch
from bench_output import output_path, print_table, write_json
from random_model import make_runner, replay_us

from specserve.engine.local_runner import LocalRunner
from specserve.model.batch import Batch

# Kernel names by part of the step (first match wins).
PARTS = [("attention", ("attn", "attention", "split", "merge")),
         ("matrices", ("gemm", "gemv", "cutlass", "sm90", "sm80", "mma", "cublas", "matmul", "xmma", "nvjet")),
         ("argmax/logits", ("argmax", "reduce"))]


def part_of(kernel: str) -> str:
    name = kernel.lower()
    return next((part for part, keys in PARTS if any(k in name for k in keys)), "other")


def fill(runner: LocalRunner, n_seqs: int, context: int) -> None:
    """Every sequence holds a `context`-token prompt."""
    for seq in range(n_seqs):
        b = Batch()
        b.add_sequence([(7 * seq + i) % 1000 + 10 for i in range(context)], 0, seq, "last")
        runner.forward(b)
    torch.cuda.synchronize()


def decode_graph(runner: LocalRunner, rows: int, context: int) -> torch.cuda.CUDAGraph:
    """The graph a decode step of sequences 0..rows-1 replays, its inputs set by two real launches (one per parity)."""
    assert runner.graphs is not None
    for _ in range(2):
        for seq in range(rows):
            runner.kv_truncate(seq, context)
        b = Batch()
        for seq in range(rows):
            b.add_sequence([11 + seq], context, seq, "last")
        runner.launch(b).logits()
    torch.cuda.synchronize()
    key = runner.graphs.graph_key(rows, rows)
    assert key is not None, f"no graph takes {rows} rows"
    return runner.graphs.graphs[(*key, 0)].graph


def profile_graph(g: torch.cuda.CUDAGraph, reps: int = 5) -> list[tuple[str, float, int]]:
    """(kernel, GPU us per replay, launches per replay), most time first."""
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    kern = [(e.key, e.device_time_total / reps, e.count // reps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(kern, key=lambda k: -k[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--context", type=int, default=600, help="prompt tokens each sequence holds")
    ap.add_argument("--formats", default="gguf_like,float")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    out = output_path(args.output, "batch_profile.json")
    results: dict[str, object] = {"context": args.context, "device": torch.cuda.get_device_name(), "steps": []}
    table = []
    for fmt in args.formats.split(","):
        runner = make_runner(fmt, n_ctx=args.context + 64, n_seqs=max(rows_list))
        fill(runner, max(rows_list), args.context)
        for rows in rows_list:
            g = decode_graph(runner, rows, args.context)
            step_us = replay_us(g)
            kern = profile_graph(g)
            parts: dict[str, float] = {}
            for name, us, _ in kern:
                parts[part_of(name)] = parts.get(part_of(name), 0.0) + us
            row = {"format": fmt, "rows": rows, "step_us": round(step_us, 1), "us_per_row": round(step_us / rows, 2),
                   **{p: round(us, 1) for p, us in sorted(parts.items())},
                   "launches": sum(k[2] for k in kern),
                   "top": [(k[0][:90], round(k[1], 1), k[2]) for k in kern[:15]]}
            results["steps"].append(row)  # type: ignore[attr-defined]
            table.append({k: v for k, v in row.items() if k != "top"})
            print(f"{fmt} {rows} rows at context {args.context}: {step_us:.0f} us a step", flush=True)
            for name, us, count in kern[:15]:
                print(f"   {us:8.1f} us  x{count:<4d} [{part_of(name)}] {name[:90]}", flush=True)
            write_json(out, results)
        del runner, g
        torch.cuda.empty_cache()
    print_table(table, ["format", "rows", "step_us", "us_per_row", "matrices", "attention", "argmax/logits", "other",
                        "launches"])


if __name__ == "__main__":
    main()
