"""`specserve bench`, like llama-bench: pp, tg, and tg under each speculative type.

Also times HF transformers on the same GGUF (same device, its default dtype for the
device) and prints our ratio to it. The measuring functions are shared with the scripts
in benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.engine.batch import Batch
from specserve.engine.generate import GenerationStats, generate, sync
from specserve.engine.runner import LocalRunner
from specserve.engine.sampling import Sampler, SamplingParams
from specserve.errors import SpecserveError
from specserve.speculative.base import SPEC_TYPES, Chain, SpecParams

KEYED_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")  # the types --spec-ngram-size-n applies to


def copy_bandwidth(device: torch.device, n_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n_bytes * reps / (time.perf_counter() - t0)


def bytes_per_token(runner: LocalRunner) -> int:
    """Weight bytes one decode step reads: everything but the embedding table (one row)."""
    w = runner.weights
    total = w.n_bytes()
    if w.output is not w.embed:  # an untied (or quantized) output matrix: the embedding is a lookup
        total -= w.embed.numel() * w.embed.element_size()
    return total


def bench_prefill(runner: LocalRunner, n: int, reps: int = 3) -> float:
    """Tokens/s of evaluating an n-token prompt in one batch (best of reps)."""
    tokens = [(i * 7919) % runner.vocab_size for i in range(n)]
    times = []
    for _ in range(reps + 1):
        runner.kv_truncate(0, 0)
        batch = Batch()
        batch.add_sequence(tokens, 0, 0, "last")
        sync(runner.device)
        t0 = time.perf_counter()
        runner.forward(batch)
        sync(runner.device)
        times.append(time.perf_counter() - t0)
    return n / min(times[1:])


# Rows of the timed steps: decode, verify steps of 1..16 drafts, and one past the largest one-pass step.
TIMED_STEP_ROWS = (1, 2, 4, 8, 9, 16, 17)


def bench_step(runner: LocalRunner, n_rows: int, steps: int = 50, context: int = 64) -> float:
    """Seconds per forward step of n_rows consecutive tokens of one sequence (a decode step
    for 1, a verify step of n_rows - 1 draft tokens otherwise), after `context` tokens: the median."""
    runner.kv_truncate(0, 0)
    batch = Batch()
    batch.add_sequence([(i * 31) % runner.vocab_size for i in range(context)], 0, 0, "last")
    runner.forward(batch)
    step = Batch()
    step.add_sequence(list(range(100, 100 + n_rows)), context, 0, "all")
    for _ in range(3):
        runner.kv_truncate(0, context)
        runner.forward(step)
    sync(runner.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.kv_truncate(0, context)
        logits = runner.forward(step)
        int(logits[-1].argmax().item())  # what a sampler pays: one small read back per step
        times.append(time.perf_counter() - t0)
    return statistics.median(times)  # (a shared machine's hiccups stay out)


def bench_decode(runner: LocalRunner, n: int, context: int = 16) -> float:
    """Tokens/s of n greedy decode steps after a `context`-token prompt, through generate() (what
    generation pays per token, host work included); the first pass warms up."""
    prompt = [(i * 31) % runner.vocab_size for i in range(1, context + 1)]
    stats = GenerationStats()
    for steps in (8, n):
        stats = GenerationStats()
        for _ in generate(runner, prompt, steps + 1, Sampler(SamplingParams(temperature=0)), stats=stats):
            pass
    return (stats.generated - 1) / stats.decode_seconds


def greedy_decode_rate(runner: LocalRunner, prompts: list[list[int]], n_predict: int,
                       is_eog: Callable[[int], bool], chain_factory: Callable[[], Chain | None],
                       n_draft_max: int = 16, overlap: bool = True,
                       repeat: int = 1) -> tuple[float, GenerationStats, list[list[int]]]:
    """Decode tokens/s over prompts (prompt time excluded; the first token of each comes from the
    prompt's forward, so it is not counted), summed stats, the outputs. overlap: see generate().
    repeat: passes over the prompts; the median pass's rate (greedy: every pass makes the same tokens)."""
    rates = []
    for _ in range(repeat):
        total = GenerationStats()
        outputs = []
        seconds = 0.0
        for prompt in prompts:
            stats = GenerationStats()
            chain = chain_factory()
            tokens = list(generate(runner, prompt, n_predict, Sampler(SamplingParams(temperature=0)), is_eog=is_eog,
                                   speculator=chain, n_draft_max=n_draft_max, stats=stats, overlap=overlap))
            seconds += stats.decode_seconds
            outputs.append(tokens)
            for field in ("generated", "target_forwards", "draft_tokens", "draft_accepted"):
                setattr(total, field, getattr(total, field) + getattr(stats, field))
        rates.append((total.generated - len(prompts)) / seconds)
    return statistics.median(rates), total, outputs


def hf_decode_rate(model_path: Path, device: torch.device, prompt: list[int], n: int) -> float:
    """HF transformers greedy decode tokens/s on the same GGUF (bf16 on CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    model = model.to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
    return (out.shape[1] - len(prompt)) / (time.perf_counter() - t0)


def register(subparsers: argparse._SubParsersAction) -> None:
    from specserve.cli import add_model_args

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
    p.add_argument("--repeat", type=int, default=3,
                   help="passes over the code-edit prompts per row; the median pass is reported")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--prompts", default=None, help="workload JSON (default: ../shared/workloads/prompts.json)")
    p.add_argument("-o", "--output", default=None, help="JSON file (default: benchmarks/results/bench_<model>.json)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve import catalog
    from specserve.session import GenerationSession
    from specserve.speculative.factory import build_chain
    from specserve.workloads import workload_prompts

    if args.n_prompt < 1 or args.n_gen < 1 or args.repeat < 1:
        raise SpecserveError("-p, -n and --repeat must be at least 1")
    types = [t for t in args.spec_types.split(",") if t]
    try:
        sizes = [int(n) for n in args.ngram_sizes.split(",") if n]
    except ValueError:
        raise SpecserveError(f"--ngram-sizes takes integers, got {args.ngram_sizes!r}") from None
    if not sizes:
        raise SpecserveError("--ngram-sizes needs at least one size")
    for n in sizes:  # before the model loads
        SpecParams(type="ngram-simple").with_overrides(ngram_size_n=n)
    unknown = set(types) - set(SPEC_TYPES)
    if unknown:
        raise SpecserveError(f"unknown speculative type(s): {', '.join(sorted(unknown))}")
    if "draft" in types and not args.model_draft:
        types.remove("draft")
    session = GenerationSession.load(args.model, draft_model=args.model_draft, device=args.device,
                                     n_ctx=max(args.ctx_size or 0, args.n_prompt + 64, 4096),
                                     weight_format=args.weight_format)
    runner = session.runner
    for r in (runner, session.draft_runner):
        if r is not None:
            r.warmup(17)
    rows: list[tuple[str, float, str]] = []
    result: dict[str, object] = {"model": args.model or catalog.DEFAULT_MODEL, "device": str(runner.device),
                                 "dtype": str(runner.dtype).replace("torch.", ""),
                                 "weight_format": runner.weight_format}
    pp = bench_prefill(runner, args.n_prompt)
    rows.append((f"pp{args.n_prompt}", pp, ""))
    tg = bench_decode(runner, args.n_gen)
    rows.append((f"tg{args.n_gen}", tg, ""))
    step_ms = {n: bench_step(runner, n) * 1e3 for n in TIMED_STEP_ROWS}
    result.update({f"pp{args.n_prompt}": round(pp, 1), f"tg{args.n_gen}": round(tg, 1),
                   "decode_step_ms": round(step_ms[1], 3), "verify8_step_ms": round(step_ms[9], 3),
                   "verify8_over_decode": round(step_ms[9] / step_ms[1], 3),
                   "verify_8_rows_over_decode": round(step_ms[8] / step_ms[1], 3),
                   "step_ms_by_rows": {n: round(ms, 3) for n, ms in step_ms.items()}})
    if runner.device.type == "cuda":
        bw = copy_bandwidth(runner.device)
        roofline = bw / bytes_per_token(runner)
        result.update(copy_bandwidth_gb_s=round(bw / 1e9, 1), roofline_tokens_per_s=round(roofline, 1),
                      tg_roofline_fraction=round(tg / roofline, 3))
    code_edit = workload_prompts(session.tokenizer, "code_edit", args.prompts)
    none_rate, _, none_out = greedy_decode_rate(runner, code_edit, args.n_gen, session.tokenizer.is_eog, lambda: None,
                                                repeat=args.repeat)
    rows.append((f"tg{args.n_gen} code-edit none", none_rate, ""))
    spec_rows = {}
    runs = [(t, None, True) for t in types if t not in KEYED_TYPES] + [(t, n, True) for t in types
                                                                       if t in KEYED_TYPES for n in sizes]
    if runs:  # the first again with one step at a time: what overlapping the plain steps gains
        runs.append((runs[0][0], runs[0][1], False))
    for t, n, overlap in runs:
        spec = SpecParams(type="none" if t == "draft" else t)
        if n is not None:
            spec = spec.with_overrides(ngram_size_n=n)
        label = t if n is None or sizes == [SpecParams.ngram_size_n] else f"{t} n={n}"
        label += "" if overlap else " (no overlap)"
        draft = session.draft_runner if t == "draft" else None
        rate, stats, out = greedy_decode_rate(runner, code_edit, args.n_gen, session.tokenizer.is_eog,
                                              lambda spec=spec, draft=draft: build_chain(spec, draft),
                                              overlap=overlap, repeat=args.repeat)
        acc = stats.draft_accepted / stats.draft_tokens if stats.draft_tokens else 0.0
        note = f"x{rate / none_rate:.2f}, accept {acc:.2f}, {stats.generated / stats.target_forwards:.2f} tok/fwd"
        if out != none_out:
            note += ", OUTPUT DIFFERS"
        rows.append((f"tg{args.n_gen} code-edit {label}", rate, note))
        spec_rows[label] = {"tokens_per_s": round(rate, 1), "speedup": round(rate / none_rate, 3),
                        "acceptance": round(acc, 4), "tokens_per_forward": round(stats.generated /
                                                                                  stats.target_forwards, 3),
                        "identical": out == none_out}
    result.update({"code_edit_none": round(none_rate, 1), "code_edit_spec": spec_rows})
    if not args.no_hf:
        hf = hf_decode_rate(catalog.resolve(args.model), runner.device, code_edit[0][:64], args.n_gen)
        rows.append((f"tg{args.n_gen} HF transformers", hf, f"specserve x{tg / hf:.1f}"))
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
    out_path = Path(args.output or f"benchmarks/results/bench_{result['model']}_{runner.device.type}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0
