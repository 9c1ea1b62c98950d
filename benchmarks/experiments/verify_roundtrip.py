"""Experiment (kernel_notes.md v11): where a verify step's round trip goes outside the GPU's work.

A greedy verify step (6 rows, random weights in the Q4_K_M layout) replayed in a loop, the host
waiting for each step's argmax before launching the next, as generate() does:

  separate  the inputs uploaded from pinned memory before the replay and the argmax copied back after
            it, each through torch (copy_, Event): the step path before v11
  in_graph  the graph's first node uploads the inputs from pinned memory, its last copies the argmax
            back; the host writes the inputs, replays, records an event and waits (cuda_graphs.py)
  runner    LocalRunner.step_argmax(...).read(): in_graph with the runner's checks and bookkeeping
  bare      replay and an event wait only (the same inputs every time, nothing read back)

Rounds of every variant in turn (the machine's noise moves between rounds); per variant the median
over rounds of the mean wall time per step against the GPU time of a replay (back to back), and the
host time of each part. Writes JSON to $OUT/verify_roundtrip.json.
Run from the repository root on a CUDA machine: python benchmarks/experiments/verify_roundtrip.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402

from specserve.engine import cuda_driver  # noqa: E402

ROWS, BASE, STEPS, ROUNDS = 6, 600, 200, 7
VARIANTS = ("separate", "in_graph", "runner", "bare")
TOKENS = [(7 * i + 3) % kb.CFG.vocab_size for i in range(ROWS)]


class Step:
    """A step graph of ROWS rows at BASE, with the copies in it or not."""

    def __init__(self, runner, in_graph: bool) -> None:  # noqa: ANN001 - LocalRunner
        dev = runner.device
        self.inputs = torch.zeros((3, ROWS), dtype=torch.long, device=dev)
        self.host_in = torch.zeros((3, ROWS), dtype=torch.long, pin_memory=True)
        self.host_out = torch.zeros(ROWS, dtype=torch.long, pin_memory=True)
        self.host_in_np, self.host_out_np = self.host_in.numpy(), self.host_out.numpy()
        self.write_inputs()
        self.inputs.copy_(self.host_in)

        def step() -> torch.Tensor:
            if in_graph:
                cuda_driver.copy_async(self.inputs, self.host_in)
            argmax = runner.graphs.forward(self.inputs[0], self.inputs[1], self.inputs[2], None).argmax(dim=-1)
            if in_graph:
                cuda_driver.copy_async(self.host_out, argmax)
            return argmax

        self.graph, self.argmax = runner.graphs.capture(step)
        self.uploaded, self.done = torch.cuda.Event(), torch.cuda.Event()

    def write_inputs(self) -> None:
        self.host_in_np[0, :] = TOKENS
        self.host_in_np[1, :] = range(BASE, BASE + ROWS)
        self.host_in_np[2, :] = 0


def loop(runner, variant: str, steps: dict[str, Step]) -> dict[str, float]:  # noqa: ANN001 - LocalRunner
    parts = {"stage": 0.0, "launch": 0.0, "wait": 0.0}
    torch.cuda.synchronize()
    t_begin = time.perf_counter()
    for _ in range(STEPS):
        t0 = time.perf_counter()
        if variant == "runner":
            t1 = time.perf_counter()
            pending = runner.step_argmax(0, TOKENS, BASE)
            t2 = time.perf_counter()
            pending.read()
            runner.kv_truncate(0, BASE)
        else:
            s = steps["separate" if variant == "separate" else "in_graph"]
            if variant == "separate":
                s.uploaded.synchronize()
                s.write_inputs()
                t1 = time.perf_counter()
                s.inputs.copy_(s.host_in, non_blocking=True)
                s.uploaded.record()
            elif variant == "in_graph":
                s.done.synchronize()
                s.write_inputs()
                t1 = time.perf_counter()
            else:
                t1 = time.perf_counter()
            s.graph.replay()
            if variant == "separate":
                s.host_out.copy_(s.argmax, non_blocking=True)
            s.done.record()
            t2 = time.perf_counter()
            s.done.synchronize()
            if variant != "bare":
                s.host_out_np.tolist()
        t3 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[name] += dt
    wall = (time.perf_counter() - t_begin) / STEPS * 1e6
    return {"wall_us": wall, **{k: v / STEPS * 1e6 for k, v in parts.items()}}


def main() -> None:
    os.environ["SPECSERVE_QUANT_KERNEL"] = "mma"
    runner = kb.make_runner("gguf_like")
    runner.warmup(17, prompt_rows=0)
    gpu_us = kb.step_gpu_us(runner, (ROWS,), BASE)[ROWS]  # also leaves BASE tokens in sequence 0
    steps = {"separate": Step(runner, False), "in_graph": Step(runner, True)}
    for name in ("separate", "in_graph"):
        loop(runner, name, steps)
    expected = runner.step_argmax(0, TOKENS, BASE).read()
    runner.kv_truncate(0, BASE)
    assert steps["separate"].host_out_np.tolist() == steps["in_graph"].host_out_np.tolist() == expected
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(ROUNDS):
        for v in VARIANTS:
            rounds[v].append(loop(runner, v, steps))
    out: dict[str, object] = {"rows": ROWS, "gpu_us": round(gpu_us, 1), "steps": STEPS, "rounds": ROUNDS,
                              "variants": {}}
    print(f"GPU us per replay (back to back): {gpu_us:.1f}")
    for v, rs in rounds.items():
        r = {k: round(statistics.median(x[k] for x in rs), 1) for k in rs[0]}
        r["idle_us"] = round(r["wall_us"] - gpu_us, 1)
        r["idle_us_rounds"] = [round(x["wall_us"] - gpu_us, 1) for x in rs]
        out["variants"][v] = r  # type: ignore[index]
        print(f"{v:9s}", json.dumps(r), flush=True)
    Path(os.environ.get("OUT", "/tmp"), "verify_roundtrip.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
