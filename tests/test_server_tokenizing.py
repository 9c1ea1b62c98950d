"""The server's tokenizing helpers (no server process): pieces give the ids of one encode call."""

from __future__ import annotations

import random
from functools import cache

import pytest

from specserve import catalog
from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import Tokenizer
from specserve.server.tokenizing import TextEncoder
from tests.test_tokenizer import CORPUS


@cache
def tokenizer(pre: str | None = None) -> Tokenizer:
    """The default model's vocabulary, with its own pre-tokenizer or another one of the three regexes."""
    gguf = GGUFFile(catalog.pull(catalog.DEFAULT_MODEL))
    if pre is None:
        return Tokenizer.from_gguf(gguf)
    md = gguf.metadata
    return Tokenizer(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.merges"],
                     pre, md)


def mixed_text(seed: int, n_words: int = 400) -> str:
    rng = random.Random(seed)
    words = ["the", "Cat", "x1", "42", "3.14", "don't", "I'm", "a", "é", "日本", " ", "  ", "\n", "\t", ",", "—",
             "<|im_end|>", "<|im_start|>", "user", "1234567", "A", "zz", "😀", "'s", "\r\n"]
    return "".join(rng.choice(words) + rng.choice(["", " ", " ", "  ", "\n"]) for _ in range(n_words))


@pytest.mark.parametrize("pre", [None, "gpt2", "qwen2", "llama3", "starcoder"])
def test_pieces_encode_like_one_call(pre: str | None) -> None:
    tok = tokenizer(pre)
    enc = TextEncoder(tok, piece_chars=8)  # tiny pieces: a cut at nearly every allowed place
    assert enc.can_cut
    texts = [*CORPUS, " ".join(CORPUS), *(mixed_text(seed) for seed in range(20))]
    n_cut = 0
    for text in texts:
        pieces = enc.pieces(text)
        assert "".join(pieces) == text
        n_cut += len(pieces) - 1
        for parse_special in (True, False):
            for add_special in (True, False):
                assert enc.encode(text, add_special, parse_special) == tok.encode(text, add_special, parse_special), \
                    (pre, text[:80])
    assert n_cut > 500  # the cuts were really exercised


def test_piece_sizes_follow_the_limit() -> None:
    enc = TextEncoder(tokenizer(), piece_chars=1000)
    text = "word " * 10_000
    pieces = enc.pieces(text)
    assert len(pieces) >= 40 and max(len(p) for p in pieces) <= 1010
    assert enc.pieces("x" * 5000) == ["x" * 5000]  # no safe cut: one piece
