"""serve_bench's streaming clients: one request's timings, clients over a connection pool (in client processes
past 8), and the KV sampler, each in a process of its own so that it takes no time from the clients."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

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


class RawStream:
    """One client's keep-alive HTTP/1.1 connection, reading a streamed answer's chunks (chunked transfer encoding)
    with little work per server-sent event: an httpx stream costs ~100 us an event, which on a small box made the
    clients, not the server, the bottleneck."""

    def __init__(self, url: str, headers: dict[str, str]):
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise SystemExit(f"serve_bench's clients speak plain http, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST body to path; yields each event's data (after `data: `) as it arrives."""
        assert self._reader is not None and self._writer is not None, "connect() first"
        payload = json.dumps(body).encode()
        self._writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(payload)}\r\n{self.head}\r\n".encode() + payload)
        head = (await self._reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:])}
        chunked = "chunked" in fields.get("transfer-encoding", "")
        if status != 200 or not chunked:
            data = (b"".join([c async for c in self._chunks()]) if chunked
                    else await self._reader.readexactly(int(fields.get("content-length", "0"))))
            raise RuntimeError(f"HTTP {status}: {data.decode(errors='replace')[:300]}")
        pending = b""
        async for chunk in self._chunks():
            pending += chunk
            *complete, pending = pending.split(b"\n\n")
            for event in complete:
                if event.startswith(b"data: "):
                    yield event[6:]

    async def _chunks(self) -> AsyncIterator[bytes]:
        """A chunked body's chunks, to its end."""
        assert self._reader is not None
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await self._reader.readexactly(size + 2)  # the data and its CRLF
            if size == 0:
                return
            yield chunk[:-2]


async def one_request(stream: RawStream, prompt: str, n_predict: int, mode: str,
                      cache_prompt: bool = False) -> RequestStats:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "stream": True, "return_tokens": True,
            "cache_prompt": cache_prompt, **spec_fields(mode)}
    stats = RequestStats()
    t0 = last = time.perf_counter()
    async for data in stream.events("/completion", body):
        if data == b"[DONE]":
            continue
        event = json.loads(data)
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
    """Clients `ids` (of `clients`), a connection each, each sending its requests one after another. Their
    connections open before the clock starts (connecting is not the server's work), then `ready()` (e.g. a
    barrier with other client processes). Returns (start, end, stats)."""
    streams = [RawStream(url, headers) for _ in ids]
    await asyncio.gather(*(s.connect() for s in streams))
    try:
        if ready is not None:
            await asyncio.to_thread(ready)

        async def client_loop(i: int, stream: RawStream) -> list[RequestStats]:
            return [await one_request(stream, prompts[(i + k * clients) % len(prompts)], n_predict, mode,
                                      cache_prompt) for k in range(requests)]

        t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        per_client = await asyncio.gather(*(client_loop(i, s) for i, s in zip(ids, streams, strict=True)))
        t1 = time.perf_counter()
    finally:
        await asyncio.gather(*(s.close() for s in streams))
    return t0, t1, [s for stats in per_client for s in stats]


def _client_process(job: tuple, start: Any, results: Any) -> None:
    """One client process: connects, waits for the others, runs its share, reports (start, end, stats)."""
    results.put(asyncio.run(run_clients(*job, ready=lambda: start.wait(timeout=120))))


def run_in_processes(n_procs: int, url: str, headers: dict[str, str], prompts: list[str], clients: int,
                      requests: int, n_predict: int, mode: str, cache_prompt: bool) -> tuple[float, list]:
    """The clients spread over n_procs processes (one process reads some tens of thousands of events a second).
    Returns (wall seconds, stats)."""
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
