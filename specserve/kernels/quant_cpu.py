"""Quantized matrix-vector products on the CPU: QuantWeight read as packed integers, never widened to an fp32
matrix, by a small C kernel (cpu/gemv_q.c, AVX-512) that the machine's C compiler builds at first use into
specserve's cache. Decode reads 4 or 8 bits a weight instead of 32. Where there is no compiler or no AVX-512,
or SPECSERVE_CPU_KERNEL=0, `available()` says no and the product dequantizes instead (the reference).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve import catalog

if TYPE_CHECKING:
    from specserve.kernels.linear import QuantWeight

log = logging.getLogger(__name__)

MAX_ROWS = 16  # rows one kernel call takes (more run in slices)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_build_lock = threading.Lock()


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "f16c", "fma"))


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_CPU_KERNEL", "1") == "0" or not _cpu_has_avx512():
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler: quantized CPU products dequantize instead")
        return None
    source = resources.files("specserve.kernels.cpu").joinpath("gemv_q.c").read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = catalog.cache_dir() / "kernels" / f"gemv_q-{key}.so"
    with _build_lock:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "gemv_q.c"
                src.write_bytes(source)
                out = Path(tmp) / "gemv_q.so"
                result = subprocess.run([compiler, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
                if result.returncode != 0:
                    log.warning("building the quantized CPU kernel failed (dequantizing instead): %s",
                                result.stderr.strip()[:2000])
                    return None
                os.replace(out, target)  # atomic: a concurrent process sees a whole file or none
    lib = ctypes.CDLL(str(target))
    lib.q_gemv.restype = None
    lib.q_gemv.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 8
    return lib


def kernel_built() -> bool:
    """Whether this machine runs the kernel (AVX-512, a compiler; built now if it was not)."""
    return _library() is not None


def available(x: torch.Tensor, w: QuantWeight) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.words.device.type == "cpu"
            and w.bits in (4, 8) and 16 % (w.group * w.bits // 32) == 0 and _library() is not None)


@cache
def _permutation(k: int, bits: int, group: int) -> tuple[torch.Tensor, int]:
    """The k of each slot of the kernel's [chunks, fields, 16] activation order (-1 past K), int32."""
    words_per_group = group * bits // 32
    fields = 32 // bits
    n_words = k * bits // 32
    chunks = -(-n_words // 16)
    c = torch.arange(chunks).view(-1, 1, 1)
    i = torch.arange(fields).view(1, -1, 1)
    lane = torch.arange(16).view(1, 1, -1)
    word = 16 * c + lane
    index = (word // words_per_group) * group + i * words_per_group + word % words_per_group
    index = torch.where(word < n_words, index, torch.full_like(index, -1))
    return index.reshape(-1).to(torch.int32).contiguous(), chunks


def gemv(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., K] fp32 @ W^T -> fp32 [..., N]."""
    lib = _library()
    assert lib is not None
    n, k = w.shape
    flat = x.reshape(-1, k).contiguous()
    perm, chunks = _permutation(k, w.bits, w.group)
    rows_total = flat.shape[0]
    slice_rows = min(MAX_ROWS, rows_total)
    scratch = torch.empty(slice_rows * (perm.numel() + chunks * 16), dtype=torch.float32)
    out = torch.empty(rows_total, n, dtype=torch.float32)
    words, sm = w.words, w.sm
    if not (words.is_contiguous() and sm.is_contiguous()):
        raise ValueError("packed weights must be contiguous")
    for start in range(0, rows_total, MAX_ROWS):
        rows = min(MAX_ROWS, rows_total - start)
        lib.q_gemv(words.data_ptr(), sm.data_ptr(), flat[start].data_ptr(), perm.data_ptr(), scratch.data_ptr(),
                   out[start].data_ptr(), rows, n, k, words.shape[1], sm.shape[1], w.bits,
                   w.group * w.bits // 32, chunks)
    return out.view(*x.shape[:-1], n)
