"""The CUDA C kernels' variants: their source filled in, an NVRTC build of each (cached, on a thread pool),
and their launch.

A kernel's source (package data beside this module) names its compile-time parameters as `__NAME__`
placeholders; a key (kernel name, then the values in KERNELS' order) fills them in, and each key is built
once, at first use, through torch's NVRTC binding (torch_private.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from importlib import resources
from typing import Any

import torch

from specserve.kernels.cuda import driver, torch_private
from specserve.kernels.cuda.block_shapes import CORE_WARPS, MMA_SMEM_BYTES
from specserve.kernels.settings import settings

# kernel name (its source: <name>.cu) -> its compile-time parameters in key order; M, the row count, is the third
KERNELS: dict[str, tuple[str, ...]] = {
    "gemv_q": ("BITS", "WPG", "M", "RN", "U", "KSPLIT", "SILU", "BIAS", "OUT_F32"),
    "gemv_mma": ("BITS", "G", "M", "TILES", "KSPLIT", "D", "SILU", "BIAS", "OUT_F32", "U7", "SWIGLU", "NORM", "ACCUM",
                 "ROPE", "ROPE_HD", "MINB", "KC", "EXPERTS"),
}


@cache
def read_source(file_name: str) -> str:
    """A CUDA C file of this package."""
    return resources.files(__package__).joinpath(file_name).read_text(encoding="utf-8")


def common_source() -> str:
    """Types and helpers both kernels share, put where their sources say __COMMON__ (after their #defines)."""
    return read_source("common.cuh")


def kernel_source(key: tuple) -> str:
    """The CUDA C of one variant: (kernel name, its parameters in KERNELS' order) filled in."""
    name, params = key[0], key[1:]
    src = read_source(f"{name}.cu").replace("__COMMON__", common_source()).replace("__WARPS__", str(CORE_WARPS))
    for param, val in zip(KERNELS[name], params, strict=True):
        src = src.replace(f"__{param}__", str(int(val)))
    return src


_builds: dict[tuple, Future] = {}
_builds_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _build(device: int, key: tuple) -> Any:
    torch.cuda.set_device(device)  # the module is loaded into the context current in this thread
    name = key[0]
    built = torch_private.compile_kernel(kernel_source(key), name)
    if name == "gemv_mma":
        _allow_smem(built, MMA_SMEM_BYTES)
    return built


def _allow_smem(built: Any, n_bytes: int) -> None:
    """Lets a kernel take more than 48 KB of dynamic shared memory (CUDA asks for an explicit opt-in)."""
    if hasattr(built, "set_shared_memory_config"):
        built.set_shared_memory_config(n_bytes)
    else:
        driver.set_max_dynamic_shared_memory(built.func, n_bytes)


def _submit(keys: list[tuple]) -> None:
    global _pool
    with _builds_lock:
        _pool = _pool or ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1))
        device = torch.cuda.current_device()
        for key in keys:
            if key not in _builds:
                _builds[key] = _pool.submit(_build, device, key)


def prebuild(keys: list[tuple]) -> None:
    """Builds the variants (kernel name, then its parameters as in KERNELS) at once."""
    _submit(keys)
    for key in keys:
        _builds[key].result()


def kernel(key: tuple, sibling: Callable[[int], tuple] | None = None) -> Any:
    """The built variant. Asking for one row count starts the builds of all 16 (NVRTC runs outside
    the GIL): graph capture asks for each row count in turn, and one by one the builds would add up to
    much of a quantized model's warm-up. sibling(rows): the key the same product takes for that many rows
    (default: this key with only the row count changed)."""
    built = _builds.get(key)  # every call after the first: a dict lookup, no lock
    if built is None:
        sibling = sibling or (lambda rows: (*key[:3], rows, *key[4:]))
        _submit([key] + [sibling(rows) for rows in range(1, 17) if rows != key[3]])
        built = _builds[key]
    return built.result()


@cache
def sm90(device: int) -> bool:
    """sm_90 or newer: programmatic dependent launch, thread-block clusters (distributed shared memory)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@cache
def tensor_cores(device: int) -> bool:
    """bf16 mma.sync and fma.bf16x2 need sm_80 or newer."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def pdl_enabled(device: int) -> bool:
    """Programmatic dependent launch for the tensor-core kernel: sm_90+ and SPECSERVE_PDL not "0"."""
    return settings().pdl and sm90(device)


def launch(built: Any, grid: int | tuple[int, int], threads: int, args: list, shared_mem: int,
           dependent: bool = False, cluster: int = 1) -> None:
    """One launch of a built variant on the current stream. dependent: as a programmatic dependent, which
    may start before the kernel ahead of it in the stream ends (it waits in griddepcontrol.wait before
    touching activations), hiding the launch gap and its first weight loads behind that kernel's tail.
    cluster > 1: consecutive blocks form thread-block clusters of that many (the kernel's KC). Both need
    cuLaunchKernelEx; plain launches go through torch. grid: blocks, or (blocks, block rows)."""
    grid_xy = (grid, 1) if isinstance(grid, int) else grid
    if dependent or cluster > 1:
        driver.launch_ex(built.func, grid_xy, threads, args, shared_mem, dependent, cluster)
    else:
        built(grid=(*grid_xy, 1), block=(threads, 1, 1), args=args, shared_mem=shared_mem)
