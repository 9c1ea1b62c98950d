"""Prompt-processing and decode speed of one model, with the memory-bandwidth roofline.

    python benchmarks/engine_bench.py -m smollm2-135m [--device cpu] [--pp 512] [--tg 128]

Prints a table and writes JSON (-o, default engine_<model>_<device>[_<format>].json in the cache's
benchmarks folder: bench_output.py).
On CUDA it also measures device copy bandwidth and reports decode speed as a fraction of
the roofline = bandwidth / weight bytes read per token.
"""

from __future__ import annotations

import argparse
import platform

import torch
from bench_output import output_path, write_json
from random_model import StandInTokenizer

from specserve import catalog
from specserve.cli.measure import bench_decode, bench_prefill, bytes_per_token, copy_bandwidth
from specserve.engine.local_runner import LocalRunner, default_device, default_dtype
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.random_init import SHAPES, random_weights
from specserve.model.weights import WEIGHT_FORMATS, resolve_weight_format


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
    ap.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                    help="auto = float; gguf keeps the file's quantized matrices (q8 with --random-weights)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    n_ctx = args.pp + args.tg + 64
    if args.random_weights:
        dev = torch.device(args.device) if args.device else default_device()
        weights = random_weights(SHAPES[args.model], default_dtype(dev), dev)
        fmt = resolve_weight_format(args.weight_format)
        runner = LocalRunner.from_weights(SHAPES[args.model], weights, n_ctx=n_ctx, cuda_graphs=not args.no_graphs,
                                          weight_format="q8" if fmt == "gguf" else fmt)
    else:
        runner = LocalRunner(catalog.resolve(args.model), n_ctx=n_ctx, device=args.device,
                             cuda_graphs=not args.no_graphs, weight_format=args.weight_format)
    dev = runner.device
    pp = bench_prefill(runner, args.pp, args.reps)
    tokenizer = StandInTokenizer() if runner.gguf is None else Tokenizer.from_gguf(runner.gguf)
    tg = bench_decode(runner, tokenizer, args.tg)
    bpt = bytes_per_token(runner)
    result: dict[str, object] = {
        "model": args.model, "weights": "random" if args.random_weights else "gguf",
        "cuda_graphs": runner.graphs is not None, "weight_format": runner.weight_format,
        "device": str(dev), "dtype": str(runner.dtype).replace("torch.", ""),
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
    suffix = "" if args.weight_format == "auto" else f"_{args.weight_format}"
    write_json(output_path(args.output, f"engine_{args.model}_{dev.type}{suffix}.json"), result)


if __name__ == "__main__":
    main()
