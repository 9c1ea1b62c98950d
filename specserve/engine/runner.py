"""The Runner protocol: what the scheduler may call on the thing that runs the model.

LocalRunner (local_runner.py) implements it on one torch device; a remote runner implements the same
calls over a connection, so the scheduler cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Protocol

import torch

from specserve.gguf.reader import ModelFile
from specserve.model.batch import Batch
from specserve.model.config import ModelConfig
from specserve.model.kv_ledger import KVLedger


class Step(Protocol):
    """A launched forward pass."""

    def tokens(self) -> list[int]:
        """The argmax of each row that wanted logits, in row order; waits for this step only."""
        ...

    def logits(self) -> torch.Tensor:
        """fp32 logits [rows wanting logits, vocab]; valid until the runner's launch after next."""
        ...

    def wait(self) -> None: ...


class Runner(Protocol):
    n_seqs: int  # KV sequences (one per slot)
    n_ctx: int  # the most positions one sequence may hold
    seq_len: list[int]  # KV entries kept per sequence
    ledger: KVLedger  # lengths, block tables and the pool's size (kv_size), kept on the host
    device: torch.device
    dtype: torch.dtype  # the model's activations (and float weights)
    weight_format: str  # how its matrices are held (model.weights.WEIGHT_FORMATS, resolved)
    token_trees: bool  # whether a batch may hold branching token trees (Batch.add_tree) and kv_compact works

    @property
    def vocab_size(self) -> int: ...

    @property
    def config(self) -> ModelConfig | SimpleNamespace:
        """The model's numbers (a remote runner's: the host's ModelConfig, as values)."""
        ...

    @property
    def gguf(self) -> ModelFile | None:
        """The model's file (a remote runner's: its path on the host and its metadata); None for weights built
        in memory (LocalRunner.from_weights). `model_file` for a runner loaded from a file."""
        ...

    @property
    def file_bytes(self) -> int:
        """Size of the model's GGUF file."""
        ...

    def launch(self, batch: Batch, fed: Sequence[int] | None = None, logits: bool = True) -> Step:
        """Queue a forward pass over the batch (its K/V enter the cache). fed[i] >= 0 makes row i's token the
        argmax of row fed[i] of the step launched just before, on the device. logits=False: the caller reads
        only tokens() (a remote runner then sends no logits back)."""
        ...

    def forward(self, batch: Batch) -> torch.Tensor:
        """launch(batch).logits()."""
        ...

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        """Keep the first n_keep positions of a sequence (drops rejected draft tokens)."""
        ...

    def kv_compact(self, seq: int, start: int, path: Sequence[int]) -> None:
        """After a token tree written at positions start.. of the sequence: its accepted path's nodes (offsets
        from start, the root first) become positions start.., and the sequence ends after them."""
        ...

    def kv_cache(self, seq: int, names: Sequence[int]) -> None:
        """Name the sequence's full blocks by kv_blocks.content_hashes of the tokens it holds, so a sequence that
        later starts with the same tokens can take them (kv_attach) instead of evaluating them again."""
        ...

    def kv_attach(self, seq: int, names: Sequence[int]) -> int:
        """The sequence, its own positions given up, takes the cached blocks of the longest run of `names` from the
        first; the positions it now holds (a multiple of the block size)."""
        ...

    def set_adapter_scales(self, seq: int, scales: tuple[float, ...]) -> None:
        """The sequence's scale per LoRA adapter from its next step on (): none); a runner without adapters
        raises errors.NotSupported for scales."""
        ...

    # Not on the decode path (embeddings, slot files); a runner that cannot raises errors.NotSupported.

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """A forward pass, run now (its K/V enter the cache), returning the final hidden states after the
        output norm, fp32 [rows wanting logits, hidden], instead of logits. No later step may be fed from it."""
        ...

    def kv_read(self, seq: int) -> torch.Tensor:
        """A copy of the sequence's cache on the CPU: [n_layers, 2, n_kv_heads, seq_len[seq], head_dim]."""
        ...

    def kv_read_cached(self, names: Sequence[int]) -> torch.Tensor:
        """A copy on the CPU of the cached blocks of the longest run of `names` (kv_cache), as kv_read's."""
        ...

    def kv_write(self, seq: int, kv: torch.Tensor) -> None:
        """Make the sequence's cache kv (a kv_read() of a runner of the same model); its length kv.shape[3]."""
        ...

    def draft_limit(self, n_max: int) -> int:
        """The most draft tokens a verify step should carry (n_max or fewer)."""
        ...

    def warmup(self, max_rows: int = 17, prompt_rows: int = 512, sequences: int = 0, trees: int = 0) -> None:
        """Prepare steps of up to max_rows rows (e.g. capture CUDA graphs) before serving, and prompt chunks of up
        to prompt_rows beside a row of each of up to `sequences` others (0: every sequence), and steps of up to
        `trees` rows holding token trees (where the runner takes them: `token_trees`)."""
        ...

    def memory_info(self) -> dict[str, int]: ...


def model_file(runner: Runner) -> ModelFile:
    """The file of a runner loaded from one (every runner but LocalRunner.from_weights')."""
    assert runner.gguf is not None, "a runner loaded from a model file"
    return runner.gguf
