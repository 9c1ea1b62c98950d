"""What a token tree's verify step costs on CUDA against a chain's: wall ms of a step (host work and the sampler's
sync included) for chains of 1..17 rows and for trees of the same rows, replayed from their CUDA graphs and run
eagerly, on qwen2.5-coder-1.5b's shape with random weights (speed does not depend on weight values).

    python benchmarks/tree_step_bench.py --format gguf_like -o tree_step.json
"""

from __future__ import annotations

import argparse

import torch
from bench_output import output_path, print_table, write_json
from random_model import CFG, make_runner, step_ms

from specserve.model.batch import Batch
from specserve.model.token_tree import TokenTree

BASE = 600  # context before the step


def tree_of(rows: int) -> TokenTree:
    """A tree of `rows` nodes: a root and two branches of equal length (rows - 1 split between them)."""
    left = [(11 * i + 5) % CFG.vocab_size for i in range((rows - 1 + 1) // 2)]
    right = [(13 * i + 9) % CFG.vocab_size for i in range((rows - 1) // 2)]
    return TokenTree.merge(3, [left, right] if right else [left])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="gguf_like", help="float, q8 or gguf_like")
    ap.add_argument("--rows", default="1,5,9,16,17", help="rows of a step (trees: a root and two branches)")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    runner = make_runner(args.format, n_ctx=BASE + 64)
    runner.warmup(17, prompt_rows=0, trees=17)
    prompt = Batch()
    prompt.add_sequence([(5 * i + 1) % CFG.vocab_size for i in range(BASE)], 0, 0, "last")
    runner.forward(prompt)
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        row = {"rows": rows, "chain_ms": round(step_ms(runner, rows, BASE), 3)}
        if rows > 2:
            row["tree_graph_ms"] = round(step_ms(runner, rows, BASE, tree=tree_of(rows)), 3)
            graphs, runner.graphs = runner.graphs, None  # the eager path, as tree steps ran before 6f70951
            row["tree_eager_ms"] = round(step_ms(runner, rows, BASE, reps=10, tree=tree_of(rows)), 3)
            runner.graphs = graphs
        table.append(row)
    print_table(table, ["rows", "chain_ms", "tree_graph_ms", "tree_eager_ms"])
    write_json(output_path(args.output, "tree_step.json"),
               {"format": args.format, "device": torch.cuda.get_device_name(), "context": BASE, "steps": table})


if __name__ == "__main__":
    main()
