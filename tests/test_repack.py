"""GGUF block formats kept quantized: repack gives gguf's own values bit for bit, QuantWeight keeps
them up to fp16 scales, and a model loaded that way computes what the float path computes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from specserve.engine.local_runner import LocalRunner
from specserve.gguf.repack import REPACKABLE, dequantize_blocks, repack
from specserve.kernels import settings as kernel_settings
from specserve.kernels.linear import linear_ref
from specserve.kernels.quant_weight import QuantWeight, concat_quant, dequantize_ref, pack, unpack
from specserve.model.batch import Batch
from tests.gguf_blocks import raw_blocks

ROWS, COLS = 6, 512


@pytest.mark.parametrize("qtype", sorted(REPACKABLE, key=lambda t: t.name))
def test_repack_is_exact(qtype: Q) -> None:
    raw = raw_blocks(qtype, np.random.default_rng(int(qtype)), ROWS, COLS)
    q, scale, mins = repack(raw, qtype, (ROWS, COLS))
    group = COLS // scale.shape[1]
    expected = np.ascontiguousarray(dequantize(raw, qtype)).reshape(ROWS, COLS)
    exact = q.reshape(ROWS, -1, group) * scale[..., None] - (0 if mins is None else mins[..., None])
    assert np.array_equal(exact.reshape(ROWS, COLS), expected)
    w = QuantWeight.from_ints(torch.from_numpy(q), torch.from_numpy(scale),
                              None if mins is None else torch.from_numpy(mins), group)
    assert w.bits == (4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8)
    # the smallest offset that makes signed integers non-negative: 6-bit Q6_K stays below 64
    assert w.u_max == int(unpack(w.words, w.bits, group).max()) and (qtype != Q.Q6_K or w.u_max < 64)
    # fp16 scale and min: off by at most a few fp16 roundings of the group's largest magnitude
    err = (dequantize_ref(w, torch.float32) - torch.from_numpy(expected)).abs().view(ROWS, -1, group)
    assert (err <= torch.from_numpy(np.abs(expected)).view(ROWS, -1, group).amax(-1, keepdim=True) * 2e-3).all()


@pytest.mark.parametrize("qtype", sorted(REPACKABLE, key=lambda t: t.name))
@pytest.mark.parametrize("rows,cols", [(37, 768), (1, 256), (64, 4096)])
def test_dequantize_blocks_is_ggufs_decoder(qtype: Q, rows: int, cols: int) -> None:
    """Regrouping the blocks into long rows changes nothing: bit for bit gguf's dequantize, shape included."""
    raw = raw_blocks(qtype, np.random.default_rng(rows + int(qtype)), rows, cols)
    expected = dequantize(raw, qtype)
    got = dequantize_blocks(raw, qtype)
    assert got.shape == expected.shape == (rows, cols) and np.array_equal(got, expected)
    stacked = np.stack([raw, raw[::-1]])  # a stack of experts: [2, rows, bytes per row]
    assert np.array_equal(dequantize_blocks(stacked, qtype), dequantize(stacked, qtype))


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 16), (8, 32)])
def test_pack_layout(bits: int, group: int) -> None:
    """Field i of a group's word j holds k = i * (words per group) + j of the group; unpack inverts pack."""
    u = torch.randint(0, 1 << bits, (5, 4 * group), dtype=torch.int32)
    words = pack(u, bits, group)
    per, wpg = 32 // bits, group * bits // 32
    assert words.dtype == torch.int32 and words.shape == (5, 4 * group * bits // 32)
    for g, i, j in [(0, 0, 0), (1, per - 1, wpg - 1), (3, per // 2, 0)]:
        field = (int(words[2, g * wpg + j]) >> (bits * i)) & ((1 << bits) - 1)
        assert field == int(u[2, g * group + i * wpg + j])
    assert torch.equal(unpack(words, bits, group), u)


def test_concat_mixed_groups() -> None:
    """Q, K (Q4_K: groups of 32 with mins) stacked with V (Q6_K: 16, no min) decode unchanged."""
    rng = np.random.default_rng(3)
    parts = []
    for qtype in (Q.Q4_K, Q.Q6_K):
        raw = raw_blocks(qtype, rng, ROWS, COLS)
        q, scale, mins = repack(raw, qtype, (ROWS, COLS))
        parts.append(QuantWeight.from_ints(torch.from_numpy(q), torch.from_numpy(scale),
                                           None if mins is None else torch.from_numpy(mins), COLS // scale.shape[1]))
    fused = concat_quant(parts)
    assert (fused.group, fused.bits) == (16, 8) and (parts[0].group, parts[0].bits) == (32, 4)
    expected = torch.cat([dequantize_ref(p, torch.float32) for p in parts])
    assert torch.equal(dequantize_ref(fused, torch.float32), expected)
    x = torch.randn(3, COLS)
    torch.testing.assert_close(linear_ref(x, fused), x @ expected.T)


def test_gguf_format_matches_float(smollm_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smollm2 (Q4_1 / Q8_0 file) loaded with its matrices kept quantized: same weights, so the
    same logits up to fp32 rounding, through the exact products on the CPU (the int8 ones round the
    activations: tests/test_quant_cpu.py)."""
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()
    quant = LocalRunner(smollm_path, n_ctx=64, device="cpu", progress=False, weight_format="gguf")
    plain = LocalRunner(smollm_path, n_ctx=64, device="cpu", progress=False, weight_format="float")
    assert quant.weight_format == "gguf" and isinstance(quant.weights.layers[0].w_gate_up, QuantWeight)
    gate_up = quant.weights.layers[0].w_gate_up
    n, k = gate_up.shape
    assert gate_up.bits == 4 and gate_up.n_bytes() == n * k * (0.5 + 4 / 32)  # 4 bits + fp16 scale and min per 32
    logits = []
    for runner in (quant, plain):
        batch = Batch()
        batch.add_sequence([1, 504, 3158, 314, 260, 2576, 30], 0, 0, "all")
        logits.append(runner.forward(batch))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-3)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_generate_cli_gguf_format_same_text() -> None:
    """`--weight-format gguf` from the command line: the same greedy text as float weights, through the exact
    products (the int8 ones move token 6's logits across a near tie: 0.22 apart in float, 0.04 in the int8
    arithmetic summed in fp64, flipped by the order of the fp32 sums on AVX2)."""
    texts = []
    env = {**os.environ, "SPECSERVE_CPU_EXACT": "1"}
    for fmt in ("float", "gguf"):
        result = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "-p", "The capital of France is",
                                 "-n", "12", "--temp", "0", "--device", "cpu", "--weight-format", fmt],
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        texts.append(result.stdout)
    assert texts[0].strip() and texts[0] == texts[1]


def test_server_engine_weight_format(smollm_path: Path) -> None:
    """The server's settings reach its runner: `specserve serve --weight-format gguf`."""
    from specserve.server.engine import Engine, ServerSettings

    engine = Engine.load(ServerSettings(model=str(smollm_path), n_parallel=1, device="cpu", weight_format="gguf"),
                         progress=False)
    try:
        assert engine.core.scheduler.runner.weight_format == "gguf"
        assert isinstance(engine.core.scheduler.runner.weights.layers[0].wo, QuantWeight)
    finally:
        engine.shutdown()
