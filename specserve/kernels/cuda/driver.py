"""ctypes binding of the CUDA driver calls torch has no Python API for.

- `launch_ex` (cuLaunchKernelEx): a launch with attributes, here programmatic stream serialization
  (the grid may start before the kernel ahead of it ends) and thread-block cluster dimensions.
- `set_max_dynamic_shared_memory` (cuFuncSetAttribute): the opt-in past 48 KB of dynamic shared memory.
- `copy_async` (cuMemcpyAsync): a copy between raw addresses on the current stream. Called on a
  capturing stream it becomes a plain memcpy node of the graph, so step graphs upload their inputs
  from pinned memory and copy their argmax back inside the replay instead of in separate calls
  around it (torch's copy_ from pinned memory does bookkeeping of its own around the copy).
  Addresses are unified (UVA), so it serves both directions between pinned host memory and the device.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from specserve.kernels.cuda import torch_private

CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


def _libcuda() -> Any:
    return torch_private.gpu_runtime_library()


def launch_ex(func: Any, grid: tuple[int, int], block: int, args: list, shared_mem: int, dependent: bool,
              cluster: int = 1) -> None:
    """cuLaunchKernelEx of the CUfunction `func` on the current stream; args: tensors (passed as their
    addresses) and ints. dependent: programmatic stream serialization; cluster > 1: consecutive blocks
    form thread-block clusters of that many. Graph capture keeps both attributes."""
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attrs = []
    if dependent:
        attrs.append(LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION))
        attrs[-1].value[0] = 1
    if cluster > 1:
        attrs.append(LaunchAttribute(id=CLUSTER_DIMENSION))
        attrs[-1].value[:3] = [cluster, 1, 1]
    array = (LaunchAttribute * max(1, len(attrs)))(*attrs)
    config = LaunchConfig((*grid, 1), (block, 1, 1), shared_mem, torch.cuda.current_stream().cuda_stream,
                          ctypes.cast(array, ctypes.POINTER(LaunchAttribute)), len(attrs))
    err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")


def set_max_dynamic_shared_memory(func: Any, n_bytes: int) -> None:
    """Lets the CUfunction `func` take up to n_bytes of dynamic shared memory (CUDA asks for an explicit
    opt-in past 48 KB)."""
    if _libcuda().cuFuncSetAttribute(func, MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(n_bytes)) != 0:
        raise RuntimeError("cuFuncSetAttribute failed")


@cache
def _memcpy_async() -> Callable[..., int]:
    fn = _libcuda().cuMemcpyAsync
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
