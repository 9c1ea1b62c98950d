"""serve_bench's streaming clients: one request's timings, clients over a connection pool (in client processes
past 8), and the KV sampler, each in a process of its own so that it takes no time from the clients."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestStats:
    ttft: float = 0.0  # seconds to the first generated token
    gaps: list[float] = field(default_factory=list)  # per-token inter-token latencies
    tokens: int = 0
    decode_s: float = 0.0  # from the first generated token to the last
    draft_n: int = 0
    draft_accepted: int = 0


def kv_tokens(client: httpx.Client) -> int | None:
    """KV positions in use, from /metrics; None where the server has no such gauge."""
    try:
        text = client.get("/metrics").text
    except httpx.HTTPError:
        return None
    found = re.search(r"^\S*kv_cache_tokens(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return int(float(found.group(1))) if found else None


def _sample_kv_peak(url: str, headers: dict[str, str], started: Any, stop: Any, peak_out: Any) -> None:
    """A process of its own, so that its scrapes take no time from the clients' event loop."""
    peak: int | None = None
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        while True:
            value = kv_tokens(client)
            if value is not None:
                peak = max(peak or 0, value)
            started.set()
            if stop.wait(0.25):
                break
    peak_out.put(peak)


class KVPeak:
    """The most KV positions in use while a level runs, sampled from /metrics every 0.25 s."""

    def __init__(self, url: str, headers: dict[str, str]):
        ctx = multiprocessing.get_context("spawn")
        started, self._stop, self._peak = ctx.Event(), ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_sample_kv_peak, args=(url, headers, started, self._stop, self._peak),
                                 daemon=True)
        self._proc.start()
        started.wait(120)  # its first scrape done: it samples the whole level

    def result(self) -> int | None:
        self._stop.set()
        peak = self._peak.get(timeout=60)
        self._proc.join(30)
        return peak


def spec_fields(mode: str) -> dict[str, object]:
    return {"speculative.n_max": 0} if mode == "none" else {"speculative.type": mode}


async def one_request(client: httpx.AsyncClient, prompt: str, n_predict: int, mode: str,
                      cache_prompt: bool = False) -> RequestStats:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "stream": True, "return_tokens": True,
            "cache_prompt": cache_prompt, **spec_fields(mode)}
    stats = RequestStats()
    t0 = last = time.perf_counter()
    async with client.stream("POST", "/completion", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            n = len(event.get("tokens") or [])
            now = time.perf_counter()
            if n:
                if stats.tokens == 0:
                    stats.ttft = now - t0
                else:
                    stats.gaps.extend([(now - last) / n] * n)
                stats.tokens += n
                last = now
                stats.decode_s = now - t0 - stats.ttft
            if event.get("stop"):
                timings = event.get("timings", {})
                stats.draft_n = timings.get("draft_n", 0)
                stats.draft_accepted = timings.get("draft_n_accepted", 0)
    return stats


async def run_clients(url: str, headers: dict[str, str], prompts: list[str], ids: list[int], clients: int,
                       requests: int, n_predict: int, mode: str, cache_prompt: bool,
                       ready: Callable[[], Any] | None = None) -> tuple[float, float, list[RequestStats]]:
    """Clients `ids` (of `clients`) over one connection pool, each sending its requests one after another.
    Their connections open before the clock starts (a client keeps its connection; connecting is not the
    server's work), then `ready()` (e.g. a barrier with other client processes). Returns (start, end, stats)."""
    limits = httpx.Limits(max_connections=len(ids) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        await asyncio.gather(*(client.get("/health") for _ in ids))  # one connection each, concurrently
        if ready is not None:
            await asyncio.to_thread(ready)

        async def client_loop(i: int) -> list[RequestStats]:
            return [await one_request(client, prompts[(i + k * clients) % len(prompts)], n_predict, mode,
                                      cache_prompt) for k in range(requests)]

        t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        per_client = await asyncio.gather(*(client_loop(i) for i in ids))
        t1 = time.perf_counter()
    return t0, t1, [s for stats in per_client for s in stats]


def _client_process(job: tuple, start: Any, results: Any) -> None:
    """One client process: connects, waits for the others, runs its share, reports (start, end, stats)."""
    results.put(asyncio.run(run_clients(*job, ready=lambda: start.wait(timeout=120))))


def run_in_processes(n_procs: int, url: str, headers: dict[str, str], prompts: list[str], clients: int,
                      requests: int, n_predict: int, mode: str, cache_prompt: bool) -> tuple[float, list]:
    """The clients spread over n_procs processes: one Python process parses ~10k events/s, which is less than
    the server sends at 64 clients. Returns (wall seconds, stats)."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(n_procs), ctx.Queue()
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=((url, headers, prompts, list(range(k, clients, n_procs)), clients, requests,
                                n_predict, mode, cache_prompt), start, results)) for k in range(n_procs)]
    for proc in procs:
        proc.start()
    done = [results.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join(30)
    wall = max(t1 for _, t1, _ in done) - min(t0 for t0, _, _ in done)
    return wall, [s for _, _, stats in done for s in stats]
