"""Where the benchmark scripts write their JSON, and how they print their tables.

One rule for every script: `-o FILE` writes there; without it the file goes to
$SPECSERVE_CACHE/benchmarks/ (else ~/.cache/specserve/benchmarks/), outside the checkout, so a run
never overwrites the headline results kept in benchmarks/results/ (copy a run there on purpose).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specserve import catalog


def output_path(option: str | None, default_name: str) -> Path:
    """The -o value if given, else default_name in the benchmarks folder of specserve's cache."""
    return Path(option) if option else catalog.cache_dir() / "benchmarks" / default_name


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def print_table(rows: Sequence[dict[str, object]], columns: Sequence[str]) -> None:
    """rows as aligned columns (a missing value prints as '-')."""
    cells = [[str(row.get(c, "-")) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)), flush=True)
