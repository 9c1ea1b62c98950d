"""benchmarks/edit_bench.py without a server: the two workloads load and are well formed, the prompts and request
bodies are what each mode asks for, and streams read into the right answers, rates and summaries (a stand-in
transport plays the server)."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load() -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("edit_bench")


eb = _load()


def test_the_edit_tasks_are_whole_stdlib_files_of_50_to_400_lines() -> None:
    items = eb.load_edits()
    assert len(items) >= 20 and len({i.id for i in items}) == len(items)
    assert {"add_type_hints", "rename", "fix_bug", "add_parameter", "add_docstring",
            "loop_to_comprehension"} <= {i.kind for i in items}
    for item in items:
        assert 50 <= len(item.prediction.splitlines()) <= 400, item.id
        prompt = item.messages[0]["content"]
        assert item.messages == [{"role": "user", "content": prompt}]
        # the instruction, then the file whole in one python block, then the answer's form
        assert f"```python\n{item.prediction}```" in prompt and "whole edited file" in prompt
    data = json.loads(eb.EDITS.read_text())
    assert all(set(t) == {"id", "file", "instruction", "kind"} for t in data["tasks"])
    folder = sum(f.stat().st_size for f in eb.WORKLOADS.rglob("*")
                 if f.is_file() and not any(p.startswith((".", "__")) for p in f.relative_to(eb.WORKLOADS).parts))
    assert folder < 400_000
    assert (eb.WORKLOADS / "edit_files" / "README.md").read_text().count("Python Software Foundation") >= 2


def test_the_agent_conversations_answer_every_tool_call_and_end_for_the_model() -> None:
    items = eb.load_agent_loop()
    assert len(items) >= 8 and len({i.id for i in items}) == len(items)
    for item in items:
        calls: list[str] = []
        for m in item.messages:
            if m["role"] == "assistant":
                calls += [c["id"] for c in m["tool_calls"]]
                assert all(json.loads(c["function"]["arguments"]) is not None for c in m["tool_calls"])
            elif m["role"] == "tool":
                assert m["tool_call_id"] == calls[-1] and isinstance(m["content"], str)
        assert calls and item.messages[-1]["role"] in ("user", "tool")
        assert item.tools and item.prediction is None
        assert item.sized_by == max((m["content"] for m in item.messages if m["role"] == "tool"), key=len)
    assert any("Traceback" in m["content"] for i in items for m in i.messages if m["role"] == "tool")


def test_each_mode_asks_for_its_speculation() -> None:
    item = eb.load_edits()[0]
    none = eb.request_body(item, "none", 100)
    assert none["speculative.n_max"] == 0 and "prediction" not in none and "speculative.type" not in none
    assert none["temperature"] == 0 and none["max_tokens"] == 100 and none["stream"]
    assert none["stream_options"] == {"include_usage": True} and "model" not in none
    pred = eb.request_body(item, "prediction", 100, model="m")
    assert pred["prediction"] == {"type": "content", "content": item.prediction} and pred["model"] == "m"
    assert "speculative.n_max" not in pred and "speculative.type" not in pred
    assert eb.request_body(item, "ngram-suffix", 100)["speculative.type"] == "ngram-suffix"
    both = eb.request_body(item, "prediction+ngram-suffix", 100)
    assert both["speculative.type"] == "ngram-suffix" and both["prediction"]["content"] == item.prediction
    agent = eb.load_agent_loop()[0]
    assert eb.request_body(agent, "none", 10)["tools"] == agent.tools
    with pytest.raises(ValueError):
        eb.request_body(agent, "prediction", 10)
    assert eb.parse_modes("prediction, none,ngram-suffix") == ["none", "prediction", "ngram-suffix"]
    with pytest.raises(ValueError):
        eb.parse_modes("none,prediction+")


def sse(*events: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events)


def delta(text: str = "", finish: str | None = None, **fields: Any) -> dict[str, Any]:
    d = {"content": text} if text else {}
    return {"choices": [{"index": 0, "delta": {**d, **fields}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"completion_tokens": 5, "completion_tokens_details": {
    "accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}}}


def test_a_stream_is_timed_from_its_first_read_of_text() -> None:
    reader = eb.StreamReader(start=10.0)
    assert reader.feed(sse(delta(role="assistant")), 10.1)
    assert reader.feed(sse(delta("def f(")), 10.5)
    assert reader.feed(sse(delta("x):"), delta("\n")), 10.7)  # two events in one read
    assert reader.feed('data: {"choices": [{"index": 0, "delta": {"content": " pa', 10.8)  # an event cut in two
    assert reader.feed('ss"}, "finish_reason": null}]}\n\n', 10.9)
    assert not reader.feed(sse(delta(finish="stop") | {"timings": {"predicted_per_second": 9.5}}, USAGE)
                           + "data: [DONE]\n\n", 11.5)
    a = reader.finish()
    assert a.text == "def f(x):\n pass" and a.tokens == 5 and a.finish_reason == "stop"
    assert a.ttft_s == pytest.approx(0.5) and a.decode_s == pytest.approx(1.0) and a.reads == 3
    assert a.tokens_per_s() == pytest.approx(4.0)
    item = eb.load_edits()[0]
    r = eb.item_result(item, "prediction", 50, a, save_text=False)
    assert r.accepted_prediction_tokens == 3 and r.rejected_prediction_tokens == 1
    assert r.server_tokens_per_s == 9.5 and r.text is None and r.text_chars == len(a.text)


def test_text_held_back_and_sent_at_once_has_no_client_rate() -> None:
    reader = eb.StreamReader(start=0.0)
    call = {"index": 0, "id": "call_x", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
    reader.feed(sse(delta(role="assistant")), 0.1)
    reader.feed(sse(delta(tool_calls=[call]), delta(finish="tool_calls"), USAGE) + "data: [DONE]\n\n", 2.0)
    a = reader.finish()
    assert a.text == "grep{}" and a.reads == 1 and a.tokens_per_s() is None
    errored = eb.StreamReader(start=0.0)
    assert not errored.feed(sse({"error": {"message": "boom"}}), 1.0)
    assert "boom" in (errored.finish().error or "")


def fake_server(requests: list[dict[str, Any]]) -> httpx.MockTransport:
    """Answers with the prediction when there is one (else the first words of the prompt), four tokens a read."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append(body)
        text = (body.get("prediction") or {}).get("content") or body["messages"][-1]["content"][:40]
        pieces = [text[i:i + 12] for i in range(0, len(text), 12)][:body["max_tokens"]]

        async def stream() -> Any:
            yield sse(delta(role="assistant")).encode()
            for piece in pieces:
                await asyncio.sleep(0.001)
                yield sse(delta(piece)).encode()
            usage = {"choices": [], "usage": {"completion_tokens": len(pieces)}}
            yield (sse(delta(finish="length"), usage) + "data: [DONE]\n\n").encode()

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_a_run_compares_every_mode_with_none() -> None:
    requests: list[dict[str, Any]] = []
    settings = eb.Settings(url="http://test", headers={}, concurrency=2, transport=fake_server(requests))
    items = eb.load_edits()[:3]
    results = asyncio.run(eb.run_items(settings, items, ["none", "prediction"], {i.id: 1000 for i in items}))
    assert len(requests) == 3 * 3 and sum(r["max_tokens"] == 1 for r in requests) == 3  # a priming request each
    assert [(r.id, r.mode) for r in results] == [(i.id, m) for i in items for m in ("none", "prediction")]
    eb.mark_identical(results)
    assert [r.identical_to_none for r in results] == [True, False] * 3  # the stand-in copies the prediction
    rows = eb.summarize(results, "workload")
    assert [(r["mode"], r["items"], r["identical"]) for r in rows] == [("none", 3, "3/3"), ("prediction", 3, "0/3")]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0
    shown = eb.table_rows(rows, "workload")
    assert shown[0]["speedup"] == "1.00x" and "prediction acc" not in shown[0]


def test_modes_in_turn_finish_one_mode_before_the_next() -> None:
    requests: list[dict[str, Any]] = []
    settings = eb.Settings(url="http://test", headers={}, concurrency=2, transport=fake_server(requests),
                           modes_in_turn=True)
    items = eb.load_edits()[:3]
    results = asyncio.run(eb.run_items(settings, items, ["none", "prediction"], {i.id: 1000 for i in items}))
    sent = [("prediction" in r) for r in requests if r["max_tokens"] > 1]
    assert sent == [False] * 3 + [True] * 3  # every item's plain answer before any prediction request
    assert [(r.id, r.mode) for r in results] == [(i.id, m) for i in items for m in ("none", "prediction")]
