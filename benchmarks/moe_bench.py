"""Mixture of experts: the fused routing kernel against the torch ops it replaces, and decode speed of a
Qwen3-30B-A3B-shaped model against the roofline of the bytes a step needs.

    python benchmarks/moe_bench.py [-o FILE] [--sections routing,experts,decode,profile] [--layers 12]
                                   [--weight-format q8]
    python benchmarks/moe_bench.py --device cpu --small          # smoke test: tiny shapes, eager

routing: us per call of `route` (the fused Triton kernel where it runs) against route_ref (the torch
         reference: float64 gate, stable sort) and the fp32 chain of torch ops that the kernel replaces (gate,
         bias add, topk, gather, sum, clamp, div, scale), at 1 / 16 / 512 / 4096 tokens, for the routing of
         Qwen3-30B-A3B (128 experts, top 8, softmax, norm), DeepSeek-V3 (256, top 8, sigmoid + bias, norm,
         scale 2.5) and gpt-oss (32 and 128 experts, top 4, delayed softmax). On CUDA: GPU time of graph
         replays (launch cost amortised); on the CPU: wall time.
experts: the expert products alone at 1 / 16 tokens (q8 experts of Qwen3-30B-A3B's shape, 8 of 128 per token):
         the dispatcher's path (the CUDA tensor-core pairs where they run) against the Triton pairs, GPU us and
         the bandwidth of the chosen experts' bytes.
decode:  random weights in Qwen3-30B-A3B's shapes with --layers layers (hidden 2048, 128 experts, 8 used,
         expert FFN 768, 32 query / 4 KV heads of 128, vocab 151936) through LocalRunner and the scheduler:
         greedy tok/s at 1 and 16 concurrent sequences, with CUDA graphs and eagerly, and the fraction of the
         roofline = copy bandwidth / bytes the step needs (attention, router, norm and output weights, the
         embedding rows, and in each layer the experts the step's tokens chose, counted from its routing).
profile: the decode step's kernels at 1 row (torch.profiler over graph replays): GPU us per step each.
Prints a table per section; writes JSON (-o, default moe_bench_<device>.json in the cache's benchmarks
folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from bench_output import output_path, print_table, write_json
from random_model import StandInTokenizer, graph_us, quantize_groups

from specserve.cli.measure import bytes_per_token, copy_bandwidth, sync
from specserve.engine.local_runner import LocalRunner, default_dtype
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Failure, Result, Task
from specserve.kernels.backend import kernels_for
from specserve.kernels.moe_routing import FUSED_N_EXPERT, NORM_CLAMP, Routing, route_ref
from specserve.kernels.moe_step import NormMoeAdd
from specserve.kernels.quant_experts import QuantExperts
from specserve.model.batch import Batch
from specserve.model.moe import MoeConfig
from specserve.model.random_init import random_weights
from specserve.model.weights import ExpertWeights, ModelWeights
from specserve.speculative.base import SpecParams

# name: (n_expert, k, route's keyword arguments; "bias": a random expert bias)
ROUTINGS = {
    "qwen3-30b-a3b": (128, 8, dict(gating="softmax", norm=True)),
    "deepseek-v3": (256, 8, dict(gating="sigmoid", bias=True, norm=True, scale=2.5)),
    "gpt-oss-20b": (32, 4, dict(gating="softmax", delayed_softmax=True)),
    "gpt-oss-120b": (128, 4, dict(gating="softmax", delayed_softmax=True)),
}


def torch_chain(logits: torch.Tensor, k: int, *, gating: str, bias: torch.Tensor | None = None, norm: bool = False,
                scale: float = 1.0, delayed_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused fp32 ops a model graph runs without the kernel (torch.topk: ties in no fixed order)."""
    x = logits.float()
    if delayed_softmax:
        top, ids = torch.topk(x, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(x, dim=-1) if gating == "softmax" else torch.sigmoid(x)
        ids = torch.topk(probs if bias is None else probs + bias, k, dim=-1).indices
        weights = probs.gather(1, ids)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=NORM_CLAMP)
    return ids, weights * scale if scale != 1.0 else weights


def call_us(fn: Callable[[], object], device: torch.device) -> float:
    """us per call: GPU time of graph replays on CUDA, median wall time on the CPU."""
    if device.type == "cuda":
        return graph_us(fn, calls=20)
    fn()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def section_routing(device: torch.device, tokens: list[int]) -> list[dict[str, object]]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n_expert, k, variant) in ROUTINGS.items():
        kw = dict(variant)
        if kw.pop("bias", False):
            kw["bias"] = torch.randn(n_expert, device=device, generator=gen)
        for n in tokens:
            logits = torch.randn(n, n_expert, device=device, generator=gen) * 3
            kernels = kernels_for(device)
            kernel = n_expert in FUSED_N_EXPERT and kernels.name == "triton"

            def route(x: torch.Tensor, k: int, kernels=kernels, **kw) -> tuple[torch.Tensor, torch.Tensor]:
                return kernels.route(x, Routing(k, **kw))

            ids, _ = route(logits, k, **kw)
            row: dict[str, object] = {"routing": name, "experts": n_expert, "k": k, "tokens": n,
                                      "kernel": "yes" if kernel else "no",
                                      "ids_match": bool(torch.equal(ids, route_ref(logits, k, **kw)[0]))}
            for label, fn in (("route", route), ("route_ref", route_ref), ("torch_chain", torch_chain)):
                row[f"{label}_us"] = round(call_us(lambda f=fn, x=logits, k=k, kw=kw: f(x, k, **kw), device), 2)
            row["vs_chain"] = round(row["torch_chain_us"] / row["route_us"], 2)
            row["vs_ref"] = round(row["route_ref_us"] / row["route_us"], 2)
            rows.append(row)
    print_table(rows, ["routing", "experts", "k", "tokens", "kernel", "ids_match", "route_us", "torch_chain_us",
                       "route_ref_us", "vs_chain", "vs_ref"])
    return rows


def section_experts(args: argparse.Namespace, device: torch.device, tokens: list[int]) -> list[dict[str, object]]:
    cfg = moe_config(None, args.small)
    e, f, h, k = cfg.n_expert, cfg.expert_ffn, cfg.hidden, cfg.n_expert_used
    gen = torch.Generator(device=device).manual_seed(2)
    gate_up = QuantExperts.quantize_q8(torch.randn(e, 2 * f, h, device=device, generator=gen) * h**-0.5)
    down = QuantExperts.quantize_q8(torch.randn(e, h, f, device=device, generator=gen) * f**-0.5)
    dtype = default_dtype(device)
    rows = []
    for n in tokens:
        x = torch.randn(n, h, device=device, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(e, device=device, generator=gen)[:k] for _ in range(n)])
        weights = torch.rand(n, k, device=device, generator=gen)
        chosen_bytes = ids.unique().numel() * (gate_up.n_bytes() + down.n_bytes()) // e
        row: dict[str, object] = {"tokens": n, "experts_read": ids.unique().numel(), "MB": round(chosen_bytes / 1e6, 1)}
        kernels = kernels_for(device)
        paths: list[tuple[str, Callable]] = [("dispatch", kernels.moe_experts)]
        if kernels.name == "triton":
            from specserve.kernels import moe_experts_triton

            paths.append(("triton_pairs", moe_experts_triton.pairs))
            from specserve.kernels import moe_experts_cuda, quant_cuda

            if quant_cuda.experts_usable(x, gate_up.w, down.w):
                paths.append(("cuda_pairs", lambda x, ids, w, gu, dn: moe_experts_cuda.pairs(x, ids, w, gu.w, dn.w,
                                                                                               gu.n_expert)))
        for label, fn in paths:
            us = call_us(lambda fn=fn, x=x, ids=ids, w=weights: fn(x, ids, w, gate_up, down), device)
            row[f"{label}_us"] = round(us, 1)
            row[f"{label}_GB_s"] = round(chosen_bytes / us / 1e3, 1)
        rows.append(row)
        if device.type == "cuda" and args.sweep:
            row["sweep"] = expert_block_sweep(x, ids, gate_up, down)
    print_table(rows, [c for c in rows[0] if c != "sweep"])
    return rows


# the tensor-core pairs' blocks to try: 16-row tiles a block, warps splitting K, steps in flight, cluster size
EXPERT_SWEEP = [(t, ks, d, 1) for t in (1, 2, 4, 8) for ks in (1, 2, 4, 8) for d in (1, 2) if t * ks <= 16] + [
    (t, 4, 2, kc) for t in (1, 2, 4) for kc in (2, 4)]


def expert_block_sweep(x: torch.Tensor, ids: torch.Tensor, gate_up: QuantExperts, down: QuantExperts) -> list[dict]:
    """GPU us of each expert product (quant_cuda.expert_gemv) per block shape, best first per matrix."""
    from specserve.kernels import quant_cuda

    act = quant_cuda.expert_gemv(x, ids, gate_up.w, gate_up.n_expert, x.dtype, by_token=True, swiglu_output=True)
    out = []
    for tiles, ksplit, d, kc in EXPERT_SWEEP:
        cfg = {"TILES": tiles, "KSPLIT": ksplit, "D": d, "KC": kc, "MINB": 0}
        try:
            gu = call_us(lambda c=cfg: quant_cuda.expert_gemv(x, ids, gate_up.w, gate_up.n_expert, x.dtype,
                                                              by_token=True, swiglu_output=True, blocks=c), x.device)
            dn = call_us(lambda c=cfg: quant_cuda.expert_gemv(act, ids, down.w, down.n_expert, torch.float32,
                                                              by_token=False, blocks=c), x.device)
        except Exception as exc:  # a shape the kernel cannot stage (shared memory), or a build failure
            print(f"  blocks {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        out.append({**cfg, "gate_up_us": round(gu, 1), "down_us": round(dn, 1)})
    for key in ("gate_up_us", "down_us"):
        best = sorted(out, key=lambda r: r[key])[:4]
        print(f"  tokens {x.shape[0]}, best {key}: " + "; ".join(
            f"T{r['TILES']} KS{r['KSPLIT']} D{r['D']} KC{r['KC']}: {r[key]}" for r in best))
    return out


def section_profile(args: argparse.Namespace, device: torch.device) -> list[dict[str, object]]:
    """GPU time per decode step of each kernel (by name) at one row, CUDA graphs on where they run (on the
    CPU: each op's own CPU time)."""
    runner = random_runner(args, device, 1)
    runner.warmup(1, prompt_rows=0)
    decode_rate(runner, 1, args.n_predict)
    activities = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    with torch.profiler.profile(activities=activities or None) as prof:
        decode_rate(runner, 1, args.n_predict)
    steps = args.n_predict + 8  # decode_rate runs a short warm pass of 8, then n_predict
    def own_us(ev: object) -> float:  # the CPU's own time per op where there is no device
        return getattr(ev, "self_device_time_total" if activities else "self_cpu_time_total")

    rows = [{"kernel": ev.key[:90], "calls_per_step": round(ev.count / steps, 1),
             "us_per_step": round(own_us(ev) / steps, 1)} for ev in prof.key_averages() if own_us(ev) > 0]
    rows.sort(key=lambda r: -r["us_per_step"])
    print_table(rows[:25], ["kernel", "calls_per_step", "us_per_step"])
    print(f"total us per step: {sum(r['us_per_step'] for r in rows):.1f}")
    return rows


# -- decode -----------------------------------------------------------------------------------------------------


def moe_config(layers: int | None, small: bool) -> MoeConfig:
    """Qwen3-30B-A3B's shapes (its 48 layers cut to `layers`), or tiny ones for a CPU smoke test."""
    common = dict(arch="qwen3moe", context_length=40960, rope_base=1e6, rope_style="neox", rope_scale=1.0,
                  rms_eps=1e-6, tied_embeddings=False, qkv_bias=False, qk_norm=True, expert_gating="softmax",
                  expert_weights_norm=True)
    if small:
        return MoeConfig(**common, n_layers=layers or 2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96,
                         vocab_size=512, rope_dim=16, n_expert=8, n_expert_used=2, expert_ffn=32)
    return MoeConfig(**common, n_layers=layers or 12, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn=6144,
                     vocab_size=151936, rope_dim=128, n_expert=128, n_expert_used=8, expert_ffn=768)


def random_moe_weights(cfg: MoeConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Attention, norms, embedding and output from random_init; each layer's dense feed-forward replaced by
    stacked random experts and a router (unit-variance outputs, as random_init scales its matrices)."""
    weights = random_weights(dataclasses.replace(cfg, ffn=1), dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)

    def stack(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * shape[-1] ** -0.5).to(dtype)

    e, f, h = cfg.n_expert, cfg.expert_ffn, cfg.hidden
    for layer in weights.layers:
        layer.w_gate_up = layer.w_down = None
        layer.experts = ExpertWeights(router=stack(e, h), gate_up=stack(e, 2 * f, h), down=stack(e, h, f))
    return weights


def tensor_bytes(t: torch.Tensor | QuantExperts) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.n_bytes()


def prompt_of(seq: int, vocab: int, length: int = 16) -> list[int]:
    return [(977 * seq + 31 * i + 1) % vocab for i in range(length)]


def decode_rate(runner: LocalRunner, rows: int, n_predict: int) -> float:
    """Greedy tok/s of `rows` sequences decoding together through the scheduler (generated tokens after
    each one's first, over the longest decode time); a first short pass warms up."""
    scheduler = Scheduler(runner, StandInTokenizer())
    rate = 0.0
    for n in (8, n_predict):
        events: list[object] = []
        for seq in range(rows):
            scheduler.submit(Task(prompt=prompt_of(seq, runner.vocab_size), sampling=SamplingParams(temperature=0),
                                  spec=SpecParams(n_max=0), n_predict=n, ignore_eos=True), events.append)
        while scheduler.busy:
            scheduler.run_once()
        failures = [e.message for e in events if isinstance(e, Failure)]
        if failures:
            raise SystemExit(f"decode failed: {failures[0]}")
        results = [e for e in events if isinstance(e, Result)]
        rate = sum(r.n_predicted - 1 for r in results) * 1000 / max(r.predicted_ms for r in results)
    return rate


class CountExperts:
    """A runner's routing that also records how many distinct experts each call chose."""

    def __init__(self, route: Callable, counts: list[int]) -> None:
        self.route, self.counts = route, counts

    def __call__(self, logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = self.route(logits, routing)
        self.counts.append(int(ids.unique().numel()))
        return ids, weights


def experts_per_layer(runner: LocalRunner, rows: int) -> list[int]:
    """Distinct experts each layer runs in one decode step of `rows` sequences (one eager step, recorded)."""
    ops = [op for layer in runner.model.layers for op in layer.ops() if isinstance(op, NormMoeAdd)]
    graphs, runner.graphs = runner.graphs, None
    counts: list[int] = []
    try:
        prompts = Batch()
        for seq in range(rows):
            runner.kv_truncate(seq, 0)
            prompts.add_sequence(prompt_of(seq, runner.vocab_size), 0, seq, "last")
        runner.forward(prompts)
        step = Batch()
        for seq in range(rows):
            step.add(7 * seq + 3, runner.seq_len[seq], seq, logits=True)
        runner.kernels.route = CountExperts(runner.kernels.route, counts)  # type: ignore[method-assign]
        runner.forward(step)
        assert len(counts) == len(ops)
    finally:
        runner.kernels.__dict__.pop("route", None)
        for seq in range(rows):
            runner.kv_truncate(seq, 0)
        runner.graphs = graphs
    return counts


def random_runner(args: argparse.Namespace, device: torch.device, n_seqs: int) -> LocalRunner:
    """The Qwen3-30B-A3B-shaped model in random weights (--weight-format: float, q8 or gguf_like)."""
    cfg = moe_config(args.layers, args.small)
    weights = random_moe_weights(cfg, default_dtype(device), device)
    if args.weight_format == "gguf_like":  # attention and output as a Q4_K_M file holds them (4-bit, 6-bit)
        for layer in weights.layers:
            layer.wqkv, layer.wo = quantize_groups(layer.wqkv, 4, 32), quantize_groups(layer.wo, 4, 32)
        weights.output = quantize_groups(weights.output, 6, 16)
    fmt = "float" if args.weight_format == "gguf_like" else args.weight_format
    return LocalRunner.from_weights(cfg, weights, n_seqs=n_seqs, n_ctx=args.n_predict + 64, weight_format=fmt)


def decode_table(runner: LocalRunner, row_counts: list[int], n_predict: int) -> dict[str, object]:
    """Greedy tok/s at each row count, with CUDA graphs and eagerly, against the roofline of the bytes a
    step reads (the experts its tokens chose counted per layer)."""
    cfg = runner.config
    assert isinstance(cfg, MoeConfig)
    device = runner.device
    t0 = time.perf_counter()
    runner.warmup(max(row_counts), prompt_rows=0)
    warmup_s = time.perf_counter() - t0
    expert_bytes = [tensor_bytes(lw.experts.gate_up) + tensor_bytes(lw.experts.down) for lw in runner.weights.layers]
    fixed = bytes_per_token(runner) - sum(expert_bytes)  # everything but the embedding table and the experts
    embed_row = cfg.hidden * runner.weights.embed.element_size()
    bw = copy_bandwidth(device) if device.type == "cuda" else copy_bandwidth(device, 256 << 20)
    modes = ["graphs", "eager"] if runner.graphs is not None else ["eager"]
    rows_out = []
    graphs = runner.graphs
    for mode in modes:
        runner.graphs = graphs if mode == "graphs" else None
        for rows in row_counts:
            tok_s = decode_rate(runner, rows, n_predict)
            chosen = experts_per_layer(runner, rows)
            step_bytes = fixed + rows * embed_row + sum(c * b // cfg.n_expert for c, b in zip(chosen, expert_bytes,
                                                                                                strict=True))
            roofline = bw / step_bytes * rows
            rows_out.append({"mode": mode, "rows": rows, "tok_s": round(tok_s, 1),
                             "ms_per_step": round(1000 * rows / tok_s, 2),
                             "experts_per_layer": round(statistics.mean(chosen), 1),
                             "step_GB": round(step_bytes / 1e9, 4), "roofline_tok_s": round(roofline, 1),
                             "roofline_fraction": round(tok_s / roofline, 3)})
    runner.graphs = graphs
    print_table(rows_out, ["mode", "rows", "tok_s", "ms_per_step", "experts_per_layer", "step_GB", "roofline_tok_s",
                           "roofline_fraction"])
    return {"config": dataclasses.asdict(cfg), "weight_format": runner.weight_format, "warmup_s": round(warmup_s, 1),
            "weight_GB": round(runner.weights.n_bytes() / 1e9, 3), "all_experts_GB": round(sum(expert_bytes) / 1e9, 3),
            "copy_bandwidth_gb_s": round(bw / 1e9, 1), "rows": rows_out}


def section_decode(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    row_counts = [int(r) for r in args.rows.split(",")]
    if args.gguf:
        runner = LocalRunner(args.gguf, n_seqs=max(row_counts), n_ctx=args.n_predict + 64, device=device,
                             weight_format="gguf", progress=False)
    else:
        runner = random_runner(args, device, max(row_counts))
    result = decode_table(runner, row_counts, args.n_predict)
    return {**result, "weight_format": args.weight_format if not args.gguf else f"gguf ({args.gguf})"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--sections", default="routing,decode")
    ap.add_argument("--tokens", default="1,16,512,4096", help="routing: token counts")
    ap.add_argument("--rows", default="1,16", help="decode: concurrent sequences")
    ap.add_argument("--layers", type=int, default=None, help="decode: layers (default 12; 2 with --small)")
    ap.add_argument("--small", action="store_true", help="decode: tiny shapes (a smoke test on the CPU)")
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="decode: tokens per sequence")
    ap.add_argument("--sweep", action="store_true", help="experts: also sweep the tensor-core pairs' block shapes")
    ap.add_argument("--gguf", default=None, help="decode: a qwen3moe / qwen2moe GGUF file instead of random weights "
                    "(its own weight format)")
    ap.add_argument("--weight-format", default="float", choices=("float", "q8", "gguf_like"),
                    help="decode: the runner's weight format (gguf_like: attention and output quantized as a "
                    "Q4_K_M file holds them)")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result: dict[str, object] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for section in args.sections.split(","):
        print(f"== {section}", flush=True)
        if section == "routing":
            result["routing"] = section_routing(device, [int(n) for n in args.tokens.split(",")])
        elif section == "decode":
            result["decode"] = section_decode(args, device)
        elif section == "experts":
            result["experts"] = section_experts(args, device, [1, 16])
        elif section == "profile":
            result["profile"] = section_profile(args, device)
        else:
            raise SystemExit(f"unknown section '{section}' (routing, experts, decode, profile)")
        sync(device)
    write_json(output_path(args.output, f"moe_bench_{device.type}.json"), result)


if __name__ == "__main__":
    main()
