"""Remoting: the handshake and load codes, in-order replies with pipelined steps, and the real model's greedy
text through a RemoteRunner (unix socket + shared memory, and TCP) equal to a local runner's; a host killed
mid-step fails the step clearly and the front connects again once a host is back. Keep-alives: a load, warm-up
or step longer than the front's timeout goes through, a stalled or hung-up host is still reported within it,
and a front of minor 0 gets none."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch
from specserve.remote import protocol as p
from specserve.remote.client import RemoteRunner
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from tests.remote_utils import free_port, host_thread, mute_host, slow_loader

PROMPT = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
          "# renamed\ndef fibonacci(n):")


def raw_exchange(address: str, payloads: list[bytes]) -> list[tuple[int, p.Status]]:
    """Send frames on a fresh connection; (request id, status) of each reply until the host stops answering."""
    family, where = p.parse_address(address)
    with socket.socket(socket.AF_UNIX if family == "unix" else socket.AF_INET) as s:
        s.settimeout(5)
        s.connect(where)
        out = []
        for payload in payloads:
            p.send_frame(s, payload)
            try:
                _, rid, status, _ = p.decode_reply(p.recv_frame(s))
            except (ConnectionError, OSError):
                break
            out.append((rid, status))
        return out


def hello(major: int = p.VERSION[0], magic: int = p.MAGIC, token: str = "", minor: int = p.VERSION[1]) -> bytes:
    return p.encode_request("hello", 1, magic=magic, major=major, minor=minor, token=token)


def test_handshake_refuses_wrong_magic_version_and_token(tmp_path: Path) -> None:
    with host_thread(f"unix:{tmp_path / 'h.sock'}", token="s3cret") as address:
        assert raw_exchange(address, [hello(magic=0x1234, token="s3cret")]) == [(1, p.Status.BAD_FRAME)]
        newer = hello(major=p.VERSION[0] + 1, token="s3cret")
        assert raw_exchange(address, [newer]) == [(1, p.Status.VERSION_MISMATCH)]
        assert raw_exchange(address, [hello(token="wrong")]) == [(1, p.Status.BAD_TOKEN)]
        assert raw_exchange(address, [hello(token="s3cret")]) == [(1, p.Status.OK)]
        with pytest.raises(SpecserveError, match="wrong or missing token"):
            RemoteRunner(address, "x")


def test_load_codes_and_requests_before_load(tmp_path: Path) -> None:
    load = p.encode_request("load", 2, model="m", n_seqs=2, n_ctx=64, kv_size=0, weight_format="auto", device="")
    missing = p.encode_request("load", 3, model="missing", n_seqs=2, n_ctx=64, kv_size=0, weight_format="auto",
                               device="")
    truncate = p.encode_request("kv_truncate", 4, seq=0, n_keep=0)
    with host_thread(f"unix:{tmp_path / 'h.sock'}") as address:
        got = raw_exchange(address, [hello(), truncate, missing, load, load])
        assert got == [(1, p.Status.OK), (4, p.Status.NOT_LOADED), (3, p.Status.FILE_MISSING), (2, p.Status.OK),
                       (2, p.Status.ALREADY_LOADED)]
        with pytest.raises(SpecserveError, match="not found"):
            RemoteRunner(address, "missing")


def test_pipelined_steps_bookkeeping_and_refusals(tmp_path: Path) -> None:
    with host_thread(f"tcp:127.0.0.1:{free_port()}") as address:
        r = RemoteRunner(address, "fake", n_seqs=2, n_ctx=64)
        b = Batch()
        b.add_sequence([3, 4, 5], 0, 0, "all")
        first = r.launch(b)
        nxt = Batch()
        nxt.add(0, 3, 0, logits=True)
        second = r.launch(nxt, fed=[2], logits=False)  # sent before the first is read
        r.kv_truncate(1, 0)  # acknowledged with the next reply
        assert first.tokens() == [4, 5, 6] and first.logits().shape == (3, 64)
        assert second.tokens() == [1]  # the stand-in runner does not feed: token 0 -> 1
        with pytest.raises(SpecserveError):
            second.logits()  # launched without logits
        assert r.seq_len == [4, 0]
        bad = Batch()
        bad.add(1, 10, 1)  # a gap after position 0: the front refuses it before sending
        with pytest.raises(SpecserveError, match="without gaps"):
            r.launch(bad)
        assert r.memory_info() == {"weights_bytes": 1, "kv_bytes": 2}
        r.close()


TIMEOUT = 0.5  # the front's: no sign of life for this long and the host is gone
BEAT = 0.05  # the test hosts' keep-alive interval


def test_slow_load_warmup_and_step_outlive_the_timeout_through_keepalives(tmp_path: Path) -> None:
    with host_thread(f"unix:{tmp_path / 'h.sock'}", slow_loader(1.5, warmup_s=1.0, step_s=1.0), keepalive=BEAT) as a:
        t0 = time.monotonic()
        r = RemoteRunner(a, "fake", n_seqs=1, n_ctx=64, timeout=TIMEOUT)
        assert time.monotonic() - t0 >= 1.5  # three timeouts long, and alive throughout
        r.warmup(4, 8)
        b = Batch()
        b.add_sequence([3, 4], 0, 0, "last")
        first = r.launch(b)
        nxt = Batch()
        nxt.add(0, 2, 0, logits=True)
        second = r.launch(nxt, logits=False)  # queued behind the slow one: its keep-alives come first
        assert second.tokens() == [1] and first.tokens() == [5]
        r.close()


def frames_until_reply(s: socket.socket) -> list[tuple[int, p.Status, object]]:
    """(request id, status, body) of each frame up to and including the first that is not a keep-alive."""
    out: list[tuple[int, p.Status, object]] = []
    while not out or out[-1][1] == p.Status.BUSY:
        _, rid, status, body = p.decode_reply(p.recv_frame(s))
        out.append((rid, status, body))
    return out


def test_a_slow_load_sends_keepalives(tmp_path: Path) -> None:
    load = p.encode_request("load", 7, model="m", n_seqs=1, n_ctx=64, kv_size=0, weight_format="auto", device="")
    with host_thread(f"unix:{tmp_path / 'h.sock'}", slow_loader(0.6), keepalive=BEAT) as address, \
            socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(p.parse_address(address)[1])
        p.send_frame(s, hello())
        assert frames_until_reply(s)[-1][:2] == (1, p.Status.OK)
        p.send_frame(s, load)
        got = frames_until_reply(s)
        assert got[-1][:2] == (7, p.Status.OK)
        beats = got[:-1]
        assert len(beats) >= 5 and all(rid == 7 and body.startswith("load:") for rid, _, body in beats)


@pytest.mark.parametrize("then", ["silent", "close"])
def test_a_stalled_or_closed_host_is_reported_within_the_timeout(tmp_path: Path, then: str) -> None:
    with mute_host(tmp_path / "m.sock", then) as address:
        t0 = time.monotonic()
        with pytest.raises(SpecserveError, match="went away" + (": no reply and no sign of life" * (then == "silent"))):
            RemoteRunner(address, "fake", timeout=TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT + 1.0


def wait_stopped(pid: int, limit_s: float = 5.0) -> None:
    """Until /proc says the process is stopped (state T)."""
    deadline = time.monotonic() + limit_s
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the host did not stop"
        time.sleep(0.01)


def test_a_stopped_host_process_is_reported_mid_load_and_mid_step(tmp_path: Path) -> None:
    """SIGSTOP freezes the host, its keep-alive thread too: the front gives up within its timeout, even while
    a load that would take longer is under way."""
    address = f"unix:{tmp_path / 'h.sock'}"
    host = subprocess.Popen([sys.executable, "-m", "tests.remote_utils", address, "3", str(BEAT)],
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        assert host.stderr is not None and "listening" in host.stderr.readline()
        timer = threading.Timer(1.0, os.kill, (host.pid, signal.SIGSTOP))  # a third of the way into the load
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(SpecserveError, match="no sign of life for 0.5 s"):
            RemoteRunner(address, "fake", timeout=TIMEOUT)
        assert time.monotonic() - t0 < 1.0 + TIMEOUT + 1.0 < 3  # before the load would have ended
        timer.join()
        os.kill(host.pid, signal.SIGCONT)
        r = RemoteRunner(address, "fake", timeout=TIMEOUT)  # a 3 s load, alive throughout
        os.kill(host.pid, signal.SIGSTOP)
        wait_stopped(host.pid)  # the signal is asynchronous: on a busy box the host may still answer first
        t0 = time.monotonic()
        with pytest.raises(SpecserveError, match="no sign of life"):
            r.memory_info()
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        r.close()
    finally:
        host.kill()
        host.wait(10)


@pytest.fixture(scope="module")
def local(smollm_path: Path) -> tuple[LocalRunner, Tokenizer]:
    runner = LocalRunner(smollm_path, n_seqs=2, n_ctx=512, device="cpu", progress=False)
    return runner, Tokenizer.from_gguf(runner.gguf)


def real_loader(model: str, n_seqs: int, n_ctx: int, kv_size: int, weight_format: str, device: str):
    from specserve.cli.remote_host import load_runner

    return load_runner(model, n_seqs, n_ctx, kv_size, weight_format, "cpu")


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_real_model_remote_equals_local(transport: str, tmp_path: Path, local, smollm_path: Path) -> None:
    runner, tok = local
    prompt = tok.encode(PROMPT)
    address = f"unix:{tmp_path / 'h.sock'}" if transport == "unix" else f"tcp:127.0.0.1:{free_port()}"
    with host_thread(address, real_loader):
        remote = RemoteRunner(address, str(smollm_path), n_seqs=2, n_ctx=512)
        assert Tokenizer.from_gguf(remote.gguf).encode(PROMPT) == prompt
        factory = lambda s, slot: build_chain(s, None, seq=slot)  # noqa: E731
        for spec in (None, SpecParams(type="ngram-suffix")):
            ours = generate(remote, tok, prompt, 32, spec=spec, chain_factory=factory)
            assert ours.tokens == generate(runner, tok, prompt, 32, spec=spec, chain_factory=factory).tokens
        sampled = SamplingParams(temperature=0.8, seed=7)  # logits come back (shared memory on unix)
        assert (generate(remote, tok, prompt, 16, sampled).tokens == generate(runner, tok, prompt, 16, sampled).tokens)
        remote.close()


def start_host(address: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "remote-host", "--listen", address],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "listening on ..."
    assert "listening" in line, line
    return proc


def test_host_killed_mid_step_then_back(tmp_path: Path, smollm_path: Path, local) -> None:
    _, tok = local
    address = f"unix:{tmp_path / 'h.sock'}"
    host = start_host(address)
    try:
        remote = RemoteRunner(address, str(smollm_path), n_seqs=1, n_ctx=256, timeout=20)
        b = Batch()
        b.add_sequence(tok.encode(PROMPT), 0, 0, "last")
        step = remote.launch(b)
        os.kill(host.pid, signal.SIGKILL)
        host.wait(10)
        t0 = time.monotonic()
        with pytest.raises(SpecserveError, match="went away"):
            step.tokens()
        assert time.monotonic() - t0 < 5  # a clear error at once, no hang
        with pytest.raises(SpecserveError, match="cannot reach"):
            remote.launch(b)  # no host: refused quickly
        host = start_host(address)
        again = remote.launch(b)  # connects again (empty caches: position 0 is fine)
        assert len(again.tokens()) == 1 and remote.seq_len[0] == len(b)
        remote.close()
    finally:
        host.kill()
        host.wait(10)
