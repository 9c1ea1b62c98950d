"""What a drafting policy would give on a device, without the device: record each workload prompt's greedy text
once (on any device), then replay the texts through the real scheduler and speculators with a runner that knows
them, timing each step from a step table (the `step_ms_by_rows` of a `specserve bench` JSON, whose device the
replay's runner takes: the draft room rule follows it) plus a host gap before each step the scheduler could not
chain behind the one before.

    python benchmarks/spec_replay.py --record -m qwen2.5-coder-1.5b --device cpu --texts texts.json
    python benchmarks/spec_replay.py --texts texts.json \
        --steps benchmarks/results/bench_qwen2.5-coder-1.5b_cuda_gguf.json

Greedy speculation gives plain greedy's text, so the replay is exact in which drafts are accepted; its times
are a model (device time by row count only). Use it to compare policies, then measure the one kept.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("SPECSERVE_STEP_TRACE", str(Path(tempfile.gettempdir()) / "spec_replay_trace.json"))

import torch  # noqa: E402
from bench_output import output_path, print_table, write_json  # noqa: E402
from scheduler_sim import FakeRunner, TimedStep  # noqa: E402

from specserve import catalog  # noqa: E402
from specserve.engine.generate import generate  # noqa: E402
from specserve.engine.scheduler import Scheduler  # noqa: E402
from specserve.engine.step_trace import TRACE  # noqa: E402
from specserve.gguf.reader import GGUFFile  # noqa: E402
from specserve.gguf.tokenizer import Tokenizer  # noqa: E402
from specserve.model.batch import Batch  # noqa: E402
from specserve.model.kv_ledger import KVLedger  # noqa: E402
from specserve.speculative.base import SpecParams  # noqa: E402
from specserve.speculative.factory import build_chain  # noqa: E402
from specserve.speculative.shared_suffix import SuffixStore  # noqa: E402


class TextRunner(FakeRunner):
    """Row i's argmax is the token after its position in `text` (the recorded prompt + greedy output), or the
    end-of-generation token past it; every step is done at once (times come from the step table). A token tree's
    node answers for its depth's position: right where its branch is the text's, and never read otherwise (the
    settler walks only branches that matched)."""

    token_trees = True

    def __init__(self, vocab_size: int, eos: int, device: str, n_ctx: int = 8192):
        super().__init__([[0]], n_ctx, 0.0, 0.0)
        self.device = torch.device(device)  # the modelled one: the scheduler's draft room rule follows it
        self.vocab_size, self.eos, self.text = vocab_size, eos, [0]
        self.ledger = KVLedger(1, n_ctx, vocab_size)
        self.seq_len = self.ledger.seq_len

    def launch(self, batch: Batch, fed: list[int] | None = None, logits: bool = True) -> TimedStep:
        self.ledger.admit(batch, fed)
        layout = batch.tree_layout()
        where = batch.positions if layout is None else layout[0]
        ahead = [where[i] + 1 for i in batch.logit_rows()]
        tokens = [self.text[p] if p < len(self.text) else self.eos for p in ahead]
        return TimedStep(tokens, 0.0, self.vocab_size)


def step_ms(table: dict[int, float], rows: int) -> float:
    """The table's time for a step of `rows` rows, linear between (and past) its entries."""
    keys = sorted(table)
    i = min(max(bisect.bisect_left(keys, rows), 1), len(keys) - 1)
    a, b = keys[i - 1], keys[i]
    return table[a] + (table[b] - table[a]) * (rows - a) / (b - a)


def replay(items: list[dict], tokenizer: Tokenizer, spec: SpecParams, table: dict[int, float],
           host_gap_ms: float, device: str, shared: bool = False) -> dict[str, float]:
    """Modelled decode tok/s (the first token, from the prompt, not counted) and tokens a step over items, one
    after another (shared: with a suffix store across them, as the server keeps)."""
    assert TRACE is not None
    runner = TextRunner(tokenizer.vocab_size, tokenizer.eos_id or 0, device,
                        n_ctx=max(len(i["prompt"]) + len(i["output"]) for i in items) + 64)
    store = SuffixStore() if shared else None
    sched = Scheduler(runner, tokenizer, chain_factory=lambda s, slot: build_chain(s, None, seq=slot, shared=store))
    ms = tokens = steps = 0.0
    for item in items:
        runner.text = item["prompt"] + item["output"]
        TRACE.clear()
        gen = generate(runner, tokenizer, item["prompt"], len(item["output"]), spec=spec, scheduler=sched)
        if gen.tokens != item["output"][:len(gen.tokens)]:
            raise SystemExit("the replay's text differs from the recorded one")
        decode = [s for s in TRACE.steps if not s["prompt"]]
        for i, s in enumerate(decode):
            chained = i == 0 or ("ready" in decode[i - 1] and s["launch"] < decode[i - 1]["ready"])
            ms += step_ms(table, s["rows"]) + (0.0 if chained else host_gap_ms)
        tokens += len(gen.tokens) - 1
        steps += len(decode)
    return {"tokens_per_s": round(tokens / ms * 1e3, 1), "tokens_per_step": round(tokens / max(steps, 1), 3)}


def agent_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """edit_bench's agent conversations (workloads/agent_loop.json) with their tools, in the model's template (tool
    call arguments as objects, as the server renders them)."""
    from specserve.gguf.chat_template import apply_chat_template

    loop = json.loads((Path(__file__).parent / "workloads" / "agent_loop.json").read_text())
    prompts = []
    for conv in loop["conversations"]:
        messages = [dict(m, tool_calls=[{**c, "function": {**c["function"],
                                                           "arguments": json.loads(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]) if m.get("tool_calls") else m
                    for m in conv["messages"]]
        text = apply_chat_template(tokenizer, messages, tools=loop["tools"])
        prompts.append(tokenizer.encode(text, add_special=False))
    return prompts


def record(args: argparse.Namespace) -> None:
    from specserve.cli.session import GenerationSession
    from specserve.cli.workloads import workload_prompts

    session = GenerationSession.load(args.model, n_ctx=16384, device=args.device, weight_format=args.weight_format)
    texts: dict[str, list[dict]] = {}
    for cat in args.categories.split(","):
        prompts = (agent_prompts(session.tokenizer) if cat == "agent"
                   else workload_prompts(session.tokenizer, cat, args.prompts))
        texts[cat] = [{"prompt": p, "output": generate(session.runner, session.tokenizer, p, args.n_predict).tokens}
                      for p in prompts]
    write_json(args.texts, {"model": args.model, "device": args.device, "weight_format": args.weight_format,
                            "texts": texts})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=Path, required=True, help="recorded greedy texts (written by --record)")
    ap.add_argument("--record", action="store_true", help="record the texts with the model, then stop")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--weight-format", default="auto")
    ap.add_argument("--categories", default="code_edit,extract,chat",
                    help="prompts.json categories, and `agent`: edit_bench's agent loop")
    ap.add_argument("--prompts", default=None, help="workloads/prompts.json")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--steps", type=Path, help="a `specserve bench` JSON whose step_ms_by_rows times the steps")
    ap.add_argument("--host-gap-ms", type=float, default=0.13,
                    help="device idle before a step not chained (H200 trace: 0.13 ms after a drafted step)")
    ap.add_argument("--spec-types", default="ngram-suffix,ngram-simple",
                    help="speculative types; `TYPE+treeN`: with token trees of N nodes")
    ap.add_argument("--shared", action="store_true", help="a suffix store across a category's texts (the server's)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    if args.record:
        record(args)
        return
    if args.steps is None:
        raise SystemExit("--steps: a specserve bench JSON with step_ms_by_rows")
    recorded = json.loads(args.texts.read_text())
    bench = json.loads(args.steps.read_text())
    table = {int(k): float(v) for k, v in bench["step_ms_by_rows"].items()}
    device = torch.device(bench.get("device", "cpu")).type
    tokenizer = Tokenizer.from_gguf(GGUFFile(catalog.model_file(recorded["model"])))
    rows = []
    for cat, items in recorded["texts"].items():
        none = replay(items, tokenizer, SpecParams(n_max=0), table, args.host_gap_ms, device)
        rows.append({"category": cat, "type": "none", **none, "speedup": 1.0})
        for t in args.spec_types.split(","):
            kind, _, tree = t.partition("+tree")
            got = replay(items, tokenizer, SpecParams(type=kind, tree_nodes=int(tree or 0)), table, args.host_gap_ms,
                         device, args.shared)
            rows.append({"category": cat, "type": t, **got,
                         "speedup": round(got["tokens_per_s"] / none["tokens_per_s"], 3)})
    print_table(rows, ["category", "type", "tokens_per_s", "speedup", "tokens_per_step"])
    write_json(output_path(args.output, "spec_replay.json"),
               {"texts": str(args.texts), "steps": str(args.steps), "host_gap_ms": args.host_gap_ms, "rows": rows})


if __name__ == "__main__":
    main()
