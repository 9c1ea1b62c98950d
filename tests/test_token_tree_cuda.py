"""Token trees on CUDA: the tree step replayed from its CUDA graph (Triton attention with the tree mask, rotary
positions from the host) and kv_compact's row moves on the device, against each branch decoded alone; random
weights in a small shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.model.batch import Batch
from specserve.model.token_tree import TokenTree
from tests.helpers import ancestors, check_tree_step, prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16 products over a different number of rows round differently: equal within bf16's noise, same argmax
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.03 * scale)
    assert got.argmax() == want.argmax()


def small_runner(weight_format: str, device: str = "cuda"):
    """Random weights in a small shape (vocabulary 300), two sequences, CUDA graphs where the device has them."""
    from specserve.engine.local_runner import LocalRunner
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    weights = random_weights(cfg, torch.bfloat16 if device == "cuda" else torch.float32, torch.device(device), seed=7)
    return LocalRunner.from_weights(cfg, weights, n_seqs=2, n_ctx=1024, weight_format=weight_format,
                                    cuda_graphs=device == "cuda")


def check_tree_beside_another_sequence(runner) -> None:
    """A step holding sequence 0's tree and a decode row of sequence 1: each tree row is its path's logits, the
    other sequence's row is that row's alone."""
    prompts = [[(7 * i + 3) % 300 for i in range(200)], [(5 * i + 1) % 300 for i in range(90)]]
    for seq, prompt in enumerate(prompts):
        runner.kv_truncate(seq, 0)
        prefill(runner, seq, prompt)
    tree = TokenTree.merge(11, [[22, 33], [44, 55], [22, 66]])
    (start0, start1) = (len(p) for p in prompts)
    both = Batch()
    both.add_tree(tree, start0, 0)
    both.add_sequence([77], start1, 1, "all")
    got = runner.forward(both).clone()
    runner.kv_truncate(1, start1)
    alone = Batch()
    alone.add_sequence([77], start1, 1, "all")
    close(got[len(tree)], runner.forward(alone)[0])
    for i in range(len(tree)):
        runner.kv_truncate(0, start0)
        chain = Batch()
        chain.add_sequence([tree.tokens[j] for j in sorted(ancestors(tree, i))], start0, 0, "all")
        close(got[i], runner.forward(chain)[-1])


@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_cuda_tree_beside_another_sequence(weight_format: str) -> None:
    runner = small_runner(weight_format)
    runner.warmup(8, trees=8)
    check_tree_beside_another_sequence(runner)


@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_cuda_tree_step_matches_each_branch_alone(weight_format: str) -> None:
    runner = small_runner(weight_format)
    cfg = runner.config
    runner.warmup(8, trees=8)
    assert {(6, 0, 0, True), (6, 0, 1, True), (8, 0, 1, True)} <= runner.graphs.graphs.keys()
    replays = []
    launch = runner.graphs.launch

    def counting(batch, slots, fed, parity, tree=None):
        step = launch(batch, slots, fed, parity, tree)
        replays.append(step is not None and tree is not None)  # a tree step that a graph took
        return step

    runner.graphs.launch = counting
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(300)]  # past one KV block: the tree crosses a boundary
    check_tree_step(runner, prompt, [11, 22, 33, 44, 55], close)
    assert sum(replays) == 2  # both tree steps replayed their graph
