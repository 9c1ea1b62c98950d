"""Experiment (kernel_notes.md v11): output tiles per block of the tensor-core kernel at a verify step's rows.

Each block stages every activation row over all of K, so the staging work of a product grows with the
rows times its blocks; more 16-row tiles per block means fewer blocks staging. KSPLIT and D stay as
pick_mma_blocks has them (they fix a row's order of sums); TILES may change with the row count.
Prints GPU us per call of each fused product at 1, 4, 6 and 8 rows for several TILES; writes JSON to
$OUT/tiles_rows.json. Run from the repository root on a CUDA machine:
    python benchmarks/experiments/tiles_rows.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402

from specserve.kernels import linear_cuda  # noqa: E402

ROWS = (1, 4, 6, 8)
TILES = {"gate_up": (2, 3, 4, 6), "down_q4k": (1, 2, 3), "down_q6k": (1, 2, 3), "wqkv": (1, 2), "wqkv_mixed": (1, 2),
         "wo": (1, 2), "output": (4, 8, 16)}


def main() -> None:
    out: dict[str, dict[str, dict[int, object]]] = {}
    for name, tiles in TILES.items():
        n, k, _silu, bits, group = kb.MATRICES[name]
        qs = kb.Rotation(kb.quant_copies(n, k, bits, group))
        calls = {m: kb.fused_call(name, m, qs, k) for m in ROWS}
        configs = {t: {"TILES": t} for t in tiles}
        kb.prebuild_calls([lambda c=c, b=b: c(b) for c in calls.values() for b in configs.values()])
        out[name] = {}
        for t, b in configs.items():
            out[name][f"t{t}"] = {m: kb.timed(lambda c=c, b=b: c(b), 2 * len(qs.items), qs.items[0].n_bytes())["us"]
                                 for m, c in calls.items()}
            default = linear_cuda.pick_mma_blocks(n, k, 6)["TILES"]
            print(f"{name:10s} TILES={t}{' (default)' if t == default else '':10s}", out[name][f"t{t}"], flush=True)
        del qs
        torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "/tmp"), "tiles_rows.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
