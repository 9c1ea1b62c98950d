"""Serving benchmark: N concurrent streaming clients, with and without speculation.

    python benchmarks/serve_bench.py -m smollm2-135m --device cpu --clients 1,4 --n-predict 32
    python benchmarks/serve_bench.py --url http://127.0.0.1:8080 --clients 1,4,16,64

Without --url it starts `specserve serve` itself (one slot per client of the largest level).
Each client streams `--requests` requests one after another through llama-server's native
/completion (chat prompts from workloads/prompts.json, rendered by /apply-template), so it
also works against llama-server. Speculation is switched per request: mode `none` sends
`speculative.n_max = 0`, any other mode sends `speculative.type = MODE`.

Prompt mixes (--mix): `workload` (the prompts as they are, cache_prompt off), `shared-system` (a ~1,000-token
system prompt before every workload message, cache_prompt on: what prefix sharing saves), `tenants` (as
shared-system, but each conversation of the workload has a system prompt of its own, one of 8: what the
server's prompt cache keeps once there are more prefixes than slots) and `long` (user messages of ~2k, 4k and
8k tokens; the started server gets slots of 8k + n_predict positions). The `hit` column is the share of prompt
tokens the server took from its cache during the level (/metrics, specserve's counters).

Reports aggregate generated tokens/s (all clients, wall clock), time to first token and
inter-token latency (p50, p99; a chunk of k tokens counts as k gaps of 1/k of its delay),
draft acceptance and, from the server's /metrics, the share of its multi-slot turns that the
draft gate let draft, and the most KV positions in use while the level ran (/metrics `kv_cache_tokens`,
sampled every 0.25 s); prints a table and writes JSON (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from bench_output import output_path
from stream_clients import KVPeak, run_clients, run_in_processes

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT.parent / "shared" / "workloads" / "prompts.json"


@dataclass
class LevelResult:
    mode: str
    clients: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    decode_tokens_per_s: float  # one request's rate after its first token, the median (what tg128 measures)
    decode_pooled_tokens_per_s: float  # every request's tokens after its first over their decode time (bench's rate)
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    draft_n: int
    draft_accepted: int
    drafting_turns: float | None = None  # share of the server's multi-slot turns the draft gate let draft
    kv_tokens_peak: int | None = None  # most KV positions in use (all slots) while the level ran
    prompt_hit: float | None = None  # prompt tokens the server took from its cache / all, during the level
    rounds_tokens_per_s: list[float] = field(default_factory=list)  # every round's tok/s (--rounds)


def load_prompts(path: Path, category: str | None) -> list[list[dict]]:
    data = json.loads(path.read_text())
    cats = [category] if category else sorted(data)
    return [item["messages"] for cat in cats for item in data[cat]]


SYSTEM_WORDS = ("You are a meticulous assistant for a software team. Follow the house style: answer "
                "precisely, quote code exactly, keep explanations short, and say when you are unsure. ")
LONG_TOKENS = (2048, 4096, 8192)
TENANTS = ("harbour", "orchard", "quarry", "lantern", "meadow", "foundry", "glacier", "bazaar")


def mix_conversations(conversations: list[list[dict]], mix: str) -> list[list[dict]]:
    """The workload's conversations as the mix wants them (about 4 characters a token)."""
    if mix == "workload":
        return conversations
    if mix == "shared-system":
        system = SYSTEM_WORDS * (4000 // len(SYSTEM_WORDS))
        return [[{"role": "system", "content": system}, *[m for m in c if m["role"] != "system"]]
                for c in conversations]
    if mix == "tenants":
        out = []
        for i, c in enumerate(conversations):
            name = TENANTS[i % len(TENANTS)]
            preamble = f"Tenant {name}: every answer is for the {name} team. "
            system = preamble + SYSTEM_WORDS * (3800 // len(SYSTEM_WORDS))
            out.append([{"role": "system", "content": system}, *[m for m in c if m["role"] != "system"]])
        return out
    if mix == "long":
        out = []
        for i, c in enumerate(conversations):
            text = "\n".join(m["content"] for m in c)
            target = 4 * LONG_TOKENS[i % len(LONG_TOKENS)]
            body = (text + "\n") * (target // (len(text) + 1) + 1)
            out.append([{"role": "user", "content": body[:target] + "\nSummarise the text above in one line."}])
        return out
    raise SystemExit(f"unknown mix {mix!r} (workload, shared-system, tenants, long)")


async def run_level(url: str, headers: dict[str, str], prompts: list[str], clients: int, requests: int,
                    n_predict: int, mode: str, cache_prompt: bool = False, client_procs: int = 1) -> LevelResult:
    n_procs = max(1, min(client_procs, clients // 8))  # a process per 8 clients at least
    sampler = KVPeak(url, headers)
    if n_procs == 1:
        t0, t1, all_stats = await run_clients(url, headers, prompts, list(range(clients)), clients, requests,
                                               n_predict, mode, cache_prompt)
        wall = t1 - t0
    else:
        wall, all_stats = await asyncio.to_thread(run_in_processes, n_procs, url, headers, prompts, clients,
                                                  requests, n_predict, mode, cache_prompt)
    kv_peak = sampler.result()
    ttft = np.array([s.ttft for s in all_stats]) * 1000
    gaps = np.array([g for s in all_stats for g in s.gaps] or [0.0]) * 1000
    tokens = sum(s.tokens for s in all_stats)
    decoding = [s for s in all_stats if s.decode_s > 0]
    per_request = [(s.tokens - 1) / s.decode_s for s in decoding]
    decode_rate = float(np.median(per_request)) if per_request else 0.0
    pooled = sum(s.tokens - 1 for s in decoding) / sum(s.decode_s for s in decoding) if decoding else 0.0
    return LevelResult(
        mode=mode, clients=clients, requests=len(all_stats), tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
        decode_tokens_per_s=decode_rate, decode_pooled_tokens_per_s=pooled,
        ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)),
        itl_p50_ms=float(np.percentile(gaps, 50)), itl_p99_ms=float(np.percentile(gaps, 99)),
        draft_n=sum(s.draft_n for s in all_stats), draft_accepted=sum(s.draft_accepted for s in all_stats),
        kv_tokens_peak=kv_peak,
    )


def gate_turns(url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """The server's draft-gate turn counters (draft, plain) from /metrics; None where it has none."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None
    found = dict(re.findall(r'draft_gate_turns_total\{choice="(\w+)"\} ([0-9.e+]+)', text))
    return (float(found["draft"]), float(found["plain"])) if {"draft", "plain"} <= found.keys() else None


def prompt_counters(url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """The server's prompt tokens evaluated and taken from its cache, from /metrics (None: it has no such pair)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None
    found = dict(re.findall(r"^\S*(prompt_tokens(?:_cached)?)_total ([0-9.e+]+)$", text, re.M))
    return (float(found["prompt_tokens"]), float(found["prompt_tokens_cached"])) if len(found) == 2 else None


def render_prompts(url: str, headers: dict[str, str], conversations: list[list[dict]]) -> list[str]:
    out = []
    for messages in conversations:
        r = httpx.post(url + "/apply-template", json={"messages": messages}, headers=headers, timeout=60)
        r.raise_for_status()
        out.append(r.json()["prompt"])
    return out


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The server to measure: --url, else the `specserve serve` that start_server starts (--server-args last)."""
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"))
    p.add_argument("-m", "--model", default="smollm2-135m", help="model for the server this script starts")
    p.add_argument("-md", "--model-draft", default=None, help="draft model for the started server")
    p.add_argument("--device", default=None)
    p.add_argument("--slot-ctx", type=int, default=2048,
                   help="KV positions a slot of the started server's pool (-c: this times the slots)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for `specserve serve`")
    p.add_argument("--load-timeout", type=float, default=600)


def start_server(args: argparse.Namespace, n_slots: int) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "-m", args.model, "-np", str(n_slots),
           "-c", str(args.slot_ctx * n_slots), "--port", str(port), "--metrics", *args.server_args]
    if args.device:
        cmd += ["--device", args.device]
    if args.model_draft:
        cmd += ["-md", args.model_draft]
    log = open(Path(tempfile.gettempdir()) / "serve_bench_server.log", "w")  # noqa: SIM115 - lives with the process
    print(f"starting: {' '.join(cmd)} (log: {log.name})", file=sys.stderr)
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}  # spinning torch threads starve the HTTP threads
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.load_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"server not ready after {args.load_timeout}s; see {log.name}")


def median_run(runs: list[LevelResult]) -> LevelResult:
    """The run of median tok/s (the lower middle of an even count), carrying every run's rate."""
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.rounds_tokens_per_s = [r.tokens_per_s for r in runs]
    return chosen


def print_table(results: list[LevelResult]) -> None:
    head = (f"{'mode':<14} {'clients':>7} {'reqs':>5} {'tokens':>7} {'tok/s':>8} {'decode':>8} {'pooled':>8} "
            f"{'TTFT p50':>9} "
            f"{'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'accept':>12} {'drafting':>8} {'KV peak':>8} {'hit':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        acc = f"{r.draft_accepted}/{r.draft_n}" if r.draft_n else "-"
        drafting = f"{100 * r.drafting_turns:.0f}%" if r.drafting_turns is not None and r.mode != "none" else "-"
        print(f"{r.mode:<14} {r.clients:>7} {r.requests:>5} {r.tokens:>7} {r.tokens_per_s:>8.1f} "
              f"{r.decode_tokens_per_s:>8.1f} {r.decode_pooled_tokens_per_s:>8.1f} "
              f"{r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>7.0f}ms {r.itl_p50_ms:>6.1f}ms {r.itl_p99_ms:>6.1f}ms "
              f"{acc:>12} {drafting:>8} {r.kv_tokens_peak if r.kv_tokens_peak is not None else '-':>8} "
              f"{f'{100 * r.prompt_hit:.0f}%' if r.prompt_hit is not None else '-':>5}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each level's modes, interleaved; the table shows each mode's median run")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="client processes at most (one per 8 clients at most; default: half the cores, up to 8)")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--modes", default="none,ngram-simple",
                   help="comma-separated: none (no speculation) or a speculative.type per request")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="workloads/prompts.json")
    p.add_argument("--category", default=None, help="only this prompt category (default: all)")
    p.add_argument("--mix", default="workload", choices=("workload", "shared-system", "tenants", "long"),
                   help="prompt mix (module docstring)")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args()

    levels = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    conversations = mix_conversations(load_prompts(args.prompts, args.category), args.mix)
    if args.mix == "long":
        args.slot_ctx = max(args.slot_ctx, max(LONG_TOKENS) + 512 + args.n_predict)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args, max(levels))
    try:
        props = httpx.get(url + "/props", headers=headers, timeout=30).json()
        prompts = render_prompts(url, headers, conversations)
        for mode in modes:  # warm-up: a mode's first request pays one-time costs (e.g. kernels first loaded)
            asyncio.run(run_level(url, headers, prompts[:1], 1, 1, 8, mode))
        results = []
        for clients in levels:
            runs: dict[str, list[LevelResult]] = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode in modes:  # modes side by side at each level: load changes hit all alike
                    before, read = gate_turns(url, headers), prompt_counters(url, headers)
                    res = asyncio.run(run_level(url, headers, prompts, clients, args.requests, args.n_predict,
                                                mode, cache_prompt=args.mix in ("shared-system", "tenants"),
                                                client_procs=args.client_procs))
                    after, done = gate_turns(url, headers), prompt_counters(url, headers)
                    if before and after and sum(after) > sum(before):
                        res.drafting_turns = (after[0] - before[0]) / (sum(after) - sum(before))
                    if read and done and sum(done) > sum(read):
                        res.prompt_hit = (done[1] - read[1]) / (sum(done) - sum(read))
                    runs[mode].append(res)
                    print(f"{mode} x{clients}: {res.tokens_per_s:.1f} tok/s", file=sys.stderr)
            results += [median_run(runs[mode]) for mode in modes]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print_table(results)
    model = Path(props.get("model_alias") or props.get("model_path") or args.model).name.removesuffix(".gguf")
    device = args.device or ("remote" if args.url else "default")
    mix = "" if args.mix == "workload" else f"_{args.mix}"
    out = output_path(str(args.out) if args.out else None, f"serve_{model}_{device}{mix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": model, "url": args.url, "slots": props.get("total_slots"), "n_predict": args.n_predict,
        "requests_per_client": args.requests, "prompts": str(args.prompts), "mix": args.mix,
        "host": platform.node(),
        "results": [asdict(r) for r in results],
    }, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
