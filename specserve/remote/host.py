"""The remote host: owns the device, the weights and the KV cache of each connected front.

Each connection gets a thread and, after its `load`, a runner of its own. Requests are served in order and
answered in order, but a `launch` is answered only when the front's next request has not arrived yet (or two
launches are unanswered): so a front that sends step N + 1 before reading step N gets them queued back to
back on the device. A malformed or refused request gets an error reply and the connection goes on; only a
broken connection ends it. While a request is worked on (a load, a warm-up, a wait for the device), a ticker
thread sends BUSY frames for it, so the front can tell a slow host from a dead one (protocol.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.model.batch import Batch
from specserve.remote.protocol import (
    BY_NAME,
    HANDSHAKE_TIMEOUT,
    KEEPALIVE_INTERVAL,
    MAGIC,
    VERSION,
    Command,
    ProtocolError,
    SharedTensor,
    Status,
    decode_request,
    encode_error,
    encode_keepalive,
    encode_reply,
    parse_address,
    recv_frame,
    send_frame,
)

log = logging.getLogger(__name__)

# (model, n_seqs, n_ctx, kv_size, weight_format, device) -> a runner (engine.runner.Runner); raises
# ProtocolError with the load status for what it refuses.
LoadRunner = Callable[[str, int, int, int, str, str], Any]


class _SharedLogits:
    """Two shared-memory segments (by launch parity) the host writes logits into for a same-machine front."""

    def __init__(self) -> None:
        self._segments: list[shared_memory.SharedMemory | None] = [None, None]

    def put(self, parity: int, array: np.ndarray) -> SharedTensor:
        seg = self._segments[parity]
        if seg is None or seg.size < array.nbytes:
            if seg is not None:
                seg.close()
                seg.unlink()
            seg = shared_memory.SharedMemory(create=True, size=max(array.nbytes, 1 << 20))
            self._segments[parity] = seg
        np.ndarray(array.shape, dtype=array.dtype, buffer=seg.buf)[...] = array
        return SharedTensor(seg.name, 0, array.dtype, tuple(array.shape))

    def close(self) -> None:
        for seg in self._segments:
            if seg is not None:
                seg.close()
                seg.unlink()
        self._segments = [None, None]


@dataclass
class _Work:
    cmd: Command
    rid: int
    since: float
    last: float  # when the last sign of life for it went out


class _Outbox:
    """A connection's one way out. Every frame is sent under one lock, so a keep-alive from the ticker thread
    never lands inside the bytes of a reply. Once `start`ed, the ticker sends a BUSY frame for the request in
    `working` every `interval` until that request's reply is out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._cond = threading.Condition()
        self._work: _Work | None = None
        self._closed = False

    def send(self, payload: bytes) -> None:
        with self._cond:
            send_frame(self.sock, payload)
            if self._work is not None and payload[2:6] == struct.pack("<I", self._work.rid):
                # Answered: a keep-alive after its reply would name a request the front no longer waits for.
                self._work = None

    @contextmanager
    def working(self, cmd: Command, rid: int) -> Iterator[None]:
        now = time.monotonic()
        with self._cond:
            prev, self._work = self._work, _Work(cmd, rid, now, now)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._work = prev  # a nested wait (an older step answered first) hands back to the outer request

    def start(self, interval: float) -> None:
        threading.Thread(target=self._tick, args=(interval,), name="specserve-remote-keepalive", daemon=True).start()

    def _tick(self, interval: float) -> None:
        with self._cond:
            while not self._closed:
                work = self._work
                now = time.monotonic()
                if work is None or now < work.last + interval:
                    self._cond.wait(None if work is None else work.last + interval - now)
                    continue
                work.last = now
                try:
                    send_frame(self.sock, encode_keepalive(work.cmd, work.rid,
                                                           f"{work.cmd.name}: {now - work.since:.1f} s"))
                except OSError:
                    return  # the front is gone; the connection's thread finds out on its next read or send

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class Connection:
    """One front: the handshake, then its requests until it goes away."""

    def __init__(self, sock: socket.socket, load_runner: LoadRunner, token: str | None, shared: bool,
                 keepalive: float = KEEPALIVE_INTERVAL):
        self.sock = sock
        self.out = _Outbox(sock)
        self.keepalive = keepalive
        self.load_runner = load_runner
        self.token = token
        self.shm = _SharedLogits() if shared else None
        self.runner: Any = None
        self._launches = 0
        self._pending: deque[tuple[int, Any, bool, int] | bytes] = deque()  # launch (id, step, logits?, parity)

    def serve(self) -> None:
        try:
            if self._handshake():
                self._requests()
        except (ConnectionError, OSError, ProtocolError) as exc:
            log.info("front disconnected: %s", exc)
        finally:
            self.out.close()
            if self.shm is not None:
                self.shm.close()
            self.sock.close()

    def _handshake(self) -> bool:
        self.sock.settimeout(HANDSHAKE_TIMEOUT)
        payload = recv_frame(self.sock)
        self.sock.settimeout(None)
        try:
            cmd, rid, f = decode_request(payload)
        except ProtocolError as exc:
            self.out.send(encode_error(0, 0, exc.status, str(exc)))
            return False
        if cmd.name != "hello" or f["magic"] != MAGIC:
            self.out.send(encode_error(cmd.code, rid, Status.BAD_FRAME,
                                       "expected a hello with specserve's magic"))
            return False
        if f["major"] != VERSION[0]:
            self.out.send(encode_error(cmd.code, rid, Status.VERSION_MISMATCH,
                                       f"protocol {f['major']}.{f['minor']} is not {VERSION[0]}.x"))
            return False
        if self.token is not None and f["token"] != self.token:
            self.out.send(encode_error(cmd.code, rid, Status.BAD_TOKEN, "wrong or missing token"))
            return False
        if f["minor"] != VERSION[1]:
            log.warning("front speaks protocol %d.%d, the host %d.%d", f["major"], f["minor"], *VERSION)
        self.out.send(encode_reply(cmd, rid, major=VERSION[0], minor=VERSION[1], host=socket.gethostname()))
        self.out.start(self.keepalive)
        return True

    def _requests(self) -> None:
        while True:
            if self._pending and not select.select([self.sock], [], [], 0)[0]:
                self._answer_oldest()  # nothing new to queue behind it: wait for the device and answer
                continue
            payload = recv_frame(self.sock)
            try:
                cmd, rid, fields = decode_request(payload)
            except ProtocolError as exc:
                code = int.from_bytes(payload[:2], "little") if len(payload) >= 2 else 0
                rid = int.from_bytes(payload[2:6], "little") if len(payload) >= 6 else 0
                self._queue(encode_error(code, rid, exc.status, str(exc)))
                continue
            try:
                with self.out.working(cmd, rid):
                    self._handle(cmd, rid, fields)
            except ProtocolError as exc:
                self._queue(encode_error(cmd.code, rid, exc.status, str(exc)))
            except SpecserveError as exc:
                self._queue(encode_error(cmd.code, rid, Status.BAD_REQUEST, str(exc)))
            except torch.cuda.OutOfMemoryError as exc:
                self._queue(encode_error(cmd.code, rid, Status.OUT_OF_MEMORY, str(exc)))
            except Exception as exc:  # a bug on the host: report it, keep serving
                log.exception("request %s failed", cmd.name)
                self._queue(encode_error(cmd.code, rid, Status.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _queue(self, reply: bytes) -> None:
        """A ready reply, sent once every earlier request is answered."""
        self._pending.append(reply)
        while self._pending and isinstance(self._pending[0], bytes):
            self.out.send(self._pending.popleft())  # type: ignore[arg-type]

    def _answer_oldest(self) -> None:
        item = self._pending.popleft()
        if isinstance(item, bytes):
            self.out.send(item)
            return
        rid, step, want_logits, parity = item
        cmd = BY_NAME["launch"]
        with self.out.working(cmd, rid):  # a long step (a big prefill) keeps the front waiting, not worried
            try:
                argmax = step.tokens()
                logits = None
                if want_logits:
                    array = step.logits().float().cpu().numpy()
                    logits = self.shm.put(parity, array) if self.shm is not None else array
                reply = encode_reply(cmd, rid, argmax=argmax, logits=logits)
            except Exception as exc:
                log.exception("step failed")
                reply = encode_error(cmd.code, rid, Status.INTERNAL, f"{type(exc).__name__}: {exc}")
            self.out.send(reply)
        while self._pending and isinstance(self._pending[0], bytes):
            self.out.send(self._pending.popleft())  # type: ignore[arg-type]

    def _launches_pending(self) -> int:
        return sum(not isinstance(p, bytes) for p in self._pending)

    def _handle(self, cmd: Command, rid: int, f: dict[str, Any]) -> None:
        if cmd.name == "hello":
            raise ProtocolError(Status.BAD_FRAME, "hello again on a connection already greeted")
        if cmd.name == "load":
            self._load(cmd, rid, f)
            return
        if self.runner is None:
            raise ProtocolError(Status.NOT_LOADED, f"{cmd.name} before load")
        r = self.runner
        if cmd.name == "launch":
            batch, fed = _batch(f)
            while self._launches_pending() >= 2:  # a step's results hold until the launch after next
                self._answer_oldest()
            step = r.launch(batch, fed)
            self._pending.append((rid, step, bool(f["want_logits"]), self._launches % 2))
            self._launches += 1
        elif cmd.name == "kv_truncate":
            r.kv_truncate(f["seq"], f["n_keep"])
            self._queue(encode_reply(cmd, rid))
        elif cmd.name in ("kv_cache", "kv_attach"):
            (r.kv_cache if cmd.name == "kv_cache" else r.kv_attach)(f["seq"], f["names"])
            self._queue(encode_reply(cmd, rid))
        elif cmd.name == "warmup":
            if f["max_rows"] > 1 << 16 or f["prompt_rows"] > 1 << 16 or f["sequences"] > r.n_seqs:
                raise ProtocolError(Status.BAD_REQUEST, "warm-up sizes out of range")
            r.warmup(f["max_rows"], f["prompt_rows"], f["sequences"])
            self._queue(encode_reply(cmd, rid))
        elif cmd.name == "memory_info":
            info = r.memory_info()
            self._queue(encode_reply(cmd, rid, kv_bytes=info["kv_bytes"], weights_bytes=info["weights_bytes"]))
        else:
            raise ProtocolError(Status.UNKNOWN_COMMAND, f"no handler for {cmd.name}")

    def _load(self, cmd: Command, rid: int, f: dict[str, Any]) -> None:
        if self.runner is not None:
            raise ProtocolError(Status.ALREADY_LOADED, "a model is already loaded on this connection")
        # n_ctx 0: the model's default; kv_size 0: n_seqs * n_ctx
        if not (1 <= f["n_seqs"] <= 4096 and 0 <= f["n_ctx"] <= 1 << 22 and 0 <= f["kv_size"] <= 1 << 26):
            raise ProtocolError(Status.BAD_REQUEST, "sequence count, context size or KV size out of range")
        runner = self.load_runner(f["model"], f["n_seqs"], f["n_ctx"], f["kv_size"], f["weight_format"], f["device"])
        gguf = runner.gguf
        metadata = json.dumps(gguf.metadata, default=_json_value).encode()
        self.runner = runner
        rows = runner.max_step_rows
        self._queue(encode_reply(
            cmd, rid, n_seqs=runner.n_seqs, n_ctx=runner.n_ctx, kv_size=runner.ledger.kv_size,
            vocab_size=runner.vocab_size,
            max_step_rows=-1 if rows is None else rows, device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."), weight_format=runner.weight_format,
            path=str(gguf.path), metadata=metadata, weights_bytes=runner.memory_info()["weights_bytes"],
            config=json.dumps(dataclasses.asdict(runner.config)).encode(), file_bytes=runner.file_bytes))


def _json_value(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes | np.ndarray):
        return list(value)
    raise TypeError(f"cannot send metadata value of type {type(value).__name__}")


def _batch(f: dict[str, Any]) -> tuple[Batch, list[int] | None]:
    """The launch request's rows as a Batch (lengths and logit rows checked; the runner checks the rest)."""
    n = len(f["tokens"])
    if len(f["positions"]) != n or len(f["seq_ids"]) != n:
        raise ProtocolError(Status.BAD_FRAME, "tokens, positions and sequence ids differ in length")
    rows = f["logit_rows"]
    if any(not 0 <= r < n for r in rows) or any(a >= b for a, b in zip(rows, rows[1:], strict=False)):
        raise ProtocolError(Status.BAD_FRAME, "logit rows must be increasing rows of the batch")
    fed = f["fed"] or None
    if fed is not None and (len(fed) != n or any(x < -1 for x in fed)):
        raise ProtocolError(Status.BAD_FRAME, "fed rows must give one entry per row")
    if any(p < 0 for p in f["positions"]) or any(s < 0 for s in f["seq_ids"]):
        raise ProtocolError(Status.BAD_FRAME, "negative position or sequence id")
    want = [False] * n
    for r in rows:
        want[r] = True
    return Batch(list(f["tokens"]), list(f["positions"]), list(f["seq_ids"]), want), fed


def serve(listen: str, load_runner: LoadRunner, token: str | None = None,
          ready: Callable[[str], None] | None = None, stop: threading.Event | None = None,
          keepalive: float = KEEPALIVE_INTERVAL) -> None:
    """Accept fronts on `listen` (unix:PATH or tcp:HOST:PORT) until `stop` is set; each in a thread. `keepalive`:
    seconds between BUSY frames while a request is worked on (tests shorten it)."""
    family, address = parse_address(listen)
    if family == "tcp" and address[0] not in ("127.0.0.1", "localhost", "::1") and not token:
        raise SpecserveError(f"listening on {address[0]} (not loopback) needs a shared token (--token)")
    sock = socket.socket(socket.AF_UNIX if family == "unix" else
                         (socket.AF_INET6 if ":" in address[0] else socket.AF_INET))
    if family == "unix":
        if os.path.exists(address):
            os.unlink(address)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(8)
    sock.settimeout(0.2)
    if ready is not None:
        bound = address if family == "unix" else f"{sock.getsockname()[0]}:{sock.getsockname()[1]}"
        ready(f"{family}:{bound}")
    try:
        while stop is None or not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            if family == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Connection(conn, load_runner, token, shared=family == "unix", keepalive=keepalive)
            threading.Thread(target=c.serve, name="specserve-remote-front", daemon=True).start()
    finally:
        sock.close()
        if family == "unix" and os.path.exists(address):
            os.unlink(address)
