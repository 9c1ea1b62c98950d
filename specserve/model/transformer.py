"""The decoder-only transformer over a paged KV cache: embedding, the family's layers, output head."""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.kernels.cpu_layers import whole_layers
from specserve.kernels.step_ops import NormQKVRope, ResidualStream, StepFusion, StepOp
from specserve.kernels.torch_kernels import TorchKernels
from specserve.model.blocks import OutputHead, RopeTables, Runs, embed
from specserve.model.config import ModelConfig
from specserve.model.kv_cache import KVStep
from specserve.model.registry import family
from specserve.model.weights import ModelWeights


class AdapterRows(Protocol):
    """Each sequence's LoRA scales (model/lora.py's AdapterScales): [sequences + 1, adapters]."""

    table: torch.Tensor

    @property
    def in_use(self) -> bool: ...


class Transformer:
    """Stateless forward over given weights; the KV cache is passed in by the runner."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int, kernels: TorchKernels):
        """kernels: what the step's ops run on (kernels/backend.py's kernels_for the weights' device)."""
        self.config = config
        self.weights = weights
        self.kernels = kernels
        rope = RopeTables.for_config(config, max_positions, weights.embed.device)
        decoder_layer = family(config.arch).decoder_layer
        self.layers = [decoder_layer(config, i, lw, rope) for i, lw in enumerate(weights.layers)]
        self.head = OutputHead(config, weights)
        self.adapter_scales: AdapterRows | None = None  # (model/lora.py)
        self._decide()

    def _decide(self) -> None:
        """How steps run their ops: fused or composed (StepFusion), and all layers in one call where the kernels
        have one (whole_layers). Decided again when the ops change."""
        self.fusion = StepFusion(self._ops(), self.kernels)
        self.whole_layers = whole_layers(self.kernels, [layer.ops() for layer in self.layers])

    def use_adapters(self, scales: AdapterRows) -> None:
        """Steps read each row's adapter scales from `scales.table` by sequence id (while `in_use`); the products
        that have adapters no longer fuse, so the step fusion is decided again."""
        self.adapter_scales = scales
        self._decide()

    def store_cache_apart(self) -> None:
        """K or V is stored in another type than the compute dtype (-ctk/-ctv): the [q | k | v] products write their
        rotated rows to staging rows, which are then stored as each type (NormQKVRope.cache_apart)."""
        for op in self._ops():
            if isinstance(op, NormQKVRope):
                op.cache_apart = True
        self._decide()

    def _ops(self) -> list[StepOp]:
        return [op for layer in self.layers for op in layer.ops()]

    def _stream(self, tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                logit_rows: torch.Tensor | None, runs: Runs, kv: KVStep) -> ResidualStream:
        kv.note_rows(positions, seq_ids)
        stream = self.input_stream(tokens)
        if self.adapter_scales is not None and self.adapter_scales.in_use:
            stream.adapter_scales = self.adapter_scales.table[seq_ids]
        tree = (kv.rope_positions(positions), kv.hidden) if kv.hidden is not None else None
        if self.whole_layers is None or not self.whole_layers(stream, positions, seq_ids, kv.layers, kv.slots,
                                                              kv.table, tree):
            for layer in self.layers:
                layer(stream, positions, seq_ids, runs, kv)
        stream.keep_rows(logit_rows)
        return stream

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        logit_rows: torch.Tensor | None,
        runs: Runs,
        kv: KVStep,
    ) -> torch.Tensor:
        """Hidden states of `tokens` -> fp32 logits of `logit_rows` (None: all rows); writes K/V into each row's
        slot of the pool (kv.slots). `runs` comes from Batch.runs() (the torch attention's host-side layout)."""
        return self.logits(self._stream(tokens, positions, seq_ids, logit_rows, runs, kv))

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
               logit_rows: torch.Tensor | None, runs: Runs, kv: KVStep) -> torch.Tensor:
        """As forward, but the fp32 final hidden states of `logit_rows` (after the output norm): embeddings."""
        return self.head.normed(self._stream(tokens, positions, seq_ids, logit_rows, runs, kv)).float()

    def input_stream(self, tokens: torch.Tensor) -> ResidualStream:
        """The residual stream the layers work on: the tokens' embeddings."""
        return self.fusion.stream(embed(tokens, self.weights.embed))

    def logits(self, stream: ResidualStream) -> torch.Tensor:
        return self.head(stream)
