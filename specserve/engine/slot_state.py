"""What slot jobs (slot_jobs.py) do with a slot's KV sequence: embed a text, save it to a file, restore it,
erase it. Each runs on the scheduler's thread with the slot idle.

A slot file is torch.save of {"format", "model", "tokens", "kv", "adapters"}: the slot's settled tokens, their
K/V [n_layers, 2, n_kv_heads, n, head_dim] and the LoRA scales they were computed with, loaded back with
weights_only=True (plain tensors, lists and strings: a file cannot run code). "model" names the model the K/V
belong to; restoring into another model is refused.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from specserve.engine.runner import Runner
from specserve.engine.slots import Slot
from specserve.errors import SpecserveError
from specserve.model.batch import Batch

FORMAT = "specserve-slot-1"
POOLINGS = ("mean", "last")


def embed(runner: Runner, slot: Slot, tokens: list[int], n_batch: int, pooling: str) -> torch.Tensor:
    """The pooled final hidden state of tokens (fp32 [hidden], on the CPU), evaluated in the slot's sequence
    from position 0. The slot's cache then holds those tokens: a prompt that starts with them reuses them."""
    if not 0 < len(tokens) < runner.n_ctx:
        raise SpecserveError(f"the input ({len(tokens)} tokens) must be 1..{runner.n_ctx - 1} tokens (the slot "
                             "context)")
    runner.kv_truncate(slot.id, 0)
    slot.cache, slot.cache_salt = [], ""  # (no request's salt: only unsalted prompts reuse it)
    if slot.adapters:  # embeddings are the base model's
        runner.set_adapter_scales(slot.id, ())
        slot.adapters = ()
    total: torch.Tensor | None = None
    for start in range(0, len(tokens), n_batch):
        chunk = tokens[start:start + n_batch]
        final = start + len(chunk) == len(tokens)
        batch = Batch()
        batch.add_sequence(chunk, start, slot.id, "all" if pooling == "mean" else "last" if final else "none")
        hidden = runner.hidden_states(batch)
        if pooling == "mean":
            part = hidden.sum(dim=0, dtype=torch.float64)
            total = part if total is None else total + part
        elif final:
            total = hidden[-1].double()
    assert total is not None
    slot.cache = list(tokens)
    pooled = total / len(tokens) if pooling == "mean" else total
    return pooled.float().cpu()


def save(runner: Runner, slot: Slot, path: Path, model: dict[str, Any]) -> tuple[int, int]:
    """Write the slot's tokens and K/V to path; (tokens saved, bytes written)."""
    kv = runner.kv_read(slot.id)[:, :, :, :len(slot.cache)]
    tmp = path.with_name(path.name + ".part")  # a crash mid-write leaves no half file under the name
    torch.save({"format": FORMAT, "model": model, "tokens": list(slot.cache), "kv": kv,
                "adapters": list(slot.adapters)}, tmp)
    tmp.replace(path)
    return len(slot.cache), path.stat().st_size


def restore(runner: Runner, slot: Slot, path: Path, model: dict[str, Any]) -> tuple[int, int]:
    """Load a slot file into the slot (its cache is replaced); (tokens restored, bytes read)."""
    if not path.is_file():
        raise SpecserveError(f"slot file {path.name} not found")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError):
        raise SpecserveError(f"{path.name} is not a slot save file") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecserveError(f"{path.name} is not a slot save file of this version ({FORMAT})")
    if data.get("model") != model:
        raise SpecserveError(f"{path.name} was saved from another model ({data.get('model')}); this server runs "
                             f"{model}")
    tokens, kv = data.get("tokens"), data.get("kv")
    if (not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens) or not isinstance(kv, torch.Tensor)
            or kv.dim() != 5 or kv.shape[3] != len(tokens)):
        raise SpecserveError(f"{path.name} is damaged (its tokens and K/V do not match)")
    if len(tokens) >= runner.n_ctx:
        raise SpecserveError(f"{path.name} holds {len(tokens)} tokens; a slot here holds {runner.n_ctx - 1}")
    adapters = data.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(s, float) for s in adapters):
        raise SpecserveError(f"{path.name} is damaged (its LoRA scales are not a list of numbers)")
    runner.kv_truncate(slot.id, 0)
    slot.cache, slot.cache_salt = [], ""
    if tuple(adapters) != slot.adapters:  # the K/V were computed with these scales: later tasks match them
        runner.set_adapter_scales(slot.id, tuple(adapters))
        slot.adapters = tuple(adapters)
    runner.kv_write(slot.id, kv)
    slot.cache = tokens
    return len(tokens), path.stat().st_size


def erase(runner: Runner, slot: Slot) -> int:
    """Empty the slot's cache; the tokens it held."""
    n = len(slot.cache)
    runner.kv_truncate(slot.id, 0)
    slot.cache = []
    return n
