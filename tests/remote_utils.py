"""A remote host in a thread of the test process, and a cheap stand-in runner for protocol tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.model.batch import Batch
from specserve.model.kv_ledger import KVLedger
from specserve.remote.host import LoadRunner, serve
from specserve.remote.protocol import ProtocolError, Status


class FakeStep:
    def __init__(self, batch: Batch, vocab: int):
        rows = batch.logit_rows()
        self._logits = torch.zeros(len(rows), vocab)
        for i, r in enumerate(rows):
            self._logits[i, (batch.tokens[r] + 1) % vocab] = 1.0  # "the next token is this one + 1"

    def tokens(self) -> list[int]:
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


class FakeRunner:
    """The Runner protocol without a model: row i's argmax is its token + 1."""

    def __init__(self, n_seqs: int, n_ctx: int, vocab: int = 64):
        self.n_seqs, self.n_ctx, self.vocab_size = n_seqs, n_ctx, vocab
        self.ledger = KVLedger(n_seqs, n_ctx, vocab)
        self.seq_len = self.ledger.seq_len
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.weight_format, self.max_step_rows = "float", None
        self.gguf = type("G", (), {"path": Path("fake.gguf"), "metadata": {"general.architecture": "fake"}})()
        self.config, self.file_bytes = FakeConfig(vocab, n_ctx), 1

    def launch(self, batch: Batch, fed: Any = None, logits: bool = True) -> FakeStep:
        self.ledger.admit(batch, fed)
        return FakeStep(batch, self.vocab_size)

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        self.ledger.truncate(seq, n_keep)

    def kv_copy(self, src: int, dst: int) -> None:
        self.ledger.copy(src, dst)

    def warmup(self, max_rows: int = 17, prompt_rows: int = 512) -> None:
        pass

    def memory_info(self) -> dict[str, int]:
        return {"weights_bytes": 1, "kv_bytes": 2}


def fake_loader(model: str, n_seqs: int, n_ctx: int, weight_format: str, device: str) -> FakeRunner:
    if model == "missing":
        raise ProtocolError(Status.FILE_MISSING, "model file not found: missing")
    return FakeRunner(n_seqs, n_ctx or 256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def host_thread(address: str, loader: LoadRunner = fake_loader, token: str | None = None) -> Iterator[str]:
    """Serve fronts on address in a thread until the block ends; yields the address."""
    stop = threading.Event()
    ready = threading.Event()
    thread = threading.Thread(target=serve, args=(address, loader),
                              kwargs={"token": token, "stop": stop, "ready": lambda _: ready.set()}, daemon=True)
    thread.start()
    assert ready.wait(10), "the host did not start listening"
    try:
        yield address
    finally:
        stop.set()
        thread.join(5)
