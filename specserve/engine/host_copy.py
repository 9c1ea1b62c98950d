"""Small long tensors between the host and the device through pinned memory, on the path between one
step's result and the next step's launch.

A step graph uploads its inputs from a pinned buffer of its own as its first node (`PinnedInputs`) and
copies its rows' argmax into pinned memory as its last; the host reads that through numpy once the
event recorded after the replay has fired (`LaunchedStep.tokens`), rather than `.tolist()` on a device
tensor (which waits for the whole device and copies through pageable memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine import step_trace
from specserve.kernels.cuda import driver as cuda_driver


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
        if step_trace.TRACE is None:
            graph.replay()
        else:
            step_trace.TRACE.replay(graph)
        self.done.record()


@dataclass
class LaunchedStep:
    """A forward pass queued on the device: the logits of the rows that wanted them, and each such row's
    argmax (what greedy sampling reads), without waiting for anything else queued after it.

    argmax: a pinned numpy row the step's last node fills (then `done` says when), or a tensor (eager:
    read back on demand). rows: which entries of argmax are the wanted rows, in order (None: the first n)."""

    wanted_logits: torch.Tensor
    argmax: np.ndarray | torch.Tensor
    n: int
    done: torch.cuda.Event | None = None
    rows: Sequence[int] | None = None

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def tokens(self) -> list[int]:
        """Argmax of each wanted row's logits (waits for this step only)."""
        self.wait()
        values = self.argmax
        if self.rows is not None:
            return [int(values[r]) for r in self.rows]
        return values[: self.n].tolist()

    def logits(self) -> torch.Tensor:
        """fp32 logits [wanted rows, vocab]: a graph's buffer, valid until the runner's launch after next."""
        return self.wanted_logits
