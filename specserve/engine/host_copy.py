"""Token ids copied from the device into pinned host memory behind the work that computes them.

Reading a CUDA tensor with `.tolist()` waits for the whole device and copies through pageable
memory; a copy into a pinned slot with an event waits for that copy only, and the host reads the
slot through numpy (no torch op on the path between one step's result and the next step's launch).
"""

from __future__ import annotations

import torch


class HostCopies:
    """`slots` pinned rows of `width` long values; one copy in flight per slot."""

    def __init__(self, device: torch.device, slots: int, width: int):
        cuda = device.type == "cuda"
        self._host = torch.zeros((slots, width), dtype=torch.long, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._events = [torch.cuda.Event() for _ in range(slots)] if cuda else []

    def start(self, slot: int, values: torch.Tensor) -> None:
        """Copy values (long [n], n <= width) into the slot once the device has computed them."""
        self._host[slot, : values.shape[0]].copy_(values, non_blocking=True)
        if self._events:
            self._events[slot].record()

    def wait(self, slot: int) -> None:
        """Wait for the slot's copy (and nothing queued after it)."""
        if self._events:
            self._events[slot].synchronize()

    def read(self, slot: int, n: int) -> list[int]:
        """The slot's first n values, once its copy has landed."""
        self.wait(slot)
        return self._host_np[slot, :n].tolist()
