"""--sleep-idle-seconds through a real `specserve serve`: idle, the engine core's process exits while /health,
/props, /slots and /metrics keep answering (and polling them does not keep it awake); the next generation loads
the model again and answers as before; the counters carry on."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_utils import ServerProcess, served

IDLE = 1.5


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from served("-m", "smollm2-135m", "--device", "cpu", "-np", "2", "--metrics", "--slots",
                      "--sleep-idle-seconds", str(IDLE))


def _children(pid: int) -> set[int]:
    return {int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()}


def _predicted(server: ServerProcess) -> float:
    text = server.get("/metrics").text
    return float(re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.M).group(1))


def _wait_asleep(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.get("/slots")  # (monitoring must not keep it awake)
        server.get("/metrics")
        if server.get("/props").json()["is_sleeping"]:
            return
        time.sleep(0.2)
    raise AssertionError("the server did not go to sleep")


def test_sleeps_when_idle_and_wakes_for_work(server: ServerProcess) -> None:
    awake_children = _children(server.proc.pid)
    first = server.complete("The capital of France is", 12)
    assert not server.get("/props").json()["is_sleeping"]
    predicted = _predicted(server)
    assert predicted >= 12
    _wait_asleep(server)
    assert server.get("/health").status_code == 200
    slots = server.get("/slots").json()
    assert len(slots) == 2 and all(not s["is_processing"] and s["n_cached_tokens"] == 0 for s in slots)
    assert _predicted(server) == predicted  # (the counters survive the core)
    deadline = time.monotonic() + 20
    while len(_children(server.proc.pid)) >= len(awake_children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_children(server.proc.pid)) < len(awake_children)  # the core's process is gone
    again = server.complete("The capital of France is", 12)
    assert again["content"] == first["content"]
    assert again["timings"]["cache_n"] == 0  # (its cache went with the model)
    assert not server.get("/props").json()["is_sleeping"]
    assert _predicted(server) == predicted + again["tokens_predicted"]


def test_sleep_flag_errors(capsys) -> None:
    from specserve.cli import main

    assert main(["serve", "-m", "smollm2-135m", "--sleep-idle-seconds", "0"]) == 1
    assert "--sleep-idle-seconds must be -1" in capsys.readouterr().err


class _FakeCore:
    """An engine core that finishes each task when told, counting what it predicted."""

    def __init__(self) -> None:
        from specserve.engine.slots import SchedulerCounters

        self.counters_now = SchedulerCounters(tokens_predicted=5, kv_capacity=64)
        self.emits: list = []
        self.shut = False

    def submit(self, task, emit):
        self.emits.append(emit)
        return None

    def counters(self):
        return self.counters_now.copy()

    def slots_json(self):
        return [{"id": 0, "is_processing": bool(self.emits)}]

    def failure(self):
        return None

    def shutdown(self) -> None:
        self.shut = True


def test_sleeping_core_waits_for_work_to_end() -> None:
    from specserve.engine.tasks import Result
    from specserve.server.sleeping_core import SleepingCore

    cores: list[_FakeCore] = [_FakeCore()]

    def load() -> _FakeCore:
        cores.append(_FakeCore())
        return cores[-1]

    sleepy = SleepingCore(cores[0], load, 0.2, n_slots=3, n_ctx=128)
    try:
        seen: list = []
        sleepy.submit(object(), seen.append)  # a task that runs for a while
        time.sleep(0.6)
        assert not sleepy.sleeping and not cores[0].shut  # busy: never let go
        cores[0].emits[0](Result(0, "eos", "", 1, 0, 1, 0.0, 0.0, 0, 0))
        assert len(seen) == 1
        deadline = time.monotonic() + 5
        while not sleepy.sleeping and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleepy.sleeping and cores[0].shut
        assert [s["n_ctx"] for s in sleepy.slots_json()] == [128] * 3
        asleep = sleepy.counters()
        assert asleep.tokens_predicted == 5 and asleep.kv_capacity == 0
        sleepy.wake()
        assert len(cores) == 2 and not sleepy.sleeping
        awake = sleepy.counters()
        assert awake.tokens_predicted == 10 and awake.kv_capacity == 64  # totals summed, levels the new core's
    finally:
        sleepy.shutdown()
    assert cores[-1].shut
