"""Mixture-of-experts models end to end on the CPU: tiny random HF Qwen2-MoE, Qwen3-MoE and Mixtral models,
written to GGUF in llama.cpp's layout (tests/moe_gguf.py), loaded by specserve and compared with HF.

The Qwen references are loaded by HF from the GGUF file itself (from_pretrained(dir, gguf_file=..., config=...);
transformers does not read the expert FFN size from GGUF, hence the config), so the file's layout is checked
against HF's reading of llama.cpp's; HF reads no Mixtral GGUF, so Mixtral is compared with the model it was
written from.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings
from specserve.kernels.backend import kernels_for
from specserve.kernels.moe_experts import moe_experts_ref
from specserve.kernels.moe_routing import route_ref
from specserve.model.batch import Batch
from specserve.model.moe import MoeConfig
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from tests.moe_gguf import N_EXPERT, N_EXPERT_USED, hf_model, quantize_gguf, write_gguf

MODEL_TYPES = ["qwen2_moe", "qwen3_moe", "mixtral"]
PROMPT = [(37 * i + 11) % 256 for i in range(24)]
N_GREEDY = 32


class Models:
    """One model type: the HF model, its GGUF file, HF's reference and specserve's runner."""

    def __init__(self, model_type: str, directory: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.built = hf_model(model_type)
        self.path = write_gguf(self.built, directory / f"{model_type}.gguf")
        if model_type == "mixtral":
            self.reference = self.built
        else:
            self.reference = AutoModelForCausalLM.from_pretrained(
                str(directory), gguf_file=self.path.name, config=self.built.config, dtype=torch.float32).eval()
        self.runner = LocalRunner(self.path, n_ctx=128, device="cpu", progress=False)
        self.tokenizer = Tokenizer.from_gguf(self.runner.gguf)

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.reference(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=MODEL_TYPES)
def models(request, tmp_path_factory) -> Models:
    return Models(request.param, tmp_path_factory.mktemp(request.param))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_reads_the_expert_config(models: Models) -> None:
    cfg = models.runner.config
    hf = models.built.config
    assert isinstance(cfg, MoeConfig)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_gating) == (N_EXPERT, N_EXPERT_USED, "softmax")
    assert cfg.expert_ffn == getattr(hf, "moe_intermediate_size", hf.intermediate_size)
    assert cfg.shared_ffn == getattr(hf, "shared_expert_intermediate_size", 0)
    assert cfg.expert_weights_norm == getattr(hf, "norm_topk_prob", True)  # Mixtral always normalises
    assert all(layer.experts is not None and layer.w_gate_up is None for layer in models.runner.weights.layers)


def test_gguf_holds_the_built_weights(models: Models) -> None:
    """specserve reads the HF model's experts and router back exactly; for the Qwen files, HF's own GGUF
    reader recovers every weight the file was written from."""
    built = models.built.state_dict()
    for i, layer in enumerate(models.runner.weights.layers):
        p = f"model.layers.{i}.mlp."
        assert torch.equal(layer.experts.gate_up, built[p + "experts.gate_up_proj"])
        assert torch.equal(layer.experts.down, built[p + "experts.down_proj"])
        assert torch.equal(layer.experts.router, built[p + "gate.weight"])
        if p + "shared_expert_gate.weight" in built:
            assert torch.equal(layer.experts.shared_gate, built[p + "shared_expert_gate.weight"])
    if models.reference is not models.built:
        read = models.reference.state_dict()
        assert built.keys() == read.keys()
        assert all(torch.equal(built[k], read[k]) for k in built)


def test_logits_match_hf(models: Models) -> None:
    batch = Batch()
    batch.add_sequence(PROMPT, 0, 0, "all")
    ours = models.runner.forward(batch)
    hf = models.hf_logits(PROMPT)
    assert rel_err(ours[-1], hf[-1]) < 1e-3
    assert rel_err(ours, hf) < 1e-3
    models.runner.kv_truncate(0, 0)


def test_greedy_matches_hf(models: Models) -> None:
    gen = generate(models.runner, models.tokenizer, PROMPT, N_GREEDY, ignore_eos=True)
    tokens = list(PROMPT)
    for _ in range(N_GREEDY):
        tokens.append(int(models.hf_logits(tokens)[-1].argmax()))
    assert gen.tokens == tokens[len(PROMPT):]


def test_speculative_greedy_equals_plain(models: Models) -> None:
    """ngram-suffix drafts from the text so far; verify steps run several rows through the experts at once."""
    prompt = PROMPT[:8] * 4  # repeated text, so the suffix lookup drafts from the start
    plain = generate(models.runner, models.tokenizer, prompt, N_GREEDY, ignore_eos=True)
    spec = generate(models.runner, models.tokenizer, prompt, N_GREEDY, SamplingParams(temperature=0),
                    SpecParams(type="ngram-suffix"), ignore_eos=True,
                    chain_factory=lambda s, slot: build_chain(s, None, seq=slot))
    assert spec.result.draft_n > 0
    assert spec.tokens == plain.tokens


def test_expert_paths_agree_with_hf_experts() -> None:
    """Grouped by expert, or every expert over every row (the CUDA-graph path): HF's experts' output."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    n_expert, hidden, ffn, k = 16, 32, 24, 4
    experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, num_experts=n_expert, moe_intermediate_size=ffn))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(n_expert, 2 * ffn, hidden) * hidden**-0.5)
        experts.down_proj.copy_(torch.randn(n_expert, hidden, ffn) * ffn**-0.5)
    x = torch.randn(40, hidden)
    ids, weights = route_ref(torch.randn(40, n_expert), k, gating="softmax", norm=True)
    with torch.no_grad():
        want = experts(x, ids, weights)
        got = [moe_experts_ref(x, ids, weights, experts.gate_up_proj, experts.down_proj, by_expert=b)
               for b in (True, False)]
    for y in got:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU then runs the Triton kernels (test_moe_experts)
CPU_PACKS_EXPERTS = kernels_for("cpu").experts_packed


@pytest.mark.skipif(INTERPRET, reason="the CPU runs the Triton expert kernels here")
def test_quantized_experts_on_the_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With --weight-format gguf on the CPU, Q8_0 expert tensors stay packed where the CPU's packed-weight kernels
    run (each chosen expert's products on them), else they are dequantized (and the log says so); the 2-D
    matrices stay packed either way. The exact fp32 kernel (SPECSERVE_CPU_EXACT=1) then computes the file's
    values as the float runner does."""
    src = write_gguf(hf_model("qwen3_moe"), tmp_path / "f32.gguf")
    quantize_gguf(src, tmp_path / "q8.gguf")
    with caplog.at_level(logging.WARNING, logger="specserve.model.weights"):
        packed = LocalRunner(tmp_path / "q8.gguf", n_ctx=64, device="cpu", progress=False, weight_format="gguf")
    plain = LocalRunner(tmp_path / "q8.gguf", n_ctx=64, device="cpu", progress=False, weight_format="float")
    layer = packed.weights.layers[0]
    assert type(layer.wqkv).__name__ == "QuantWeight"
    if CPU_PACKS_EXPERTS:
        assert type(layer.experts.gate_up).__name__ == "QuantExperts" and "load as float" not in caplog.text
    else:
        assert "stacked expert tensors load as float" in caplog.text and layer.experts.gate_up.dtype == torch.float32
    batch = Batch()
    batch.add_sequence(PROMPT, 0, 0, "last")
    want = plain.forward(batch)
    # The int8 kernel rounds each product's activations, one scale per 32 of them (as llama.cpp): 0.14 measured
    # on this 64-wide random model (a router choice moves); the exact kernel below checks the values themselves.
    assert rel_err(packed.forward(batch), want) < 0.25
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()
    packed.kv_truncate(0, 0)
    assert rel_err(packed.forward(batch), want) < 1e-5


@pytest.mark.skipif(INTERPRET, reason="the CPU runs the Triton expert kernels here")
def test_q8_quantizes_the_experts_where_the_cpu_kernels_run(models: Models) -> None:
    """q8 on the CPU packs the 2-D matrices (the shared expert's too) and, where the CPU's packed-weight kernels
    run, the stacked experts (else they stay float); the router stays float.
    Quantization noise can flip a token's expert choice (then that position's logits move a lot), so
    the typical position is what is bounded."""
    q8 = LocalRunner(models.path, n_ctx=64, device="cpu", progress=False, weight_format="q8")
    experts = q8.weights.layers[0].experts
    assert experts.router.dtype == torch.float32
    assert (type(experts.gate_up).__name__ == "QuantExperts") == CPU_PACKS_EXPERTS
    assert experts.shared_gate_up is None or type(experts.shared_gate_up).__name__ == "QuantWeight"
    batch = Batch()
    batch.add_sequence(PROMPT, 0, 0, "all")
    ours, hf = q8.forward(batch), models.hf_logits(PROMPT)
    per_position = (ours - hf).norm(dim=-1) / hf.norm(dim=-1)
    assert per_position.median() < 5e-2
