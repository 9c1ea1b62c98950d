"""Summarise scheduler step traces (SPECSERVE_STEP_TRACE=<file>, specserve/engine/step_trace.py) side by side:
for each kind of step (prompt, plain decode, drafted), the median host and device times of its phases. Run the
same workload through `specserve bench` and through `specserve serve` with a trace each to see where a
step's time differs.

    python benchmarks/step_trace.py bench.json serve.json [-o summary.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Each phase as (name, start mark, end mark): host milliseconds between two marks of one step.
PHASES = [("plan", "plan", "launch"), ("launch", "launch", "launched"), ("to wait", "launched", "wait"),
          ("wait", "wait", "ready"), ("settle+emit", "ready", "emitted")]


def kind(step: dict) -> str:
    return "prompt" if step["prompt"] else "drafted" if step["drafted"] else "plain"


def summarise(steps: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, step in enumerate(steps):
        if i + 1 < len(steps):
            step["interval"] = (steps[i + 1]["launch"] - step["launch"]) * 1e3
    for k in ("plain", "drafted", "prompt"):
        chosen = [s for s in steps if kind(s) == k]
        if not chosen:
            continue
        row: dict[str, float] = {"steps": len(chosen), "rows": statistics.median(s["rows"] for s in chosen)}
        for name, a, b in PHASES:
            values = [(s[b] - s[a]) * 1e3 for s in chosen if a in s and b in s and s[a] > 0]
            if values:
                row[name] = statistics.median(values)
        for name in ("device_ms", "idle_before_ms", "interval"):
            values = [s[name] for s in chosen if name in s]
            if values:
                row[name.removesuffix("_ms")] = statistics.median(values)
        out[k] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args()
    result = {p.stem: summarise(json.loads(p.read_text())["steps"]) for p in args.traces}
    columns = ["steps", "rows", *(name for name, _, _ in PHASES), "device", "idle_before", "interval"]
    print("median ms a step (rows: median rows)")
    print(f"{'trace':<16} {'kind':<8} " + " ".join(f"{c:>11}" for c in columns))
    for name, kinds in result.items():
        for k, row in kinds.items():
            cells = [f"{row[c]:>11.3f}" if c in row else f"{'-':>11}" for c in columns]
            print(f"{name:<16} {k:<8} " + " ".join(cells))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
