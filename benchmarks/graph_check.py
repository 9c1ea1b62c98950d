"""Greedy text with CUDA graphs + Triton kernels vs the eager path vs pure torch ops.

    python benchmarks/graph_check.py -m smollm2-135m [-n 64]

For the first workload prompt of each category (chat-templated), generates greedily under
three set-ups on the GPU and reports whether the token sequences are identical; where they
diverge, the logit margin between the top two tokens of the reference at that step
(a near-tie explains a bf16 rounding divergence).
Also prints decode tokens/s of each set-up. Writes JSON (-o, default graph_check_<model>.json in the
cache's benchmarks folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from bench_output import output_path, write_json

from specserve import catalog
from specserve.cli.workloads import load_workloads, workload_prompts
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings
from specserve.model.batch import Batch

PROMPT_CHUNK = 512  # prompt rows a forward, as the server's default batch size


def first_prompts(runner: LocalRunner) -> list[list[int]]:
    """The first prompt of each workload category, chat-templated and tokenized for this model."""
    tok = Tokenizer.from_gguf(runner.gguf)
    return [workload_prompts(tok, category)[0] for category in load_workloads()]


def prompt_logits(runner: LocalRunner, prompt: list[int]) -> torch.Tensor:
    """Evaluate the prompt into sequence 0 in chunks; the logits of its last token."""
    for start in range(0, len(prompt), PROMPT_CHUNK):
        chunk = prompt[start:start + PROMPT_CHUNK]
        batch = Batch()
        batch.add_sequence(chunk, start, 0, "last" if start + len(chunk) == len(prompt) else "none")
        logits = runner.forward(batch)
    return logits[0]


def greedy_with_logits(runner: LocalRunner, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor], float]:
    runner.kv_truncate(0, 0)
    logits = prompt_logits(runner, prompt)
    out, all_logits = [], []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        all_logits.append(logits.float().cpu())
        token = int(logits.argmax().item())
        out.append(token)
        batch = Batch()
        batch.add(token, runner.seq_len[0], 0, logits=True)
        logits = runner.forward(batch)[0]
    torch.cuda.synchronize()
    return out, all_logits, n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("-n", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    base = LocalRunner(catalog.resolve(args.model), n_ctx=1024, device="cuda", progress=False)
    eager = LocalRunner.from_weights(base.config, base.weights, n_ctx=1024, cuda_graphs=False)
    # the torch references or the Triton kernels are chosen per run by SPECSERVE_NO_TRITON below
    setups = {"torch-eager": eager, "triton-eager": eager, "triton-graphs": base}
    report: dict[str, object] = {"model": args.model, "n": args.n, "prompts": []}
    for prompt in first_prompts(base):
        runs = {}
        for name, runner in setups.items():
            os.environ["SPECSERVE_NO_TRITON"] = "1" if name == "torch-eager" else "0"
            kernel_settings.reload()
            greedy_with_logits(runner, prompt, 4)  # warm-up (graph capture, compiles)
            runs[name] = greedy_with_logits(runner, prompt, args.n)
        ref_tokens, ref_logits, _ = runs["torch-eager"]
        entry: dict[str, object] = {"prompt_tokens": len(prompt)}
        for name, (tokens, _logits, tps) in runs.items():
            same = tokens == ref_tokens
            info: dict[str, object] = {"identical": same, "tokens_per_s": round(tps, 1)}
            if not same:
                step = next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b)
                top2 = ref_logits[step].topk(2).values
                info.update(first_divergence=step, ref_top2_margin=round((top2[0] - top2[1]).item(), 4))
            entry[name] = info
            print(f"{name:<14} identical={same!s:<5} {tps:8.1f} tok/s {info.get('first_divergence', '')}"
                  f" {info.get('ref_top2_margin', '')}")
        report["prompts"].append(entry)  # type: ignore[union-attr]
    write_json(output_path(args.output, f"graph_check_{args.model}.json"), report)


if __name__ == "__main__":
    main()
