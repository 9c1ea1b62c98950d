"""Speculation on the Qwen2.5-Coder pair (1.5B target, 0.5B draft): every type, greedy, identical.

Large models on the CPU: run with `-m slow`.
"""

from __future__ import annotations

import pytest

from specserve.cli.workloads import load_workloads
from specserve.engine.generate import Generation, generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.gguf.chat_template import apply_chat_template
from specserve.gguf.tokenizer import Tokenizer
from specserve.gguf.vocab_check import check_vocab_compatible
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from tests.conftest import model_path

pytestmark = pytest.mark.slow
N_PREDICT = 40
TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache", "ngram-suffix", "draft"]


@pytest.fixture(scope="module")
def pair() -> tuple[LocalRunner, LocalRunner, Tokenizer, list[int]]:
    target = LocalRunner(model_path("qwen2.5-coder-1.5b"), n_ctx=1024, device="cpu", progress=False)
    draft = LocalRunner(model_path("qwen2.5-coder-0.5b"), n_ctx=1024, device="cpu", progress=False)
    check_vocab_compatible(target.gguf.metadata, draft.gguf.metadata)
    tok = Tokenizer.from_gguf(target.gguf)
    prompt = tok.encode(apply_chat_template(tok, load_workloads()["code_edit"][1]), add_special=False)
    return target, draft, tok, prompt


def run(pair, spec_type: str | None) -> Generation:
    target, draft, tok, prompt = pair
    spec = None
    if spec_type is not None:
        spec = SpecParams(type="none" if spec_type == "draft" else spec_type, ngram_size_n=4, ngram_size_m=8,
                          n_max=8)
    runner = draft if spec_type == "draft" else None
    return generate(target, tok, prompt, N_PREDICT, SamplingParams(temperature=0), spec,
                    chain_factory=lambda s, slot: build_chain(s, runner, seq=slot))


@pytest.fixture(scope="module")
def plain(pair) -> Generation:
    return run(pair, None)


@pytest.mark.parametrize("spec_type", TYPES)
def test_qwen_pair_identical(pair, plain, spec_type: str) -> None:
    gen = run(pair, spec_type)
    assert gen.tokens == plain.tokens
    assert gen.result.draft_n > 0
    if spec_type in ("ngram-simple", "ngram-cache", "ngram-suffix", "draft"):
        assert gen.result.n_steps < plain.result.n_steps
