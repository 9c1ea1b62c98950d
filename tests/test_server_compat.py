"""llama-server compatibility details of the API (issue 26), against the ASGI app over one in-process engine:
streamed token ids, generation_settings, assistant prefill, n_predict on the OpenAI endpoints, /metrics'
series and header, timings, /slots' shape, --no-slots, aliases and tags."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from specserve.server.app import create_app
from specserve.server.engine import Engine
from tests import app_engine

REPEATING = "a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c"


@pytest.fixture(scope="module")
def client() -> TestClient:
    return app_engine.client()


def sse(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def complete(client: TestClient, prompt: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/completion", json={"prompt": prompt, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(client: TestClient) -> dict[str, float]:
    r = client.get("/metrics")
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples if not s.labels}


def test_streamed_completion_chunks_carry_tokens(client: TestClient) -> None:
    events = sse(client, "/completion", {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0})
    parts, final = events[:-1], events[-1]
    assert parts and all(isinstance(e["tokens"], list) and e["tokens"] for e in parts)  # without return_tokens
    assert [e["tokens_predicted"] for e in parts] == list(itertools.accumulate(len(e["tokens"]) for e in parts))
    assert all(e["tokens_evaluated"] == final["tokens_evaluated"] for e in parts)
    whole = complete(client, "Once upon a time", n_predict=6, return_tokens=True)
    assert [t for e in parts for t in e["tokens"]] == whole["tokens"]
    assert complete(client, "Once upon a time", n_predict=6)["tokens"] == []  # non-streamed: only if asked


def test_generation_settings_have_llama_servers_fields(client: TestClient) -> None:
    settings = complete(client, "Hi", n_predict=2)["generation_settings"]
    for key in ("dry_multiplier", "mirostat", "typical_p", "xtc_probability", "samplers", "logit_bias",
                "n_keep", "grammar_lazy", "speculative.n_max", "temperature", "seed"):
        assert key in settings, key
    assert settings["max_tokens"] == settings["n_predict"] == 2 and settings["stream"] is False
    assert settings["mirostat"] == 0 and settings["dry_multiplier"] == 0.0  # not implemented: shown off
    streamed = sse(client, "/completion", {"prompt": "Hi", "n_predict": 2})[-1]["generation_settings"]
    assert streamed["stream"] is True
    props = client.get("/props").json()["default_generation_settings"]["params"]
    assert props["n_predict"] == props["max_tokens"] == app_engine.SETTINGS.n_predict and "dry_base" in props


def test_assistant_prefill_continues_the_message(client: TestClient) -> None:
    user = {"role": "user", "content": "Name a color."}
    prefill = {"role": "assistant", "content": "My favourite color is"}
    rendered = client.post("/apply-template", json={"messages": [user, prefill]}).json()["prompt"]
    plain = client.post("/apply-template", json={"messages": [user]}).json()["prompt"]
    assert rendered == plain + "My favourite color is"  # no end-of-turn after it: the answer goes on
    body = {"messages": [user, prefill], "max_tokens": 3, "temperature": 0}
    out = client.post("/v1/chat/completions", json=body).json()
    tokens = client.post("/tokenize", json={"content": rendered}).json()["tokens"]
    assert out["usage"]["prompt_tokens"] == len(tokens)
    two = client.post("/v1/chat/completions", json={**body, "messages": [user, prefill, prefill]})
    assert two.status_code == 400 and "2 or more assistant" in two.json()["error"]["message"]
    # vLLM's continue_final_message: the same prompt, with add_generation_prompt false; both true is a 400
    cont = client.post("/v1/chat/completions", json={**body, "continue_final_message": True,
                                                      "add_generation_prompt": False}).json()
    assert cont["usage"]["prompt_tokens"] == len(tokens) and cont["choices"][0]["message"]["content"] == \
        out["choices"][0]["message"]["content"]
    both = client.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]
    not_assistant = client.post("/v1/chat/completions", json={"messages": [user], "continue_final_message": True,
                                                               "add_generation_prompt": False})
    assert not_assistant.status_code == 400 and "assistant" in not_assistant.json()["error"]["message"]


def test_openai_endpoints_honour_n_predict(client: TestClient) -> None:
    out = client.post("/v1/completions", json={"prompt": REPEATING, "n_predict": 3, "max_tokens": 7,
                                               "temperature": 0}).json()
    assert out["usage"]["completion_tokens"] == 3
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Count: 1 2 3 4"}], "n_predict": 2, "max_tokens": 7,
        "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 2
    assert client.post("/v1/completions", json={"prompt": "x", "n_predict": -5}).status_code == 400


def test_metrics_header_cached_tokens_and_spec_decode(client: TestClient) -> None:
    r = client.get("/metrics")
    start = int(r.headers["Process-Start-Time-Unix"])
    assert start <= time.time() and metrics(client)["llamacpp:process_start_time_seconds"] == start
    before = metrics(client)
    complete(client, REPEATING, n_predict=2, cache_prompt=False)
    again = complete(client, REPEATING, n_predict=12, **{"speculative.type": "ngram-simple",
                                                        "speculative.ngram_size_n": 3, "speculative.ngram_size_m": 8})
    after = metrics(client)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    t = again["timings"]
    assert t["cache_n"] > 0 and delta("llamacpp:prompt_tokens_cached_total") == t["cache_n"]
    ratio = after["llamacpp:prompt_cache_hit_ratio"]
    total = after["llamacpp:prompt_tokens_total"] + after["llamacpp:prompt_tokens_cached_total"]
    assert 0 < ratio < 1 and ratio == after["llamacpp:prompt_tokens_cached_total"] / total
    assert t["draft_n"] > 0
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == t["draft_n"]
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
    assert 0 < delta("llamacpp:spec_decode_num_drafts_total") <= t["draft_n"]


def test_timings_put_the_first_token_in_the_prompts_time(client: TestClient) -> None:
    """As llama-server: the first token comes out of the prompt's forward pass, so predicted_ms starts after
    it and predicted_per_second = predicted_n / predicted_ms."""
    one = complete(client, "The weather today is", n_predict=1, cache_prompt=False)["timings"]
    assert one["predicted_n"] == 1 and one["predicted_ms"] < 0.2 * one["prompt_ms"]
    t = complete(client, "The weather today is", n_predict=8, ignore_eos=True)["timings"]
    assert t["predicted_per_second"] == pytest.approx(1000 * t["predicted_n"] / t["predicted_ms"])


def test_slots_shape(client: TestClient) -> None:
    with ThreadPoolExecutor(1) as pool:  # (TestClient reads a stream whole: a request in another thread)
        running = pool.submit(complete, client, REPEATING, n_predict=40, ignore_eos=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            slots = client.get("/slots").json()
            if any(s["is_processing"] for s in slots):
                break
            time.sleep(0.01)
        running.result()
    busy = [s for s in slots if s["is_processing"]]
    idle = [s for s in slots if not s["is_processing"]]
    assert len(busy) == 1 and idle
    assert all(isinstance(s["next_token"], list) and len(s["next_token"]) == 1 for s in slots)
    assert busy[0]["params"]["n_predict"] == 40 and "dry_base" in busy[0]["params"]
    assert all("params" not in s for s in idle)


def test_no_slots_no_metrics_names_and_tags() -> None:
    off = app_engine.client(endpoint_slots=False, endpoint_metrics=False)
    for path, flag in (("/slots", "--slots"), ("/metrics", "--metrics")):  # llama-server's answers
        r = off.get(path)
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert flag in r.json()["error"]["message"]
    models = off.get("/v1/models").json()["data"][0]
    assert models["id"] == "smollm2-135m" and models["aliases"] == ["smollm2-135m", "tiny"]
    assert models["tags"] == ["small", "test"]
    ok = off.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["model"] == "smollm2-135m"
    any_name = off.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi", "max_tokens": 1})
    assert any_name.status_code == 200 and any_name.json()["model"] == "smollm2-135m"


def test_build_info_is_shaped_as_llama_servers(client: TestClient) -> None:
    build = client.get("/props").json()["build_info"]
    assert re.fullmatch(r"b\d+-[0-9a-f]{7,}|b[\w.]+-release", build), build
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 1}).json()
    assert answer["system_fingerprint"] == build


def test_return_progress_and_timings_per_token_in_streams(client: TestClient) -> None:
    prompt = "Count: one two three four five six seven eight nine ten"
    n_prompt = len(client.post("/tokenize", json={"content": prompt}).json()["tokens"])
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "cache_prompt": False, "return_progress": True,
            "timings_per_token": True}
    events = sse(client, "/completion", body)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress and progress[-1]["processed"] == progress[-1]["total"] == n_prompt
    assert progress[-1]["cache"] == 0 and progress[-1]["time_ms"] > 0
    steps = [e["timings"]["predicted_n"] for e in events if "timings" in e and not e["stop"]]
    assert steps and steps == sorted(steps) and steps[-1] <= 4
    assert events.index(next(e for e in events if "prompt_progress" in e)) < events.index(
        next(e for e in events if e.get("content")))
    chat = sse(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
                                                 "return_progress": True, "timings_per_token": True})
    assert any("prompt_progress" in e and e["choices"] == [] for e in chat[:-1])
    assert any("timings" in e and e["choices"] and e["choices"][0]["finish_reason"] is None for e in chat[:-1])
    plain = complete(client, prompt, n_predict=2, return_progress=True)  # not streamed: no progress, same answer
    assert "prompt_progress" not in plain and plain["generation_settings"]["return_progress"] is True


def test_verbose_answers_carry_the_native_body() -> None:
    verbose = app_engine.client(verbose=True)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    answer = verbose.post("/v1/chat/completions", json=body).json()
    native = answer["__verbose"]
    assert native["content"] == answer["choices"][0]["message"]["content"] and len(native["tokens"]) == 3
    assert native["timings"]["predicted_n"] == 3
    assert "__verbose" not in app_engine.client().post("/v1/chat/completions", json=body).json()


def test_context_shift_keeps_generating() -> None:
    """With --context-shift a generation that fills its context drops the older half of its tokens after
    n_keep, reads the rest again and goes on; without it the same request ends at the context, truncated."""
    ctx = 128  # (a small context: few tokens to fill it)
    body = {"prompt": "Once upon a time", "n_predict": 3 * ctx // 2, "ignore_eos": True, "temperature": 0,
            "n_keep": -1}
    answers = []
    for shift in (True, False):
        settings = dataclasses.replace(app_engine.SETTINGS, context_shift=shift, ctx_size=ctx)
        engine = Engine.load(settings, progress=False)
        try:
            client = TestClient(create_app(settings, engine=engine))
            answers.append(client.post("/completion", json=body).json())
            if shift:
                assert metrics(client)["llamacpp:context_shifts_total"] >= 1
        finally:
            engine.shutdown()
    answer, plain = answers
    assert answer["tokens_predicted"] == body["n_predict"] and answer["stop_type"] == "limit"
    assert not answer["truncated"] and answer["generation_settings"]["n_keep"] == -1
    assert plain["truncated"] and plain["tokens_predicted"] < body["n_predict"]
    assert answer["content"].startswith(plain["content"][:64])  # the same text until the first shift
