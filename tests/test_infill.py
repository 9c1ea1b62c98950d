"""/infill's prompt layout, token by token, on a vocabulary of single bytes plus FIM tokens (and on
qwen2.5-coder's real one, slow)."""

from __future__ import annotations

import pytest

from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer, byte_alphabet
from specserve.server.infill import SNIPPET_MARK, InfillUnsupported, infill_prompt
from specserve.server.schemas import InfillRequest
from specserve.server.tokenizing import TextEncoder
from tests.conftest import model_path

CHARS = sorted(byte_alphabet(), key=byte_alphabet().__getitem__)  # token i < 256 is byte i
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>", "<s>"]


def encoder(specials: list[str]) -> TextEncoder:
    tokens = CHARS + specials
    types = [TOKEN_NORMAL] * len(CHARS) + [TOKEN_CONTROL] * len(specials)
    meta = {"tokenizer.ggml.bos_token_id": len(tokens) - 1, "tokenizer.ggml.add_bos_token": True}
    return TextEncoder(Tokenizer(tokens, types, [], "gpt2", meta))


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte alphabet keeps byte order: byte b is token b's


def special(name: str) -> int:
    return len(CHARS) + FIM.index(name)


def request(**fields: object) -> InfillRequest:
    return InfillRequest.model_validate({"input_prefix": "", "input_suffix": "", **fields})


def test_full_layout_with_repo_and_files() -> None:
    enc = encoder(FIM)
    req = request(input_prefix="def f(", input_suffix="):\n", prompt="a",
                  input_extra=[{"filename": "u.py", "text": "x=1"}, {"text": "y"}])
    got = infill_prompt(enc, req, n_batch=512, n_ctx=4096, n_predict=16)
    pre, suf, mid = special("<|fim_prefix|>"), special("<|fim_suffix|>"), special("<|fim_middle|>")
    rep, sep, bos = special("<|repo_name|>"), special("<|file_sep|>"), special("<s>")
    assert got == [rep, *ids("myproject\n"), sep, *ids("u.py\n"), *ids("x=1"), sep, *ids("tmp\n"), *ids("y"),
                   sep, *ids("filename\n"), bos, pre, *ids("def f("), *ids("a"), suf, *ids("):\n"), mid]


def test_prefix_suffix_and_extra_are_cut_to_fit() -> None:
    enc = encoder(FIM)
    req = request(input_prefix="0123456789abcdefghij", input_suffix="ABCDEFGHIJ", prompt="p",
                  input_extra=[{"filename": "f", "text": "zzzzzzzzzz"}])
    n_batch, n_ctx, n_predict = 16, 40, 4  # prefix: its last 12; suffix: 16/4 - (2 + 1) = 1; extra: 40-16-8 = 16
    got = infill_prompt(enc, req, n_batch, n_ctx, n_predict)
    extra = [special("<|repo_name|>"), *ids("myproject\n"), special("<|file_sep|>"), *ids("f\n"), *ids("z" * 10),
             special("<|file_sep|>"), *ids("filename\n")]
    assert got == [*extra[-16:], special("<s>"), special("<|fim_prefix|>"), *ids("89abcdefghij"), *ids("p"),
                   special("<|fim_suffix|>"), *ids("A"), special("<|fim_middle|>")]


def test_without_repo_and_file_tokens_files_get_a_snippet_mark() -> None:
    enc = encoder(FIM[:3] + ["<s>"])
    got = infill_prompt(enc, request(input_prefix="a", input_suffix="b", input_extra=[{"text": "c"}]), 512, 4096, 8)
    bos = len(CHARS) + 3
    assert got == [*ids(SNIPPET_MARK), *ids("c"), bos, len(CHARS), *ids("a"), len(CHARS) + 1, *ids("b"),
                   len(CHARS) + 2]


def test_control_token_text_in_prefix_is_text_and_token_ids_pass() -> None:
    enc = encoder(FIM)
    got = infill_prompt(enc, request(input_prefix=["<|fim_middle|>", 65], input_suffix=""), 512, 4096, 8)
    assert got[got.index(special("<|fim_prefix|>")) + 1:][:15] == [*ids("<|fim_middle|>"), 65]
    assert got.count(special("<|fim_middle|>")) == 1  # only the layout's own


def test_a_model_without_fim_tokens_is_refused() -> None:
    with pytest.raises(InfillUnsupported, match="prefix, suffix, middle"):
        infill_prompt(encoder(["<s>"]), request(), 512, 4096, 8)
    assert InfillUnsupported("x").response().status_code == 400


@pytest.mark.slow
def test_qwen_coder_layout() -> None:
    tok = Tokenizer.from_gguf(GGUFFile(model_path("qwen2.5-coder-0.5b")))
    enc = TextEncoder(tok)
    assert tok.fim["pre"] == 151659 and tok.fim["mid"] == 151660 and tok.fim["sep"] == 151664
    got = infill_prompt(enc, request(input_prefix="def add(a, b):\n    ", input_suffix="\n"), 512, 4096, 16)
    text = tok.decode(got)
    assert text == ("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>def add(a, b):\n    "
                    "<|fim_suffix|>\n<|fim_middle|>")
