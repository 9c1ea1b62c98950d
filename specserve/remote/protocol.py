"""The remoting protocol: one declarative command table, frames, and strict field codecs.

A frame is a little-endian u32 payload length, then the payload: u16 command, u32 request id, then the
command's fields in table order. A reply carries the same command and id, a u16 status (0: ok) and, when
ok, the reply fields; otherwise a message. Both ends encode and decode through COMMANDS, so they cannot
drift apart. While the host works on a request (a load, a warm-up, a long step), it sends a BUSY frame for
that request's id every KEEPALIVE_INTERVAL, before the reply: the front's timeout then bounds the silence, not
the command, so a slow host is told from a dead one. Every length, count, index, dtype and shape read is
checked before use: a malformed frame is a ProtocolError (the host answers it with an error reply), never an
out-of-bounds read.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

MAGIC = 0x53505356  # "SPSV"
VERSION = (3, 0)  # (major, minor): a major mismatch is refused, a minor one warned about (3: blocks cached by content)
MAX_FRAME = 1 << 30  # bytes of one payload (a model's tokenizer metadata or a step's logits fit)
MAX_INTS = 1 << 20  # entries of one integer list
MAX_STR = 1 << 26  # bytes of one string
MAX_DIMS = 4

HANDSHAKE_TIMEOUT = 2.0
STEP_TIMEOUT = 30.0  # default `--remote-timeout`: seconds without a reply or a keep-alive before the host is dead
KEEPALIVE_INTERVAL = 1.0  # seconds between a working host's BUSY frames (a test host may send them faster)


class Status(IntEnum):
    OK = 0
    BAD_FRAME = 1  # malformed: lengths, counts, kinds
    UNKNOWN_COMMAND = 2
    VERSION_MISMATCH = 3
    BAD_TOKEN = 4
    NOT_LOADED = 5
    ALREADY_LOADED = 6
    FILE_MISSING = 7
    UNSUPPORTED = 8
    INIT_FAILED = 9
    OUT_OF_MEMORY = 10
    BAD_REQUEST = 11  # well formed, refused by the runner (e.g. a position past the context)
    INTERNAL = 12
    BUSY = 13  # a keep-alive, not the reply: the host still works on this request (the message says on what)


class ProtocolError(Exception):
    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Command:
    code: int
    name: str
    request: tuple[tuple[str, str], ...]  # (field, kind)
    reply: tuple[tuple[str, str], ...]
    slow: bool = False  # may run for minutes (a model load, CUDA graph capture): the host sends keep-alives


# Kinds: u8, u32, i64, str, ints (i64 list), bytes, tensor (fp32 / i64 array, inline or in shared memory).
COMMANDS = (
    Command(1, "hello", (("magic", "u32"), ("major", "u32"), ("minor", "u32"), ("token", "str")),
            (("major", "u32"), ("minor", "u32"), ("host", "str"))),
    Command(2, "load", (("model", "str"), ("n_seqs", "u32"), ("n_ctx", "u32"), ("kv_size", "u32"),
                        ("weight_format", "str"), ("device", "str")),
            (("n_seqs", "u32"), ("n_ctx", "u32"), ("kv_size", "u32"), ("vocab_size", "u32"), ("max_step_rows", "i64"),
             ("device", "str"), ("dtype", "str"), ("weight_format", "str"), ("path", "str"),
             ("metadata", "bytes"), ("weights_bytes", "i64"), ("config", "bytes"), ("file_bytes", "i64")),
            slow=True),
    Command(3, "launch", (("tokens", "ints"), ("positions", "ints"), ("seq_ids", "ints"), ("logit_rows", "ints"),
                          ("fed", "ints"), ("want_logits", "u8")),
            (("argmax", "ints"), ("logits", "tensor"))),
    Command(4, "kv_truncate", (("seq", "u32"), ("n_keep", "u32")), ()),
    Command(5, "kv_cache", (("seq", "u32"), ("names", "ints")), ()),
    Command(6, "warmup", (("max_rows", "u32"), ("prompt_rows", "u32"), ("sequences", "u32")), (), slow=True),
    Command(7, "memory_info", (), (("kv_bytes", "i64"), ("weights_bytes", "i64"))),
    Command(8, "kv_attach", (("seq", "u32"), ("names", "ints")), ()),
)
BY_CODE = {c.code: c for c in COMMANDS}
BY_NAME = {c.name: c for c in COMMANDS}

DTYPES: dict[int, np.dtype[Any]] = {0: np.dtype("<f4"), 1: np.dtype("<i8")}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


@dataclass
class SharedTensor:
    """A tensor field whose bytes sit in a shared-memory segment (unix-socket connections)."""

    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


class Reader:
    """Reads fields from one payload, checking every length against what is left."""

    def __init__(self, data: bytes | memoryview):
        self.data = memoryview(data)
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(Status.BAD_FRAME,
                                f"frame too short: {n} bytes wanted at {self.pos} of {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))

    def field(self, kind: str) -> Any:
        if kind == "u8":
            return self.unpack("<B")[0]
        if kind == "u32":
            return self.unpack("<I")[0]
        if kind == "i64":
            return self.unpack("<q")[0]
        if kind == "str":
            (n,) = self.unpack("<I")
            if n > MAX_STR:
                raise ProtocolError(Status.BAD_FRAME, f"string of {n} bytes is over the limit")
            try:
                return bytes(self._take(n)).decode("utf-8")
            except UnicodeDecodeError:
                raise ProtocolError(Status.BAD_FRAME, "string is not UTF-8") from None
        if kind == "ints":
            (n,) = self.unpack("<I")
            if n > MAX_INTS:
                raise ProtocolError(Status.BAD_FRAME, f"list of {n} integers is over the limit")
            return np.frombuffer(self._take(8 * n), dtype="<i8").tolist()
        if kind == "bytes":
            (n,) = self.unpack("<Q")
            return bytes(self._take(n))
        if kind == "tensor":
            return self._tensor()
        raise ProtocolError(Status.INTERNAL, f"unknown field kind {kind}")

    def _tensor(self) -> np.ndarray | SharedTensor | None:
        code, ndim, where = self.unpack("<BBB")
        if where == 2:
            return None  # no tensor
        if code not in DTYPES or ndim > MAX_DIMS:
            raise ProtocolError(Status.BAD_FRAME, f"bad tensor header (dtype {code}, {ndim} dims)")
        shape = self.unpack(f"<{ndim}I")
        dtype = DTYPES[code]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if where == 0:
            (stated,) = self.unpack("<Q")
            if stated != n_bytes:
                raise ProtocolError(Status.BAD_FRAME, f"tensor of shape {shape} states {stated} bytes")
            return np.frombuffer(self._take(n_bytes), dtype=dtype).reshape(shape)
        if where == 1:
            name = self.field("str")
            (offset,) = self.unpack("<Q")
            return SharedTensor(name, offset, dtype, tuple(shape))
        raise ProtocolError(Status.BAD_FRAME, f"bad tensor placement {where}")

    def done(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(Status.BAD_FRAME, f"{len(self.data) - self.pos} bytes left over in the frame")


def encode_field(kind: str, value: Any) -> bytes:
    if kind == "u8":
        return struct.pack("<B", value)
    if kind == "u32":
        return struct.pack("<I", value)
    if kind == "i64":
        return struct.pack("<q", value)
    if kind == "str":
        raw = value.encode("utf-8")
        return struct.pack("<I", len(raw)) + raw
    if kind == "ints":
        return struct.pack("<I", len(value)) + np.asarray(value, dtype="<i8").tobytes()
    if kind == "bytes":
        return struct.pack("<Q", len(value)) + value
    if kind == "tensor":
        if value is None:
            return struct.pack("<BBB", 0, 0, 2)
        if isinstance(value, SharedTensor):
            head = struct.pack("<BBB", DTYPE_CODES[value.dtype], len(value.shape), 1)
            return (head + struct.pack(f"<{len(value.shape)}I", *value.shape) + encode_field("str", value.name)
                    + struct.pack("<Q", value.offset))
        array = np.ascontiguousarray(value)
        head = struct.pack("<BBB", DTYPE_CODES[array.dtype.newbyteorder("<")], array.ndim, 0)
        return head + struct.pack(f"<{array.ndim}I", *array.shape) + struct.pack("<Q", array.nbytes) + array.tobytes()
    raise ValueError(f"unknown field kind {kind}")


def encode_request(name: str, request_id: int, **fields: Any) -> bytes:
    cmd = BY_NAME[name]
    body = b"".join(encode_field(kind, fields[f]) for f, kind in cmd.request)
    return struct.pack("<HI", cmd.code, request_id) + body


def encode_reply(cmd: Command, request_id: int, **fields: Any) -> bytes:
    body = b"".join(encode_field(kind, fields[f]) for f, kind in cmd.reply)
    return struct.pack("<HIH", cmd.code, request_id, Status.OK) + body


def encode_error(code: int, request_id: int, status: Status, message: str) -> bytes:
    return struct.pack("<HIH", code, request_id, status) + encode_field("str", message[:4096])


def encode_keepalive(cmd: Command, request_id: int, message: str) -> bytes:
    """A BUSY frame: shaped like an error reply (a message and nothing else), so fronts decode it alike."""
    return encode_error(cmd.code, request_id, Status.BUSY, message)


def decode_request(payload: bytes | memoryview) -> tuple[Command, int, dict[str, Any]]:
    r = Reader(payload)
    code, request_id = r.unpack("<HI")
    cmd = BY_CODE.get(code)
    if cmd is None:
        raise ProtocolError(Status.UNKNOWN_COMMAND, f"unknown command {code}")
    fields = {f: r.field(kind) for f, kind in cmd.request}
    r.done()
    return cmd, request_id, fields


def decode_reply(payload: bytes | memoryview) -> tuple[Command | None, int, Status, dict[str, Any] | str]:
    """(command, request id, status, fields or the error message); an error reply may name a command code
    that does not exist (the request's)."""
    r = Reader(payload)
    code, request_id, status = r.unpack("<HIH")
    cmd = BY_CODE.get(code)
    if status != Status.OK:
        message = r.field("str")
        r.done()
        return cmd, request_id, Status(status) if status in Status._value2member_map_ else Status.INTERNAL, message
    if cmd is None:
        raise ProtocolError(Status.UNKNOWN_COMMAND, f"reply to unknown command {code}")
    fields = {f: r.field(kind) for f, kind in cmd.reply}
    r.done()
    return cmd, request_id, Status.OK, fields


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the connection closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ProtocolError(Status.BAD_FRAME, f"frame of {n} bytes is over the limit")
    return _recv_exact(sock, n)


def parse_address(address: str) -> tuple[str, Any]:
    """"unix:PATH" or "tcp:HOST:PORT" -> (family, socket address)."""
    kind, _, rest = address.partition(":")
    if kind == "unix" and rest:
        return "unix", rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return "tcp", (host.strip("[]"), int(port))
    raise ValueError(f"bad address {address!r}: expected unix:PATH or tcp:HOST:PORT")
