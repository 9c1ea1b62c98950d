"""`specserve bench`, like llama-bench: pp, tg, and tg under each speculative type.

Also times HF transformers on the same GGUF (same device, its default dtype for the
device) and prints our ratio to it. Every generation runs through the scheduler, as the
server's requests do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve import catalog
from specserve.cli.args import add_model_args, kv_types_from_args, tensor_parallel_from_args
from specserve.cli.measure import (
    TIMED_STEP_ROWS,
    bench_decode,
    bench_prefill,
    bench_step,
    bytes_per_token,
    copy_bandwidth,
    greedy_decode_rate,
    hf_decode_rate,
)
from specserve.cli.session import GenerationSession
from specserve.cli.workloads import workload_prompts
from specserve.engine.local_runner import LocalRunner
from specserve.engine.runner import Runner
from specserve.engine.scheduler import ChainFactory
from specserve.errors import SpecserveError
from specserve.speculative.base import SPEC_TYPES, SpecParams
from specserve.speculative.factory import build_chain

KEYED_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")  # the types --spec-ngram-size-n applies to


def results_dir() -> Path:
    """Where benchmark JSON goes by default: outside the checkout (the cache's benchmarks folder)."""
    return catalog.cache_dir() / "benchmarks"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="llama-bench style speed table (pp, tg, tg per speculative type)")
    add_model_args(p)
    p.add_argument("-md", "--model-draft", default=None, help="draft model for the `draft` row")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--spec-types", default=",".join(t for t in SPEC_TYPES if t != "none"),
                   help="types to time on the code-edit prompts")
    p.add_argument("--ngram-sizes", default=str(SpecParams.ngram_size_n),
                   help="comma-separated n-gram key lengths (--spec-ngram-size-n) to time each keyed n-gram type "
                        "with (default: llama.cpp's); shorter keys draft more often on edited code")
    p.add_argument("--draft-tree", type=int, default=0, metavar="N",
                   help="also time each type with token trees of up to N nodes (speculative.tree_nodes)")
    p.add_argument("--repeat", type=int, default=3,
                   help="passes over the code-edit prompts per row; the median pass is reported")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--prompts", default=None, help="workload JSON (default: ../shared/workloads/prompts.json)")
    p.add_argument("-o", "--output", default=None,
                   help="JSON file (default: bench_<model>_<device>.json in ~/.cache/specserve/benchmarks)")
    p.set_defaults(func=cmd_bench)


def _chains(draft: Runner | None) -> ChainFactory:
    """Each slot's speculator chain, the draft model (on `draft`) last."""
    return lambda spec, slot: build_chain(spec, draft, seq=slot)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.n_prompt < 1 or args.n_gen < 1 or args.repeat < 1:
        raise SpecserveError("-p, -n and --repeat must be at least 1")
    SpecParams(tree_nodes=args.draft_tree).validate()  # (before the model loads)
    types = [t for t in args.spec_types.split(",") if t]
    try:
        sizes = [int(n) for n in args.ngram_sizes.split(",") if n]
    except ValueError:
        raise SpecserveError(f"--ngram-sizes takes integers, got {args.ngram_sizes!r}") from None
    if not sizes:
        raise SpecserveError("--ngram-sizes needs at least one size")
    for size in sizes:  # before the model loads
        SpecParams(type="ngram-simple").with_overrides(ngram_size_n=size)
    unknown = set(types) - set(SPEC_TYPES)
    if unknown:
        raise SpecserveError(f"unknown speculative type(s): {', '.join(sorted(unknown))}")
    if "draft" in types and not args.model_draft:
        types.remove("draft")
    session = GenerationSession.load(args.model, draft_model=args.model_draft, device=args.device,
                                     n_ctx=max(args.ctx_size or 0, args.n_prompt + 64, 4096),
                                     weight_format=args.weight_format, kv_types=kv_types_from_args(args),
                                     tensor_parallel=tensor_parallel_from_args(args))
    runner = session.runner
    for r in (runner, session.draft_runner):
        if r is not None:
            r.warmup(17, trees=args.draft_tree if r is runner else 0)
    rows: list[tuple[str, float, str]] = []

    def record(name: str, rate: float, note: str = "") -> None:
        """A row of the table; also a progress line on stderr now (a bench runs for minutes)."""
        rows.append((name, rate, note))
        print(f"bench: {name}: {rate:.1f} t/s {note}".rstrip(), file=sys.stderr, flush=True)

    result: dict[str, object] = {"model": args.model or catalog.DEFAULT_MODEL, "device": str(runner.device),
                                 "dtype": str(runner.dtype).replace("torch.", ""),
                                 "weight_format": runner.weight_format}
    pp = bench_prefill(runner, args.n_prompt)
    record(f"pp{args.n_prompt}", pp)
    tg = bench_decode(runner, session.tokenizer, args.n_gen)
    record(f"tg{args.n_gen}", tg)
    print("bench: timing single steps by row count ...", file=sys.stderr, flush=True)
    steps = 50 if runner.device.type == "cuda" else 12  # a CPU step is 10-100x longer: 12 give a stable median
    step_ms = {n: bench_step(runner, n, steps=steps) * 1e3 for n in TIMED_STEP_ROWS}
    result.update({f"pp{args.n_prompt}": round(pp, 1), f"tg{args.n_gen}": round(tg, 1),
                   "decode_step_ms": round(step_ms[1], 3), "verify8_step_ms": round(step_ms[9], 3),
                   "verify8_over_decode": round(step_ms[9] / step_ms[1], 3),
                   "verify_8_rows_over_decode": round(step_ms[8] / step_ms[1], 3),
                   "step_ms_by_rows": {n: round(ms, 3) for n, ms in step_ms.items()}})
    if runner.device.type == "cuda":
        assert isinstance(runner, LocalRunner)  # (a remote runner's device is this side's: the CPU)
        bw = copy_bandwidth(runner.device)
        roofline = bw / bytes_per_token(runner)
        result.update(copy_bandwidth_gb_s=round(bw / 1e9, 1), roofline_tokens_per_s=round(roofline, 1),
                      tg_roofline_fraction=round(tg / roofline, 3))
    code_edit = workload_prompts(session.tokenizer, "code_edit", args.prompts)
    none_rate, _, none_out = greedy_decode_rate(runner, session.tokenizer, code_edit, args.n_gen, repeat=args.repeat)
    record(f"tg{args.n_gen} code-edit none", none_rate)
    spec_rows = {}
    runs: list[tuple[str, int | None, bool, int]] = [(t, None, True, 0) for t in types if t not in KEYED_TYPES]
    runs += [(t, n, True, 0) for t in types if t in KEYED_TYPES for n in sizes]
    if runs:  # the first again with one step at a time: what overlapping the plain steps gains
        runs.append((runs[0][0], runs[0][1], False, 0))
    if args.draft_tree:
        runs += [(t, n, True, args.draft_tree) for t, n, overlap, _ in runs if overlap]
    for t, n, overlap, tree in runs:
        spec = SpecParams(type="none" if t == "draft" else t, tree_nodes=tree)
        if n is not None:
            spec = spec.with_overrides(ngram_size_n=n)
        label = t if n is None or sizes == [SpecParams.ngram_size_n] else f"{t} n={n}"
        label += ("" if overlap else " (no overlap)") + (f" tree {tree}" if tree else "")
        draft = session.draft_runner if t == "draft" else None
        rate, stats, out = greedy_decode_rate(
            runner, session.tokenizer, code_edit, args.n_gen, spec=spec, overlap=overlap, repeat=args.repeat,
            chain_factory=_chains(draft))
        acc = stats.acceptance
        note = f"x{rate / none_rate:.2f}, accept {acc:.2f}, {stats.tokens_per_step:.2f} tok/step"
        if out != none_out:
            note += ", OUTPUT DIFFERS"
        record(f"tg{args.n_gen} code-edit {label}", rate, note)
        spec_rows[label] = {"tokens_per_s": round(rate, 1), "speedup": round(rate / none_rate, 3),
                        "acceptance": round(acc, 4), "tokens_per_step": round(stats.tokens_per_step, 3),
                        "identical": out == none_out}
    result.update({"code_edit_none": round(none_rate, 1), "code_edit_spec": spec_rows})
    if not args.no_hf and args.remote is None:  # (HF needs the file here)
        hf = hf_decode_rate(catalog.resolve(args.model), runner.device, code_edit[0][:64], args.n_gen)
        record(f"tg{args.n_gen} HF transformers", hf, f"specserve x{tg / hf:.1f}")
        result.update(hf_tg=round(hf, 1), ratio_to_hf=round(tg / hf, 2))
    print(f"{'test':<34} {'t/s':>10}  notes")
    print("-" * 70)
    for name, rate, note in rows:
        print(f"{name:<34} {rate:>10.1f}  {note}")
    for key in ("decode_step_ms", "verify8_step_ms", "verify8_over_decode", "verify_8_rows_over_decode",
                "copy_bandwidth_gb_s", "roofline_tokens_per_s", "tg_roofline_fraction"):
        if key in result:
            print(f"{key:<34} {result[key]:>10}")
    print("step ms by rows: " + ", ".join(f"{n}: {ms:.3f}" for n, ms in step_ms.items()))
    out_path = Path(args.output or results_dir() / f"bench_{result['model']}_{runner.device.type}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0
