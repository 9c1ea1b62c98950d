"""GGUF block formats kept quantized (QuantWeight) decode to gguf's own values bit for bit, and a
model loaded that way computes what the float path computes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from specserve.engine.batch import Batch
from specserve.engine.runner import LocalRunner
from specserve.gguf.repack import REPACKABLE, repack
from specserve.kernels.linear import QuantWeight, concat_quant, dequantize_ref, linear_ref
from tests.gguf_blocks import raw_blocks

ROWS, COLS = 6, 512


@pytest.mark.parametrize("qtype", sorted(REPACKABLE, key=lambda t: t.name))
def test_repack_is_exact(qtype: Q) -> None:
    raw = raw_blocks(qtype, np.random.default_rng(int(qtype)), ROWS, COLS)
    q, scale, mins = repack(raw, qtype, (ROWS, COLS))
    w = QuantWeight(torch.from_numpy(q), torch.from_numpy(scale), None if mins is None else torch.from_numpy(mins),
                    COLS // scale.shape[1])
    expected = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype)).reshape(ROWS, COLS))
    assert torch.equal(dequantize_ref(w, torch.float32), expected)
    assert w.small == (qtype != Q.Q8_0)  # 4- to 6-bit formats fit the kernel's fast path


def test_concat_mixed_groups() -> None:
    """Q, K (Q4_K: groups of 32 with mins) stacked with V (Q6_K: 16, no min) decode unchanged."""
    rng = np.random.default_rng(3)
    parts = []
    for qtype in (Q.Q4_K, Q.Q6_K):
        raw = raw_blocks(qtype, rng, ROWS, COLS)
        q, scale, mins = repack(raw, qtype, (ROWS, COLS))
        parts.append(QuantWeight(torch.from_numpy(q), torch.from_numpy(scale),
                                 None if mins is None else torch.from_numpy(mins), COLS // scale.shape[1]))
    fused = concat_quant(parts)
    assert fused.group == 16 and fused.min is not None
    expected = torch.cat([dequantize_ref(p, torch.float32) for p in parts])
    assert torch.equal(dequantize_ref(fused, torch.float32), expected)
    x = torch.randn(3, COLS)
    torch.testing.assert_close(linear_ref(x, fused), x @ expected.T)


def test_gguf_format_matches_float(smollm_path: Path) -> None:
    """smollm2 (Q4_1 / Q8_0 file) loaded with its matrices kept quantized: same weights, so the
    same logits up to fp32 rounding, through the torch reference path on the CPU."""
    quant = LocalRunner(smollm_path, n_ctx=64, device="cpu", progress=False, weight_format="gguf")
    plain = LocalRunner(smollm_path, n_ctx=64, device="cpu", progress=False, weight_format="float")
    assert quant.weight_format == "gguf" and isinstance(quant.weights.layers[0].w_gate_up, QuantWeight)
    gate_up = quant.weights.layers[0].w_gate_up
    assert gate_up.n_bytes() == 1.25 * gate_up.q.numel()  # int8 + fp32 scale and min per 32 (fp32: 4 bytes)
    logits = []
    for runner in (quant, plain):
        batch = Batch()
        batch.add_sequence([1, 504, 3158, 314, 260, 2576, 30], 0, 0, "all")
        logits.append(runner.forward(batch))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-3)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_generate_cli_gguf_format_same_text() -> None:
    """`--weight-format gguf` from the command line: the same greedy text as float weights."""
    texts = []
    for fmt in ("float", "gguf"):
        result = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "-p", "The capital of France is",
                                 "-n", "12", "--temp", "0", "--device", "cpu", "--weight-format", fmt],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout)
    assert texts[0].strip() and texts[0] == texts[1]


def test_server_engine_weight_format(smollm_path: Path) -> None:
    """The server's settings reach its runner: `specserve serve --weight-format gguf`."""
    from specserve.server.engine import Engine, ServerSettings

    engine = Engine.load(ServerSettings(model=str(smollm_path), n_parallel=1, device="cpu", weight_format="gguf"),
                         progress=False)
    try:
        assert engine.scheduler.runner.weight_format == "gguf"
        assert isinstance(engine.scheduler.runner.weights.layers[0].wo, QuantWeight)
    finally:
        engine.shutdown()
