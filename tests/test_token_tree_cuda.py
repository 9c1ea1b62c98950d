"""Token trees on CUDA: the eager tree step (Triton attention with the tree mask, rotary positions from the host)
and kv_compact's row moves on the device, against each branch decoded alone; random weights in a small shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import check_tree_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16 products over a different number of rows round differently: equal within bf16's noise, same argmax
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.03 * scale)
    assert got.argmax() == want.argmax()


@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_cuda_tree_step_matches_each_branch_alone(weight_format: str) -> None:
    from specserve.engine.local_runner import LocalRunner
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runner = LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=7),
                                      n_seqs=2, n_ctx=1024, weight_format=weight_format, cuda_graphs=True)
    runner.warmup(8)  # plain steps replay graphs; the tree step must take the eager path beside them
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(300)]  # past one KV block: the tree crosses a boundary
    check_tree_step(runner, prompt, [11, 22, 33, 44, 55], close)
