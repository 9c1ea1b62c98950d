"""Experiment (kernel_notes.md v13): the host's part of the GPU's idle time between steps.

host_gaps.py measures the GPU idle before each replay of an ngram-suffix pass over the code-edit
prompts; this splits the host's side of it. Host marks (perf_counter) at: a step's result in hand
(PendingTokens.read or the chain's HostCopies.read returning), the draft (Chain.draft entry and exit),
the replay call's entry and exit; CUDA events around every replay. Per transition (V: a verify step,
C: a chained step) the medians and means of: the GPU's idle, result -> draft, the draft, draft -> replay
call, the replay call itself, and the rest (idle minus the host's time from result to replay: the
wake-up and the GPU's start). Writes host_trace_<format>.json under $OUT.
Run on a CUDA machine with the model: python benchmarks/experiments/host_trace.py gguf
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
from host_gaps import CHAINS, load_code_edits  # this folder is on the path when run as a script

from specserve.bench import greedy_decode_rate
from specserve.engine import host_copy
from specserve.speculative.base import Chain

Mark = tuple[str, float]


def patch(marks: list[Mark], kinds: dict[int, str]) -> list[tuple[object, str, object]]:
    """Wrap the functions that bound each segment; returns what to restore."""
    saved = []

    def wrap(owner: object, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if before:
                marks.append((before, time.perf_counter()))
            value = fn(*args, **kwargs)
            if after:
                marks.append((after, time.perf_counter()))
            return value

        setattr(owner, name, wrapped)

    wrap(host_copy.PendingTokens, "read", None, "result")
    wrap(host_copy.HostCopies, "read", None, "result")
    wrap(Chain, "draft", "draft0", "draft1")
    replay = torch.cuda.CUDAGraph.replay
    saved.append((torch.cuda.CUDAGraph, "replay", replay))

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks.append(("call0", time.perf_counter()))
        start.record()
        replay(graph)
        end.record()
        marks.append(("call1", time.perf_counter()))
        marks.append(("gpu", (kinds.get(id(graph), "C"), start, end)))  # type: ignore[arg-type]

    torch.cuda.CUDAGraph.replay = timed_replay
    return saved


def segments(marks: list[Mark]) -> dict[str, dict[str, float]]:
    """Per transition: the GPU's idle before a replay and, where the host waited for a result between
    the two launches, its segments from that result to the replay call."""
    out: dict[str, dict[str, list[float]]] = {}
    last: dict[str, float] = {}
    prev = None  # (kind, end event, call1) of the replay before
    for name, value in marks:
        if name != "gpu":
            last[name] = value  # type: ignore[assignment]
            continue
        kind, start, end = value  # type: ignore[misc]
        if prev is not None:
            idle = prev[1].elapsed_time(start) * 1e3
            result = last.get("result", 0.0)
            if idle < 1000 and prev[2] < result < last["call0"]:  # the host waited in between; not a new prompt
                drafted = result <= last.get("draft0", 0.0) <= last.get("draft1", 0.0) <= last["call0"]
                d0, d1 = (last["draft0"], last["draft1"]) if drafted else (result, result)
                seg = {"idle": idle, "result_to_draft": (d0 - result) * 1e6, "draft": (d1 - d0) * 1e6,
                       "draft_to_call": (last["call0"] - d1) * 1e6, "call": (last["call1"] - last["call0"]) * 1e6,
                       "rest": idle - (last["call1"] - result) * 1e6}
                acc = out.setdefault(f"{prev[0]}>{kind}", {})
                for k, v in seg.items():
                    acc.setdefault(k, []).append(v)
        prev = (kind, end, last["call1"])
    return {t: {"n": len(v["idle"]), **{f"{k}_median": round(statistics.median(x), 1) for k, x in v.items()},
                **{f"{k}_mean": round(statistics.fmean(x), 1) for k, x in v.items()}} for t, v in out.items()}


def main(weight_format: str) -> None:
    session, prompts = load_code_edits(weight_format)
    runner = session.runner
    is_eog = session.tokenizer.is_eog
    res: dict = {"format": weight_format}
    for name, factory in CHAINS.items():
        rate, stats, _ = greedy_decode_rate(runner, prompts, 128, is_eog, factory, repeat=3)
        res[name] = round(rate, 1)
        res[name + "_forwards"] = stats.target_forwards
    res["speedup"] = round(res["ngram-suffix"] / res["none"], 3)
    print(json.dumps(res), flush=True)
    kinds = {id(entry.graph): "V" for entry in runner.graphs.graphs.values()}
    marks: list[Mark] = []
    saved = patch(marks, kinds)
    try:
        greedy_decode_rate(runner, prompts, 128, is_eog, CHAINS["ngram-suffix"])
        torch.cuda.synchronize()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    res["transitions"] = segments(marks)
    for t, v in res["transitions"].items():
        print(t, json.dumps(v), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"host_trace_{weight_format}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
