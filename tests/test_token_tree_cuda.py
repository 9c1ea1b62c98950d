"""Token trees on CUDA: the tree step replayed from its CUDA graph (Triton attention with the tree mask, rotary
positions from the host) and kv_compact's row moves on the device, against each branch decoded alone; random
weights in a small shape."""

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
    runner.warmup(8, trees=8)
    assert {(6, 0, 0, True), (6, 0, 1, True), (8, 0, 1, True)} <= runner.graphs.graphs.keys()
    replays = []
    launch = runner.graphs.launch

    def counting(*args, **kwargs):
        step = launch(*args, **kwargs)
        replays.append(step is not None and kwargs.get("tree", args[4] if len(args) > 4 else None) is not None)
        return step

    runner.graphs.launch = counting
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(300)]  # past one KV block: the tree crosses a boundary
    check_tree_step(runner, prompt, [11, 22, 33, 44, 55], close)
    assert sum(replays) == 2  # both tree steps replayed their graph
