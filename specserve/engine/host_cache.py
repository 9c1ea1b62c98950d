"""Prompt caches kept in host memory (llama-server's --cache-ram), a tier below the KV pool.

When the pool gives up an idle slot's cache (least recently used first: kv_room.py), its K/V are copied here instead
of lost, up to a byte limit, the least recently used entry going first. A new prompt that starts with more of an
entry than the pool holds for it gets those positions written back into its slot (Runner.kv_write) instead of
reading the tokens again. Entries are keyed by their tokens, LoRA scales and cache salt (Task.kv_key), and an entry that
another extends is dropped for it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.engine.tasks import KVKey
from specserve.model.batch import common_prefix

MIN_TOKENS = 16  # shorter caches are cheaper to read again than to keep


@dataclass
class HostEntry:
    tokens: list[int]
    key: KVKey
    kv: torch.Tensor  # [n_layers, 2, n_kv_heads, len(tokens), head_dim], on the CPU (Runner.kv_read)


class HostCache:
    def __init__(self, limit_bytes: int):
        """limit_bytes < 0: no limit."""
        self.limit = limit_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, tokens: list[int], key: KVKey, read: Callable[[], torch.Tensor]) -> bool:
        """Keep a cache the pool gives up (read() copies its K/V out); False where it is short, held already
        (an entry has all of its tokens) or larger than the limit."""
        if len(tokens) < MIN_TOKENS:
            return False
        extended = []
        for entry_id, entry in self._entries.items():
            if entry.key != key:
                continue
            n = common_prefix(entry.tokens, tokens)
            if n == len(tokens):
                self._entries.move_to_end(entry_id)
                return False
            if n == len(entry.tokens):  # these tokens extend it: the new entry replaces it
                extended.append(entry_id)
        kv = read()
        size = kv.numel() * kv.element_size()
        if 0 <= self.limit < size:
            return False
        for entry_id in extended:
            self._drop(entry_id)
        while self._entries and 0 <= self.limit < self.bytes + size:
            self._drop(next(iter(self._entries)))
        self._entries[next(self._ids)] = HostEntry(list(tokens), key, kv)
        self.bytes += size
        return True

    def best(self, prompt: list[int], key: KVKey) -> tuple[int, HostEntry | None]:
        """The entry sharing the longest prefix with the prompt (for this LoRA mix and cache salt), and that
        length."""
        best_n, best_key = 0, None
        for entry_id, entry in self._entries.items():
            if entry.key == key and entry.tokens[:1] == prompt[:1]:
                n = common_prefix(entry.tokens, prompt)
                if n > best_n:
                    best_n, best_key = n, entry_id
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best_n, self._entries[best_key]

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.bytes -= entry.kv.numel() * entry.kv.element_size()
