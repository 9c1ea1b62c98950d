"""The CPU kernels' one library: the C sources beside this module compiled at first use by the machine's C
compiler into specserve's cache (once per sources and flags) and loaded with ctypes. One library, so one thread
pool (pool.c) serves every kernel. The kernels are written once against simd.h; the flags follow the CPU
(/proc/cpuinfo), so no machine is handed an instruction it lacks: AVX-512 with VNNI where it is reported (16
lanes, vpdpbusd), else AVX2 with FMA and F16C (8 lanes; most laptops, AMD before Zen 4). Either build holds every
kernel.

SPECSERVE_CPU_KERNEL=0, neither instruction set or no compiler: `library()` is None and callers use torch.
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

from specserve import catalog
from specserve.kernels.settings import settings

log = logging.getLogger(__name__)

# -ffp-contract=off: plain C arithmetic rounds as torch's elementwise ops do (the kernels write their fmas out)
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-pthread", "-shared", "-fPIC"]
# (name, /proc/cpuinfo flags it needs, compiler flags), the first this CPU has wins
BUILDS = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"),
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"]),
    ("avx2", ("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
)
SOURCES = ("pool.c", "gemv_q.c", "gemv_i8.c", "ops.c", "layers.c")
HEADERS = ("kv_rows.h", "packed.h", "pool.h", "simd.h", "spans.h")
_lock = threading.Lock()


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def builds() -> list[tuple[str, list[str]]]:
    """The builds this CPU runs, best first: (name, compiler flags)."""
    return [(name, [*COMMON_FLAGS, *flags]) for name, needs, flags in BUILDS
            if all(f in cpu_flags() for f in needs)]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _texts(sources: tuple[str, ...]) -> dict[str, bytes]:
    package = resources.files("specserve.kernels.cpu")
    return {file: package.joinpath(file).read_bytes() for file in (*sources, *HEADERS)}


def compile_into(out: Path, sources: tuple[str, ...], flags: list[str]) -> str | None:
    """Build the library at `out` (any machine's compiler builds every target's flags, whatever this CPU runs);
    None, or the compiler's complaint."""
    cc = compiler()
    if cc is None:
        return "no C compiler"
    with tempfile.TemporaryDirectory() as tmp:
        for file, text in _texts(sources).items():
            (Path(tmp) / file).write_bytes(text)
        cmd = [cc, *flags, *(str(Path(tmp) / f) for f in sources), "-o", str(out), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
    return None if result.returncode == 0 else result.stderr.strip()[:2000]


def _compile(sources: tuple[str, ...], flags: list[str]) -> ctypes.CDLL | None:
    if compiler() is None:
        log.warning("no C compiler: the CPU kernels are not built (torch serves instead)")
        return None
    key = hashlib.sha256(b"\0".join([*_texts(sources).values(), " ".join(flags).encode()])).hexdigest()[:16]
    target = catalog.cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    with _lock:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "cpu_kernels.so"
                failure = compile_into(out, sources, flags)
                if failure is not None:
                    log.warning("building the CPU kernels (%s) failed: %s", ", ".join(sources), failure)
                    return None
                os.replace(out, target)  # atomic: a concurrent process sees a whole file or none
    return ctypes.CDLL(str(target))


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {  # name: (result, arguments), as the C sources declare them
        "q_gemv": (None, [ptr] * 6 + [i32] * 9),
        "q_gemv_i8": (i32, [ptr] * 5 + [i32] * 9),
        "q_i8_grouped": (i32, [i32]),
        "cpu_rms_norm": (None, [ptr] * 5 + [i32, i32, f32]),
        "cpu_rope_cache": (None, [ptr] * 3 + [i64] + [i32] * 5 + [ptr] * 4 + [ptr, i64, i64, i32] * 2
                           + [i32, i32, ptr]),
        "cpu_attention": (i32, [ptr, i32, i32, i32, i32] + [ptr, i64, i64, i32] * 2
                          + [ptr, ptr, ptr, ptr, i32, i32, f32, ptr, i32]),
        "cpu_silu_mul": (None, [ptr, ptr, i32, i32]),
        "cpu_argmax": (None, [ptr, i32, i32, ptr]),
        "cpu_layers": (i32, [ptr, ptr]),
        "cpu_layers_scratch": (i64, [ptr, ptr]),
    }
    for name, (result, args) in signatures.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = result, args


@cache
def library() -> ctypes.CDLL | None:
    """The kernels this machine runs (built now if they were not); None where torch must serve."""
    if not settings().cpu_kernel:
        return None
    for name, flags in builds():  # a compiler that lacks the best target's flags builds the next
        lib = _compile(SOURCES, flags)
        if lib is not None:
            log.debug("CPU kernels: the %s build", name)
            _declare(lib)
            return lib
    return None


@cache
def has(name: str) -> bool:
    """Whether the library is built here and holds the C function `name` (asked per op: cached, as library() is)."""
    lib = library()
    return lib is not None and hasattr(lib, name)
