"""qwen2.5-coder-1.5b with random weights on CUDA, and the GPU time of its step graphs.

Speed does not depend on weight values, so kernel work needs no model file: `make_runner("gguf_like")`
quantizes random weights in the layout of the real Q4_K_M file, and `step_gpu_us` times graph replays.
Shared by kernel_bench.py, engine_bench.py, tree_step_bench.py and ab_trees.py; it uses only the runner's public
pieces so that ab_trees.py can time another package tree with it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from specserve.engine.local_runner import LocalRunner
from specserve.kernels import settings as kernel_settings
from specserve.kernels.quant_weight import QuantWeight
from specserve.model.batch import Batch
from specserve.model.random_init import SHAPES, random_weights
from specserve.model.token_tree import TokenTree
from specserve.model.weights import ModelWeights

MODEL = "qwen2.5-coder-1.5b"
CFG = SHAPES[MODEL]
DEV = torch.device("cuda")
STEP_ROWS = (1, 2, 4, 8, 9, 16)


def replay_us(g: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """Median GPU microseconds of one replay of g."""
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def graph_us(fn: Callable[[], object], calls: int, reps: int = 30) -> float:
    """Median GPU microseconds per fn() call, from replays of a graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return replay_us(g, reps) / calls


def quantize_groups(w: torch.Tensor, bits: int, group: int) -> QuantWeight:
    """Min-max quantization per group to `bits`-bit integers (as Q4_1 does), for random weights laid
    out like a GGUF file's (Q6_K's 6-bit integers are stored in 8-bit fields)."""
    n, k = w.shape
    blocks = w.float().view(n, k // group, group)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    u = ((blocks - lo[..., None]) / scale[..., None]).round().view(n, k).to(torch.uint8)
    return QuantWeight.from_ints(u, scale, -lo, group)


def gguf_like(weights: ModelWeights) -> ModelWeights:
    """Matrices quantized as qwen2.5-coder-1.5b's Q4_K_M file holds them: 4 bits in groups of 32,
    8 bits in groups of 16 for the output, and for wqkv / down in every other layer (Q6_K there)."""
    for i, layer in enumerate(weights.layers):
        wide = (6, 16) if i % 2 else (4, 32)
        layer.wqkv = quantize_groups(layer.wqkv, *wide)
        layer.w_down = quantize_groups(layer.w_down, *wide)
        layer.wo = quantize_groups(layer.wo, 4, 32)
        layer.w_gate_up = quantize_groups(layer.w_gate_up, 4, 32)
    weights.output = quantize_groups(weights.output, 6, 16)
    return weights


def make_runner(fmt: str, n_ctx: int = 1024, n_seqs: int = 1) -> LocalRunner:
    """Random weights: "float" (bf16), "q8", or "gguf_like" (the real file's quantization layout)."""
    weights = random_weights(CFG, torch.bfloat16, DEV)
    if fmt == "gguf_like":
        return LocalRunner.from_weights(CFG, gguf_like(weights), n_ctx=n_ctx, n_seqs=n_seqs)
    return LocalRunner.from_weights(CFG, weights, n_ctx=n_ctx, n_seqs=n_seqs, weight_format=fmt)


def graph_at(runner: LocalRunner, rows: int, base: int = 600) -> torch.cuda.CUDAGraph:
    """The captured graph for `rows` rows (parity 0), its inputs set to rows at positions base.. of sequence 0."""
    step = runner.graphs.graphs[(rows, 0, 0, False)]
    host = step.inputs.write()  # pinned: the graph's first node uploads them
    host[0] = [7 * i + 3 for i in range(rows)]
    host[1] = range(base, base + rows)
    host[2] = 0
    host[3] = -1  # no row takes its token from the step before
    return step.graph


def step_gpu_us(runner: LocalRunner, rows: tuple[int, ...] = STEP_ROWS, base: int = 600) -> dict[int, float]:
    """GPU us per graph replay of a step of each row count after a `base`-token prompt (captured graphs);
    leaves the prompt in sequence 0."""
    runner.kv_truncate(0, 0)
    b = Batch()
    b.add_sequence(list(range(base)), 0, 0, "last")
    runner.forward(b)
    return {r: replay_us(graph_at(runner, r, base)) for r in rows}


def gguf_model_step_us(rows: tuple[int, ...] = STEP_ROWS) -> dict[int, float]:
    """GPU us per graph replay of the model (random weights in the Q4_K_M layout, tensor-core kernel) per row count."""
    os.environ["SPECSERVE_QUANT_KERNEL"] = "mma"
    kernel_settings.reload()
    runner = make_runner("gguf_like")
    runner.warmup(17, prompt_rows=0)
    return {r: round(us, 1) for r, us in step_gpu_us(runner, rows).items()}


class StandInTokenizer:
    """What the scheduler reads of a tokenizer, for runners without a vocabulary (random weights): every
    token is one character of text and none is special or ends a generation."""

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"

    def is_special(self, token_id: int) -> bool:
        return False

    def is_eog(self, token_id: int) -> bool:
        return False


def step_ms(runner: LocalRunner, n_rows: int, base: int = 600, reps: int = 40, tree: TokenTree | None = None) -> float:
    """Median wall ms of runner.forward for n_rows new rows at context `base` (host work included); with `tree`,
    the step verifies that token tree instead."""
    times = []
    for _ in range(reps):
        runner.kv_truncate(0, base)
        batch = Batch()
        if tree is not None:
            batch.add_tree(tree, base, 0)
        else:
            batch.add_sequence([(7 * i + 3) % CFG.vocab_size for i in range(n_rows)], base, 0, "all")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = runner.forward(batch)
        logits.argmax(-1).tolist()  # the sampler's sync
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]
