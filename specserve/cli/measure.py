"""The measurements `specserve bench` and the scripts in benchmarks/ share."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.runner import Runner
from specserve.engine.scheduler import ChainFactory, Scheduler
from specserve.engine.tasks import Result
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch
from specserve.speculative.base import SpecParams


def sync(device: torch.device) -> None:
    """Wait for the device (timings), a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, n_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n_bytes * reps / (time.perf_counter() - t0)


def bytes_per_token(runner: LocalRunner) -> int:
    """Weight bytes one decode step reads: everything but the embedding table (one row)."""
    w = runner.weights
    total = w.n_bytes()
    if w.output is not w.embed:  # an untied (or quantized) output matrix: the embedding is a lookup
        total -= w.embed.numel() * w.embed.element_size()
    return total


def bench_prefill(runner: Runner, n: int, reps: int = 3) -> float:
    """Tokens/s of evaluating an n-token prompt in one batch (best of reps)."""
    tokens = [(i * 7919) % runner.vocab_size for i in range(n)]
    times = []
    for _ in range(reps + 1):
        runner.kv_truncate(0, 0)
        batch = Batch()
        batch.add_sequence(tokens, 0, 0, "last")
        sync(runner.device)
        t0 = time.perf_counter()
        runner.forward(batch)
        sync(runner.device)
        times.append(time.perf_counter() - t0)
    return n / min(times[1:])


# Rows of the timed steps: decode, verify steps of 1..16 drafts, and one past the largest one-pass step.
TIMED_STEP_ROWS = (1, 2, 4, 8, 9, 16, 17)


def bench_step(runner: Runner, n_rows: int, steps: int = 50, context: int = 64) -> float:
    """Seconds per forward step of n_rows consecutive tokens of one sequence (a decode step
    for 1, a verify step of n_rows - 1 draft tokens otherwise), after `context` tokens: the median."""
    runner.kv_truncate(0, 0)
    batch = Batch()
    batch.add_sequence([(i * 31) % runner.vocab_size for i in range(context)], 0, 0, "last")
    runner.forward(batch)
    step = Batch()
    step.add_sequence(list(range(100, 100 + n_rows)), context, 0, "all")
    for _ in range(3):
        runner.kv_truncate(0, context)
        runner.forward(step)
    sync(runner.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.kv_truncate(0, context)
        logits = runner.forward(step)
        int(logits[-1].argmax().item())  # what a sampler pays: one small read back per step
        times.append(time.perf_counter() - t0)
    return statistics.median(times)  # (a shared machine's hiccups stay out)


def bench_decode(runner: Runner, tokenizer: Tokenizer, n: int, context: int = 16) -> float:
    """Tokens/s of n greedy decode steps after a `context`-token prompt, through the scheduler (what
    generation pays per token, host work included); the first pass warms up."""
    prompt = [(i * 31) % runner.vocab_size for i in range(1, context + 1)]
    scheduler = Scheduler(runner, tokenizer)
    rate = 0.0
    for steps in (8, n):
        rate = generate(runner, tokenizer, prompt, steps + 1, ignore_eos=True, scheduler=scheduler).decode_rate
    return rate


@dataclass
class DecodeTotals:
    generated: int = 0
    steps: int = 0  # decode and verify steps
    draft_tokens: int = 0
    draft_accepted: int = 0

    def add(self, result: Result) -> None:
        self.generated += result.n_predicted
        self.steps += result.n_steps
        self.draft_tokens += result.draft_n
        self.draft_accepted += result.draft_n_accepted

    @property
    def acceptance(self) -> float:
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.generated / self.steps if self.steps else 0.0


def greedy_decode_rate(runner: Runner, tokenizer: Tokenizer, prompts: list[list[int]], n_predict: int,
                       spec: SpecParams | None = None, chain_factory: ChainFactory | None = None,
                       overlap: bool = True, repeat: int = 1) -> tuple[float, DecodeTotals, list[list[int]]]:
    """Greedy decode tokens/s over prompts through one scheduler (prompt time excluded; the first token of
    each comes from the prompt's forward, so it is not counted), the last pass's totals and outputs.
    spec: speculation per request (None: off). repeat: passes over the prompts; the median pass's rate."""
    scheduler = Scheduler(runner, tokenizer, chain_factory=chain_factory, overlap=overlap)
    rates = []
    totals = DecodeTotals()
    outputs: list[list[int]] = []
    for _ in range(repeat):
        totals, outputs, seconds = DecodeTotals(), [], 0.0
        for prompt in prompts:
            gen = generate(runner, tokenizer, prompt, n_predict, spec=spec, scheduler=scheduler)
            seconds += gen.result.predicted_ms / 1000
            totals.add(gen.result)
            outputs.append(gen.tokens)
        rates.append((totals.generated - len(prompts)) / seconds)
    return statistics.median(rates), totals, outputs


def hf_decode_rate(model_path: Path, device: torch.device, prompt: list[int], n: int) -> float:
    """HF transformers greedy decode tokens/s on the same GGUF (bf16 on CUDA, fp32 on CPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]  # (transformers types `to` by functools.wraps)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
    return (out.shape[1] - len(prompt)) / (time.perf_counter() - t0)


