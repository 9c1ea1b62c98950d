"""Dump the greedy outputs (token ids) of every workload prompt, for replaying drafters offline.

Writes greedy_<format>.json under $OUT: {category: [{"prompt": ids, "output": ids}, ...]}.
Run on a CUDA machine with the model: python benchmarks/experiments/dump_greedy.py gguf 256
"""

from __future__ import annotations

import json
import os
import sys

from specserve.bench import greedy_decode_rate
from specserve.session import GenerationSession
from specserve.workloads import load_workloads, workload_prompts


def main(weight_format: str, n_predict: int) -> None:
    session = GenerationSession.load("qwen2.5-coder-1.5b", n_ctx=4096, weight_format=weight_format, progress=False)
    tok = session.tokenizer
    out: dict[str, list[dict[str, list[int]]]] = {}
    for category in load_workloads(None):
        prompts = workload_prompts(tok, category)
        _, _, outputs = greedy_decode_rate(session.runner, prompts, n_predict, tok.is_eog, lambda: None)
        out[category] = [{"prompt": p, "output": o} for p, o in zip(prompts, outputs, strict=True)]
        print(category, [len(o) for o in outputs], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"greedy_{weight_format}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
