"""Graceful shutdown of a real server process: SIGTERM during four streams and a queued request."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from tests.server_utils import ServerProcess

GRACE_S = 4.0
REPEATING = "a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c"


class StreamReader(threading.Thread):
    """Reads one SSE answer to its end; records its events, when it ended and whether the body was whole."""

    def __init__(self, url: str, path: str, body: dict[str, Any]):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.events: list[Any] = []
        self.first_event = threading.Event()
        self.error: Exception | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first_event.set()
        except Exception as exc:  # an incomplete chunked body, a reset: what the test must not see
            self.error = exc
        self.ended_at = time.monotonic()
        self.first_event.set()


def test_sigterm_finishes_short_streams_and_ends_long_ones() -> None:
    srv = ServerProcess("-m", "smollm2-135m", "--device", "cpu", "-np", "4", "-c", "4096",
                        "--shutdown-grace", str(GRACE_S))
    try:
        srv.wait_ready()
        chat = "/v1/chat/completions"
        messages = [{"role": "user", "content": "Count from one to one hundred."}]
        short = {"temperature": 0, "stream": True, "ignore_eos": True}  # 12 tokens, whatever the greedy text
        readers = [
            StreamReader(srv.url, chat, {**short, "messages": messages, "max_tokens": 12}),
            StreamReader(srv.url, "/completion", {**short, "prompt": REPEATING, "n_predict": 12}),
            # (a prompt greedy decoding keeps continuing: no early end of generation)
            StreamReader(srv.url, "/v1/completions", {"prompt": REPEATING, "max_tokens": 900, "temperature": 0,
                                                      "stream": True}),
            StreamReader(srv.url, "/completion", {"prompt": REPEATING, "n_predict": 900, "temperature": 0,
                                                  "stream": True}),
        ]
        for r in readers:
            r.start()
        for r in readers:
            assert r.first_event.wait(60) and r.error is None, r.error
        # A fifth, not streamed, waits for a slot: when the grace period is over it is answered 503. (Greedy: a
        # sampled continuation could reach an end of generation inside the grace period and answer 200.)
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(httpx.post(
            srv.url + "/completion", json={"prompt": REPEATING, "n_predict": 900, "temperature": 0}, timeout=120)))
        waiter.start()
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()

        # Draining: the socket still answers, with 503 and Retry-After, /health included (once the signal has
        # reached the server's event loop).
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = httpx.post(srv.url + "/completion", json={"prompt": "hi", "n_predict": 1}, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503

        assert srv.proc.wait(GRACE_S + 30) == 0, srv.log()
        for r in readers:
            r.join(10)
            assert not r.is_alive() and r.error is None, (r.path, r.error)

        waiter.join(10)
        assert queued[0].status_code == 503 and "shutting down" in queued[0].json()["error"]["message"]
        chat_short, native_short, openai_long, native_long = readers
        # The short ones finished normally inside the grace period.
        assert chat_short.events[-1] == "[DONE]"
        assert chat_short.events[-2]["choices"][0]["finish_reason"] == "length"
        assert native_short.events[-1]["stop"] is True and native_short.events[-1]["tokens_predicted"] == 12
        # The long ones ran until the grace period was over, then got an error event (and [DONE]).
        for r in (openai_long, native_long):
            assert r.ended_at - t_term >= GRACE_S - 0.5
            assert len([e for e in r.events if isinstance(e, dict) and "error" not in e]) > 3
        assert openai_long.events[-1] == "[DONE]"
        for last in (openai_long.events[-2], native_long.events[-1]):
            assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
        log = srv.log()
        assert "shutdown grace period over: ending 3 requests" in log and "Traceback" not in log
    finally:
        srv.stop()
