"""A forward pass that fails never becomes an answer: each request of the failed step ends with an error the client
sees (HTTP 500 with an error body, or a final SSE error event), is counted in /metrics, and the server goes on
serving the others. The runner fails on purpose: at launch (a bad batch, an out-of-memory) or when the launched
step is read (an error the device reports late)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests import app_engine

MARKER = " xylophone"  # a prompt holding this word makes the runner fail


@pytest.fixture(scope="module")
def client() -> TestClient:
    return app_engine.client()


def marker_token() -> int:
    return app_engine.engine().core.scheduler.tokenizer.encode(MARKER)[-1]


class BrokenStep:
    """A launched step whose results cannot be read (the device reported an error after the launch)."""

    def tokens(self) -> list[int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    def logits(self) -> Any:
        return self.tokens()

    def wait(self) -> None:
        self.tokens()


@pytest.fixture(params=["launch", "read"])
def failing_runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The engine's runner fails every step that holds the marker token: at launch, or when the step is read."""
    runner = app_engine.engine().core.scheduler.runner
    launch = runner.launch
    marker = marker_token()

    def failing_launch(batch: Any, *args: Any, **kwargs: Any) -> Any:
        if marker in batch.tokens:
            if request.param == "launch":
                raise RuntimeError("CUDA out of memory (simulated)")
            launch(batch, *args, **kwargs)
            return BrokenStep()
        return launch(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "launch", failing_launch)
    yield request.param


def failed_count(client: TestClient) -> float:
    text = client.get("/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "llamacpp:requests_failed_total")


def test_a_failed_step_is_an_error_and_the_server_goes_on(client: TestClient, failing_runner: str) -> None:
    before = failed_count(client)
    r = client.post("/completion", json={"prompt": f"Name an instrument:{MARKER}", "n_predict": 8,
                                         "temperature": 0})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == 500 and error["type"] == "server_error" and "simulated" in error["message"]

    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"Play the{MARKER}"}],
                                                  "max_tokens": 8, "temperature": 0})
    assert r.status_code == 500 and "simulated" in r.json()["error"]["message"]

    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": f"Tune the{MARKER}"}], "max_tokens": 8,
                             "temperature": 0, "stream": True}) as s:
        assert s.status_code == 200  # the stream started before the step failed
        data = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "simulated" in data[-1]["error"]["message"]  # the last event is the error
    finishes = [c["finish_reason"] for d in data for c in d.get("choices", ())]
    assert not any(finishes), "a failed stream must not end with a normal finish_reason"
    assert failed_count(client) == before + 3

    # the next requests are served as if nothing had happened
    ok = client.post("/completion", json={"prompt": "Name an instrument:", "n_predict": 8, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["content"] and ok.json()["stop_type"] in ("limit", "eos", "word")
    slots = client.get("/slots").json()
    assert all(not s["is_processing"] for s in slots)
