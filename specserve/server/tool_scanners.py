"""The scanners behind server/tool_calls.py: one per tool-call format (hermes, llama3, mistral, generic), each
cutting the start of an output buffer into content text and whole calls. A scanner's decisions never depend on text
not seen yet (it waits, returning None, while the buffer could still become a marker or a call), which is what lets
a stream of deltas read the same calls as the whole text."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from specserve.server.held_text import partial_tail

FORMATS = ("hermes", "llama3", "mistral", "generic")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"

# The first key of a JSON object that starts an answer and is read as a call; any other object is content, so a
# plain JSON answer is not held back to its end.
_LLAMA3_KEYS = ('"name"', '"type"')
_GENERIC_KEYS = ('"tool_calls"', '"tool_call"', '"response"')
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}\"]+")
_IN_STRING = re.compile(r'["\\]')  # what ends or escapes inside a JSON string
_OUTSIDE_STRING = re.compile(r'[{}\[\]"]')  # brackets and the start of a string


class TextPiece(NamedTuple):
    text: str


class CallPiece(NamedTuple):
    name: str
    arguments: str  # compact JSON


Piece = TextPiece | CallPiece
_Step = tuple[int, list[Piece]]  # characters consumed from the buffer's start, and what they were


def _skip_space(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos].isspace():
        pos += 1
    return pos


def _content(buf: str, markers: tuple[str, ...], final: bool) -> _Step | None:
    """Plain text up to the first marker; an end that may begin a marker waits for more text."""
    found = [i for i in (buf.find(m) for m in markers) if i >= 0]
    held = 0 if final else partial_tail(buf, markers)
    cut = min(found) if found else len(buf) - held
    return (cut, [TextPiece(buf[:cut])]) if cut > 0 else None


def _unfinished(buf: str, final: bool) -> _Step | None:
    """A call still being written: wait, or at the end of the output give its text back as content."""
    return (len(buf), [TextPiece(buf)]) if final else None


def _opens_object(buf: str, start: int, keys: tuple[str, ...]) -> bool | None:
    """Whether buf[start:] opens a JSON object whose first key is one of `keys`; None while not yet known."""
    if start == len(buf):
        return None
    if buf[start] != "{":
        return False
    rest = buf[_skip_space(buf, start + 1):]
    if any(rest.startswith(key) for key in keys):
        return True
    return None if any(key.startswith(rest) for key in keys) else False


def _leading_object(buf: str, keys: tuple[str, ...], final: bool) -> int | None:
    """Where a call object that opens the output (after whitespace) starts, -1 if the output opens with none, None
    while not yet known (`keys`: its possible first keys)."""
    start = _skip_space(buf, 0)
    opens = _opens_object(buf, start, keys)
    if opens is None and not final:
        return None
    return start if opens else -1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would be written back as invalid JSON


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _make_call(name: Any, args: Any, tool_names: set[str] | None) -> CallPiece | None:
    if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
        return None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _loads(args)
    return CallPiece(name, _compact(args)) if isinstance(args, dict) else None


def _call_from(obj: Any, tool_names: set[str] | None) -> CallPiece | None:
    """A call from a decoded `{"name": ..., "arguments"|"parameters": {...}}`; no arguments means `{}`."""
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _make_call(obj.get("name"), args, tool_names)


def _decode(text: str, tool_names: set[str] | None) -> CallPiece | None:
    return _call_from(_loads(text), tool_names)


def _decode_many(text: str, tool_names: set[str] | None) -> list[Piece] | None:
    """Calls from a JSON array of call objects (or one object); None if any of them is malformed."""
    value = _loads(text)
    pieces: list[Piece] = []
    for item in value if isinstance(value, list) else [value]:
        call = _call_from(item, tool_names)
        if call is None:
            return None
        pieces.append(call)
    return pieces or None


def _generic_pieces(text: str, tool_names: set[str] | None) -> list[Piece] | None:
    value = _loads(text)
    if not isinstance(value, dict):
        return None
    pieces: list[Piece] = []
    if "response" in value:
        response = value["response"]
        pieces.append(TextPiece(response if isinstance(response, str) else _compact(response)))
    calls = value.get("tool_calls", [value["tool_call"]] if "tool_call" in value else [])
    if not isinstance(calls, list):
        return None
    for item in calls:
        call = _call_from(item, tool_names)
        if call is None:
            return None
        pieces.append(call)
    return pieces or None


class _JsonSpan:
    """Where the JSON object or array that starts at `start` of a growing buffer ends. Resumes where the last
    look stopped, so a long call costs linear time however many deltas bring it. It only counts brackets outside
    strings; whether the span is valid JSON is json.loads's business."""

    def __init__(self, start: int):
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._end: int | None = None

    def end(self, buf: str) -> int | None:
        while self._end is None:
            if self._in_string:
                found = _IN_STRING.search(buf, self._pos)
                if found is None or (found.group() == "\\" and found.end() >= len(buf)):
                    self._pos = len(buf) if found is None else found.start()
                    return None
                self._pos = found.end() + (1 if found.group() == "\\" else 0)
                self._in_string = found.group() == "\\"
                continue
            found = _OUTSIDE_STRING.search(buf, self._pos)
            if found is None:
                self._pos = len(buf)
                return None
            self._pos = found.end()
            char = found.group()
            self._in_string = char == '"'
            self._depth += 1 if char in "{[" else -1 if char in "}]" else 0
            if self._depth == 0:
                self._end = self._pos
        return self._end


class _Scanner:
    """One format's reading of the output. `step` says what the buffer starts with (content, a call, or the text
    of a malformed call) and how many characters that was, or None while that depends on text not seen yet
    (`final`: there is no more). A decision made on a prefix is never contradicted by later text: that is what
    makes streaming agree with parsing the whole text."""

    def __init__(self, tool_names: set[str] | None):
        self.tool_names = tool_names
        self._span: _JsonSpan | None = None

    def step(self, buf: str, final: bool) -> _Step | None:
        raise NotImplementedError

    def consumed(self) -> None:
        """The buffer lost its start: positions of a span in progress no longer hold."""
        self._span = None

    def _json_end(self, buf: str, start: int) -> int | None:
        if self._span is None or self._span.start != start:
            self._span = _JsonSpan(start)
        return self._span.end(buf)


def _closer_end(buf: str, pos: int, closer: str, final: bool) -> int | None:
    """After a call's JSON: past the closing marker if (after whitespace) it comes next, else `pos`; None while
    the text may still become the closer."""
    start = _skip_space(buf, pos)
    if buf.startswith(closer, start):
        return start + len(closer)
    if not final and closer.startswith(buf[start:]):
        return None
    return pos


class _Marked(_Scanner):
    """A format whose calls follow a marker, anywhere in the output: `_after` reads from the first character past
    the marker and its whitespace."""

    marker: str

    def step(self, buf: str, final: bool) -> _Step | None:
        if not buf.startswith(self.marker):
            return _content(buf, (self.marker,), final)
        start = _skip_space(buf, len(self.marker))
        if start == len(buf):
            return _unfinished(buf, final)
        return self._after(buf, start, final)

    def _after(self, buf: str, start: int, final: bool) -> _Step | None:
        raise NotImplementedError


class _Hermes(_Marked):
    marker = HERMES_OPEN

    def _after(self, buf: str, start: int, final: bool) -> _Step | None:
        if buf[start] != "{":  # some other syntax inside the tag: the tag is just text
            return start, [TextPiece(buf[:start])]
        end = self._json_end(buf, start)
        if end is None:
            return _unfinished(buf, final)
        # A complete JSON call needs no closing tag (a model may stop right after it).
        stop = _closer_end(buf, end, HERMES_CLOSE, final)
        if stop is None:
            return None
        return stop, [_decode(buf[start:end], self.tool_names) or TextPiece(buf[:stop])]


class _Llama3(_Scanner):
    def __init__(self, tool_names: set[str] | None):
        super().__init__(tool_names)
        self._at_start = True  # a bare JSON call is only read at the very start of the output
        self._chained = False  # after a call: `; {...}` is the next call

    def step(self, buf: str, final: bool) -> _Step | None:
        if self._at_start:
            return self._leading(buf, final)
        if self._chained:
            return self._next_in_chain(buf, final)
        if buf.startswith(PYTHON_TAG):
            return self._tagged(buf, final)
        return _content(buf, (PYTHON_TAG,), final)

    def _leading(self, buf: str, final: bool) -> _Step | None:
        start = _leading_object(buf, _LLAMA3_KEYS, final)
        if start is None:
            return None
        if start < 0:
            self._at_start = False
            return self.step(buf, final)
        step = self._object(buf, start, final)
        if step is not None:
            self._at_start = False
        return step

    def _next_in_chain(self, buf: str, final: bool) -> _Step | None:
        semi = _skip_space(buf, 0)
        if semi < len(buf) and buf[semi] == ";":
            brace = _skip_space(buf, semi + 1)
            if brace < len(buf) and buf[brace] == "{":
                return self._object(buf, brace, final)
            known = brace < len(buf)
        else:
            known = semi < len(buf)
        if not known and not final:
            return None
        self._chained = False
        return self.step(buf, final)

    def _tagged(self, buf: str, final: bool) -> _Step | None:
        start = _skip_space(buf, len(PYTHON_TAG))
        if start == len(buf):
            return _unfinished(buf, final)
        if buf[start] != "{":  # a built-in tool's Python call: left to the client as text
            return len(PYTHON_TAG), [TextPiece(PYTHON_TAG)]
        return self._object(buf, start, final)

    def _object(self, buf: str, start: int, final: bool) -> _Step | None:
        """The call object at `start`; whatever precedes it (tag, separator) is part of its text."""
        end = self._json_end(buf, start)
        if end is None and not final:
            return None
        call = None if end is None else _decode(buf[start:end], self.tool_names)
        end = len(buf) if end is None else end
        self._chained = call is not None
        return end, [call or TextPiece(buf[:end])]


class _Mistral(_Marked):
    marker = MISTRAL_CALLS

    def _after(self, buf: str, start: int, final: bool) -> _Step | None:
        if buf[start] in "[{":
            end = self._json_end(buf, start)
            if end is None:
                return _unfinished(buf, final)
            # One array is one unit: if any call in it is malformed, the whole array stays content.
            return end, _decode_many(buf[start:end], self.tool_names) or [TextPiece(buf[:end])]
        return self._named(buf, start, final)

    def _named(self, buf: str, start: int, final: bool) -> _Step | None:
        """`name[ARGS]{...}`, the form of Mistral's newer tokenizers."""
        name = _MISTRAL_NAME.match(buf, start)
        args_at = name.end() if name else start
        if args_at == start:
            return start, [TextPiece(buf[:start])]
        if args_at == len(buf):
            return _unfinished(buf, final)
        if not buf.startswith(MISTRAL_ARGS, args_at):
            if not final and MISTRAL_ARGS.startswith(buf[args_at:]):
                return None
            return args_at, [TextPiece(buf[:args_at])]
        brace = _skip_space(buf, args_at + len(MISTRAL_ARGS))
        if brace == len(buf):
            return _unfinished(buf, final)
        if buf[brace] != "{":
            return brace, [TextPiece(buf[:brace])]
        end = self._json_end(buf, brace)
        if end is None:
            return _unfinished(buf, final)
        call = _make_call(buf[start:args_at], _loads(buf[brace:end]), self.tool_names)
        return end, [call or TextPiece(buf[:end])]


class _Generic(_Scanner):
    def __init__(self, tool_names: set[str] | None):
        super().__init__(tool_names)
        self._at_start = True

    def step(self, buf: str, final: bool) -> _Step | None:
        if not self._at_start:
            return _content(buf, (), final)
        start = _leading_object(buf, _GENERIC_KEYS, final)
        if start is None:
            return None
        if start < 0:
            self._at_start = False
            return _content(buf, (), final)
        end = self._json_end(buf, start)
        if end is None and not final:
            return None
        pieces = None if end is None else _generic_pieces(buf[start:end], self.tool_names)
        end = len(buf) if end is None else end
        self._at_start = False
        return end, pieces or [TextPiece(buf[:end])]


SCANNERS: dict[str, type[_Scanner]] = {"hermes": _Hermes, "llama3": _Llama3, "mistral": _Mistral,
                                        "generic": _Generic}


def check_format(fmt: str) -> None:
    if fmt not in SCANNERS:
        raise ValueError(f"unknown tool-call format {fmt!r} (one of {', '.join(FORMATS)})")
