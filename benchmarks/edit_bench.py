"""Whole-file code edits and agent loops through a running server: plain greedy, predicted outputs, n-gram drafts.

    python benchmarks/edit_bench.py --url http://127.0.0.1:8080
    python benchmarks/edit_bench.py --url http://127.0.0.1:8091 --limit 2 --max-tokens 64 --modes none
    python benchmarks/edit_bench.py --url http://127.0.0.1:8080 --modes none,prediction,ngram-suffix \
        --agent-modes none,ngram-suffix --concurrency 4 -o edit.json

Two workloads, both in benchmarks/workloads/:

- `edits.json`: whole-file edits of CPython standard library modules (edit_files/, 50-400 lines each). The
  prompt is the instruction and the whole file in a ```python block; the answer is the whole edited file. Mode
  `prediction` sends the file as given as OpenAI's predicted output (`"prediction": {"type": "content",
  "content": FILE}`), which the answer repeats but for the edit.
- `agent_loop.json`: multi-turn agent conversations (assistant tool calls, `role: "tool"` results) that end on
  a tool result or a user question whose answer quotes the earlier tool output: files, tracebacks, grep and diff
  output.

A mode is `none` (no speculation: `"speculative.n_max": 0`), `prediction` (the prediction field, with the
server's own speculation settings otherwise), a `speculative.type` sent per request (`ngram-suffix`, ...), or
`prediction+TYPE` (both); a part `treeN` adds `"speculative.tree_nodes": N` (token trees of up to N nodes from every
drafter's candidate: `prediction+ngram-suffix+tree24`). The agent loop has no prediction to send: its prediction
modes are skipped.

Every request streams /v1/chat/completions greedily (temperature 0) with max_tokens = the tokens of the file
(edits) or of the longest tool output (agent loop), as /tokenize counts them, plus --extra-tokens; --max-tokens
caps it. Each item first gets a 1-token request (its prompt then waits in the server's cache for every mode), then
its modes one after another; --concurrency runs that many items at a time, so every mode meets the same load
(with --modes-in-turn, every item in one mode before the next mode: each mode then meets only itself, a clean A/B
under load, where interleaved modes make a mode's rate depend on the others in flight beside it). Each
mode of a run sends its own `speculative.scope`, so it drafts from the earlier answers of that mode only, never from
an answer another mode gave for the same item (`--one-store`: one store for all).

Per workload and mode it reports the generated tokens/s after each answer's first token, pooled over the answers
((tokens - 1) / time from the first network read of text to the read of the finish), its speedup over `none`, the
same from the server's `timings.predicted_per_second` where the server sends timings (specserve and llama-server
do), how many answers equal the `none` answer (greedy speculation must not change the text), and the drafts
accepted: OpenAI's `usage.completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens` and
the timings' `draft_n_accepted` / `draft_n`, where present. An answer that arrives in one read (a tool call, which
a server holds until it has parsed it) has no client-side rate: the server columns still count it (--no-tools
sends the agent loop without tool definitions). Prints a table (and one by edit kind) and writes JSON (-o, default
edit_<model>.json in the cache's benchmarks folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_output import output_path, print_table, write_json

WORKLOADS = Path(__file__).resolve().parent / "workloads"
EDITS = WORKLOADS / "edits.json"
AGENT_LOOP = WORKLOADS / "agent_loop.json"


@dataclass
class Item:
    """One prompt of a workload: the chat messages, what max_tokens is counted from, and the prediction."""

    workload: str  # "edits" or "agent"
    id: str
    kind: str  # the edit kind; "agent" for the agent loop
    messages: list[dict[str, Any]]
    sized_by: str  # the text whose token count (+ --extra-tokens) is the request's max_tokens
    prediction: str | None = None  # the predicted output (edits: the file as given)
    tools: list[dict[str, Any]] | None = None


def edit_prompt(instruction: str, name: str, text: str) -> str:
    """The user message of an edit task: the instruction, the whole file, and the answer's form."""
    body = text if text.endswith("\n") else text + "\n"
    return (f"{instruction}\n\nThe file `{name}`:\n\n```python\n{body}```\n\n"
            "Reply with the whole edited file in one ```python block, and nothing else.")


def load_edits(path: Path = EDITS) -> list[Item]:
    """The edit tasks of edits.json, each with its file read (paths are relative to the JSON's folder; a file is
    stored as NAME.py.txt and named NAME.py in the prompt)."""
    data = json.loads(path.read_text())
    items = []
    for task in data["tasks"]:
        file = path.parent / task["file"]
        text, name = file.read_text(), file.name.removesuffix(".txt")
        items.append(Item(workload="edits", id=task["id"], kind=task["kind"],
                          messages=[{"role": "user", "content": edit_prompt(task["instruction"], name, text)}],
                          sized_by=text, prediction=text))
    return items


def load_agent_loop(path: Path = AGENT_LOOP) -> list[Item]:
    """The agent conversations of agent_loop.json; max_tokens follows the longest tool output of each."""
    data = json.loads(path.read_text())
    items = []
    for conv in data["conversations"]:
        outputs = [m["content"] for m in conv["messages"] if m["role"] == "tool"]
        items.append(Item(workload="agent", id=conv["id"], kind="agent", messages=conv["messages"],
                          sized_by=max(outputs, key=len), tools=conv.get("tools", data.get("tools"))))
    return items


def mode_fields(mode: str, prediction: str | None) -> dict[str, Any]:
    """The request fields that select a mode (module docstring)."""
    if mode == "none":
        return {"speculative.n_max": 0}
    out: dict[str, Any] = {}
    for part in mode.split("+"):
        if part == "prediction":
            if prediction is None:
                raise ValueError(f"mode {mode!r} needs a prediction")
            out["prediction"] = {"type": "content", "content": prediction}
        elif part.startswith("tree") and part[4:].isdigit():
            out["speculative.tree_nodes"] = int(part[4:])
        elif part in ("", "none") or "speculative.type" in out:
            raise ValueError(f"bad mode {mode!r}")
        else:
            out["speculative.type"] = part
    out.setdefault("speculative.tree_nodes", 0)  # a chain, whatever the server's --draft-tree says
    return out


def request_body(item: Item, mode: str, max_tokens: int, model: str | None = None,
                 scope: str | None = None) -> dict[str, Any]:
    """The streamed, greedy /v1/chat/completions request of an item in a mode; scope: the mode's requests draft from
    each other's text in the server's shared store (`speculative.scope` scope/mode), never another mode's."""
    body: dict[str, Any] = {"messages": item.messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, **mode_fields(mode, item.prediction)}
    if scope is not None and mode != "none":
        body["speculative.scope"] = f"{scope}/{mode}"
    if item.tools:
        body["tools"] = item.tools
    if model:
        body["model"] = model
    return body


def uses_prediction(mode: str) -> bool:
    return "prediction" in mode.split("+")


@dataclass
class Answer:
    """One streamed answer and its clock: the first network read that carried generated text, and the read that
    carried the finish, from the request's start."""

    text: str = ""
    tokens: int = 0  # completion tokens (usage, else timings' predicted_n, else the chunks that carried text)
    chunks: int = 0  # events that carried text
    reads: int = 0  # network reads that carried text: 1 when the server held the whole answer back (a tool call)
    ttft_s: float = 0.0
    decode_s: float = 0.0  # the first read with text to the read with the finish
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None

    def tokens_per_s(self) -> float | None:
        """Generated tokens after the first over the time after it; None without two reads of text to time."""
        if self.error or self.reads < 2 or self.tokens < 2 or self.decode_s <= 0:
            return None
        return (self.tokens - 1) / self.decode_s


def delta_text(delta: dict[str, Any]) -> str:
    """What a chat delta adds to the answer: content, reasoning, and tool calls' names and arguments."""
    parts = [delta.get("reasoning_content") or "", delta.get("content") or ""]
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        parts += [fn.get("name") or "", fn.get("arguments") or ""]
    return "".join(parts)


class StreamReader:
    """Reads an OpenAI chat stream's server-sent events into an Answer, a network read at a time: events of one
    read share its time (perf_counter seconds), so text a server held back and sent at once has no clock."""

    def __init__(self, start: float):
        self.start = start
        self.answer = Answer()
        self.pieces: list[str] = []
        self.buffer = ""
        self.first: float | None = None
        self.last: float | None = None

    def feed(self, data: str, now: float) -> bool:
        """Take the text of one network read; False once the stream said [DONE] or sent an error."""
        self.buffer += data
        *lines, self.buffer = self.buffer.split("\n")
        had_text = False
        going = True
        for line in lines:
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                going = False
                break
            event = json.loads(payload)
            if "error" in event:
                self.answer.error = json.dumps(event["error"])[:500]
                going = False
                break
            had_text |= self.event(event, now)
        self.answer.reads += had_text
        return going

    def event(self, event: dict[str, Any], now: float) -> bool:
        """One event of the stream; whether it carried generated text."""
        had_text = False
        for choice in event.get("choices") or []:
            text = delta_text(choice.get("delta") or {})
            if text:
                had_text = True
                self.pieces.append(text)
                self.answer.chunks += 1
                if self.first is None:
                    self.first = now
                self.last = now
            if choice.get("finish_reason"):
                self.answer.finish_reason = choice["finish_reason"]
                self.last = now
        if event.get("usage"):
            self.answer.usage = event["usage"]
        if event.get("timings"):
            self.answer.timings = event["timings"]
        return had_text

    def finish(self) -> Answer:
        a = self.answer
        a.text = "".join(self.pieces)
        if a.usage and a.usage.get("completion_tokens") is not None:
            a.tokens = int(a.usage["completion_tokens"])
        elif a.timings and a.timings.get("predicted_n") is not None:
            a.tokens = int(a.timings["predicted_n"])
        else:
            a.tokens = a.chunks
        if self.first is not None and self.last is not None:
            a.ttft_s = self.first - self.start
            a.decode_s = self.last - self.first
        return a


async def stream_answer(client: httpx.AsyncClient, body: dict[str, Any]) -> Answer:
    """POST the body to /v1/chat/completions and read the stream (an HTTP error is the answer's error)."""
    reader = StreamReader(time.perf_counter())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                reader.answer.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
                return reader.answer
            async for data in r.aiter_text():
                if not reader.feed(data, time.perf_counter()):
                    break
    except httpx.HTTPError as e:
        reader.answer.error = f"{type(e).__name__}: {e}"
        return reader.answer
    return reader.finish()


def count_tokens(url: str, headers: dict[str, str], text: str) -> int | None:
    """The server's token count of a text (llama-server's /tokenize); None where it has no such endpoint."""
    try:
        r = httpx.post(url + "/tokenize", json={"content": text}, headers=headers, timeout=60)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return len(r.json().get("tokens", []))


def max_tokens_for(items: Sequence[Item], url: str, headers: dict[str, str], extra: int,
                   cap: int | None) -> dict[str, int]:
    """Each item's max_tokens: its text's tokens + extra (about 3 characters a token without /tokenize), capped."""
    out = {}
    for item in items:
        n = count_tokens(url, headers, item.sized_by)
        if n is None:
            n = len(item.sized_by) // 3
        out[item.id] = min(n + extra, cap) if cap else n + extra
    return out


def server_model(url: str, headers: dict[str, str]) -> str:
    """The served model's name: llama-server's /props, else the first of /v1/models."""
    try:
        props = httpx.get(url + "/props", headers=headers, timeout=30)
        if props.status_code == 200:
            p = props.json()
            name = p.get("model_alias") or p.get("model_path")
            if name:
                return Path(name).name.removesuffix(".gguf")
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        if models.status_code == 200 and models.json().get("data"):
            return str(models.json()["data"][0]["id"])
    except httpx.HTTPError:
        pass
    return "server"


@dataclass
class ItemResult:
    workload: str
    id: str
    kind: str
    mode: str
    max_tokens: int
    tokens: int
    ttft_s: float
    decode_s: float
    tokens_per_s: float | None  # (tokens - 1) / decode_s; None when the text came in one read (held back)
    server_tokens_per_s: float | None  # timings.predicted_per_second
    finish_reason: str | None
    text_sha1: str
    text_chars: int
    identical_to_none: bool | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    error: str | None = None
    text: str | None = None  # with --save-texts


def item_result(item: Item, mode: str, max_tokens: int, a: Answer, save_text: bool) -> ItemResult:
    details = (a.usage or {}).get("completion_tokens_details") or {}
    timings = a.timings or {}
    rate = a.tokens_per_s()
    return ItemResult(
        workload=item.workload, id=item.id, kind=item.kind, mode=mode, max_tokens=max_tokens, tokens=a.tokens,
        ttft_s=round(a.ttft_s, 4), decode_s=round(a.decode_s, 6), tokens_per_s=round(rate, 2) if rate else None,
        server_tokens_per_s=timings.get("predicted_per_second"), finish_reason=a.finish_reason,
        text_sha1=hashlib.sha1(a.text.encode()).hexdigest(), text_chars=len(a.text),
        accepted_prediction_tokens=details.get("accepted_prediction_tokens"),
        rejected_prediction_tokens=details.get("rejected_prediction_tokens"),
        draft_n=timings.get("draft_n"), draft_n_accepted=timings.get("draft_n_accepted"), error=a.error,
        text=a.text if save_text else None,
    )


@dataclass
class Settings:
    """How the items are sent."""

    url: str
    headers: dict[str, str]
    timeout: float = 1800
    model: str | None = None  # the request's model field
    concurrency: int = 1
    prime: bool = True  # a 1-token request before an item's modes, so each finds its prompt in the server's cache
    save_text: bool = False
    transport: httpx.AsyncBaseTransport | None = None  # tests: a stand-in server
    scope: str | None = None  # request_body's: None, every mode drafts from every earlier answer
    modes_in_turn: bool = False  # every item in a mode before the next mode (run_items)


async def run_items(settings: Settings, items: Sequence[Item], modes: Sequence[str],
                    max_tokens: dict[str, int]) -> list[ItemResult]:
    """Every item in every mode, the modes of an item one after another (after its priming request) and
    `concurrency` items at a time, so that every mode meets the same load (modes_in_turn: all items in one mode,
    then the next mode); results in the items' order."""
    gate = asyncio.Semaphore(settings.concurrency)
    limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
    async with httpx.AsyncClient(base_url=settings.url, headers=settings.headers, timeout=settings.timeout,
                                 limits=limits, transport=settings.transport) as client:

        async def one(item: Item, item_modes: Sequence[str]) -> list[ItemResult]:
            out = []
            async with gate:
                if settings.prime:
                    await stream_answer(client, request_body(item, "none", 1, settings.model))
                for mode in item_modes:
                    body = request_body(item, mode, max_tokens[item.id], settings.model, settings.scope)
                    answer = await stream_answer(client, body)
                    out.append(item_result(item, mode, max_tokens[item.id], answer, settings.save_text))
            shown = [f"{r.mode} {r.tokens_per_s:.1f}" if r.tokens_per_s else f"{r.mode} {(r.error or 'held')[:100]}"
                     for r in out]
            print(f"  {item.workload} {item.id} ({out[0].tokens} tokens): {', '.join(shown)}", file=sys.stderr,
                  flush=True)
            return out

        if not settings.modes_in_turn:
            groups = await asyncio.gather(*(one(item, modes) for item in items))
            return [r for group in groups for r in group]
        by_mode = [await asyncio.gather(*(one(item, [mode]) for item in items)) for mode in modes]
    return [by_mode[m][i][0] for i in range(len(items)) for m in range(len(modes))]


async def warm_up(settings: Settings, item: Item, modes: Sequence[str]) -> None:
    """A short request per mode first: a mode's first request pays one-time costs."""
    async with httpx.AsyncClient(base_url=settings.url, headers=settings.headers, timeout=settings.timeout,
                                 transport=settings.transport) as client:
        for mode in modes:
            await stream_answer(client, request_body(item, mode, 8, settings.model, settings.scope))


def mark_identical(results: list[ItemResult]) -> None:
    """identical_to_none on every answered result, against the same item's `none` answer."""
    none = {(r.workload, r.id): r for r in results if r.mode == "none" and r.error is None}
    for r in results:
        base = none.get((r.workload, r.id))
        if base is not None and r.error is None:
            r.identical_to_none = r.text_sha1 == base.text_sha1


def _sum(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def summarize(results: Sequence[ItemResult], group: str) -> list[dict[str, Any]]:
    """A row per (group value, mode): pooled rates, speedup over none, identical answers, drafts."""
    keys = list(dict.fromkeys((getattr(r, group), r.mode) for r in results))
    rows = []
    for key, mode in keys:
        rs = [r for r in results if getattr(r, group) == key and r.mode == mode]
        ok = [r for r in rs if r.error is None]
        timed = [r for r in ok if r.tokens_per_s]
        rate = sum(r.tokens - 1 for r in timed) / sum(r.decode_s for r in timed) if timed else None
        served = [r for r in ok if r.server_tokens_per_s]
        server_rate = (sum(r.tokens for r in served) / sum(r.tokens / r.server_tokens_per_s for r in served)
                       if served else None)
        compared = [r for r in ok if r.identical_to_none is not None]
        rows.append({
            group: key, "mode": mode, "items": len(rs), "errors": len(rs) - len(ok),
            "tokens": sum(r.tokens for r in ok),
            "tokens_per_s": round(rate, 2) if rate else None,
            "server_tokens_per_s": round(server_rate, 2) if server_rate else None,
            "ttft_p50_s": round(statistics.median(r.ttft_s for r in ok), 3) if ok else None,
            "identical": f"{sum(r.identical_to_none for r in compared)}/{len(compared)}" if compared else None,
            "accepted_prediction_tokens": _sum([r.accepted_prediction_tokens for r in ok]),
            "rejected_prediction_tokens": _sum([r.rejected_prediction_tokens for r in ok]),
            "draft_n": _sum([r.draft_n for r in ok]), "draft_n_accepted": _sum([r.draft_n_accepted for r in ok]),
        })
    for row in rows:
        base = next((b for b in rows if b[group] == row[group] and b["mode"] == "none"), None)
        for rate, speedup in (("tokens_per_s", "speedup"), ("server_tokens_per_s", "server_speedup")):
            if base and base[rate] and row[rate]:
                row[speedup] = round(row[rate] / base[rate], 3)
    return rows


def table_rows(rows: Sequence[dict[str, Any]], group: str) -> list[dict[str, object]]:
    """The summary rows as printed: rates to one decimal, drafts as accepted/drafted."""
    out = []
    for row in rows:
        shown: dict[str, object] = {group: row[group], "mode": row["mode"], "items": row["items"],
                                    "errors": row["errors"], "tokens": row["tokens"]}
        for key, label, form in (("tokens_per_s", "tok/s", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
                                 ("server_tokens_per_s", "server tok/s", "{:.1f}"),
                                 ("server_speedup", "server x", "{:.2f}x"), ("ttft_p50_s", "TTFT p50", "{:.2f}s"),
                                 ("identical", "identical", "{}")):
            if row.get(key) is not None:
                shown[label] = form.format(row[key])
        acc, rej = row.get("accepted_prediction_tokens"), row.get("rejected_prediction_tokens")
        if acc is not None or rej is not None:
            shown["prediction acc"] = f"{acc or 0}/{(acc or 0) + (rej or 0)}"
        if row.get("draft_n"):
            shown["drafts acc"] = f"{row['draft_n_accepted']}/{row['draft_n']}"
        out.append(shown)
    return out


def parse_modes(text: str) -> list[str]:
    """Comma-separated modes with `none` first (the baseline every other mode is compared with)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        mode_fields(m, "")  # raises on a malformed mode
    return ["none", *[m for m in modes if m != "none"]] if "none" in modes else modes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="a running specserve serve, llama-server or OpenAI-compatible server")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"))
    p.add_argument("--model", default=None, help="the request's model field (default: none sent)")
    p.add_argument("--workloads", default="edits,agent", help="comma-separated: edits, agent")
    p.add_argument("--modes", default="none,prediction,ngram-suffix",
                   help="edit modes: none, prediction, a speculative.type, or prediction+TYPE")
    p.add_argument("--agent-modes", default="none,ngram-suffix",
                   help="agent-loop modes (prediction modes are skipped: there is no prediction)")
    p.add_argument("--edits", type=Path, default=EDITS, help="edit tasks JSON")
    p.add_argument("--agent-loop", type=Path, default=AGENT_LOOP, help="agent conversations JSON")
    p.add_argument("--no-tools", action="store_true",
                   help="send the agent loop without its tool definitions (its answers then stream as plain text)")
    p.add_argument("--limit", type=int, default=None, help="only the first N items of each workload")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--modes-in-turn", action="store_true",
                   help="run every item in one mode before the next mode (a clean A/B under --concurrency)")
    p.add_argument("--extra-tokens", type=int, default=64, help="max_tokens = tokens of the file/tool output + this")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on every request's max_tokens")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a request may take")
    p.add_argument("--no-warmup", action="store_true", help="skip the short request per mode before measuring")
    p.add_argument("--no-prime", action="store_true",
                   help="skip the 1-token request that puts an item's prompt in the server's cache before its modes")
    p.add_argument("--save-texts", action="store_true", help="keep every answer's text in the JSON")
    p.add_argument("--one-store", action="store_true",
                   help="let every mode draft from every earlier answer in the server's shared store (by default each "
                        "mode and run has its own speculative.scope, so a mode never drafts an answer another gave)")
    p.add_argument("-o", "--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args()

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    workloads: dict[str, tuple[list[Item], list[str]]] = {}
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        if name == "edits":
            workloads[name] = (load_edits(args.edits), parse_modes(args.modes))
        elif name == "agent":
            items = load_agent_loop(args.agent_loop)
            if args.no_tools:
                for item in items:
                    item.tools = None
            workloads[name] = (items, [m for m in parse_modes(args.agent_modes) if not uses_prediction(m)])
        else:
            raise SystemExit(f"unknown workload {name!r} (edits, agent)")

    model = server_model(url, headers)
    settings = Settings(url=url, headers=headers, timeout=args.timeout, model=args.model,
                        concurrency=max(1, args.concurrency), prime=not args.no_prime, save_text=args.save_texts,
                        modes_in_turn=args.modes_in_turn,
                        scope=None if args.one_store else f"edit-bench-{time.time_ns()}")
    results: list[ItemResult] = []
    budgets: dict[str, dict[str, int]] = {}
    for name, (items, modes) in workloads.items():
        items = items[:args.limit] if args.limit else items
        if not items:
            continue
        budget = max_tokens_for(items, url, headers, args.extra_tokens, args.max_tokens)
        budgets[name] = budget
        if not args.no_warmup:
            asyncio.run(warm_up(settings, items[0], modes))
        print(f"{name}: {len(items)} items, modes {', '.join(modes)} (tok/s after the first token)", file=sys.stderr,
              flush=True)
        results += asyncio.run(run_items(settings, items, modes, budget))
    mark_identical(results)

    by_workload = summarize(results, "workload")
    print_table(table_rows(by_workload, "workload"), ["workload", "mode", "items", "errors", "tokens", "tok/s",
                                                      "speedup", "server tok/s", "server x", "TTFT p50", "identical",
                                                      "prediction acc", "drafts acc"])
    by_kind = summarize([r for r in results if r.workload == "edits"], "kind")
    if by_kind:
        print()
        print_table(table_rows(by_kind, "kind"), ["kind", "mode", "items", "tokens", "tok/s", "speedup", "server x",
                                                  "identical", "prediction acc", "drafts acc"])
    out = output_path(str(args.out) if args.out else None, f"edit_{model}.json")
    write_json(out, {
        "model": model, "url": url, "host": platform.node(), "concurrency": args.concurrency,
        "extra_tokens": args.extra_tokens, "max_tokens_cap": args.max_tokens, "limit": args.limit,
        "workloads": {name: {"file": str(args.edits if name == "edits" else args.agent_loop), "modes": modes,
                             "max_tokens": budgets.get(name, {})} for name, (_, modes) in workloads.items()},
        "summary": by_workload, "by_kind": by_kind, "results": [asdict(r) for r in results],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
