"""Prompt-processing and decode speed of one model, with the memory-bandwidth roofline.

    python benchmarks/engine_bench.py -m smollm2-135m [--device cpu] [--pp 512] [--tg 128]

Prints a table and writes JSON (default benchmarks/results/engine_<model>_<device>.json).
On CUDA it also measures device copy bandwidth and reports decode speed as a fraction of
the roofline = bandwidth / weight bytes read per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve import catalog  # noqa: E402
from specserve.engine.batch import Batch  # noqa: E402
from specserve.engine.runner import LocalRunner, default_device, default_dtype  # noqa: E402
from specserve.model.random_init import SHAPES, random_weights  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    if w.output is not w.embed:
        total -= w.embed.numel() * w.embed.element_size()
    return total


def bench_prefill(runner: LocalRunner, n: int, reps: int) -> float:
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


def bench_decode(runner: LocalRunner, n: int, context: int = 16) -> float:
    """Greedy-style single-token steps (argmax fed back, as generation does)."""
    runner.kv_truncate(0, 0)
    batch = Batch()
    batch.add_sequence(list(range(1, context + 1)), 0, 0, "last")
    logits = runner.forward(batch)
    for warm in (True, False):
        sync(runner.device)
        t0 = time.perf_counter()
        steps = 8 if warm else n
        for _ in range(steps):
            token = int(logits[0].argmax().item())
            batch = Batch()
            batch.add(token, runner.seq_len[0], 0, logits=True)
            logits = runner.forward(batch)
        sync(runner.device)
        elapsed = time.perf_counter() - t0
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--device", default=None)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--random-weights", action="store_true",
                    help="random weights in the model's shapes (no file needed; speed only)")
    ap.add_argument("--no-graphs", action="store_true", help="disable CUDA graphs")
    ap.add_argument("--weight-format", default="bf16", choices=["bf16", "q8"],
                    help="q8: int8 matrices with fp16 scales per 32 weights (fused dequantize kernels)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    n_ctx = args.pp + args.tg + 64
    if args.random_weights:
        dev = torch.device(args.device) if args.device else default_device()
        weights = random_weights(SHAPES[args.model], default_dtype(dev), dev)
        runner = LocalRunner.from_weights(SHAPES[args.model], weights, n_ctx=n_ctx, cuda_graphs=not args.no_graphs,
                                           weight_format=args.weight_format)
    else:
        runner = LocalRunner(catalog.resolve(args.model), n_ctx=n_ctx, device=args.device,
                             cuda_graphs=not args.no_graphs, weight_format=args.weight_format)
    dev = runner.device
    pp = bench_prefill(runner, args.pp, args.reps)
    tg = bench_decode(runner, args.tg)
    bpt = bytes_per_token(runner)
    result: dict[str, object] = {
        "model": args.model, "weights": "random" if args.random_weights else "gguf",
        "cuda_graphs": runner.graphs is not None, "device": str(dev), "dtype": str(runner.dtype).replace("torch.", ""),
        "weight_format": args.weight_format,
        "torch": torch.__version__, "host": platform.node(),
        f"pp{args.pp}_tokens_per_s": round(pp, 1), f"tg{args.tg}_tokens_per_s": round(tg, 1),
        "weight_bytes_per_token": bpt,
    }
    if dev.type == "cuda":
        bw = copy_bandwidth(dev)
        roofline = bw / bpt
        result.update(gpu=torch.cuda.get_device_name(dev), copy_bandwidth_gb_s=round(bw / 1e9, 1),
                      roofline_tokens_per_s=round(roofline, 1), decode_roofline_fraction=round(tg / roofline, 3))
    else:
        result.update(threads=torch.get_num_threads())
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
    suffix = "" if args.weight_format == "bf16" else f"_{args.weight_format}"
    out = Path(args.output or f"benchmarks/results/engine_{args.model}_{dev.type}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
