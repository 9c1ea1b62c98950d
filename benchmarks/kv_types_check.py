"""Greedy text and KV memory with each KV cache type (-ctk / -ctv), through `specserve serve`.

    python benchmarks/kv_types_check.py -m smollm2-135m --device cpu
    python benchmarks/kv_types_check.py -m qwen2.5-coder-1.5b --device cuda --server-args --weight-format gguf

For each --types entry a server is started with that type for keys and values ("default": the flags left out,
the compute dtype); every workload prompt (workloads/prompts.json) is sent alone, greedy. Prints, per type, the KV
pool's size (the server's log line) and, per prompt, where its tokens first leave the first type's (the
reference), and writes JSON (-o, default kv_types_<model>_<device>.json in the cache's benchmarks folder).
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import tempfile
from pathlib import Path

from bench_output import output_path, print_table, write_json
from fidelity_check import complete, first_difference
from serve_bench import DEFAULT_PROMPTS, add_server_args, load_prompts, render_prompts, start_server

SERVER_LOG = Path(tempfile.gettempdir()) / "serve_bench_server.log"  # where start_server sends the log


def greedy_with(args: argparse.Namespace, kv_type: str, conversations: list[list[dict]]) -> tuple[list, float]:
    """Each prompt's greedy tokens from a server whose pool stores K and V as kv_type, and the pool's MiB."""
    extra = [] if kv_type == "default" else ["-ctk", kv_type, "-ctv", kv_type]
    run = argparse.Namespace(**{**vars(args), "server_args": [*args.server_args, *extra]})
    proc, url = start_server(run, 1)
    try:
        prompts = render_prompts(url, {}, conversations)
        tokens = [complete(url, {}, prompt, args.n_predict, "none") for prompt in prompts]
    finally:
        proc.terminate()
        proc.wait(30)
    found = re.search(r"KV cache: .*, ([\d.]+) MiB", SERVER_LOG.read_text(errors="replace"))
    return tokens, float(found.group(1)) if found else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--types", default="default,f16,q8_0,q4_0", help="KV cache types, the first the reference")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="workloads/prompts.json")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args()
    if args.url:
        raise SystemExit("kv_types_check starts its own servers (one per type): --url is not taken")

    conversations = load_prompts(args.prompts, None)
    types = [t for t in args.types.split(",") if t]
    results = {t: greedy_with(args, t, conversations) for t in types}
    ref = results[types[0]][0]
    rows = []
    for t, (tokens, mib) in results.items():
        diffs = [first_difference(got, want) for got, want in zip(tokens, ref, strict=True)]
        same = sum(min(d if d is not None else len(w), len(w)) for d, w in zip(diffs, ref, strict=True))
        rows.append({"type": t, "KV MiB": round(mib, 1), "equal": f"{sum(d is None for d in diffs)}/{len(ref)}",
                     "tokens before a difference": f"{100 * same / max(1, sum(map(len, ref))):.1f}%",
                     "first differences": " ".join("=" if d is None else str(d) for d in diffs)})
    print_table(rows, ["type", "KV MiB", "equal", "tokens before a difference", "first differences"])
    device = args.device or "default"
    write_json(output_path(str(args.out) if args.out else None, f"kv_types_{args.model}_{device}.json"),
               {"model": args.model, "device": device, "server_args": args.server_args, "n_predict": args.n_predict,
                "host": platform.node(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
