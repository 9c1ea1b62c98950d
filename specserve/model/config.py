"""ModelConfig: the numbers a decoder stack needs, read from GGUF metadata.

Which architectures load, and how each reads its metadata, is model/registry.py's; the fields every
decoder family reads alike are read here (`decoder_fields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.errors import SpecserveError


@dataclass(frozen=True)
class ModelConfig:
    """A family that needs more numbers (a mixture of experts' expert counts, say) subclasses this with
    fields of its own, given defaults, so the dense families never see them."""

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    context_length: int
    rope_base: float
    rope_dim: int
    rope_style: str  # "interleaved" (adjacent pairs) or "neox" (the two halves of each head)
    rope_scale: float  # linear position scaling (1.0 = none)
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


def decoder_fields(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """ModelConfig's fields that every decoder family reads alike, all but rope_style, from the keys under
    the file's architecture; q/k/v biases and per-head q/k norms are there when the file has their tensors."""
    arch = metadata["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise SpecserveError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise SpecserveError("per-layer head_count_kv is not supported")
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // n_heads))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise SpecserveError("GGUF metadata gives no vocabulary size")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise SpecserveError(f"unsupported RoPE scaling type '{scaling}'")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
    return dict(
        arch=arch,
        n_layers=int(get("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        ffn=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(get("context_length", 4096)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(metadata.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_scale=factor,
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
    )
