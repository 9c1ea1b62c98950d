"""The two private torch APIs the CUDA build stands on, in one place: NVRTC compilation of a kernel
(`torch.cuda._compile_kernel`) and the driver library torch loaded (`torch.cuda._utils._get_gpu_runtime_library`).
A torch upgrade may move or change them without notice; `check()` says so in one line (tests/test_cuda_builds.py
runs it on every machine, GPU or not) instead of a kernel failing at its first launch."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from specserve.errors import SpecserveError

# The parameters the build passes to _compile_kernel, by name.
COMPILE_PARAMS = ("kernel_source", "kernel_name")


def check() -> None:
    """SpecserveError naming what this torch lacks, if it lacks either API as the build uses it."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    utils = getattr(torch.cuda, "_utils", None)
    missing = []
    if compile_kernel is None:
        missing.append("torch.cuda._compile_kernel")
    elif tuple(inspect.signature(compile_kernel).parameters)[:2] != COMPILE_PARAMS:
        missing.append(f"torch.cuda._compile_kernel{inspect.signature(compile_kernel)} (expected {COMPILE_PARAMS})")
    if getattr(utils, "_get_gpu_runtime_library", None) is None:
        missing.append("torch.cuda._utils._get_gpu_runtime_library")
    if missing:
        raise SpecserveError(f"torch {torch.__version__} lacks what the CUDA kernels are built with: "
                             f"{', '.join(missing)}")


def compile_kernel(source: str, name: str) -> Any:
    """The kernel `name` of CUDA C `source`, compiled by NVRTC for the current device and loaded."""
    check()
    return torch.cuda._compile_kernel(source, name)


def gpu_runtime_library() -> Any:
    """The CUDA driver library (ctypes) torch has loaded."""
    check()
    return torch.cuda._utils._get_gpu_runtime_library()
