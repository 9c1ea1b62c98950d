"""Speculative decoding per type and workload category, measured side by side in one run.

    python benchmarks/spec_bench.py -m qwen2.5-coder-1.5b -md qwen2.5-coder-0.5b -n 256

For each category of the workload file and each type (none, the n-gram types, draft):
greedy generation of every prompt of the category; reports tokens generated per target
forward pass, draft acceptance rate, decode tokens/s, speedup over `none`, and whether
the text is identical to `none`. Prints a table and writes JSON (-o, default
spec_<model>_<device>[_<format>].json in the cache's benchmarks folder: bench_output.py).
"""

from __future__ import annotations

import argparse

from bench_output import output_path, write_json

from specserve.cli.measure import greedy_decode_rate
from specserve.cli.session import GenerationSession
from specserve.cli.workloads import load_workloads, workload_prompts
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain

TYPES = ["none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache", "ngram-suffix", "draft"]


def run_type(session: GenerationSession, prompts: list[list[int]], spec_type: str, base: SpecParams,
             n_predict: int) -> dict[str, object]:
    spec = None if spec_type == "none" else base.with_overrides(type="none" if spec_type == "draft" else spec_type)
    draft = session.draft_runner if spec_type == "draft" else None
    rate, totals, outputs = greedy_decode_rate(session.runner, session.tokenizer, prompts, n_predict, spec=spec,
                                               chain_factory=lambda spec, slot: build_chain(spec, draft, seq=slot))
    return {
        "type": spec_type,
        "generated": totals.generated,
        "target_forwards": totals.steps,
        "tokens_per_forward": round(totals.tokens_per_step, 3),
        "draft_tokens": totals.draft_tokens,
        "draft_accepted": totals.draft_accepted,
        "acceptance_rate": round(totals.draft_accepted / totals.draft_tokens, 4) if totals.draft_tokens else None,
        "tokens_per_s": round(rate, 1),
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("-n", "--n-predict", type=int, default=256)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--device", default=None)
    ap.add_argument("--weight-format", default="auto", help="as `specserve serve --weight-format`")
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--spec-ngram-size-n", type=int, default=SpecParams.ngram_size_n)
    ap.add_argument("--spec-ngram-size-m", type=int, default=SpecParams.ngram_size_m)
    ap.add_argument("--prompts", default=None, help="workload JSON (default: ../shared/workloads/prompts.json)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t != "draft" or args.model_draft]
    session = GenerationSession.load(args.model, draft_model=args.model_draft, device=args.device, n_ctx=4096,
                                     progress=False, weight_format=args.weight_format)
    for runner in (session.runner, session.draft_runner):
        if runner is not None:
            runner.warmup(args.draft_max + 1)
    base = SpecParams(n_max=args.draft_max, ngram_size_n=args.spec_ngram_size_n,
                      ngram_size_m=args.spec_ngram_size_m)
    results = []
    for category in load_workloads(args.prompts):
        prompts = workload_prompts(session.tokenizer, category, args.prompts)
        rows = {t: run_type(session, prompts, t, base, args.n_predict) for t in types}
        none = rows["none"]
        for row in rows.values():
            row["category"] = category
            row["speedup"] = round(row["tokens_per_s"] / none["tokens_per_s"], 3)
            row["identical_to_none"] = row["outputs"] == none["outputs"]
            results.append(row)
    header = f"{'category':<10} {'type':<14} {'tok/fwd':>8} {'accept':>7} {'tok/s':>8} {'speedup':>8} identical"
    print(header)
    print("-" * len(header))
    for r in results:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        print(f"{r['category']:<10} {r['type']:<14} {r['tokens_per_forward']:>8} {acc:>7} {r['tokens_per_s']:>8}"
              f" {r['speedup']:>7}x {r['identical_to_none']}")
    device = str(session.runner.device)
    fmt = "" if session.runner.weight_format == "float" else f"_{session.runner.weight_format}"
    out = output_path(args.output, f"spec_{args.model}_{session.runner.device.type}{fmt}.json")
    for r in results:
        r.pop("outputs")
    meta = {"model": args.model, "draft": args.model_draft, "n_predict": args.n_predict, "device": device,
            "weight_format": session.runner.weight_format,
            "draft_max": args.draft_max, "ngram_size_n": args.spec_ngram_size_n,
            "ngram_size_m": args.spec_ngram_size_m}
    write_json(out, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
