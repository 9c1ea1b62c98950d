"""A remote host in a thread of the test process, and a cheap stand-in runner for protocol tests (optionally
slow, to test keep-alives)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.model.batch import Batch
from specserve.model.kv_ledger import KVLedger, LedgerOnlyKV
from specserve.remote.host import LoadRunner, serve
from specserve.remote.protocol import (
    KEEPALIVE_INTERVAL,
    VERSION,
    ProtocolError,
    Status,
    decode_request,
    encode_reply,
    recv_frame,
    send_frame,
)


class FakeStep:
    def __init__(self, batch: Batch, vocab: int, delay: float = 0.0):
        rows = batch.logit_rows()
        self._logits = torch.zeros(len(rows), vocab)
        for i, r in enumerate(rows):
            self._logits[i, (batch.tokens[r] + 1) % vocab] = 1.0  # "the next token is this one + 1"
        self._delay = delay  # seconds the "device" takes, paid by the first read

    def tokens(self) -> list[int]:
        time.sleep(self._delay)
        self._delay = 0.0
        return self._logits.argmax(dim=-1).tolist()

    def logits(self) -> torch.Tensor:
        return self._logits

    def wait(self) -> None:
        pass


@dataclass
class FakeConfig:
    vocab_size: int
    context_length: int
    hidden: int = 8


class FakeRunner(LedgerOnlyKV):
    """The Runner protocol without a model: row i's argmax is its token + 1. A warm-up takes `warmup_s` seconds,
    a step `step_s`."""

    def __init__(self, n_seqs: int, n_ctx: int, vocab: int = 64, warmup_s: float = 0.0, step_s: float = 0.0,
                 kv_size: int = 0):
        self.warmup_s, self.step_s = warmup_s, step_s
        self.n_seqs, self.n_ctx, self.vocab_size = n_seqs, n_ctx, vocab
        self.ledger = KVLedger(n_seqs, n_ctx, vocab, kv_size or None)
        self.seq_len = self.ledger.seq_len
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.weight_format, self.max_step_rows = "float", None
        self.gguf = type("G", (), {"path": Path("fake.gguf"), "metadata": {"general.architecture": "fake"}})()
        self.config, self.file_bytes = FakeConfig(vocab, n_ctx), 1

    def launch(self, batch: Batch, fed: Any = None, logits: bool = True) -> FakeStep:
        self.ledger.admit(batch, fed)
        return FakeStep(batch, self.vocab_size, self.step_s)

    def warmup(self, max_rows: int = 17, prompt_rows: int = 512, sequences: int = 0, trees: int = 0) -> None:
        time.sleep(self.warmup_s)

    def memory_info(self) -> dict[str, int]:
        return {"weights_bytes": 1, "kv_bytes": 2}


def fake_loader(model: str, n_seqs: int, n_ctx: int, kv_size: int, weight_format: str, device: str) -> FakeRunner:
    if model == "missing":
        raise ProtocolError(Status.FILE_MISSING, "model file not found: missing")
    return FakeRunner(n_seqs, n_ctx or 256, kv_size=kv_size)


def slow_loader(load_s: float, warmup_s: float = 0.0, step_s: float = 0.0) -> LoadRunner:
    """A loader whose load takes load_s seconds, and whose runner's warm-ups and steps are slow too."""

    def load(model: str, n_seqs: int, n_ctx: int, kv_size: int, weight_format: str, device: str) -> FakeRunner:
        time.sleep(load_s)
        return FakeRunner(n_seqs, n_ctx or 256, warmup_s=warmup_s, step_s=step_s, kv_size=kv_size)

    return load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def host_thread(address: str, loader: LoadRunner = fake_loader, token: str | None = None,
                keepalive: float = KEEPALIVE_INTERVAL) -> Iterator[str]:
    """Serve fronts on address in a thread until the block ends; yields the address."""
    stop = threading.Event()
    ready = threading.Event()
    thread = threading.Thread(target=serve, args=(address, loader),
                              kwargs={"token": token, "stop": stop, "ready": lambda _: ready.set(),
                                      "keepalive": keepalive}, daemon=True)
    thread.start()
    assert ready.wait(10), "the host did not start listening"
    try:
        yield address
    finally:
        stop.set()
        thread.join(5)


@contextmanager
def mute_host(path: Path, then: str) -> Iterator[str]:
    """A host on unix:path that answers hello (the current protocol) and then, to everything, `then`: "silent"
    (reads on, answers nothing, sends no keep-alive: a stalled host) or "close" (hangs up)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(10)

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            cmd, rid, _ = decode_request(recv_frame(conn))
            send_frame(conn, encode_reply(cmd, rid, major=VERSION[0], minor=VERSION[1], host="mute"))
            if then == "silent":
                while conn.recv(1 << 16):
                    pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"unix:{path}"
    finally:
        listener.close()
        thread.join(5)


if __name__ == "__main__":  # a host process with slow fake models: python -m tests.remote_utils ADDR LOAD_S KEEPALIVE
    import sys

    serve(sys.argv[1], slow_loader(float(sys.argv[2])), keepalive=float(sys.argv[3]),
          ready=lambda a: print(f"listening on {a}", file=sys.stderr, flush=True))
