"""Greedy text, KV memory and speed with each KV cache type (-ctk / -ctv), through `specserve serve`.

    python benchmarks/kv_types_check.py -m smollm2-135m --device cpu --slots 16 --rounds 2
    python benchmarks/kv_types_check.py -m qwen2.5-coder-1.5b --device cuda --slots 64 \
        --server-args --weight-format gguf

For each --types entry a server is started with that type for keys and values ("default": the flags left out,
the compute dtype), sized for --slots clients; every workload prompt (workloads/prompts.json) is sent alone, greedy
(decode tok/s: the server's own timings, averaged), then all of them at once (tok/s: tokens over wall time). The
types take turns, --rounds times, so a drifting machine moves them alike. Prints, per type, the KV pool's size
(the server's log line), the speeds with their ratio to the first type's (the reference), and where each prompt's
tokens first leave the reference's; writes JSON (-o, default kv_types_<model>_<device>.json in the cache's
benchmarks folder).
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_output import output_path, print_table, write_json
from fidelity_check import first_difference
from serve_bench import DEFAULT_PROMPTS, add_server_args, load_prompts, render_prompts, start_server

SERVER_LOG = Path(tempfile.gettempdir()) / "serve_bench_server.log"  # where start_server sends the log


def _complete(url: str, prompt: str, n_predict: int) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True}
    r = httpx.post(url + "/completion", json=body, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def run_type(args: argparse.Namespace, kv_type: str, conversations: list[list[dict]]) -> dict:
    """One server with keys and values stored as kv_type: each prompt's greedy tokens, the pool's MiB, the mean
    decode rate of the prompts alone and the tok/s of all of them at once."""
    extra = [] if kv_type == "default" else ["-ctk", kv_type, "-ctv", kv_type]
    run = argparse.Namespace(**{**vars(args), "server_args": [*args.server_args, *extra]})
    proc, url = start_server(run, args.slots)
    try:
        prompts = render_prompts(url, {}, conversations)
        alone = [_complete(url, prompt, args.n_predict) for prompt in prompts]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: _complete(url, p, args.n_predict), prompts))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    found = re.search(r"KV cache: .*, ([\d.]+) MiB", SERVER_LOG.read_text(errors="replace"))
    return {"tokens": [r["tokens"] for r in alone], "mib": float(found.group(1)) if found else float("nan"),
            "decode": statistics.mean(r["timings"]["predicted_per_second"] for r in alone),
            "together": sum(len(r["tokens"]) for r in together) / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--types", default="default,f16,q8_0,q4_0", help="KV cache types, the first the reference")
    p.add_argument("--slots", type=int, default=16, help="-np of each server (a server sized for many clients)")
    p.add_argument("--rounds", type=int, default=1, help="times the types take turns")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="workloads/prompts.json")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args()
    if args.url:
        raise SystemExit("kv_types_check starts its own servers (one per type): --url is not taken")

    conversations = load_prompts(args.prompts, None)
    types = [t for t in args.types.split(",") if t]
    runs: dict[str, list[dict]] = {t: [] for t in types}
    for _ in range(args.rounds):
        for t in types:
            runs[t].append(run_type(args, t, conversations))
    ref = runs[types[0]][0]["tokens"]
    rows = []
    for t, results in runs.items():
        tokens, mib = results[0]["tokens"], results[0]["mib"]
        diffs = [first_difference(got, want) for got, want in zip(tokens, ref, strict=True)]
        same = sum(min(d if d is not None else len(w), len(w)) for d, w in zip(diffs, ref, strict=True))
        decode = [r["decode"] for r in results]
        together = [r["together"] for r in results]
        ratio = [r["together"] / b["together"] for r, b in zip(results, runs[types[0]], strict=True)]
        rows.append({"type": t, "KV MiB": round(mib, 1), "decode tok/s": [round(x, 1) for x in decode],
                     "together tok/s": [round(x, 1) for x in together],
                     "together x ref": round(statistics.median(ratio), 3),
                     "equal": f"{sum(d is None for d in diffs)}/{len(ref)}",
                     "tokens before a difference": f"{100 * same / max(1, sum(map(len, ref))):.1f}%",
                     "first differences": " ".join("=" if d is None else str(d) for d in diffs)})
    print_table(rows, ["type", "KV MiB", "decode tok/s", "together tok/s", "together x ref", "equal",
                       "tokens before a difference", "first differences"])
    device = args.device or "default"
    write_json(output_path(str(args.out) if args.out else None, f"kv_types_{args.model}_{device}.json"),
               {"model": args.model, "device": device, "server_args": args.server_args, "n_predict": args.n_predict,
                "slots": args.slots, "rounds": args.rounds,
                "host": platform.node(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
