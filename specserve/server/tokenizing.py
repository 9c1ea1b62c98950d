"""Tokenizing request text (and writing long token lists) without holding the GIL for long.

The tokenizer library keeps the GIL for a whole `encode` call (3 s for 4 MB of text), so a
request handler in a worker thread would still stall the event loop and every stream with
it. Long texts are therefore encoded in pieces of about PIECE_CHARS characters, cut only where
every pre-tokenizer splits anyway (a space between two ASCII letters or digits: the word before
ends there and the space starts the next pre-token), so the ids are those of one call.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from specserve.gguf.tokenizer import Tokenizer

PIECE_CHARS = 2048  # ~2 ms of encoding: about the longest the event loop waits for the GIL
_CUT = re.compile(r"[A-Za-z0-9] [A-Za-z0-9]")


def yield_gil() -> None:
    """Hand the GIL over now: a waiting thread (the event loop) would otherwise wait the interpreter's
    switch interval (5 ms) at each of the several hand-overs that answering one request takes."""
    time.sleep(0)


def json_list(key: str, items: list[Any], piece: int = 4096) -> bytes:
    """`{key: items}` as JSON, serialized a slice at a time: json.dumps keeps the GIL for a whole call."""
    parts = [f"{{{json.dumps(key)}: [".encode()]
    for i in range(0, len(items), piece):
        if i:
            parts.append(b", ")
        parts.append(json.dumps(items[i:i + piece], ensure_ascii=False)[1:-1].encode())
        yield_gil()
    parts.append(b"]}")
    return b"".join(parts)  # bytes joined: one copy, where a str join and then encode() copy twice


class TextEncoder:
    """`Tokenizer.encode` in GIL-friendly pieces; call it from a worker thread."""

    def __init__(self, tokenizer: Tokenizer, piece_chars: int = PIECE_CHARS):
        self.tokenizer = tokenizer
        self.piece_chars = piece_chars
        # An added token with a space in it could span a cut; vocabulary entries spell spaces as 'Ġ',
        # so a literal space only appears in such tokens. Then encode in one piece.
        self.can_cut = not any(" " in tokenizer.token_text(i) for i in range(tokenizer.vocab_size))

    def pieces(self, text: str) -> list[str]:
        """text cut at safe places into pieces of about piece_chars (joined, they are text)."""
        if not self.can_cut or len(text) <= self.piece_chars:
            return [text]
        out, start = [], 0
        while len(text) - start > self.piece_chars:
            m = _CUT.search(text, start + self.piece_chars)
            if m is None:
                break
            out.append(text[start:m.start() + 1])
            start = m.start() + 1
        out.append(text[start:])
        return out

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tok = self.tokenizer
        ids: list[int] = []
        pieces = self.pieces(text)
        for piece in pieces:
            ids += tok.encode(piece, add_special=False, parse_special=parse_special)
            if len(pieces) > 1:
                yield_gil()
        if add_special:  # bos/eos as the model asks, around the whole text
            if tok.add_bos and tok.bos_id is not None:
                ids.insert(0, tok.bos_id)
            if tok.add_eos and tok.eos_id is not None:
                ids.append(tok.eos_id)
        return ids
