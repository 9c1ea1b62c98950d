"""The engine core in a process of its own (server/core_process.py) behind the HTTP front: the same answers
as the in-process core, cancellation, slot jobs and grammars across the boundary, and what a client sees when
the core's process dies."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from specserve.server.app import create_app
from specserve.server.core_client import CoreClient
from specserve.server.engine import Engine
from tests import app_engine

PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load(dataclasses.replace(app_engine.SETTINGS, core_process=True), progress=False)
    assert isinstance(eng.core, CoreClient)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Engine) -> TestClient:
    return TestClient(create_app(app_engine.SETTINGS, engine=engine))


def completion(client: TestClient, prompt: str, n: int = 12, **extra: object) -> dict:
    r = client.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_same_greedy_text_as_the_in_process_core(client: TestClient) -> None:
    local = app_engine.client()
    for prompt in PROMPTS:
        ours, theirs = completion(client, prompt), completion(local, prompt)
        assert ours["content"] and ours["content"] == theirs["content"]
        assert ours["tokens_predicted"] == theirs["tokens_predicted"] == 12


def test_concurrent_streams_each_get_their_own_text(client: TestClient) -> None:
    alone = {p: completion(client, p)["content"] for p in PROMPTS[:2]}
    got: dict[str, str] = {}

    def stream(prompt: str) -> None:
        with client.stream("POST", "/completion", json={"prompt": prompt, "n_predict": 12, "temperature": 0,
                                                         "stream": True}) as r:
            text = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    text += json.loads(line[6:]).get("content", "")
            got[prompt] = text

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone


def test_grammar_crosses_as_its_source(client: TestClient) -> None:
    out = completion(client, "Answer yes or no:", n=8, grammar='root ::= "yes" | "no"')
    assert out["content"] in ("yes", "no")


def test_cancelled_stream_frees_its_slot(client: TestClient, engine: Engine) -> None:
    with client.stream("POST", "/completion", json={"prompt": "Count: 1, 2, 3,", "n_predict": 400,
                                                     "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first token
    deadline = time.monotonic() + 30
    while any(s["is_processing"] for s in engine.core.slots_json()):
        assert time.monotonic() < deadline, engine.core.slots_json()
        time.sleep(0.05)
    assert engine.counters().tokens_predicted < 400 * 2


def test_slot_jobs_cross_the_boundary(client: TestClient) -> None:
    local = app_engine.client()
    ours = client.post("/embeddings", json={"content": "hello there"}).json()[0]["embedding"][0]
    theirs = local.post("/embeddings", json={"content": "hello there"}).json()[0]["embedding"][0]
    assert len(ours) == len(theirs) == 576
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5
    completion(client, "Slot files keep", n=4, id_slot=1)
    saved = client.post("/slots/1?action=save", json={"filename": "core-process.bin"}).json()
    assert saved["n_saved"] > 0
    assert client.post("/slots/1?action=erase").json()["n_erased"] == saved["n_saved"]
    restored = client.post("/slots/1?action=restore", json={"filename": "core-process.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    bad = client.post("/slots/7?action=erase")
    assert bad.status_code == 400 and "Invalid slot ID 7" in bad.json()["error"]["message"]


def test_metrics_and_slots_come_from_the_core(client: TestClient) -> None:
    before = client.get("/metrics").text
    completion(client, "Metrics count", n=5)
    after = client.get("/metrics").text

    def predicted(text: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("llamacpp:tokens_predicted_total"))

    assert predicted(after) - predicted(before) == 5
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == app_engine.CTX for s in slots)


def test_a_dead_core_fails_requests_instead_of_hanging() -> None:
    """Killed mid-stream: the open request ends with an error, later ones get an error at once."""
    eng = Engine.load(dataclasses.replace(app_engine.SETTINGS, core_process=True), progress=False)
    core = eng.core
    assert isinstance(core, CoreClient)
    http = TestClient(create_app(app_engine.SETTINGS, engine=eng))
    try:
        events: list[str] = []
        with http.stream("POST", "/completion", json={"prompt": "Count: 1, 2, 3,", "n_predict": 2000,
                                                       "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 1:
                    assert core._process.pid is not None
                    os.kill(core._process.pid, signal.SIGKILL)
        assert "error" in events[-1] and "engine core stopped" in events[-1]
        assert len(events) < 2000
        after = http.post("/completion", json={"prompt": "hello", "n_predict": 4})
        assert after.status_code == 503 and "engine core stopped" in after.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "engine core stopped" in health.json()["error"]["message"]
    finally:
        eng.shutdown()
