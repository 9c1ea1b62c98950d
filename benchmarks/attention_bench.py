"""The Triton attention over the paged KV pool on CUDA: what the block tables cost.

    python benchmarks/attention_bench.py [--contexts 512,2048,8192,32768] [--rows 1,16,64] [-o FILE]

For each context and count of decode rows (one row per sequence, qwen2.5-coder-1.5b's heads: 12 query / 2 KV
heads of 128), the kernel's GPU time (CUDA graph replays, median) with every sequence's blocks in order in the
pool (as the fixed per-slot layout read them), with the same blocks shuffled over the pool (as a long-running
server's pool holds them), and shuffled in a table as wide as a pool of --wide positions (what `-c` sets: the
time must not follow it), and the bandwidth the shuffled time gives for the K/V bytes the rows read. Prints a
table, writes JSON (bench_output.py; default attention_bench.json in the cache's benchmarks folder).
"""

from __future__ import annotations

import argparse

import torch
from bench_output import output_path, print_table, write_json
from random_model import graph_us

from specserve.cli.measure import copy_bandwidth
from specserve.kernels import attention_triton
from specserve.model.kv_blocks import BLOCK_SIZE

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def measure(ctx: int, rows: int, shuffled: bool, width: int = 0) -> float:
    """width: positions the table spans (0: the context's own)."""
    blocks = -(-ctx // BLOCK_SIZE)
    order = torch.randperm(rows * blocks) if shuffled else torch.arange(rows * blocks)
    table = order.view(rows, blocks).int()
    if width > ctx:
        table = torch.cat([table, torch.zeros(rows, -(-width // BLOCK_SIZE) - blocks, dtype=torch.int32)], dim=1)
    table = table.cuda()
    k = torch.randn(rows * blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    positions = torch.full((rows,), ctx - 1, device="cuda")
    seq_ids = torch.arange(rows, device="cuda")
    return graph_us(lambda: attention_triton.attention(q, k, v, positions, seq_ids, table, HEAD_DIM ** -0.5),
                    calls=1, reps=50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--grid-programs", default=str(attention_triton.GRID_PROGRAMS),
                    help="the least split programs of a launch (attention_triton.GRID_PROGRAMS), a list to compare")
    ap.add_argument("--wide", type=int, default=1 << 20, help="positions of the wide table (a pool's -c)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results = []
    grids = [int(g) for g in args.grid_programs.split(",")]
    for ctx, rows, grid in ((int(c), int(r), g) for c in args.contexts.split(",") for r in args.rows.split(",")
                            for g in grids):
        attention_triton.GRID_PROGRAMS = grid
        ordered, shuffled = measure(ctx, rows, False), measure(ctx, rows, True)
        wide = measure(ctx, rows, True, args.wide)
        kv_bytes = rows * ctx * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
        results.append({"context": ctx, "rows": rows, "grid_programs": grid, "in_order_us": round(ordered, 2),
                        "shuffled_us": round(shuffled, 2), "shuffled_over_in_order": round(shuffled / ordered, 3),
                        "wide_us": round(wide, 2), "wide_over_shuffled": round(wide / shuffled, 3),
                        "shuffled_bandwidth_fraction": round(kv_bytes / (shuffled * 1e-6) / bandwidth, 3)})
    print_table(results, list(results[0]))
    write_json(output_path(args.output, "attention_bench.json"),
               {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
                "heads": [HEADS, KV_HEADS, HEAD_DIM], "block_size": BLOCK_SIZE, "wide_positions": args.wide,
                "results": results})


if __name__ == "__main__":
    main()
