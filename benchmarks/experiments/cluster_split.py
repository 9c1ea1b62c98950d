"""Experiment (kernel_notes.md v14): the products with few tiles split K across a thread-block cluster.

down (1536 x 8960) has 96 tiles of 16 output rows: one block each, 16 warps splitting K, so 96 of the
H200's 132 SMs stream its weights and each block stages all of K for every activation row. With KC
blocks per tile (a cluster, `gemv_mma`'s KC), each takes a contiguous share of K and the shares' sums
are added in rank order through distributed shared memory. Prints GPU us per fused call (as the model
runs it: down and wo add to the residual stream) for each block shape at 1..8 and 16 rows, then the
model's GPU us per graph replay (random weights in the Q4_K_M layout) with the best shapes picked for
the products that take them. Run from the repository root on an sm_90 GPU:
    python benchmarks/experiments/cluster_split.py [tiles]
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

ROWS = (1, 2, 4, 5, 6, 8, 16)
# (TILES, KSPLIT, D, KC)
SHAPES = [(1, 16, 2, 1), (1, 8, 2, 2), (1, 4, 2, 4), (1, 8, 2, 4), (1, 4, 4, 4), (2, 4, 2, 4), (1, 2, 2, 8),
          (2, 8, 2, 2), (1, 4, 2, 2)]
PRODUCTS = ("down_q4k", "down_q6k", "wo")


def label(shape: tuple[int, int, int, int]) -> str:
    tiles, ksplit, d, kc = shape
    return f"t{tiles}k{ksplit}d{d}c{kc}"


def products(names: tuple[str, ...] = PRODUCTS, shapes: list[tuple[int, int, int, int]] = SHAPES,
             rows: tuple[int, ...] = ROWS) -> dict[str, dict[str, dict[int, float | str]]]:
    blocks = {label(s): {"TILES": s[0], "KSPLIT": s[1], "D": s[2], "KC": s[3], "MINB": 0} for s in shapes}
    return {name: su.time_blocks(name, blocks, rows) for name in names}


def best(table: dict[str, dict[int, float | str]]) -> str:
    """The shape with the least time summed over 1, 5 and 6 rows (decode and the usual verify steps)."""
    def cost(label: str) -> float:
        vals = [table[label][m] for m in (1, 1, 5, 6)]
        return sum(v for v in vals if isinstance(v, float)) if all(isinstance(v, float) for v in vals) else 1e9
    return min(table, key=cost)


def model_with(picks: dict[tuple[int, int], tuple[int, int, int, int]]) -> dict[int, float]:
    """The model step with pick_mma_blocks returning picks[(n, k)] for those products' shapes."""
    original = linear_cuda.pick_mma_blocks

    def pick(n: int, k: int, rows: int = 1, clusters: bool = False) -> dict[str, int]:
        if (n, k) in picks:
            tiles, ksplit, d, kc = picks[(n, k)]
            return {"TILES": tiles, "KSPLIT": ksplit, "D": d, "MINB": 0, "KC": kc}
        return original(n, k, rows, False)

    linear_cuda.pick_mma_blocks = pick
    try:
        return kb.gguf_model_step_us((1, 2, 4, 5, 6, 8, 16))
    finally:
        linear_cuda.pick_mma_blocks = original


def tiles_main(out_dir: Path) -> None:
    """`tiles`: down with K split four ways at each tile count per block (the sums' order does not
    depend on it, so it may change with the row count), 1..16 rows, against one block per tile."""
    shapes = [(1, 16, 2, 1), *((t, 4, 2, 4) for t in (1, 2, 3, 4, 6)), *((t, 8, 2, 2) for t in (1, 2, 3, 4))]
    table = products(("down_q4k", "down_q6k"), shapes, (1, 2, 4, 6, 8, 9, 12, 16))
    (out_dir / "cluster_split_tiles.json").write_text(json.dumps(table, indent=1) + "\n")


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if sys.argv[1:] == ["tiles"]:
        tiles_main(out_dir)
        return
    table = products()
    shape = {label(s): s for s in SHAPES}
    down, wo = best(table["down_q4k"]), best(table["wo"])
    print("best: down", down, "wo", wo, flush=True)
    models = {"one block a tile": model_with({}), f"down {down}": model_with({(1536, 8960): shape[down]}),
              f"down {down}, wo {wo}": model_with({(1536, 8960): shape[down], (1536, 1536): shape[wo]})}
    for what, steps in models.items():
        print(f"model {what:32s}", " ".join(f"{v:>8}" for v in steps.values()), flush=True)
    result = {"rows": ROWS, "products": table, "model": models}
    (out_dir / "cluster_split.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
