"""Small long tensors from the device to the host through pinned memory, on the path between one step's
result and the next step's launch.

Reading a CUDA tensor with `.tolist()` waits for the whole device and copies through pageable
memory; a copy into a pinned slot with an event waits for that copy only, and the host reads the
slot through numpy (`HostCopies`). The other way, step graphs upload their inputs from pinned buffers
of their own as their first node (cuda_graphs.py, LocalRunner.greedy_step).
"""

from __future__ import annotations

import numpy as np
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


class PendingTokens:
    """Token ids a launched step computes; read() waits for them (that step only) and returns them.

    From a step graph: a pinned row that the graph's last node fills and the event recorded after the
    replay. Otherwise a tensor (the eager path: read() copies it, waiting for the device)."""

    def __init__(self, values: np.ndarray | torch.Tensor, done: torch.cuda.Event | None = None):
        self._values = values
        self._done = done

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def read(self) -> list[int]:
        self.wait()
        return self._values.tolist()
