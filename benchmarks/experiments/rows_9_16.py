"""Experiment (kernel_notes.md v12): what a verify step of 9-16 rows costs, and whether 8-row launches beat one.

A gguf step of 9 rows cost 1.733 ms against 1.422 for 8 (real file, v11): the tensor-core kernel takes
two blocks of 8 activation rows (NB = 2) above 8 rows, with the registers that takes. Every row is computed
with the same instructions in any launch, so the products could as well run as launches of at most 8 rows
(`linear_cuda.ROWS_PER_LAUNCH`) with the same sums. Variants, each in its own process:

  one      up to 16 rows per launch (the source as it is)
  split8   launches of at most 8 rows
  mu8      (v15) one launch; products with unbounded registers and no SiLU staging stage 8 rows per pass
           above 8 rows too (4 before: 2-4 passes of L2 loads at 9-16 rows instead of 1-2)
  mu16     the same, all rows in one pass
  blocks   (v15) tiles per block and the register bound (neither changes a row's sums) of gate_up and the
           output matrix at 8-16 rows: above 8 rows the output matrix runs unbounded (112 registers, one
           512-thread block per SM instead of two)

Prints and writes the fused products and the model's GPU us per graph replay at the ROWS below (random
weights in the Q4_K_M layout). Run from the repository root on a CUDA machine:
    python benchmarks/experiments/rows_9_16.py [variant ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench as kb  # noqa: E402
import staging_units as su  # noqa: E402

from specserve.kernels import linear_cuda  # noqa: E402

VARIANTS = {"one": 16, "split8": 8, "mu8": 16, "mu16": 16}
MU_RULES = {"mu8": "#define MU (REGS <= 64 ? (M < 2 ? M : 2) : SILU || (REGS < 128 && NORM) ? (M < 4 ? M : 4) "
                   ": (M < 8 ? M : 8))",
            "mu16": "#define MU (REGS <= 64 ? (M < 2 ? M : 2) : SILU || (REGS < 128 && NORM) ? (M < 4 ? M : 4) : M)"}
ROWS = (8, 9, 12, 16)


def run_one(variant: str, out_dir: Path) -> None:
    linear_cuda.ROWS_PER_LAUNCH = VARIANTS[variant]
    if variant in MU_RULES:
        source, names = linear_cuda.KERNELS["gemv_mma"]
        assert su.CURRENT_MU in source
        linear_cuda.KERNELS["gemv_mma"] = (source.replace(su.CURRENT_MU, MU_RULES[variant]), names)
    result = {"variant": variant, "fused": su.fused_products(ROWS), "model": kb.gguf_model_step_us((1, *ROWS))}
    print(variant, "model", result["model"], flush=True)
    (out_dir / f"rows_9_16_{variant}.json").write_text(json.dumps(result, indent=1) + "\n")


BLOCKS = {"output": [(8, 2, 1, 1), (8, 2, 1, 2), (4, 2, 1, 2), (4, 2, 1, 3), (16, 2, 1, 1)],
          "gate_up": [(3, 2, 2, 0), (3, 2, 2, 1), (2, 2, 2, 0), (4, 2, 2, 0), (6, 2, 2, 0), (2, 2, 2, 2)]}


def blocks_main(out_dir: Path) -> None:
    """`blocks`: GPU us per fused call of BLOCKS' (TILES, KSPLIT, D, MINB; 0: one wave) at 8-16 rows."""
    table = {name: su.time_blocks(name, {f"t{t}k{ks}d{d}b{mb}": {"TILES": t, "KSPLIT": ks, "D": d, "MINB": mb}
                                         for t, ks, d, mb in shapes}, ROWS)
             for name, shapes in BLOCKS.items()}
    (out_dir / "rows_9_16_blocks.json").write_text(json.dumps(table, indent=1) + "\n")


def main() -> None:
    if sys.argv[1:] == ["blocks"]:
        out_dir = Path(os.environ.get("OUT", "/tmp"))
        out_dir.mkdir(parents=True, exist_ok=True)
        blocks_main(out_dir)
        return
    su.experiment_main(run_one, __file__, "rows_9_16", VARIANTS, ROWS)


if __name__ == "__main__":
    main()
