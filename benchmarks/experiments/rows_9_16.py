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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench as kb  # noqa: E402
import staging_units as su  # noqa: E402

from specserve.kernels import linear_cuda  # noqa: E402

VARIANTS = {"one": 16, "split8": 8}
ROWS = (8, 9, 12, 16)


def run_one(variant: str, out_dir: Path) -> None:
    linear_cuda.ROWS_PER_LAUNCH = VARIANTS[variant]
    result = {"variant": variant, "fused": su.fused_products(ROWS), "model": kb.gguf_model_step_us((1, *ROWS))}
    print(variant, "model", result["model"], flush=True)
    (out_dir / f"rows_9_16_{variant}.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    su.experiment_main(run_one, __file__, "rows_9_16", VARIANTS, ROWS)


if __name__ == "__main__":
    main()
