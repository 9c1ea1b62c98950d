"""Experiment (kernel_notes.md v12): what a verify step of 9-16 rows costs, and whether 8-row launches beat one.

A gguf step of 9 rows cost 1.733 ms against 1.422 for 8 (real file, v11): the tensor-core kernel takes
two blocks of 8 activation rows (NB = 2) above 8 rows, with the registers that takes. Every row is computed
with the same instructions in any launch, so the products could as well run as launches of at most 8 rows
(`linear_cuda.ROWS_PER_LAUNCH`) with the same sums. Variants, each in its own process:

  one      up to 16 rows per launch (the source as it is)
  split8   launches of at most 8 rows

Prints and writes the fused products and the model's GPU us per graph replay at the ROWS below (random
weights in the Q4_K_M layout). Run from the repository root on a CUDA machine:
    python benchmarks/experiments/rows_9_16.py [variant ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402

from specserve.kernels import linear_cuda  # noqa: E402

VARIANTS = {"one": 16, "split8": 8}
ROWS = (8, 9, 12, 16)
PRODUCTS = ("gate_up", "down_q4k", "down_q6k", "wqkv", "wqkv_mixed", "wo", "output")


def run_one(variant: str, out_dir: Path) -> None:
    linear_cuda.ROWS_PER_LAUNCH = VARIANTS[variant]
    fused: dict[str, dict[int, float]] = {}
    for name in PRODUCTS:
        n, k, _silu, bits, group = kb.MATRICES[name]
        qs = kb.Rotation(kb.quant_copies(n, k, bits, group))
        calls = {m: kb.fused_call(name, m, qs, k) for m in ROWS}
        kb.prebuild_calls(list(calls.values()))
        fused[name] = {m: kb.timed(c, 2 * len(qs.items), qs.items[0].n_bytes())["us"] for m, c in calls.items()}
        print(variant, name, fused[name], flush=True)
        del qs
        torch.cuda.empty_cache()
    result = {"variant": variant, "fused": fused, "model": kb.gguf_model_step_us((1, *ROWS))}
    print(variant, "model", result["model"], flush=True)
    (out_dir / f"rows_9_16_{variant}.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = sys.argv[1:] or list(VARIANTS)
    if len(variants) == 1:
        run_one(variants[0], out_dir)
        return
    for v in variants:
        subprocess.run([sys.executable, __file__, v], check=False)
    table = {v: json.loads((out_dir / f"rows_9_16_{v}.json").read_text()) for v in variants
             if (out_dir / f"rows_9_16_{v}.json").exists()}
    print("\nGPU us per call / per model step, rows", ROWS)
    for what in (*PRODUCTS, "model"):
        for v, res in table.items():
            vals = res["model"] if what == "model" else res["fused"][what]
            print(f"{what:11s} {v:7s}", " ".join(f"{vals[str(m)]:>8}" for m in ROWS))


if __name__ == "__main__":
    main()
