"""Soak benchmark: N streaming clients for T minutes against one `specserve serve`, some hanging up mid-stream.

    python benchmarks/soak_bench.py                                 # 64 clients x 10 min, smollm2-135m on the CPU
    python benchmarks/soak_bench.py --clients 4 --minutes 0.5       # a short check

Without --url it starts `specserve serve` itself (--slots slots, so requests also wait in its queue). Each
client streams llama-server's native /completion one request after another (chat prompts from
workloads/prompts.json rendered by /apply-template, n_predict drawn from 8..--n-predict); with probability
--disconnect it closes the connection after a few events. Counted: requests, disconnects (on purpose), errors
(a status other than 200, an error event, a transport error), truncated answers (a stream that ended without
its final `stop: true` event, or whose token count disagrees with it). After the clients stop: whether every
slot is idle (GET /slots) and how long that took; the server's RSS after warm-up and at the end (Linux /proc,
only for a server started here) and its growth. Prints a table and writes JSON (benchmarks/bench_output.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from bench_output import output_path, print_table, write_json
from serve_bench import DEFAULT_PROMPTS, load_prompts, render_prompts, start_server


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0  # closed by the client on purpose
    errors: int = 0
    truncated: int = 0
    tokens: int = 0
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(what[:300])


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process (Linux), MB."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def one_request(client: httpx.AsyncClient, tally: Tally, prompt: str, n_predict: int,
                      hang_up_after: int | None) -> None:
    tally.requests += 1
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.7, "stream": True}
    events = tokens = 0
    final = None
    try:
        async with client.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                tally.error(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.error(f"error event: {event['error']}")
                    return
                events += 1
                if event.get("stop"):
                    final = event
                    break
                tokens += len(event.get("tokens", []))
                if hang_up_after is not None and events >= hang_up_after:
                    tally.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        tally.error(f"{type(exc).__name__}: {exc}")
        return
    if final is None or final.get("tokens_predicted") != tokens:
        tally.truncated += 1
        return
    tally.completed += 1
    tally.tokens += tokens


async def soak(url: str, headers: dict[str, str], prompts: list[str], args: argparse.Namespace) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + args.minutes * 60
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients)

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:
            while time.monotonic() < deadline:
                hang_up = rng.randint(1, 5) if rng.random() < args.disconnect else None
                await one_request(client, tally, prompts[rng.randrange(len(prompts))],
                                  rng.randint(8, args.n_predict), hang_up)

    await asyncio.gather(*(client_loop(i) for i in range(args.clients)))
    return tally


def slots_idle(url: str, headers: dict[str, str], timeout: float) -> tuple[bool, float]:
    """(every slot idle, seconds it took) once the clients are gone."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        slots = httpx.get(url + "/slots", headers=headers, timeout=30).json()
        if not any(s["is_processing"] for s in slots):
            return True, time.monotonic() - t0
        time.sleep(0.1)
    return False, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="soak a running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"))
    p.add_argument("-m", "--model", default="smollm2-135m", help="model for the server this script starts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--slots", type=int, default=16, help="slots (-np) of the started server")
    p.add_argument("--slot-ctx", type=int, default=512,
                   help="KV positions a slot of the started server's pool (-c: this times the slots)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for `specserve serve`")
    p.add_argument("--load-timeout", type=float, default=600)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("-n", "--n-predict", type=int, default=48, help="most tokens a request asks for (at least 8)")
    p.add_argument("--disconnect", type=float, default=0.33, help="share of requests the client hangs up on")
    p.add_argument("--timeout", type=float, default=300, help="seconds a client waits for a read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="workloads/prompts.json")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args()
    args.model_draft = None  # (serve_bench.start_server's arguments)
    if args.clients < 1 or args.minutes <= 0 or args.n_predict < 8 or not 0 <= args.disconnect <= 1:
        p.error("--clients >= 1, --minutes > 0, --n-predict >= 8 and --disconnect in [0, 1]")

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc, url = (None, args.url) if args.url else start_server(args, args.slots)
    pid = proc.pid if proc is not None else None
    try:
        prompts = render_prompts(url, headers, load_prompts(args.prompts, None))
        asyncio.run(soak(url, headers, prompts[:1], argparse.Namespace(**{**vars(args), "clients": 1,
                                                                         "minutes": 0.01, "disconnect": 0})))
        rss_start = rss_mb(pid)
        t0 = time.monotonic()
        tally = asyncio.run(soak(url, headers, prompts, args))
        wall = time.monotonic() - t0
        idle, idle_s = slots_idle(url, headers, timeout=60)
        rss_end = rss_mb(pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    growth = 100 * (rss_end - rss_start) / rss_start if rss_start and rss_end else None
    row = {"clients": args.clients, "minutes": args.minutes, **{k: v for k, v in asdict(tally).items()
                                                               if k != "error_samples"},
           "tokens_per_s": round(tally.tokens / wall, 1), "slots_idle": idle, "idle_after_s": round(idle_s, 2),
           "rss_start_mb": round(rss_start, 1) if rss_start else None,
           "rss_end_mb": round(rss_end, 1) if rss_end else None,
           "rss_growth_pct": round(growth, 2) if growth is not None else None}
    print_table([row], list(row))
    for sample in tally.error_samples:
        print(f"error: {sample}", file=sys.stderr)
    name = Path(args.model).name.removesuffix(".gguf")
    write_json(output_path(str(args.out) if args.out else None, f"soak_{name}_{args.device}.json"),
               {"url": args.url, "slots": args.slots, "slot_ctx": args.slot_ctx, "n_predict": args.n_predict,
                "disconnect": args.disconnect, "wall_s": round(wall, 1), "result": row,
                "error_samples": tally.error_samples})
    return 0 if tally.errors == tally.truncated == 0 and idle else 1


if __name__ == "__main__":
    sys.exit(main())
