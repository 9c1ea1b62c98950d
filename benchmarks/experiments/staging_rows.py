"""Experiment (kernel_notes.md v8): activation rows staged per pass (MU) and 3 or 4 tiles per block for
gate_up; the fused products at 1, 2, 8, 9 rows and the model's GPU time per graph replay (random weights).

MU_VARIANT=default | 8 (eight rows per pass for RMSNorm-fused products too: the rule before v8) | 2.
Run from the repository root on a CUDA machine: MU_VARIANT=8 python benchmarks/experiments/staging_rows.py
It patches the staging rule of v8-v10 (commit ab1882b's linear_cuda.py); v11 changed it (staging_units.py).
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

RULE = "#define MU (SILU || NORM || M > 8 ? (M < 4 ? M : 4) : (M < 8 ? M : 8))"
VARIANTS = {"default": RULE, "8": "#define MU (SILU || M > 8 ? (M < 4 ? M : 4) : (M < 8 ? M : 8))",
            "2": "#define MU (M < 2 ? M : 2)"}


def use_variant(name: str) -> None:
    """Swap the staging rule in the kernel source before anything builds."""
    source, names = linear_cuda.KERNELS["gemv_mma"]
    assert RULE in source, "this experiment patches the staging rule of v8-v10 (commit ab1882b)"
    linear_cuda.KERNELS["gemv_mma"] = (source.replace(RULE, VARIANTS[name]), names)


def fused_products() -> list[dict[str, object]]:
    rows_out = []
    for name in ("gate_up", "down_q4k", "wqkv", "wo", "output"):
        n, k, _silu, bits, group = kb.MATRICES[name]
        qs = kb.Rotation(kb.quant_copies(n, k, bits, group))
        for m in (1, 2, 8, 9):
            call = kb.fused_call(name, m, qs, k)
            r = {"matrix": name, "rows": m, "default": kb.timed(call, 2 * len(qs.items), qs.items[0].n_bytes())["us"]}
            if name == "gate_up":
                for tiles in (3, 4):
                    b = {"TILES": tiles, "KSPLIT": 2, "D": 2}
                    r[f"t{tiles}"] = kb.timed(lambda c=call, b=b: c(b), 2 * len(qs.items),
                                              qs.items[0].n_bytes())["us"]
            rows_out.append(r)
            print(json.dumps(r), flush=True)
        del qs
        torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    variant = os.environ.get("MU_VARIANT", "default")
    use_variant(variant)
    out = {"mu": variant, "fused": fused_products(), "model": kb.gguf_model_step_us()}
    print(variant, "model", out["model"], "ratio8", round(out["model"][8] / out["model"][1], 3), flush=True)
    Path(os.environ.get("OUT", "/tmp"), f"exp_mu_{variant}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
