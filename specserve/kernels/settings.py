"""The kernels' switches, read from the environment once: each names a kernel to leave out or to pick for A/B
runs and tests, never a choice a caller makes. `reload()` reads them again (tests that change the environment).

SPECSERVE_NO_TRITON=1       the torch references instead of every Triton kernel
TRITON_INTERPRET=1          Triton's CPU interpreter: the Triton kernels on CPU tensors (kernel tests)
SPECSERVE_TRITON_GEMV=0     one-row float products on cuBLAS instead of Triton's GEMV
SPECSERVE_QUANT_KERNEL      packed 1-16-row products: mma (tensor cores, default), core (CUDA cores) or triton
SPECSERVE_MOE_KERNEL=triton the experts' Triton kernels instead of the CUDA ones
SPECSERVE_PDL=0             no programmatic dependent launch (sm_90+)
SPECSERVE_CPU_KERNEL=0      no C kernels on the CPU (torch)
SPECSERVE_CPU_EXACT=1       the CPU's packed products without int8 activations
SPECSERVE_DENSE_COPIES=0    no dense copies of packed matrices on CUDA
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class KernelSettings:
    triton: bool  # Triton kernels may run (installed, and not switched off)
    triton_interpret: bool
    triton_gemv: bool
    quant_kernel: str
    moe_kernel: str
    pdl: bool
    cpu_kernel: bool
    cpu_exact: bool
    cpu_layers: bool
    dense_copies: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KernelSettings:
        return cls(triton=HAVE_TRITON and env.get("SPECSERVE_NO_TRITON") != "1",
                   triton_interpret=env.get("TRITON_INTERPRET") == "1",
                   triton_gemv=env.get("SPECSERVE_TRITON_GEMV") != "0",
                   quant_kernel=env.get("SPECSERVE_QUANT_KERNEL", "mma"),
                   moe_kernel=env.get("SPECSERVE_MOE_KERNEL", "cuda"),
                   pdl=env.get("SPECSERVE_PDL") != "0",
                   cpu_kernel=env.get("SPECSERVE_CPU_KERNEL", "1") != "0",
                   cpu_exact=env.get("SPECSERVE_CPU_EXACT", "0") == "1",
                   cpu_layers=env.get("SPECSERVE_CPU_LAYERS") != "0",
                   dense_copies=env.get("SPECSERVE_DENSE_COPIES") != "0")


_current = KernelSettings.from_env(os.environ)


def settings() -> KernelSettings:
    return _current


def reload() -> KernelSettings:
    """Read the environment again (a test that set a switch; the kernels built so far stay as they are)."""
    global _current
    _current = KernelSettings.from_env(os.environ)
    return _current
