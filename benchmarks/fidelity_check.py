"""Greedy text through a server, alone vs among concurrent requests vs with each speculative type.

    python benchmarks/fidelity_check.py -m qwen2.5-coder-1.5b --device cuda --server-args --weight-format gguf
    python benchmarks/fidelity_check.py --url http://127.0.0.1:8080 --types ngram-simple,ngram-map-k

spec/server.md: a greedy request's text may not depend on how many other requests run, nor on
speculation. Each workload prompt (workloads/prompts.json) is sent alone without speculation (the
reference), then all prompts at once without speculation, then all at once with each --types entry.
Prints, per prompt, whether each run's tokens equal the reference's (else the first differing
token index), and writes JSON (-o, default fidelity_<model>_<device>.json in the cache's benchmarks folder).
Without --url it starts `specserve serve` with one slot per prompt.
"""

from __future__ import annotations

import argparse
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_output import output_path, print_table, write_json
from serve_bench import DEFAULT_PROMPTS, add_server_args, load_prompts, render_prompts, start_server
from stream_clients import spec_fields


def complete(url: str, headers: dict[str, str], prompt: str, n_predict: int, mode: str) -> list[int]:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True, **spec_fields(mode)}
    r = httpx.post(url + "/completion", json=body, headers=headers, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["tokens"]


def together(url: str, headers: dict[str, str], prompts: list[str], n_predict: int, mode: str) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, headers, p, n_predict, mode), prompts))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a length counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)  # with -md, type draft is checked too
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--types", default="ngram-simple,ngram-map-k,ngram-map-k4v,ngram-cache,ngram-suffix",
                   help="speculative types to check, comma-separated")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="workloads/prompts.json")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args()

    conversations = load_prompts(args.prompts, None)
    types = [t for t in args.types.split(",") if t] + (["draft"] if args.model_draft else [])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc, url = (None, args.url) if args.url else start_server(args, len(conversations))
    try:
        prompts = render_prompts(url, headers, conversations)
        alone = [complete(url, headers, prompt, args.n_predict, "none") for prompt in prompts]
        runs = {"concurrent": together(url, headers, prompts, args.n_predict, "none")}
        for mode in types:
            runs[f"concurrent {mode}"] = together(url, headers, prompts, args.n_predict, mode)
        props = httpx.get(url + "/props", headers=headers, timeout=30).json()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    rows = []
    for i, ref in enumerate(alone):
        row: dict[str, object] = {"prompt": i, "tokens": len(ref)}
        for name, texts in runs.items():
            diff = first_difference(texts[i], ref)
            row[name] = "=" if diff is None else f"@{diff}"
        rows.append(row)
    summary = {name: sum(first_difference(t, ref) is None for t, ref in zip(texts, alone, strict=True))
               for name, texts in runs.items()}
    print_table(rows, ["prompt", "tokens", *runs])
    print("equal to alone: " + ", ".join(f"{name} {n}/{len(alone)}" for name, n in summary.items()))
    model = Path(props.get("model_alias") or props.get("model_path") or args.model).name.removesuffix(".gguf")
    device = args.device or ("remote" if args.url else "default")
    write_json(output_path(str(args.out) if args.out else None, f"fidelity_{model}_{device}.json"),
               {"model": model, "url": args.url, "server_args": args.server_args, "n_predict": args.n_predict,
                "host": platform.node(), "rows": rows, "equal": summary, "of": len(alone)})
    return 0 if all(n == len(alone) for n in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
