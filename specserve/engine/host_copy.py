"""Small long tensors from the device to the host through pinned memory, on the path between one step's
result and the next step's launch.

Reading a CUDA tensor with `.tolist()` waits for the whole device and copies through pageable
memory; a copy into a pinned slot with an event waits for that copy only, and the host reads the
slot through numpy (`HostCopies`). The other way, a step graph uploads its inputs from a pinned buffer
of its own as its first node (`PinnedInputs`: cuda_graphs.py, LocalRunner.greedy_step).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.engine import cuda_driver


class PinnedInputs:
    """Long values a captured graph uploads from pinned memory as its first node (`upload`, inside the
    capture). The host writes the next replay's values (`write`) once the last replay is done (`done`, recorded
    by `replay`: its inputs read, its outputs written)."""

    def __init__(self, values: torch.Tensor, device: torch.device):
        self.host = values.to(torch.long).pin_memory()
        self.array = self.host.numpy()  # the same memory
        self.on_device = self.host.to(device)  # where the graph reads them
        self.done = torch.cuda.Event()

    def upload(self) -> torch.Tensor:
        """The copy to the device, as a node of the graph being captured; where the values land."""
        cuda_driver.copy_async(self.on_device, self.host)
        return self.on_device

    def write(self) -> np.ndarray:
        """The buffer to write the next replay's values into, once the last replay has read it."""
        self.done.synchronize()
        return self.array

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()
        self.done.record()


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
