"""ModelConfig: the numbers a transformer needs, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.errors import SpecserveError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# llama.cpp rotates adjacent pairs for llama (its converter permutes Q/K to match) and
# the two halves of each head ("neox" style) for the Qwen family.
ROPE_STYLE = {"llama": "interleaved", "qwen2": "neox", "qwen3": "neox"}


@dataclass(frozen=True)
class ModelConfig:
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
    rope_style: str
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

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise SpecserveError(
                f"unsupported model architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})"
            )

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
        return cls(
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
            rope_style=ROPE_STYLE[arch],
            rope_scale=factor,
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            tied_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )
