"""LoRA adapter files for tests: random low-rank pairs written as llama.cpp's converter writes them, and the
merged weights they stand for."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from specserve.gguf.reader import GGUFFile

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_adapter(path: Path, model: Path, *, rank: int = 4, alpha: float = 8.0, seed: int = 0,
                  matrices: tuple[str, ...] = LAYER_MATRICES, output: bool = True, std: float = 0.05,
                  extra: dict[str, np.ndarray] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter over `model`'s matrices (every layer's `matrices`, and the output head) with random A [r, in]
    and B [out, r]; returns the pairs by base tensor name, fp32."""
    base = GGUFFile(model)
    rng = np.random.default_rng(seed)
    names = [f"blk.{i}.{m}.weight" for i in range(base.metadata["llama.block_count"]) for m in matrices]
    names += ["output.weight"] if output else []
    writer = gguf.GGUFWriter(str(path), base.metadata["general.architecture"])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    pairs = {}
    for name in names:
        shape = base.tensor_shape(name if name in base.tensor_names() else "token_embd.weight")
        a = (rng.standard_normal((rank, shape[1])) * std).astype(np.float32)
        b = (rng.standard_normal((shape[0], rank)) * std).astype(np.float32)
        writer.add_tensor(name + ".lora_a", a)
        writer.add_tensor(name + ".lora_b", b)
        pairs[name] = (torch.from_numpy(a), torch.from_numpy(b))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pairs
