"""Where a serving step's GPU time goes: decode steps of many sequences, one row each, on CUDA.

    python benchmarks/batch_profile.py [--rows 64,256] [--context 600] [--chunks 0,448] [--formats gguf_like,float]
        [-o FILE]

Random weights in qwen2.5-coder-1.5b's shapes (random_model.py) on a paged pool of `max(rows)` sequences, each
holding a `--context`-token prompt; then, per row count, the captured decode graph of that many sequences (the one
`specserve serve` replays at that many clients): its GPU time (median replay) and torch.profiler's per-kernel
table, summed into matrices (cuBLAS / tensor-core products), attention and the rest; with --chunks, also steps
that carry a prompt chunk of that many rows beside the decode rows (as a serving step at many clients often does).
Prints a table per step and writes JSON (bench_output.py; default batch_profile.json in the cache's benchmarks folder).
"""

from __future__ import annotations

import argparse

import torch
from bench_output import output_path, print_table, write_json
from random_model import make_runner, replay_us

from specserve.engine.local_runner import LocalRunner
from specserve.kernels import attention_triton
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


def step_graph(runner: LocalRunner, rows: int, context: int, chunk: int) -> torch.cuda.CUDAGraph:
    """The graph a step of a decode row for each of sequences 0..rows-1 (and a `chunk`-row prompt chunk of the
    runner's last sequence, which no decode row uses) replays, its inputs set by two real launches (one per
    parity)."""
    assert runner.graphs is not None
    spare = runner.n_seqs - 1
    for _ in range(2):
        for seq in range(rows):
            runner.kv_truncate(seq, context)
        runner.kv_truncate(spare, 0)
        b = Batch()
        for seq in range(rows):
            b.add_sequence([11 + seq], context, seq, "last")
        if chunk:
            b.add_sequence([(5 * i) % 1000 + 10 for i in range(chunk)], 0, spare, "last")
        runner.launch(b).logits()
    torch.cuda.synchronize()
    key = runner.graphs.graph_key(rows + chunk, rows + (chunk > 0))
    assert key is not None, f"no graph takes {rows} rows"
    return runner.graphs.graphs[(*key, 0, False)].graph


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
    ap.add_argument("--chunks", default="0", help="prompt rows beside the decode rows (0: a decode step only)")
    ap.add_argument("--formats", default="gguf_like,float")
    ap.add_argument("--grid-programs", default=str(attention_triton.GRID_PROGRAMS),
                    help="the attention's least split programs a launch (attention_triton.GRID_PROGRAMS), a list")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    out = output_path(args.output, "batch_profile.json")
    results: dict[str, object] = {"context": args.context, "device": torch.cuda.get_device_name(), "steps": []}
    table = []
    for fmt, grid in ((f, int(g)) for f in args.formats.split(",") for g in args.grid_programs.split(",")):
        attention_triton.GRID_PROGRAMS = grid
        runner = make_runner(fmt, n_ctx=max(args.context + 64, *chunks), n_seqs=max(rows_list) + 1)
        fill(runner, max(rows_list), args.context)
        for rows, chunk in ((r, c) for r in rows_list for c in chunks):
            g = step_graph(runner, rows, args.context, chunk)
            step_us = replay_us(g)
            kern = profile_graph(g)
            parts: dict[str, float] = {}
            for name, us, _ in kern:
                parts[part_of(name)] = parts.get(part_of(name), 0.0) + us
            row = {"format": fmt, "grid_programs": grid, "rows": rows, "chunk": chunk, "step_us": round(step_us, 1),
                   "us_per_row": round(step_us / (rows + chunk), 2),
                   **{p: round(us, 1) for p, us in sorted(parts.items())},
                   "launches": sum(k[2] for k in kern),
                   "top": [(k[0][:90], round(k[1], 1), k[2]) for k in kern[:15]]}
            results["steps"].append(row)  # type: ignore[attr-defined]
            table.append({k: v for k, v in row.items() if k != "top"})
            print(f"{fmt} (grid {grid}) {rows} rows at context {args.context}, chunk {chunk}: {step_us:.0f} us a step",
                  flush=True)
            for name, us, count in kern[:15]:
                print(f"   {us:8.1f} us  x{count:<4d} [{part_of(name)}] {name[:90]}", flush=True)
            write_json(out, results)
        del runner, g
        torch.cuda.empty_cache()
    print_table(table, ["format", "grid_programs", "rows", "chunk", "step_us", "us_per_row", "matrices", "attention",
                        "argmax/logits", "other", "launches"])


if __name__ == "__main__":
    main()
