"""GGUF tokenizer: identical to HF's tokenizer of the same file, plus rules checked on a tiny vocabulary."""

from __future__ import annotations

import logging
import random
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest

from specserve import catalog
from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import IncrementalDecoder, Tokenizer, byte_alphabet

CORPUS = [
    "Hello world",
    "Hello 12345 world, 3.14159 and 1,000,000 - also 0xDEADBEEF, 1e-10 and -42",
    "I'm sure they'll say we've done it, isn't it? DON'T YOU'LL SHE'D",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    return None\n",
    "```python\nimport numpy as np\narr = np.zeros((3, 4), dtype=np.float32)\n```\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v); }',
    "Ünïcödé façade naïve — “quotes” ‘single’ … «guillemets»",
    "日本語のテキストと中文文本。한국어 텍스트입니다.",
    "Русский текст, ελληνικά, العربية, עברית, हिन्दी, ไทย",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇯🇵 ✨done✨",
    "   leading spaces and trailing   ",
    "\n\n\nnewlines\r\n\r\nwindows\t\ttabs \t mixed  \n \n",
    "A  B   C    D     E",
    "non-breaking\u00a0space, em\u2003space, ideographic\u3000space",
    "decomposed e\u0301 vs composed é; zero\u200bwidth",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    '<tool_call>{"name": "f"}</tool_call>',
    "<reponame>x<file_sep>y <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "x" * 60 + " " + "ab" * 40,
    "",
    " ",
    "\t",
]


@cache
def load(name: str) -> tuple[Tokenizer, Any]:
    """Our tokenizer and HF's, both built from the GGUF file of catalog model `name`."""
    from transformers import AutoTokenizer

    path = catalog.pull(name)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(GGUFFile(path)), hf


def check_matches_hf(tok: Tokenizer, hf: Any) -> None:
    # Like with like: neither model asks for a BOS, and HF's default encode adds none either.
    assert tok.add_bos is False and tok.add_eos is False
    assert hf("hi")["input_ids"] == hf("hi", add_special_tokens=False)["input_ids"]
    assert tok.vocab_size == len(hf)
    for text in CORPUS:
        ours = tok.encode(text)
        assert ours == hf(text)["input_ids"], text
        plain = tok.encode(text, parse_special=False)
        assert plain == hf(text, split_special_tokens=True)["input_ids"], text
        for skip in (False, True):
            assert tok.decode(ours, skip_special=skip) == hf.decode(ours, skip_special_tokens=skip), text
        assert tok.decode(plain) == text  # byte-level BPE round-trips exactly
    # Arbitrary id sequences (broken UTF-8, control and unused tokens mixed in) decode like HF too.
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
        for skip in (False, True):
            assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)


def check_incremental(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # Meaningful only if some token carries part of a character.
    assert any(not _is_utf8(tok.token_bytes(i)) for i in ids)
    decoder = IncrementalDecoder(tok)
    chunks = [decoder.add(i) for i in ids]
    chunks.append(decoder.flush())
    assert "".join(chunks) == tok.decode(ids) == text
    for chunk in chunks:
        assert "\ufffd" not in chunk
        chunk.encode("utf-8")  # no lone surrogates


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- smollm2-135m (default run) -------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> tuple[Tokenizer, Any]:
    return load("smollm2-135m")


def test_smollm_matches_hf(smollm) -> None:
    check_matches_hf(*smollm)


def test_smollm_special_ids(smollm) -> None:
    tok, _ = smollm
    assert tok.bos_id == 1 and tok.eos_id == 2
    assert tok.token_text(2) == "<|im_end|>"
    # llama.cpp's rules: <|endoftext|> and <|im_end|> by text, <reponame> as the FIM repo token
    assert tok.eog_ids == frozenset({0, 2, 4})
    assert tok.is_eog(2) and not tok.is_eog(1)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_smollm_digits_split_one_by_one(smollm) -> None:
    # The "smollm" pre-tokenizer isolates every digit (llama.cpp's \p{N} split).
    tok, _ = smollm
    ids = tok.encode("x 2024")
    assert [tok.token_text(i) for i in ids] == ["x", "Ġ", "2", "0", "2", "4"]


def test_smollm_token_text_and_bytes(smollm) -> None:
    tok, _ = smollm
    (hello,) = tok.encode(" hello")
    assert tok.token_text(hello) == "Ġhello"
    assert tok.token_bytes(hello) == b" hello"
    assert tok.token_bytes(tok.encode("\n")[0]) == b"\n"
    assert tok.token_bytes(2) == b"<|im_end|>"


def test_smollm_parse_special(smollm) -> None:
    tok, _ = smollm
    assert tok.encode("<|im_end|>") == [2]
    plain = tok.encode("<|im_end|>", parse_special=False)
    assert 2 not in plain and tok.decode(plain) == "<|im_end|>"


def test_smollm_skip_special(smollm) -> None:
    tok, _ = smollm
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "assistant\nHi!"
    assert tok.decode(ids) == "<|im_start|>assistant\nHi!<|im_end|>"


def test_smollm_incremental_decoder(smollm) -> None:
    tok, _ = smollm
    check_incremental(tok, "Snow ☃ 雪 눈 🌨️ and a family 👨‍👩‍👧 — done 🎉🎉")


def test_smollm_incremental_skip_special(smollm) -> None:
    tok, _ = smollm
    ids = tok.encode("<|im_start|>日本<|im_end|>")
    decoder = IncrementalDecoder(tok, skip_special=True)
    text = "".join(decoder.add(i) for i in ids) + decoder.flush()
    assert text == tok.decode(ids, skip_special=True) == "日本"


def test_smollm_incremental_broken_utf8(smollm) -> None:
    # A character cut short and never completed: the stream shows U+FFFD exactly where decode() does.
    tok, _ = smollm
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1
    ids = emoji_ids[:-1] + tok.encode("ok") + emoji_ids[:-1]
    decoder = IncrementalDecoder(tok)
    chunks = [decoder.add(i) for i in ids]
    tail = decoder.flush()
    assert "".join(chunks) + tail == tok.decode(ids)
    assert tok.decode(ids).startswith("\ufffd") and tail == "\ufffd"


def test_invalid_ids_raise(smollm) -> None:
    tok, _ = smollm
    for bad in (-1, tok.vocab_size, 10**9):
        with pytest.raises(SpecserveError, match="invalid token id"):
            tok.decode([5, bad])
        with pytest.raises(SpecserveError):
            tok.token_bytes(bad)
    with pytest.raises(SpecserveError):
        IncrementalDecoder(tok).add(-3)


# -- Qwen2.5-Coder pair (slow) ---------------------------------------------------------------

QWEN = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


@pytest.mark.slow
@pytest.mark.parametrize("name", QWEN)
def test_qwen_matches_hf(name: str) -> None:
    check_matches_hf(*load(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", QWEN)
def test_qwen_special_tokens(name: str) -> None:
    tok, _ = load(name)
    assert tok.eos_id == 151645 and tok.token_text(151645) == "<|im_end|>"
    texts = {tok.token_text(i) for i in tok.eog_ids}
    assert texts == {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    # <tool_call> is user-defined: matched whole even when control tokens are not parsed
    assert tok.encode("<tool_call>", parse_special=False) == [151657]
    check_incremental(tok, "中文注释 // ✓ 🚀 𓀀𓀁 𝔘𝔫𝔦 ok")


# -- rules on a tiny synthetic vocabulary ----------------------------------------------------

CHARS = {b: c for c, b in byte_alphabet().items()}  # byte -> its byte-level spelling


def tiny_gguf(extra: list[tuple[str, int]], merges: list[str], **metadata: Any) -> SimpleNamespace:
    """A stand-in GGUFFile: the 256 byte tokens, then `extra` (text, token type) entries."""
    tokens = [CHARS[b] for b in range(256)] + [t for t, _ in extra]
    types = [1] * 256 + [ty for _, ty in extra]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        **metadata,
    }
    return SimpleNamespace(metadata=md, path="tiny.gguf")


TINY_EXTRA = [("he", 1), ("ll", 1), ("hell", 1), ("hello", 1), ("<s>", 3), ("</s>", 3), ("<|im_end|>", 3), ("<t>", 4)]
TINY_MERGES = ["h e", "l l", "he ll", "hell o"]
HELLO, BOS, EOS, IM_END, USER_TOK = 259, 260, 261, 262, 263


def test_tiny_add_bos_eos() -> None:
    gguf = tiny_gguf(
        TINY_EXTRA,
        TINY_MERGES,
        **{
            "tokenizer.ggml.bos_token_id": BOS,
            "tokenizer.ggml.eos_token_id": EOS,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": True,
        },
    )
    tok = Tokenizer.from_gguf(gguf)
    assert tok.add_bos and tok.add_eos
    assert tok.encode("hello") == [BOS, HELLO, EOS]
    assert tok.encode("hello", add_special=False) == [HELLO]
    assert tok.decode([BOS, HELLO, EOS]) == "<s>hello</s>"
    assert tok.decode([BOS, HELLO, EOS], skip_special=True) == "hello"


def test_tiny_special_parsing_and_eog() -> None:
    tok = Tokenizer.from_gguf(tiny_gguf(TINY_EXTRA, TINY_MERGES, **{"tokenizer.ggml.eos_token_id": EOS}))
    assert tok.add_bos is False  # gpt2 pre-tokenizer: no BOS unless the file says so
    assert tok.encode("hello<|im_end|>") == [HELLO, IM_END]
    assert tok.encode("hello<|im_end|>", parse_special=False) == [HELLO] + [ord(c) for c in "<|im_end|>"]
    # user-defined tokens are matched whole either way, and are not "special" for skipping
    assert tok.encode("<t>", parse_special=False) == [USER_TOK]
    assert tok.decode([USER_TOK, IM_END], skip_special=True) == "<t>"
    assert tok.eog_ids == frozenset({EOS, IM_END})


def test_tiny_eog_from_metadata_and_harmony_rule() -> None:
    extra = [("<|return|>", 3), ("<|call|>", 3), ("<|end|>", 3), ("<my_eot>", 3)]
    meta = {"tokenizer.ggml.eot_token_id": 259}
    tok = Tokenizer.from_gguf(tiny_gguf(extra, [], **meta))
    # <|end|> only ends a message when <|return|> and <|call|> exist (gpt-oss); eot id comes from the file
    assert {tok.token_text(i) for i in tok.eog_ids} == {"<|return|>", "<|call|>", "<my_eot>"}


def test_tiny_unknown_pre_tokenizer_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specserve.gguf.tokenizer"):
        tok = Tokenizer.from_gguf(tiny_gguf(TINY_EXTRA, TINY_MERGES, **{"tokenizer.ggml.pre": "no-such-pre"}))
    assert "no-such-pre" in caplog.text
    assert tok.encode("hello hello") == [HELLO, ord(" "), HELLO]


def test_tiny_raw_spelled_token_decodes() -> None:
    # A token stored with raw (non byte-level) characters decodes to their UTF-8 bytes.
    tok = Tokenizer.from_gguf(tiny_gguf([("é ü", 1)], []))
    assert tok.token_bytes(256) == "é ü".encode()
    assert tok.decode([256, ord("!")]) == "é ü!"


def test_tiny_incremental_holds_partial_characters() -> None:
    tok = Tokenizer.from_gguf(tiny_gguf([], []))
    data = "é😀".encode()
    decoder = IncrementalDecoder(tok)
    assert [decoder.add(b) for b in data] == ["", "é", "", "", "", "😀"]
    assert decoder.flush() == ""
    # a lead byte followed by ASCII can never complete: replaced at once, like decode()
    ids = [0xF0, 0x9F, ord("a"), 0xE6]
    chunks = [decoder.add(i) for i in ids] + [decoder.flush()]
    assert chunks == ["", "", "\ufffda", "", "\ufffd"]
    assert "".join(chunks) == tok.decode(ids)


def test_unsupported_tokenizer_model() -> None:
    gguf = tiny_gguf([], [], **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(SpecserveError, match="only byte-level BPE"):
        Tokenizer.from_gguf(gguf)


def test_malformed_vocab() -> None:
    with pytest.raises(SpecserveError, match="malformed merge"):
        Tokenizer.from_gguf(tiny_gguf([], ["abc"]))
    gguf = tiny_gguf([], [])
    gguf.metadata["tokenizer.ggml.token_type"] = [1, 1]
    with pytest.raises(SpecserveError, match="token types"):
        Tokenizer.from_gguf(gguf)
    with pytest.raises(SpecserveError, match="can only tokenize text"):
        Tokenizer.from_gguf(tiny_gguf([], [])).encode(None)  # type: ignore[arg-type]
