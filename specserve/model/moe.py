"""Mixture-of-experts decoder layers: attention, then a routed feed-forward of stacked experts.

A family with MoE layers reads `MoeConfig` (its expert counts from the gguf package's metadata keys,
the routing rule its llama.cpp graph hard-codes) and builds its layers with `decoder_layer`, which picks
the MoE feed-forward for a layer whose file has stacked expert tensors (ffn_gate_exps) and the dense one
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf.constants import Keys

from specserve.errors import SpecserveError
from specserve.kernels.moe_routing import GATINGS, Routing
from specserve.kernels.moe_step import NormMoeAdd, SharedExpert
from specserve.kernels.step_ops import ResidualStream, StepOp
from specserve.model.blocks import AttentionBlock, DecoderLayer, DenseFeedForward, RopeTables
from specserve.model.config import ModelConfig, decoder_fields
from specserve.model.weights import ExpertWeights, LayerWeights


@dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """ModelConfig plus the mixture of experts: counts and sizes from the file, routing from the family."""

    n_expert: int = 0
    n_expert_used: int = 0  # k, the experts each token runs
    expert_ffn: int = 0  # one expert's feed-forward size
    shared_ffn: int = 0  # the shared expert's (0: none)
    expert_gating: str = "softmax"
    expert_weights_norm: bool = False  # chosen weights divided by their sum
    expert_weights_scale: float = 1.0

    def routing(self) -> Routing:
        return Routing(self.n_expert_used, self.expert_gating, norm=self.expert_weights_norm,
                       scale=self.expert_weights_scale)


def read_moe_config(metadata: dict[str, Any], tensor_names: set[str], *, rope_style: str, weights_norm: bool,
                    gating: str = "softmax") -> MoeConfig:
    """The file's config with its expert counts ({arch}.expert_count, expert_used_count,
    expert_feed_forward_length: feed_forward_length where absent, as Mixtral files write it,
    expert_shared_feed_forward_length); gating and weights_norm are the family's routing."""
    fields = decoder_fields(metadata, tensor_names)
    arch = fields["arch"]

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(key.format(arch=arch), default)
        if value is None:
            raise SpecserveError(f"GGUF metadata is missing {key.format(arch=arch)}")
        return value

    n_expert, k = int(get(Keys.LLM.EXPERT_COUNT)), int(get(Keys.LLM.EXPERT_USED_COUNT))
    if not 1 <= k <= n_expert:
        raise SpecserveError(f"{arch}: {k} experts used of {n_expert}")
    if gating not in GATINGS:
        raise SpecserveError(f"{arch}: unknown expert gating '{gating}'")
    return MoeConfig(**fields, rope_style=rope_style, n_expert=n_expert, n_expert_used=k,
                     expert_ffn=int(get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, fields["ffn"])),
                     shared_ffn=int(get(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)),
                     expert_gating=gating, expert_weights_norm=weights_norm)


class MoeFeedForward:
    """RMSNorm -> router -> each token's k experts (SwiGLU), weighted -> (+ the gated shared expert), added
    to the residual stream."""

    def __init__(self, config: MoeConfig, experts: ExpertWeights, lw: LayerWeights) -> None:
        if experts.gate_up.shape[0] != config.n_expert or experts.down.shape[2] != config.expert_ffn:
            raise SpecserveError(f"expert tensors {tuple(experts.gate_up.shape)} do not match {config.n_expert} "
                                 f"experts of feed-forward size {config.expert_ffn}")
        shared = None
        if experts.shared_gate_up is not None and experts.shared_down is not None:
            shared = SharedExpert(experts.shared_gate_up, experts.shared_down, experts.shared_gate)
        self.ffn = NormMoeAdd(lw.ffn_norm, config.rms_eps, experts.router, config.routing(), experts.gate_up,
                              experts.down, shared)

    def ops(self) -> list[StepOp]:
        return [self.ffn]

    def __call__(self, stream: ResidualStream) -> None:
        self.ffn(stream)


def decoder_layer(config: ModelConfig, layer_idx: int, lw: LayerWeights, rope: RopeTables) -> DecoderLayer:
    """Attention and the layer's feed-forward: the experts where the layer has them, else dense SwiGLU."""
    attention = AttentionBlock(config, layer_idx, lw, rope)
    if lw.experts is None:
        return DecoderLayer(attention, DenseFeedForward(config, lw))
    if not isinstance(config, MoeConfig):
        raise SpecserveError(f"layer {layer_idx} has expert tensors but the {config.arch} config has no experts")
    return DecoderLayer(attention, MoeFeedForward(config, lw.experts, lw))
