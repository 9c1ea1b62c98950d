"""Experiment (kernel_notes.md v10): where greedy speculative decoding leaves the GPU idle.

On the code-edit prompts (128 tokens, the model's real file): tokens/s without speculation and with
ngram-suffix (three passes each), then one pass of each with CUDA events around every graph replay
(GPU time per replay, idle time between replays), then one ngram-suffix pass split by transition
(V: a verify step, C: a chained plain step): the GPU's idle time before a replay and the host's time
from its last event wait to the replay call. Writes host_gaps_<label>_<format>.json under $OUT.

Run from the repository root on a CUDA machine (another tree's package first on PYTHONPATH to compare):
python benchmarks/experiments/host_gaps.py after gguf
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from specserve.bench import bench_step, greedy_decode_rate
from specserve.gguf.chat_template import apply_chat_template
from specserve.session import GenerationSession
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from specserve.workloads import load_workloads

# the code edits' rates are compared without speculation and with ngram-suffix
CHAINS = {"none": lambda: None, "ngram-suffix": lambda: build_chain(SpecParams(type="ngram-suffix"))}


def load_code_edits(weight_format: str) -> tuple[GenerationSession, list[list[int]]]:
    """The model with its graphs captured, and the code-edit prompts' tokens (encoded here rather than by
    specserve.workloads.workload_prompts, so that ab_trees.py can run trees from before it)."""
    session = GenerationSession.load("qwen2.5-coder-1.5b", n_ctx=4096, weight_format=weight_format, progress=False)
    session.runner.warmup(17)
    tok = session.tokenizer
    prompts = [tok.encode(apply_chat_template(tok, m), add_special=False) for m in load_workloads(None)["code_edit"]]
    return session, prompts


def main(label: str, weight_format: str) -> None:
    session, prompts = load_code_edits(weight_format)
    runner = session.runner
    is_eog = session.tokenizer.is_eog
    res: dict = {"label": label, "format": weight_format,
                 "steps_ms": {n: round(bench_step(runner, n) * 1e3, 3) for n in (1, 2, 4, 5, 6, 8)}}
    outputs = {}
    for _ in range(3):
        for name, factory in CHAINS.items():
            rate, stats, outputs[name] = greedy_decode_rate(runner, prompts, 128, is_eog, factory)
            res.setdefault(name, []).append(round(rate, 1))
            res[name + "_tok_fwd"] = round(stats.generated / stats.target_forwards, 3)
    res["identical"] = outputs["none"] == outputs["ngram-suffix"]
    res["speedup_best"] = round(max(res["ngram-suffix"]) / max(res["none"]), 3)
    print(json.dumps(res), flush=True)

    replay, synchronize = torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize
    kinds = {id(entry[0]): str(key[0]) for key, entry in runner.graphs.graphs.items()}  # the rest: chained steps
    marks: list[tuple[str, float, torch.cuda.Event, torch.cuda.Event]] = []
    last_wait = [0.0]

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
        called = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        marks.append(("V" if id(graph) in kinds else "C", called - last_wait[0], start, end))

    def timed_synchronize(event: torch.cuda.Event) -> None:
        synchronize(event)
        last_wait[0] = time.perf_counter()

    torch.cuda.CUDAGraph.replay = timed_replay
    torch.cuda.Event.synchronize = timed_synchronize
    try:
        profile = {}
        for name, factory in CHAINS.items():
            marks.clear()
            rate, _, _ = greedy_decode_rate(runner, prompts, 128, is_eog, factory)
            torch.cuda.synchronize()
            busy = sum(s.elapsed_time(e) for _, _, s, e in marks)
            gaps = [marks[i][3].elapsed_time(marks[i + 1][2]) for i in range(len(marks) - 1)]
            idle = sum(g for g in gaps if g < 1.0)  # a ms or more: between prompts
            profile[name] = {"rate": round(rate, 1), "replays": len(marks),
                             "busy_per_replay_us": round(busy / len(marks) * 1e3, 1),
                             "idle_per_replay_us": round(idle / len(marks) * 1e3, 1)}
            if name == "ngram-suffix":
                by_kind: dict[str, list[float]] = {}
                for prev, cur, gap in zip(marks, marks[1:], gaps, strict=False):
                    if gap < 1.0:
                        acc = by_kind.setdefault(f"{prev[0]}>{cur[0]}", [0, 0.0, 0.0])
                        acc[0] += 1
                        acc[1] += gap * 1e3
                        acc[2] += cur[1] * 1e6
                res["transitions"] = {k: {"n": n, "gpu_idle_us": round(g / n, 1), "host_since_wait_us": round(h / n, 1)}
                                      for k, (n, g, h) in by_kind.items()}
    finally:
        torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize = replay, synchronize
    res["profile"] = profile
    print(json.dumps(profile), json.dumps(res.get("transitions")), flush=True)
    out = os.path.join(os.environ.get("OUT", "."), f"host_gaps_{label}_{weight_format}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
