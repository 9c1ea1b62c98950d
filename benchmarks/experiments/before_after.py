"""Experiment helper (kernel_notes.md v16): the tensor-core kernel's source now against the one before a change.

Variants, each in its own process:

  now     gemv_mma's source as it is
  before  gemv_mma's source from the file $BEFORE (the linear_cuda.py of the tree before the change)

Per variant: GPU us per fused call (as the model runs it, random weights) at 1..16 rows with the blocks the
kernel picks, and the model's GPU us per graph replay (random weights in the Q4_K_M layout). On a CUDA
machine, from the repository root (one lease: the two sources alternate, each twice):
    BEFORE=old_tree/specserve/kernels/linear_cuda.py python benchmarks/experiments/before_after.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench as kb  # noqa: E402
import staging_units as su  # noqa: E402

from specserve.kernels import linear_cuda  # noqa: E402

VARIANTS = ("before", "now", "before2", "now2")  # the same two sources twice: the spread between runs
ROWS = (1, 2, 4, 6, 8, 12, 16)
MODEL_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)


def use_variant(name: str) -> None:
    if name.startswith("before"):
        spec = importlib.util.spec_from_file_location("linear_cuda_before", os.environ["BEFORE"])
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = before  # (its dataclasses look their module up)
        spec.loader.exec_module(before)
        linear_cuda.KERNELS["gemv_mma"] = before.KERNELS["gemv_mma"]


def run_one(variant: str, out_dir: Path) -> None:
    use_variant(variant)
    result = {"variant": variant, "fused": su.fused_products(ROWS), "model": kb.gguf_model_step_us(MODEL_ROWS)}
    print(variant, "model", result["model"], flush=True)
    (out_dir / f"before_after_{variant}.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    su.experiment_main(run_one, __file__, "before_after", VARIANTS, ROWS)


if __name__ == "__main__":
    main()
