"""Running llama.cpp's own tools beside specserve: its environment and llama-bench's rates.

The environment is the one before specserve's thread defaults (`specserve.foreign_env`: with specserve's
OMP_WAIT_POLICY=PASSIVE llama.cpp's OpenMP barriers decode ~4x slower), with the tools' own libraries (beside
the binaries) and, where torch came with them, the CUDA libraries of the nvidia-* wheels on the library path.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from specserve import foreign_env


def llama_env(bin_dir: Path) -> dict[str, str]:
    env = foreign_env()
    try:
        import nvidia  # type: ignore[import-not-found]  (the CUDA wheels torch depends on)
    except ImportError:  # a CPU-only torch: a CPU build of llama.cpp needs none
        libs: list[str] = []
    else:
        libs = [str(Path(p) / sub / "lib") for p in nvidia.__path__ for sub in ("cu13", "cu12")
                if (Path(p) / sub).exists()]
    env["LD_LIBRARY_PATH"] = ":".join([str(bin_dir), *libs, env.get("LD_LIBRARY_PATH", "")])
    return env


def llama_bench(binary: Path, model: Path, *, n_prompt: int = 512, n_gen: int = 128, reps: int = 3,
                threads: int | None = None, gpu_layers: int | None = None) -> dict[str, float | None]:
    """llama-bench's mean prompt ("pp") and generation ("tg") tok/s on `model`, each from a run of its own, so that
    one that fails leaves the other (a native build's prefill dies of SIGILL on a VM whose CPU reports AMX): None
    for a failed one, after printing why; RuntimeError if both fail."""
    rates: dict[str, float | None] = {}
    errors = []
    for test, (p, n) in (("pp", (n_prompt, 0)), ("tg", (0, n_gen))):
        cmd = [str(binary), "-m", str(model), "-p", str(p), "-n", str(n), "-r", str(reps), "-o", "json"]
        cmd += ["-t", str(threads)] if threads is not None else []
        cmd += ["-ngl", str(gpu_layers)] if gpu_layers is not None else []
        out = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(binary.parent), check=False,
                             timeout=1800)
        if out.returncode == 0:
            rates[test] = float(json.loads(out.stdout)[0]["avg_ts"])
            continue
        rates[test] = None
        why = (f"killed by {signal.Signals(-out.returncode).name}" if out.returncode < 0
               else f"exit {out.returncode}: {out.stderr[-2000:]}")
        errors.append(f"llama-bench's {test} run failed ({why})")
        print(errors[-1])
    if not any(rates.values()):
        raise RuntimeError("; ".join(errors))
    return rates
