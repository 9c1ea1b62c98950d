"""How far a weight format moves the model: teacher-forced top-1 agreement and logit error
against the float weights, on the workload prompts.

    python benchmarks/format_accuracy.py -m qwen2.5-coder-1.5b --formats gguf,q8 [--device cpu] [-n 32]

The float model greedily continues each prompt for n tokens; each other format then scores the
same prompt + continuation in one forward, and every position's argmax and logits are compared.
Prints a table; writes JSON (-o, default format_accuracy_<model>.json in the cache's benchmarks folder:
bench_output.py).
"""

from __future__ import annotations

import argparse

import torch
from bench_output import output_path, write_json

from specserve import catalog
from specserve.cli.workloads import load_workloads, workload_prompts
from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch


def scored_logits(runner: LocalRunner, tokens: list[int]) -> torch.Tensor:
    runner.kv_truncate(0, 0)
    batch = Batch()
    batch.add_sequence(tokens, 0, 0, "all")
    return runner.forward(batch).float().cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--formats", default="gguf,q8")
    ap.add_argument("--device", default=None)
    ap.add_argument("-n", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per workload category")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    path = catalog.resolve(args.model)
    ref = LocalRunner(path, n_ctx=2048, device=args.device, progress=False, weight_format="float", cuda_graphs=False)
    tok = Tokenizer.from_gguf(ref.gguf)
    sequences, n_prompt = [], []
    for prompt in (p for category in load_workloads() for p in workload_prompts(tok, category)[: args.prompts]):
        out = generate(ref, tok, prompt, args.n).tokens  # greedy
        sequences.append(prompt + out)
        n_prompt.append(len(prompt))
    ref_logits = [scored_logits(ref, s) for s in sequences]
    del ref
    result: dict[str, object] = {"model": args.model, "n": args.n, "prompts": len(sequences)}
    print(f"{'format':<8} {'top-1 agree':>12} {'rel err':>9} {'continuation agree':>19}")
    for fmt in args.formats.split(","):
        runner = LocalRunner(path, n_ctx=2048, device=args.device, progress=False, weight_format=fmt,
                             cuda_graphs=False)
        agree = total = cont_agree = cont_total = 0
        errs = []
        for seq, start, base in zip(sequences, n_prompt, ref_logits, strict=True):
            got = scored_logits(runner, seq)
            same = got.argmax(-1) == base.argmax(-1)
            agree, total = agree + int(same.sum()), total + len(seq)
            cont_agree, cont_total = cont_agree + int(same[start - 1 : -1].sum()), cont_total + len(seq) - start
            errs.append(((got - base).norm() / base.norm()).item())
        result[fmt] = {"top1_agree": f"{agree}/{total}", "continuation_top1_agree": f"{cont_agree}/{cont_total}",
                       "max_rel_err": round(max(errs), 5), "bytes": runner.weights.n_bytes()}
        print(f"{fmt:<8} {agree:>6}/{total:<5} {max(errs):9.5f} {cont_agree:>10}/{cont_total}")
        del runner
    write_json(output_path(args.output, f"format_accuracy_{args.model}.json"), result)


if __name__ == "__main__":
    main()
