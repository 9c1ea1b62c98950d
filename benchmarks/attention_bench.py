"""The Triton attention over the paged KV pool on CUDA: what the block tables cost.

    python benchmarks/attention_bench.py [--contexts 512,2048,8192,32768] [--rows 1,16,64] [-o FILE]

For each context and count of decode rows (one row per sequence, qwen2.5-coder-1.5b's heads: 12 query / 2 KV
heads of 128), the kernel's GPU time (CUDA graph replays, median) with every sequence's blocks in order in the
pool (as the fixed per-slot layout read them), with the same blocks shuffled over the pool (as a long-running
server's pool holds them), and shuffled in a table as wide as a pool of --wide positions (what `-c` sets: the
time must not follow it), and the bandwidth the shuffled time gives for the K/V bytes the rows read; then prompt
chunks beside decode rows through the row kernels and the tiled one (--chunks). Prints tables, writes JSON
(bench_output.py; default attention_bench.json in the cache's benchmarks folder).
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


def random_pool(seqs: int, blocks: int, shuffled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table [seqs, blocks], K, V pools of seqs * blocks blocks) in bf16 on CUDA; shuffled: blocks anywhere."""
    order = torch.randperm(seqs * blocks) if shuffled else torch.arange(seqs * blocks)
    k = torch.randn(seqs * blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM, device="cuda").to(torch.bfloat16)
    return order.view(seqs, blocks).int().cuda(), k, torch.randn_like(k)


def measure(ctx: int, rows: int, shuffled: bool, width: int = 0) -> float:
    """width: positions the table spans (0: the context's own)."""
    blocks = -(-ctx // BLOCK_SIZE)
    table, k, v = random_pool(rows, blocks, shuffled)
    if width > ctx:
        table = torch.cat([table, torch.zeros(rows, -(-width // BLOCK_SIZE) - blocks, dtype=torch.int32,
                                              device="cuda")], dim=1)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    positions = torch.full((rows,), ctx - 1, device="cuda")
    seq_ids = torch.arange(rows, device="cuda")
    return graph_us(lambda: attention_triton.attention(q, k, v, positions, seq_ids, table, HEAD_DIM ** -0.5),
                    calls=1, reps=50)


def measure_chunk(chunk: int, start: int, decode_rows: int, ctx: int, tiled: bool) -> float:
    """A prompt chunk of `chunk` rows (positions start..) after `decode_rows` decode rows of other sequences at
    context ctx, shuffled blocks; tiled=False: every row through the row kernels."""
    blocks = -(-max(ctx, start + chunk) // BLOCK_SIZE)
    seqs = decode_rows + 1
    table, k, v = random_pool(seqs, blocks)
    q = torch.randn(decode_rows + chunk, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    positions = torch.tensor([ctx - 1] * decode_rows + list(range(start, start + chunk)), device="cuda")
    seq_ids = torch.tensor(list(range(1, seqs)) + [0] * chunk, device="cuda")
    return graph_us(lambda: attention_triton.attention(q, k, v, positions, seq_ids, table, HEAD_DIM ** -0.5,
                                                       tiled=tiled), calls=1, reps=50)


def chunk_rows(chunks: str, decode_rows: int, ctx: int) -> list[dict[str, object]]:
    """Each chunk as `rows@start`: the row kernels against the tiled kernel (one-sequence tiles of 16 rows)."""
    out = []
    for spec in chunks.split(","):
        rows, start = (int(x) for x in spec.split("@"))
        by_rows, tiled = (measure_chunk(rows, start, decode_rows, ctx, t) for t in (False, True))
        out.append({"chunk_rows": rows, "chunk_start": start, "decode_rows": decode_rows, "decode_context": ctx,
                    "row_kernels_us": round(by_rows, 2), "tiled_us": round(tiled, 2),
                    "speedup": round(by_rows / tiled, 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--grid-programs", default=str(attention_triton.GRID_PROGRAMS),
                    help="the least split programs of a launch (attention_triton.GRID_PROGRAMS), a list to compare")
    ap.add_argument("--wide", type=int, default=1 << 20, help="positions of the wide table (a pool's -c)")
    ap.add_argument("--chunks", default="448@0,448@2048,512@0",
                    help="prompt chunks `rows@start` beside --chunk-decode-rows decode rows ('': none)")
    ap.add_argument("--chunk-decode-rows", type=int, default=64)
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
    chunks = chunk_rows(args.chunks, args.chunk_decode_rows, 600) if args.chunks else []
    if chunks:
        print_table(chunks, list(chunks[0]))
    write_json(output_path(args.output, "attention_bench.json"),
               {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
                "heads": [HEADS, KV_HEADS, HEAD_DIM], "block_size": BLOCK_SIZE, "wide_positions": args.wide,
                "results": results, "chunks": chunks})


if __name__ == "__main__":
    main()
