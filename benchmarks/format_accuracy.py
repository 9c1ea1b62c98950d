"""How far a weight format moves the model: teacher-forced top-1 agreement and logit error against a reference
format (float weights by default), and how many greedy continuations stay identical, on the workload prompts.

    python benchmarks/format_accuracy.py -m qwen2.5-coder-1.5b --formats gguf,q8 [--device cpu] [-n 32]
    python benchmarks/format_accuracy.py -m smollm2-135m --device cpu --formats gguf,gguf-exact --step-rows 16

The reference model greedily continues each prompt for n tokens; each other format then scores the same prompt
+ continuation (in one forward, or in forwards of --step-rows rows, as decode and verify steps run), every
position's argmax and logits are compared, and the format's own greedy continuation (decode steps, one row each)
is compared token by token with the reference's.
"gguf-exact" is gguf with SPECSERVE_CPU_EXACT=1 (the CPU's exact fp32 kernel instead of the int8 one).
Prints a table; writes JSON (-o, default format_accuracy_<model>.json in the cache's benchmarks folder:
bench_output.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from bench_output import output_path, write_json

from specserve import catalog
from specserve.cli.workloads import load_workloads, workload_prompts
from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings
from specserve.model.batch import Batch

EXACT_SUFFIX = "-exact"


def scored_logits(runner: LocalRunner, tokens: list[int], step_rows: int) -> torch.Tensor:
    runner.kv_truncate(0, 0)
    step_rows = step_rows or len(tokens)
    parts = []
    for start in range(0, len(tokens), step_rows):
        batch = Batch()
        batch.add_sequence(tokens[start : start + step_rows], start, 0, "all")
        parts.append(runner.forward(batch).float().cpu())
    return torch.cat(parts)


@contextmanager
def weight_format(name: str) -> Iterator[str]:
    """The runner's weight format for `name`, with SPECSERVE_CPU_EXACT set while it runs for "<fmt>-exact"."""
    exact = name.endswith(EXACT_SUFFIX)
    old = os.environ.get("SPECSERVE_CPU_EXACT")
    os.environ["SPECSERVE_CPU_EXACT"] = "1" if exact else "0"
    kernel_settings.reload()
    try:
        yield name.removesuffix(EXACT_SUFFIX)
    finally:
        os.environ.pop("SPECSERVE_CPU_EXACT") if old is None else os.environ.update(SPECSERVE_CPU_EXACT=old)
        kernel_settings.reload()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--formats", default="gguf,q8", help="formats to compare; <fmt>-exact: SPECSERVE_CPU_EXACT=1")
    ap.add_argument("--reference", default="float", help="the format the others are compared with")
    ap.add_argument("--device", default=None)
    ap.add_argument("-n", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per workload category")
    ap.add_argument("--step-rows", type=int, default=0, help="rows per scoring forward (0: the whole sequence)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    path = catalog.resolve(args.model)

    def runner_for(fmt: str) -> LocalRunner:
        return LocalRunner(path, n_ctx=2048, device=args.device, progress=False, weight_format=fmt, cuda_graphs=False)

    with weight_format(args.reference) as fmt:
        ref = runner_for(fmt)
        tok = Tokenizer.from_gguf(ref.gguf)
        prompts = [p for category in load_workloads() for p in workload_prompts(tok, category)[: args.prompts]]
        ref_out = [generate(ref, tok, prompt, args.n).tokens for prompt in prompts]  # greedy
        sequences = [prompt + out for prompt, out in zip(prompts, ref_out, strict=True)]
        ref_logits = [scored_logits(ref, s, args.step_rows) for s in sequences]
    del ref
    result: dict[str, object] = {"model": args.model, "reference": args.reference, "n": args.n,
                                 "prompts": len(sequences), "step_rows": args.step_rows}
    print(f"vs {args.reference}: {'format':<12} {'top-1 agree':>12} {'rel err':>9} {'continuation agree':>19} "
          f"{'greedy same':>12} {'greedy prefix':>14}")
    for name in args.formats.split(","):
        with weight_format(name) as fmt:
            runner = runner_for(fmt)
            agree = total = cont_agree = cont_total = same_text = prefix = 0
            errs = []
            for prompt, seq, base, base_out in zip(prompts, sequences, ref_logits, ref_out, strict=True):
                got = scored_logits(runner, seq, args.step_rows)
                same = got.argmax(-1) == base.argmax(-1)
                start = len(prompt)
                agree, total = agree + int(same.sum()), total + len(seq)
                cont_agree, cont_total = cont_agree + int(same[start - 1 : -1].sum()), cont_total + len(seq) - start
                errs.append(((got - base).norm() / base.norm()).item())
                out = generate(runner, tok, prompt, args.n).tokens
                same_text += out == base_out
                prefix += common_prefix(out, base_out)
            bytes_ = runner.weights.n_bytes()
            del runner
        result[name] = {"top1_agree": f"{agree}/{total}", "continuation_top1_agree": f"{cont_agree}/{cont_total}",
                        "max_rel_err": round(max(errs), 5), "greedy_identical": f"{same_text}/{len(prompts)}",
                        "greedy_common_prefix": f"{prefix}/{sum(len(o) for o in ref_out)}", "bytes": bytes_}
        print(f"{'':>{4 + len(args.reference)}}{name:<12} {agree:>6}/{total:<5} {max(errs):9.5f} "
              f"{cont_agree:>10}/{cont_total:<8} {same_text:>6}/{len(prompts):<5} "
              f"{prefix:>7}/{sum(len(o) for o in ref_out)}")
    write_json(output_path(args.output, f"format_accuracy_{args.model}.json"), result)


if __name__ == "__main__":
    main()
