"""A CUDA driver call torch has no Python API for: an asynchronous copy between raw addresses.

Step graphs capture the upload of their inputs from pinned memory and the copy back of their argmax
as nodes of the graph (cuda_graphs.py): as separate calls before and after each replay they cost ~35 us
of GPU idle between a verify step's result and the next launch (kernel_notes.md v11).
Called on the capturing stream, cuMemcpyAsync becomes a plain memcpy node (torch's copy_ from pinned
memory does bookkeeping of its own around the copy). Addresses are unified (UVA), so it serves both
directions between pinned host memory and the device.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch


@cache
def _memcpy_async() -> ctypes._CFuncPtr:
    fn = torch.cuda._utils._get_gpu_runtime_library().cuMemcpyAsync
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy src's first bytes into all of dst (contiguous; one on the device, the other there or in pinned host
    memory) in the order of the device's current stream (the capturing one, in a graph capture)."""
    device = dst.device if dst.is_cuda else src.device
    stream = torch.cuda.current_stream(device).cuda_stream
    err = _memcpy_async()(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), stream)
    if err != 0:
        raise RuntimeError(f"cuMemcpyAsync failed with CUDA error {err}")
