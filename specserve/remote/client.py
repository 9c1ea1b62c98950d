"""RemoteRunner: the Runner protocol over a connection to a remote host (remote/host.py).

A step carries its token ids, positions and sequence ids in, and out only each wanted row's argmax, plus the
wanted rows' logits when the scheduler needs them (a sampling slot); on a unix socket those come through
shared memory. Requests are sent at once and their replies read in order when needed, so the scheduler's
step N + 1 is on its way before step N's result is read, and KV bookkeeping costs no round trip. A broken
connection fails what was in flight with a clear error; the next call connects again and loads the model
anew (the host's caches are gone, so every sequence starts empty). `timeout` bounds the host's silence: the host
sends a keep-alive every second while it works, each of which restarts the wait, so a model load of minutes
goes through and a stalled host is reported `timeout` seconds after its last sign of life. The front's KV ledger
mirrors the host's (the same calls give the same block tables), so the scheduler plans within the host's pool.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import numpy as np
import torch

from specserve.errors import NotSupported, SpecserveError
from specserve.gguf.reader import MetadataFile
from specserve.model.batch import Batch
from specserve.model.kv_ledger import KVLedger
from specserve.remote.protocol import (
    HANDSHAKE_TIMEOUT,
    MAGIC,
    STEP_TIMEOUT,
    VERSION,
    ProtocolError,
    SharedTensor,
    Status,
    decode_reply,
    encode_request,
    parse_address,
    recv_frame,
    send_frame,
)

log = logging.getLogger(__name__)


class RemoteStep:
    def __init__(self, runner: RemoteRunner, request_id: int, want_logits: bool):
        self._runner = runner
        self._id = request_id
        self._want_logits = want_logits
        self._fields: dict[str, Any] | None = None

    def wait(self) -> None:
        if self._fields is None:
            self._fields = self._runner._reply(self._id)

    def tokens(self) -> list[int]:
        self.wait()
        assert self._fields is not None
        return self._fields["argmax"]

    def logits(self) -> torch.Tensor:
        if not self._want_logits:
            raise SpecserveError("this step was launched without logits")
        self.wait()
        assert self._fields is not None
        return self._fields["logits"]


class RemoteRunner:
    """Runs `model` (a catalog name or a path on the host) on the host at `address`."""

    token_trees = False  # (protocol 3.0 sends rows, not trees)

    def __init__(self, address: str, model: str, *, n_seqs: int = 1, n_ctx: int | None = None,
                 kv_size: int | None = None, weight_format: str = "auto", device: str | None = None,
                 token: str | None = None, timeout: float = STEP_TIMEOUT):
        self.address = address
        self._load_args = (model, n_seqs, n_ctx or 0, kv_size or 0, weight_format, device or "")
        self._token = token or ""
        self.timeout = timeout
        self.device = torch.device("cpu")  # where this side's tensors (logits) are
        self._sock: socket.socket | None = None
        self._next_id = 1
        self._replies: dict[int, dict[str, Any] | SpecserveError] = {}
        self._unanswered: list[int] = []
        self._acks: set[int] = set()  # requests nobody waits for (KV bookkeeping): a failure surfaces at once
        self._keepalive = False  # the host's hello says it sends BUSY frames while it works
        self._shm: dict[str, shared_memory.SharedMemory] = {}
        self._connect()

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> None:
        family, address = parse_address(self.address)
        sock = socket.socket(socket.AF_UNIX if family == "unix" else socket.AF_INET)
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            sock.connect(address)
            if family == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._replies.clear()
            self._unanswered.clear()
            self._acks.clear()
            self._keepalive = False
            hello = self._call("hello", HANDSHAKE_TIMEOUT, magic=MAGIC, major=VERSION[0], minor=VERSION[1],
                               token=self._token)
            self._keepalive = True
            model, n_seqs, n_ctx, kv_size, weight_format, device = self._load_args
            info = self._call("load", model=model, n_seqs=n_seqs, n_ctx=n_ctx, kv_size=kv_size,
                              weight_format=weight_format, device=device)
        except OSError as exc:
            self._drop()
            raise SpecserveError(f"cannot reach the remote host at {self.address}: {exc}") from None
        except SpecserveError:
            self._drop()
            raise
        if hello["minor"] != VERSION[1]:
            log.warning("the remote host speaks protocol %d.%d, this front %d.%d",
                                                hello["major"], hello["minor"], *VERSION)
        self.n_seqs, self.n_ctx, self.vocab_size = info["n_seqs"], info["n_ctx"], info["vocab_size"]
        self.max_step_rows = None if info["max_step_rows"] < 0 else info["max_step_rows"]
        self.remote_device = info["device"]
        self.dtype = getattr(torch, info["dtype"], torch.float32)
        self.weight_format = info["weight_format"]
        self.weights_bytes = info["weights_bytes"]
        self.gguf = MetadataFile(Path(info["path"]), json.loads(info["metadata"]))
        self.config = SimpleNamespace(**json.loads(info["config"]))  # the host's ModelConfig, as values
        self.file_bytes = info["file_bytes"]
        self.ledger = KVLedger(self.n_seqs, self.n_ctx, self.vocab_size, info["kv_size"])
        self.seq_len = self.ledger.seq_len

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def close(self) -> None:
        self._drop()
        for seg in self._shm.values():
            seg.close()
        self._shm.clear()

    def _ensure(self) -> None:
        if self._sock is None:  # the host went away earlier: connect again, with empty caches
            self._connect()

    def _send(self, name: str, **fields: Any) -> int:
        self._ensure()
        assert self._sock is not None
        rid = self._next_id
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF or 1
        try:
            send_frame(self._sock, encode_request(name, rid, **fields))
        except OSError as exc:
            self._lost(exc)
        self._unanswered.append(rid)
        return rid

    def _lost(self, exc: Exception | str) -> NoReturn:
        self._drop()
        for rid in self._unanswered:
            self._replies[rid] = SpecserveError(f"the remote host at {self.address} went away: {exc}")
        self._unanswered.clear()
        raise SpecserveError(f"the remote host at {self.address} went away: {exc}") from None

    def _reply(self, rid: int, timeout: float | None = None) -> dict[str, Any]:
        """The reply to request rid (reading, in order, the replies before it). `timeout`: the most seconds to
        wait for the next frame; a keep-alive counts, so it bounds the host's silence, not its work."""
        limit = timeout or self.timeout
        while rid not in self._replies:
            if self._sock is None:
                raise SpecserveError(f"the remote host at {self.address} went away")
            self._sock.settimeout(limit)
            try:
                _, got, status, body = decode_reply(recv_frame(self._sock))
            except TimeoutError:
                self._lost(f"no reply and no sign of life for {limit:g} s")
            except (OSError, ConnectionError, ProtocolError) as exc:
                self._lost(exc)
            if status == Status.BUSY:
                if not self._keepalive or got not in self._unanswered:  # strict: a keep-alive names a request
                    self._lost(ConnectionError(f"keep-alive for request {got}, which is not awaited"))
                log.debug("remote host still working on request %d (%s)", got, body)
                continue  # alive: wait `limit` again
            expected = self._unanswered.pop(0) if self._unanswered else None
            if got != expected:
                self._lost(ConnectionError(f"reply {got} out of order (expected {expected})"))
            if got in self._acks:
                self._acks.discard(got)
                if status != Status.OK:
                    raise SpecserveError(f"remote host: {body} ({status.name.lower()})")
                continue
            self._replies[got] = (SpecserveError(f"remote host: {body} ({status.name.lower()})")
                                  if status != Status.OK else self._resolve(body))  # type: ignore[arg-type]
        reply = self._replies.pop(rid)
        if isinstance(reply, SpecserveError):
            raise reply
        return reply

    def _resolve(self, fields: dict[str, Any]) -> dict[str, Any]:
        value = fields.get("logits")
        if isinstance(value, SharedTensor):
            seg = self._shm.get(value.name)
            if seg is None:
                seg = shared_memory.SharedMemory(name=value.name)
                resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]  # the host owns it
                self._shm[value.name] = seg
            n = int(np.prod(value.shape)) * value.dtype.itemsize
            if value.offset + n > seg.size:
                raise SpecserveError("remote host: shared tensor past its segment")
            array = np.ndarray(value.shape, dtype=value.dtype, buffer=seg.buf, offset=value.offset)
            fields["logits"] = torch.from_numpy(array.copy())
        elif isinstance(value, np.ndarray):
            fields["logits"] = torch.from_numpy(value.copy())
        return fields

    def _call(self, name: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        rid = self._send(name, **fields)  # first: it may connect again
        return self._reply(rid, timeout)

    # -- the Runner protocol ---------------------------------------------------------------------

    def launch(self, batch: Batch, fed: Sequence[int] | None = None, logits: bool = True) -> RemoteStep:
        """logits=False: only each wanted row's argmax comes back (what greedy slots read)."""
        self._ensure()
        self.ledger.admit(batch, fed)
        rid = self._send("launch", tokens=batch.tokens, positions=batch.positions, seq_ids=batch.seq_ids,
                         logit_rows=batch.logit_rows(), fed=list(fed) if fed is not None else [],
                         want_logits=int(logits))
        return RemoteStep(self, rid, logits)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.launch(batch).logits()

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        self.ledger.truncate(seq, n_keep)
        self._acks.add(self._send("kv_truncate", seq=seq, n_keep=n_keep))  # acknowledged with the next reply

    def kv_compact(self, seq: int, start: int, path: Sequence[int]) -> None:
        raise NotSupported("token trees are not verified through a remote host")

    def kv_cache(self, seq: int, names: Sequence[int]) -> None:
        self.ledger.cache(seq, names)
        self._acks.add(self._send("kv_cache", seq=seq, names=list(names)))

    def kv_attach(self, seq: int, names: Sequence[int]) -> int:
        """(The host's ledger makes the same choice as this mirror: no reply is waited for.)"""
        n = self.ledger.attach(seq, names)
        self._acks.add(self._send("kv_attach", seq=seq, names=list(names)))
        return n

    def set_adapter_scales(self, seq: int, scales: tuple[float, ...]) -> None:
        if scales:
            raise NotSupported("LoRA adapters are not supported with --remote")

    # The protocol has no commands for these yet (they would carry hidden states and whole caches).
    def hidden_states(self, batch: Batch) -> torch.Tensor:
        raise NotSupported("embeddings are not supported with --remote (the remote protocol has no such command)")

    def kv_read(self, seq: int) -> torch.Tensor:
        raise NotSupported("slot save/restore is not supported with --remote (the remote protocol has no such "
                           "command)")

    def kv_write(self, seq: int, kv: torch.Tensor) -> None:
        raise NotSupported("slot save/restore is not supported with --remote (the remote protocol has no such "
                           "command)")

    def kv_read_cached(self, names: Sequence[int]) -> torch.Tensor:
        raise NotSupported("the host prompt cache is not supported with --remote (the remote protocol has no such "
                           "command)")

    def draft_limit(self, n_max: int) -> int:
        rows = self.max_step_rows
        return n_max if rows is None else min(n_max, rows - 1)

    def warmup(self, max_rows: int = 17, prompt_rows: int = 512, sequences: int = 0, trees: int = 0) -> None:
        self._call("warmup", max_rows=max_rows, prompt_rows=prompt_rows, sequences=sequences)

    def memory_info(self) -> dict[str, int]:
        info = self._call("memory_info")
        return {"weights_bytes": info["weights_bytes"], "kv_bytes": info["kv_bytes"]}

    def ping_ms(self) -> float:
        """One round trip, in ms (diagnostics)."""
        t0 = time.perf_counter()
        self.memory_info()
        return (time.perf_counter() - t0) * 1000
