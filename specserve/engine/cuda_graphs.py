"""CUDA graphs for small forward passes (decode and verify steps).

At batch sizes of a few tokens the GPU finishes each kernel faster than Python can
launch the next, so the whole forward is captured once per row-count bucket and
replayed. The graph's inputs are [3, rows] long values (tokens, positions, sequence ids)
that the host writes into a pinned buffer of the graph's own and its first node copies to
the device; rows past the batch are padding that writes only to a scratch sequence.
Steps of up to 256 rows return logits for every row; the caller picks the rows it wants.
Batches of more than 16 rows that want one row's logits or none (prompt chunks) have graphs
of their own, up to 512 rows, that compute the logits of that one row (its index is an input):
an eager 512-row forward spends more time launching kernels (~0.1 ms of host time each over
packed weights) than running them. Step graphs of up to ARGMAX_ROWS rows also take every row's argmax,
and their last node copies it into pinned memory, which greedy verification reads instead of the
logits (`run_argmax`). Both copies are nodes of the graph: as separate calls they cost ~35 us of GPU idle
between a verify step's result and the next launch (kernel_notes.md v11). The returned logits are the
graph's own output buffer: valid until the next forward (graphs share a memory pool).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from specserve.engine import cuda_driver
from specserve.engine.batch import Batch
from specserve.engine.host_copy import PendingTokens, PinnedInputs

# Row counts with a graph: exact up to 16 (batch-1 decode and verify), coarser above.
BUCKETS = [*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
STEP_ROWS = 256  # the largest step with logits for every row (its [rows, vocab] fp32 logits are kept)
PROMPT_ROWS = 512  # the largest prompt chunk with a graph (generate()'s default chunk)
ONE_ROW_FROM = 16  # batches of more rows wanting one row's logits or none take the one-row graphs
ARGMAX_ROWS = 32  # step graphs of up to this many rows also take each row's argmax (a few us on the GPU)


def bucket_for(n_rows: int, max_rows: int) -> int | None:
    for b in BUCKETS:
        if b >= n_rows:
            return b if b <= max_rows else None
    return None


def buckets_up_to(n_rows: int, max_rows: int) -> list[int]:
    """The buckets of steps of 1..n_rows rows: up to the one that holds n_rows (17 rows: 1..16 and
    24), none past max_rows."""
    top = bucket_for(min(n_rows, max_rows), max_rows)
    return [b for b in BUCKETS if top is not None and b <= top]


class StepGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: PinnedInputs  # [3, rows]: tokens, positions, sequences (one-row-logits graphs: a 4th, its index);
    # its `done` event also says when the argmax is there
    logits: torch.Tensor
    argmax: np.ndarray | None  # pinned [rows]: each row's argmax, copied back by the last node (graphs of up
    # to ARGMAX_ROWS rows wanting every row)


class GraphCache:
    """Captures `forward(tokens, positions, seq_ids, logit_rows) -> logits` per bucket, lazily."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                                         torch.Tensor],
                 device: torch.device, pad_seq: int, max_rows: int = STEP_ROWS, max_prompt_rows: int = PROMPT_ROWS):
        """forward: fp32 logits of the rows in logit_rows (None: of every row)."""
        self.forward = forward
        self.device = device
        self.pad_seq = pad_seq
        self.max_rows = max_rows
        self.max_prompt_rows = max_prompt_rows
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, bool], StepGraph] = {}  # (rows, one logit row) -> its graph

    @staticmethod
    def one_logit_row(n_rows: int, n_wanted: int) -> bool:
        """Batches past the step sizes that want at most one row's logits (prompt chunks) take the
        graphs that compute just that row's."""
        return n_rows > ONE_ROW_FROM and n_wanted <= 1

    def graph_key(self, n_rows: int, n_wanted: int) -> tuple[int, bool] | None:
        """The graph a batch of n_rows rows wanting n_wanted rows' logits replays: (bucket, one logit
        row), or None (none does: the eager path)."""
        one = self.one_logit_row(n_rows, n_wanted)
        rows = bucket_for(n_rows, self.max_prompt_rows if one else self.max_rows)
        return None if rows is None else (rows, one)

    def _pad_rows(self, inputs: torch.Tensor | np.ndarray, start: int) -> None:
        if start >= inputs.shape[1]:  # an exact bucket (every step of up to 16 rows): even empty writes cost
            return
        inputs[0, start:] = 0
        inputs[1, start:] = 0
        inputs[2, start:] = self.pad_seq

    def capture(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Run fn twice on a side stream (Triton compiles, cuBLAS picks kernels), then capture it
        into this cache's memory pool; returns the graph and fn's output buffer."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    def _capture(self, key: tuple[int, bool]) -> StepGraph:
        rows, one = key
        initial = torch.zeros((4 if one else 3, rows), dtype=torch.long)
        self._pad_rows(initial, 0)
        inputs = PinnedInputs(initial, self.device)
        pick = inputs.on_device[3, :1] if one else None
        host_argmax = torch.zeros(rows, dtype=torch.long, pin_memory=True) if not one and rows <= ARGMAX_ROWS else None

        def step() -> torch.Tensor:
            device_in = inputs.upload()
            logits = self.forward(device_in[0], device_in[1], device_in[2], pick)
            if host_argmax is not None:
                argmax = logits.argmax(dim=-1)
                cuda_driver.copy_async(host_argmax, argmax)
            return logits

        graph, logits = self.capture(step)
        return StepGraph(graph, inputs, logits, host_argmax.numpy() if host_argmax is not None else None)

    def capture_up_to(self, n_rows: int, prompt_rows: int = 0) -> None:
        """Capture every bucket a step of up to n_rows rows takes now, and those of prompt chunks of
        up to prompt_rows rows, so no capture lands inside a request or a timed run."""
        keys = [(b, False) for b in buckets_up_to(n_rows, self.max_rows)]
        keys += [(b, True) for b in buckets_up_to(prompt_rows, self.max_prompt_rows) if b > ONE_ROW_FROM]
        for key in keys:
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)

    def run(self, batch: Batch) -> torch.Tensor | None:
        """The logits of the batch's wanted rows, or None where no graph takes it."""
        n = len(batch)
        wanted = batch.logit_rows()
        key = self.graph_key(n, len(wanted))
        if key is None:
            return None
        one = key[1]
        static_out = self._replay(key, batch.tokens, batch.positions, batch.seq_ids,
                                  (wanted[0] if wanted else 0) if one else None).logits
        if one:
            return static_out[: len(wanted)]
        if len(wanted) == n:
            return static_out[:n]
        return static_out[torch.tensor(wanted, device=self.device)]

    def run_argmax(self, tokens: list[int], position: int, seq: int) -> PendingTokens | None:
        """Launch the evaluation of tokens at position.. of sequence seq: the argmax of each row's logits,
        to read once the step is done (until the next step of as many rows), or None past ARGMAX_ROWS rows."""
        n = len(tokens)
        if n > ARGMAX_ROWS:
            return None
        key = self.graph_key(n, n)
        assert key is not None and key[0] <= ARGMAX_ROWS
        step = self._replay(key, tokens, range(position, position + n), [seq] * n, None)
        assert step.argmax is not None  # graphs of up to ARGMAX_ROWS rows take it
        return PendingTokens(step.argmax[:n], step.inputs.done)

    def _replay(self, key: tuple[int, bool], tokens: Sequence[int], positions: Sequence[int],
                seq_ids: Sequence[int], logit_row: int | None) -> StepGraph:
        """Replay the graph `key` (capturing it first if needed) on these rows."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        step = self.graphs[key]
        n = len(tokens)
        host = step.inputs.write()  # (at once on the step path: its last replay is done by now)
        host[0, :n] = tokens
        host[1, :n] = positions
        host[2, :n] = seq_ids
        self._pad_rows(host, n)
        if logit_row is not None:
            host[3, 0] = logit_row
        step.inputs.replay(step.graph)
        return step
