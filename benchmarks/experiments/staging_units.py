"""Experiment (kernel_notes.md v11): how the tensor-core kernel stages few activation rows (2-8).

The staging rule (MU rows per pass, RU units of 8 activations per thread and row) was tuned at 1, 2, 8
and 9 rows. Real-file steps of 2 and 3 rows cost more than 4 (1.377 / 1.519 / 1.344 ms, v9), and the
output matrix more at 2 rows than at 8 (131 / 120 us, v8): both take RU = 2. Variants, each in its own
process (the source is swapped before anything builds):

  current  the source as it is (v11: one unit a thread; 2 rows a pass under a 64-register bound, 8 where
           registers are unbounded, else 4)
  default  the rule of v8
  ru1      one unit per thread and pass always
  mu2      at most 2 rows per pass, one unit
  mu1      one row per pass (the one-row kernel's registers, M passes)
  row0     (timing only, wrong sums) the current source staging only the first row: what staging
           the other rows costs
The middle four swap the rules of the source before v11 (commit ab1882b's linear_cuda.py); v11 has no RU.

Prints and writes the fused products at 1..8 rows and the model's GPU us per graph replay (random
weights in the Q4_K_M layout). Run from the repository root on a CUDA machine:
    python benchmarks/experiments/staging_units.py [variant ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402

from specserve.kernels import linear_cuda  # noqa: E402

MU_RULE = "#define MU (SILU || NORM || M > 8 ? (M < 4 ? M : 4) : (M < 8 ? M : 8))"
RU_RULE = "#define RU (MU == 2 || MU == 3 ? 2 : 1)"
VARIANTS: dict[str, tuple[str, str] | None] = {
    "current": None,
    "default": (MU_RULE, RU_RULE),
    "ru1": (MU_RULE, "#define RU 1"),
    "mu2": ("#define MU (M < 2 ? M : 2)", "#define RU 1"),
    "mu1": ("#define MU 1", "#define RU 1"),
    "row0": None,
}
CURRENT_MU = ("#define MU (REGS <= 64 ? (M < 2 ? M : 2) : M > 8 || SILU || (REGS < 128 && NORM) ? (M < 4 ? M : 4) "
              ": (M < 8 ? M : 8))")
STAGE_LOOP = "for (int m0 = 0; m0 < M; m0 += MU)"
ROWS = tuple(range(1, 9))
PRODUCTS = ("gate_up", "down_q4k", "down_q6k", "wqkv", "wqkv_mixed", "wo", "output")


def use_variant(name: str) -> None:
    if name == "row0":
        source, names = linear_cuda.KERNELS["gemv_mma"]
        assert STAGE_LOOP in source and CURRENT_MU in source
        source = source.replace(STAGE_LOOP, "for (int m0 = 0; m0 < 1; m0 += MU)").replace(CURRENT_MU, "#define MU 1")
        linear_cuda.KERNELS["gemv_mma"] = (source, names)
    if VARIANTS[name] is None:
        return
    source, names = linear_cuda.KERNELS["gemv_mma"]
    assert MU_RULE in source and RU_RULE in source, "these variants patch the source before v11 (ab1882b)"
    mu, ru = VARIANTS[name]
    linear_cuda.KERNELS["gemv_mma"] = (source.replace(MU_RULE, mu).replace(RU_RULE, ru), names)


def time_blocks(name: str, shapes: dict[str, dict[str, int] | None],
                rows: tuple[int, ...]) -> dict[str, dict[int, float | str]]:
    """GPU us per call of product `name` (as the fused path runs it) at each row count, for each labelled
    block shape (None: what the kernel picks)."""
    n, k, _silu, bits, group = kb.MATRICES[name]
    qs = kb.Rotation(kb.quant_copies(n, k, bits, group))
    calls = {m: kb.fused_call(name, m, qs, k) for m in rows}
    out: dict[str, dict[int, float | str]] = {}
    for label, blocks in shapes.items():
        kb.prebuild_calls([lambda c=c, b=blocks: c(b) for c in calls.values()])
        out[label] = {m: kb.timed(lambda c=c, b=blocks: c(b), 2 * len(qs.items), qs.items[0].n_bytes())["us"]
                      for m, c in calls.items()}
        print(f"{name:10s} {label:12s}", " ".join(f"{v:>8}" for v in out[label].values()), flush=True)
    del qs, calls
    torch.cuda.empty_cache()
    return out


def fused_products(rows: tuple[int, ...] = ROWS) -> dict[str, dict[int, float | str]]:
    """GPU us per call of each fused product at each row count (the variant in use)."""
    return {name: time_blocks(name, {"picked": None}, rows)["picked"] for name in PRODUCTS}


def run_one(variant: str, out_dir: Path) -> None:
    use_variant(variant)
    result = {"variant": variant, "fused": fused_products(), "model": kb.gguf_model_step_us((*ROWS, 9, 16))}
    print(variant, "model", result["model"], flush=True)
    (out_dir / f"staging_units_{variant}.json").write_text(json.dumps(result, indent=1) + "\n")


def compare(script: str, prefix: str, variants: list[str], rows: tuple[int, ...]) -> None:
    """Runs `script VARIANT` once per variant (one process each: builds are cached per key, whatever the
    source; each writes $OUT/{prefix}_{variant}.json), then prints their products and model steps side by side."""
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    for v in variants:
        subprocess.run([sys.executable, script, v], check=False)
    table = {v: json.loads((out_dir / f"{prefix}_{v}.json").read_text()) for v in variants
             if (out_dir / f"{prefix}_{v}.json").exists()}
    print("\nGPU us per call / per model step, rows", rows)
    for what in (*PRODUCTS, "model"):
        for v, res in table.items():
            vals = res["model"] if what == "model" else res["fused"][what]
            print(f"{what:11s} {v:8s}", " ".join(f"{vals[str(m)]:>8}" for m in rows))


def experiment_main(run_variant: Callable[[str, Path], None], script: str, prefix: str, variants: Iterable[str],
                    rows: tuple[int, ...]) -> None:
    """An experiment's command line: one variant named, run it in this process; else each variant (all by
    default) in its own, then the table (`compare`)."""
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = sys.argv[1:] or list(variants)
    if len(chosen) == 1:
        run_variant(chosen[0], out_dir)
    else:
        compare(script, prefix, chosen, rows)


def main() -> None:
    experiment_main(run_one, __file__, "staging_units", VARIANTS, ROWS)


if __name__ == "__main__":
    main()
