"""CUDA graphs for small forward passes (decode and verify steps).

At batch sizes of a few tokens the GPU finishes each kernel faster than Python can
launch the next, so the whole forward is captured once per row-count bucket and
replayed. The graph's inputs live in one static [3, rows] tensor (tokens, positions,
sequence ids); rows past the batch are padding that writes only to a scratch sequence.
Logits come back for every row; the caller picks the rows it wants. The returned tensor
is the graph's own output buffer: it is valid until the next forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.engine.batch import Batch

# Row counts with a graph: exact up to 16 (batch-1 decode and verify), coarser above.
BUCKETS = [*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256]


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


class GraphCache:
    """Captures `forward_all(tokens, positions, seq_ids) -> logits` per bucket, lazily."""

    def __init__(self, forward_all: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, pad_seq: int, max_rows: int = 256):
        self.forward_all = forward_all
        self.device = device
        self.pad_seq = pad_seq
        self.max_rows = max_rows
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.host = torch.empty((3, max(BUCKETS)), dtype=torch.long, pin_memory=True)
        self.copied = torch.cuda.Event()  # the last upload from `host` has finished

    def supports(self, n_rows: int) -> bool:
        return bucket_for(n_rows, self.max_rows) is not None

    def _pad_rows(self, inputs: torch.Tensor, start: int) -> None:
        inputs[0, start:] = 0
        inputs[1, start:] = 0
        inputs[2, start:] = self.pad_seq

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        static_in = torch.empty((3, rows), dtype=torch.long, device=self.device)
        self._pad_rows(static_in, 0)
        graph, static_out = self.capture(lambda: self.forward_all(static_in[0], static_in[1], static_in[2]))
        return graph, static_in, static_out

    def capture_up_to(self, n_rows: int) -> None:
        """Capture every bucket a step of up to n_rows rows takes now, so no capture lands inside a
        request or a timed run."""
        for b in buckets_up_to(n_rows, self.max_rows):
            if b not in self.graphs:
                self.graphs[b] = self._capture(b)

    def run(self, batch: Batch) -> torch.Tensor:
        n = len(batch)
        rows = bucket_for(n, self.max_rows)
        assert rows is not None
        if rows not in self.graphs:
            self.graphs[rows] = self._capture(rows)
        graph, static_in, static_out = self.graphs[rows]
        self.copied.synchronize()  # never rewrite the pinned buffer under a pending upload
        host = self.host[:, :rows]
        host[:, :n] = torch.tensor((batch.tokens, batch.positions, batch.seq_ids))
        self._pad_rows(host, n)
        static_in.copy_(host, non_blocking=True)
        self.copied.record()
        graph.replay()
        wanted = batch.logit_rows()
        if len(wanted) == n:
            return static_out[:n]
        return static_out[torch.tensor(wanted, device=self.device)]
