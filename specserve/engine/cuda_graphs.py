"""CUDA graphs for forward passes of up to 512 rows.

At batch sizes of a few tokens the GPU finishes each kernel faster than Python can launch the
next, so the whole forward is captured once per row-count bucket and replayed. A graph's inputs
are [5, rows] long values — tokens, positions, sequence ids, for each row the batch row of the
step launched just before whose argmax is its token (-1: the token given), and each row's KV pool
slot — that the host writes into a pinned buffer of the graph's own and its first node copies to the
device; rows past the batch are padding that writes only to a scratch block. Feeding tokens from the previous step's
argmax on the device lets the scheduler queue step N + 1 before it has read step N.

Each bucket has two graphs, one per parity of the runner's launch count: the graph of parity p takes
fed tokens from `ring[1 - p]` and writes its rows' argmax to `ring[p]` (a buffer outside the graphs'
pool), and copies them into pinned memory of its own as its last node. So the step in flight and the
one queued behind it never share an input buffer, an output buffer or an argmax row, and the host never
waits for a step to finish before queuing the next.

A step with token trees (Batch.tree_layout) replays graphs of their own, every-row buckets only, whose inputs
have two more rows: each row's rotary position and its 64-bit word of hidden tree positions (the attention
kernel's tree mask is compiled into them). Without them a tree step ran eagerly, ~4x a graph step's time at
one client (1.5B model, H100), which cost more than the tree's extra accepted tokens won.

Steps of up to 16 rows return logits for every row; the caller picks the rows it wants. Larger
batches (up to 512 rows) compute the logits of only the rows they want, up to a bucket of `picks`
rows whose indices are a sixth input row: a prompt chunk wants one row or none, a chunk read beside
the decode rows of other slots one per slot; a batch that wants about as many rows as it has (a
verify step) takes the every-row graph of its bucket (up to 256 rows; past that, every row picked).
Without the picked graphs a mixed batch ran eagerly: ~14 ms of kernel launches from Python for a 3 ms
forward (1.5B model, H200).
The returned logits are the graph's own output buffer: valid until the graph of the same parity runs
again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from specserve.engine.host_copy import LaunchedStep, PinnedInputs
from specserve.kernels.cuda import driver as cuda_driver
from specserve.model.batch import Batch
from specserve.model.kv_ledger import MAX_LOGIT_ROWS

# Row counts with a graph: exact up to 16 (batch-1 decode and verify), coarser above.
BUCKETS = [*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
STEP_ROWS = 256  # the largest step with logits for every row (its [rows, vocab] fp32 logits are kept)
PROMPT_ROWS = 512  # the largest prompt chunk with a graph (the default chunk)
PICK_BUCKETS = [1, 16, 64, 256, 512]  # logit rows of the picked graphs
PICKS_FROM = 16  # batches of more rows compute the logits of the rows they want only (a bucket of them)
RING_ROWS = MAX_LOGIT_ROWS  # argmax rows a step can leave for the next one to take its tokens from

GraphKey = tuple[int, int, int, bool]  # (rows, picks (0: every row), parity, token trees)
TREE_INPUT_ROWS = 7  # a tree graph's input rows: the five of every graph, rotary positions, hidden words
TreeRows = tuple[torch.Tensor, torch.Tensor]  # per row: rotary position, hidden tree positions (KVStep)


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


def pick_bucket(n_wanted: int, max_rows: int) -> int | None:
    """The logit rows a picked graph computes for n_wanted (coarse: a few more rows of logits cost less than
    a graph per count)."""
    return next((p for p in PICK_BUCKETS if p >= n_wanted and p <= max_rows), None)


def feed_tokens(tokens: torch.Tensor, fed: torch.Tensor, previous_argmax: torch.Tensor) -> torch.Tensor:
    """tokens, with rows whose fed index is >= 0 taking the previous step's argmax at that row."""
    taken = previous_argmax.gather(0, fed.clamp(min=0))
    return torch.where(fed >= 0, taken, tokens)


class StepGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: PinnedInputs  # [5, rows] (picked graphs: [6, rows], the wanted rows' indices at [5, :picks]; tree
    # graphs: [7, rows], rotary positions at [5] and hidden words at [6]);
    # its `done` event also says when the argmax is there
    logits: torch.Tensor
    argmax: np.ndarray  # pinned: each logit row's argmax, copied back by the last node


class GraphCache:
    """Captures `forward(tokens, positions, seq_ids, slots, logit_rows, tree) -> logits` per bucket, parity and
    whether a token tree is in the step, lazily."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor | None, TreeRows | None], torch.Tensor],
                 device: torch.device, pad_seq: int, pad_slot: int, ring: torch.Tensor, max_rows: int = STEP_ROWS,
                 max_prompt_rows: int = PROMPT_ROWS):
        """forward: fp32 logits of the rows in logit_rows (None: of every row), tree: (rotary positions, hidden
        words) per row of a step with token trees, else None. pad_seq, pad_slot: the scratch
        sequence and KV slot padding rows use. ring: [2, RING_ROWS] long, the argmax rows of the last two steps
        (shared with the runner's eager path)."""
        self.forward = forward
        self.device = device
        self.pad_seq = pad_seq
        self.pad_slot = pad_slot
        self.ring = ring
        self.max_rows = max_rows
        self.max_prompt_rows = max_prompt_rows
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, StepGraph] = {}

    def graph_key(self, n_rows: int, n_wanted: int) -> tuple[int, int] | None:
        """The graph a batch of n_rows rows wanting n_wanted rows' logits replays: (row bucket, picks: the
        logit rows it computes, 0 for every row), or None (none does: the eager path)."""
        if n_rows <= PICKS_FROM:
            rows = bucket_for(n_rows, self.max_rows)
            return None if rows is None else (rows, 0)
        rows = bucket_for(n_rows, self.max_prompt_rows)
        if rows is None:
            return None
        picks = pick_bucket(n_wanted, self.max_prompt_rows)
        if picks is None or picks >= rows:  # about every row wanted: the every-row graph, or all picked past it
            return (rows, 0) if rows <= self.max_rows else (rows, rows)
        return rows, picks

    def _pad_rows(self, inputs: torch.Tensor | np.ndarray, start: int) -> None:
        if start >= inputs.shape[1]:  # an exact bucket (every step of up to 16 rows): even empty writes cost
            return
        inputs[0, start:] = 0
        inputs[1, start:] = 0
        inputs[2, start:] = self.pad_seq
        inputs[3, start:] = -1
        inputs[4, start:] = self.pad_slot
        if len(inputs) == TREE_INPUT_ROWS:  # rotary position 0, nothing hidden
            inputs[5:, start:] = 0

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

    def _capture(self, key: GraphKey) -> StepGraph:
        rows, picks, parity, tree = key
        initial = torch.zeros((TREE_INPUT_ROWS if tree else 6 if picks else 5, rows), dtype=torch.long)
        self._pad_rows(initial, 0)
        inputs = PinnedInputs(initial, self.device)
        pick = inputs.on_device[5, :picks] if picks else None
        tree_rows = (inputs.on_device[5], inputs.on_device[6]) if tree else None
        host_argmax = torch.zeros(picks or rows, dtype=torch.long, pin_memory=True)
        mine, previous = self.ring[parity], self.ring[1 - parity]

        def step() -> torch.Tensor:
            device_in = inputs.upload()
            tokens = feed_tokens(device_in[0], device_in[3], previous)
            logits = self.forward(tokens, device_in[1], device_in[2], device_in[4], pick, tree_rows)
            argmax = logits.argmax(dim=-1)
            if pick is not None:
                mine.index_copy_(0, pick, argmax)
            else:
                mine[:rows].copy_(argmax)
            cuda_driver.copy_async(host_argmax, argmax)
            return logits

        graph, logits = self.capture(step)
        return StepGraph(graph, inputs, logits, host_argmax.numpy())

    def capture_up_to(self, n_rows: int, prompt_rows: int = 0, mixed_picks: int = 1, trees: int = 0) -> None:
        """Capture every bucket a step of up to n_rows rows takes now, and those of batches of up to
        prompt_rows rows wanting one row's logits (prompt chunks) or up to mixed_picks rows' (a chunk
        beside decode rows), both parities, so no capture lands inside a request or a timed run; and the tree
        graphs of steps of up to `trees` rows."""
        keys = {self.graph_key(b, b) for b in buckets_up_to(n_rows, self.max_rows)}
        top = pick_bucket(mixed_picks, self.max_prompt_rows) or 1
        for b in buckets_up_to(prompt_rows, self.max_prompt_rows):
            keys |= {self.graph_key(b, p) for p in PICK_BUCKETS if p <= top} if b > PICKS_FROM else set()
        wanted = [(k[0], k[1], False) for k in keys if k is not None]
        wanted += [(b, 0, True) for b in buckets_up_to(trees, self.max_rows)] if trees else []
        for rows, picks, tree in sorted(wanted):
            for parity in (0, 1):
                if (rows, picks, parity, tree) not in self.graphs:
                    self.graphs[rows, picks, parity, tree] = self._capture((rows, picks, parity, tree))

    def launch(self, batch: Batch, slots: Sequence[int], fed: Sequence[int] | None, parity: int,
               tree: tuple[list[int], list[int]] | None = None) -> LaunchedStep | None:
        """Queue the batch (slots: each row's KV pool slot; fed: see the module docstring; tree: the batch's
        Batch.tree_layout()), or None where no graph takes it."""
        n = len(batch)
        wanted = batch.logit_rows()
        key = self.graph_key(n, len(wanted))
        if key is None or (tree is not None and key[1]):  # tree graphs compute every row's logits
            return None
        rows, picks = key
        full = (rows, picks, parity, tree is not None)
        if full not in self.graphs:
            self.graphs[full] = self._capture(full)
        step = self.graphs[full]
        host = step.inputs.write()  # at once on the step path: this graph's last replay was two steps ago
        host[0, :n] = batch.tokens
        host[1, :n] = batch.positions
        host[2, :n] = batch.seq_ids
        host[3, :n] = -1 if fed is None else fed
        host[4, :n] = slots
        if tree is not None:
            host[5, :n], host[6, :n] = tree
        self._pad_rows(host, n)
        if picks:  # the padding repeats the last wanted row: its argmax lands in the same ring slot
            host[5, :len(wanted)] = wanted
            host[5, len(wanted):picks] = wanted[-1] if wanted else 0
        step.inputs.replay(step.graph)
        done = step.inputs.done
        if picks:
            return LaunchedStep(step.logits[: len(wanted)], step.argmax, len(wanted), done)
        if len(wanted) == n:
            return LaunchedStep(step.logits[:n], step.argmax, n, done)
        index = torch.tensor(wanted, dtype=torch.long, device=self.device)  # (long even when empty: a chunk read again)
        return LaunchedStep(step.logits[index], step.argmax, len(wanted), done, rows=wanted)
