"""One tensor-parallel rank's forward: the family's own layers over the rank's shard (tp_layout.py), joined by
collectives the engine hands in.

Per layer, two all-reduces: the output product of attention and the down product of the feed-forward are
row-parallel, so each rank's result is a partial sum over its heads or ffn units, and the residual stream
takes the sum (`ShardedStream.add`). QKV and gate|up are column-parallel and need nothing. The embedding is
vocabulary-parallel: a rank looks up the tokens of its range, zero rows for the others, and one all-reduce
sums them (exactly: one rank's row plus zeros). The output head gives each rank the logits of its vocabulary
range, and an all-gather gives every rank all of them, so every rank takes the same argmax (what a fed row of
the next step reads, on every rank).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from specserve.kernels.step_ops import ResidualStream
from specserve.kernels.torch_kernels import TorchKernels
from specserve.model.tp_layout import ShardLayout
from specserve.model.transformer import Transformer
from specserve.model.weights import ModelWeights


class Collectives(Protocol):
    """The tensor-parallel group's collectives (engine/tp_launch.py implements them on torch.distributed)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x (every rank's), in place; returns x."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (all of one shape), concatenated along the last dimension in rank order."""
        ...


class ShardedStream(ResidualStream):
    """A rank's residual stream: each sub-layer's output arrives as the rank's partial sum and is summed
    over the ranks before it joins the stream. Always unfused, so `add` is the one place every sub-layer output
    passes."""

    def __init__(self, x: torch.Tensor, comm: Collectives, kernels: TorchKernels) -> None:
        super().__init__(x, fused=False, kernels=kernels)
        self._comm = comm

    def add(self, y: torch.Tensor) -> None:
        super().add(self._comm.all_reduce(y))


class ShardedTransformer(Transformer):
    """Transformer over one rank's shard (the layers are the family's own, built on the shard's numbers)."""

    def __init__(self, layout: ShardLayout, weights: ModelWeights, max_positions: int, comm: Collectives,
                 kernels: TorchKernels):
        super().__init__(layout.local_config, weights, max_positions, kernels)
        self.layout = layout
        self.comm = comm

    def _decide(self) -> None:
        super()._decide()
        self.whole_layers = None  # each sub-layer's output must pass the all-reduce (ShardedStream.add)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows for its token ids, zeros for the rest, summed."""
        local = tokens - self.layout.vocab.start
        mine = (local >= 0) & (local < len(self.layout.vocab))
        rows = F.embedding(local.clamp(0, self.layout.vocab_rows - 1), self.weights.embed)
        return self.comm.all_reduce(torch.where(mine[:, None], rows, torch.zeros_like(rows)))

    def input_stream(self, tokens: torch.Tensor) -> ResidualStream:
        return ShardedStream(self.embed_tokens(tokens), self.comm, self.kernels)

    def logits(self, stream: ResidualStream) -> torch.Tensor:
        """All the vocabulary's fp32 logits on every rank."""
        logits = self.comm.all_gather(self.head(stream).contiguous())
        vocab = self.layout.config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()  # the padding rows' out
