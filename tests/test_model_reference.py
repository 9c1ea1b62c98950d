"""Our transformer against HF transformers loading the same GGUF (fp32, CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings
from tests.conftest import load_hf_model, model_path
from tests.helpers import prefill

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(autouse=True)
def exact_cpu_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model against HF at 1e-3: the CPU's exact fp32 products. The int8 ones round activations (~0.4% a
    product); tests/test_quant_cpu.py bounds them and docs/perf.md (how far the int8 products move the model)
    gives their greedy agreement."""
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()


def rel_max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def last_logits(runner: LocalRunner, tokens: list[int]) -> torch.Tensor:
    runner.kv_truncate(0, 0)
    return prefill(runner, 0, tokens, n_batch=512)


def greedy(runner: LocalRunner, tokenizer, tokens: list[int], n: int) -> list[int]:
    return generate(runner, tokenizer, tokens, n, SamplingParams(temperature=0.0)).tokens


def hf_greedy(hf, tokens: list[int], n: int, eog: frozenset[int]) -> list[int]:
    out = hf.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(eog),
                      pad_token_id=sorted(eog)[0])
    return out[0, len(tokens):].tolist()


def check_against_hf(runner: LocalRunner, hf, tokenizer: Tokenizer, n_tokens: int = 64) -> None:
    for prompt in PROMPTS:
        tokens = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1].float()
        err = rel_max_err(last_logits(runner, tokens), ref)
        assert err < 1e-3, f"{prompt!r}: relative max error {err}"
        ours = greedy(runner, tokenizer, tokens, n_tokens)
        with torch.no_grad():
            theirs = hf_greedy(hf, tokens, n_tokens, tokenizer.eog_ids)
        assert ours == theirs, f"{prompt!r}: greedy text differs\nours:   {ours}\ntheirs: {theirs}"


def test_smollm2_matches_hf(smollm_runner, smollm_hf) -> None:
    # 32 greedy tokens a prompt in the default run (HF's generate is most of its time); -m slow runs 64 on qwen
    check_against_hf(smollm_runner, smollm_hf, Tokenizer.from_gguf(smollm_runner.gguf), n_tokens=32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_matches_hf(name: str) -> None:
    path = model_path(name)
    runner = LocalRunner(path, n_ctx=512, device="cpu", progress=False)
    hf = load_hf_model(path)
    try:
        check_against_hf(runner, hf, Tokenizer.from_gguf(runner.gguf))
    finally:
        del hf, runner
        gc.collect()
