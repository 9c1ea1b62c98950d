"""A change's worth, measured against the tree before it on the same machine: two package trees alternated.

A host's speed differs from one machine to the next by more than most host-side changes are worth,
so a before / after pair is only comparable on one machine, in turns. Each run is a fresh process with its
tree first on PYTHONPATH (a tree: a directory holding specserve/, e.g. `git worktree add /tmp/before HEAD~1`).

Measures:
  code-edits   greedy tok/s of a model (qwen2.5-coder-1.5b by default) over the code-edit prompts, without
               speculation and with ngram-suffix (median of --repeat passes each), the speedup, and whether
               the two texts are the same: for host-side and end-to-end changes.
  model-steps  GPU us per graph replay of the model with random weights in the Q4_K_M layout at 1..16 rows
               (random_model.py, no model file): for kernel changes.

    python benchmarks/ab_trees.py /tmp/before . [--measure code-edits|model-steps] [--rounds 2] [-o FILE]

Both trees must provide the specserve names the measure imports (see code_edit_rates / model_step_us).
Prints one table row per run; writes JSON (-o, default ab_trees_<measure>.json in the cache's benchmarks
folder: bench_output.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "ab_trees result: "  # the line of a run's output that carries its JSON
MODEL_ROWS = (1, 2, 4, 6, 8, 9, 12, 16)


def code_edit_rates(model: str, weight_format: str, n_predict: int, repeat: int) -> dict[str, object]:
    from specserve.cli.measure import greedy_decode_rate
    from specserve.cli.session import GenerationSession
    from specserve.cli.workloads import workload_prompts
    from specserve.speculative.base import SpecParams

    session = GenerationSession.load(model, n_ctx=4096, weight_format=weight_format, progress=False)
    session.runner.warmup(17)
    tok = session.tokenizer
    prompts = workload_prompts(tok, "code_edit")
    res: dict[str, object] = {}
    outputs = {}
    for name, spec in {"none": None, "ngram-suffix": SpecParams(type="ngram-suffix")}.items():
        rate, _, outputs[name] = greedy_decode_rate(session.runner, tok, prompts, n_predict, spec=spec,
                                                    chain_factory=session.new_chain, repeat=repeat)
        res[name] = round(rate, 1)
    res["x"] = round(res["ngram-suffix"] / res["none"], 3)  # type: ignore[operator]
    res["identical"] = outputs["none"] == outputs["ngram-suffix"]
    return res


def model_step_us() -> dict[str, object]:
    from random_model import gguf_model_step_us

    return {f"us {rows}": us for rows, us in gguf_model_step_us(MODEL_ROWS).items()}


def child(args: argparse.Namespace) -> None:
    """One run in this process, under whichever specserve PYTHONPATH put first."""
    import specserve

    if args.measure == "code-edits":
        res = code_edit_rates(args.model, args.weight_format, args.n_predict, args.repeat)
    else:
        res = model_step_us()
    print(MARK + json.dumps({"where": str(Path(specserve.__file__).parent.parent), **res}), flush=True)


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, __file__, "--child", "--measure", args.measure, "-m", args.model,
           "--weight-format", args.weight_format, "-n", str(args.n_predict), "--repeat", str(args.repeat), str(tree)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    lines = proc.stdout.splitlines()
    for line in lines:
        if not line.startswith(MARK):
            print(line)
    found = [json.loads(line[len(MARK):]) for line in lines if line.startswith(MARK)]
    return found[-1] if found else {"error": f"exit status {proc.returncode}, no result"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path, help="package trees (directories holding specserve/), in turn")
    ap.add_argument("--measure", choices=("code-edits", "model-steps"), default="code-edits")
    ap.add_argument("--rounds", type=int, default=2, help="times each tree runs (alternated)")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="code-edits: the model")
    ap.add_argument("--weight-format", default="gguf", help="code-edits: as `specserve bench --weight-format`")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="code-edits: tokens per prompt")
    ap.add_argument("--repeat", type=int, default=5, help="code-edits: passes per rate (the median is kept)")
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    # imported here, not at the top: a run imports only what its measure needs from its tree
    from bench_output import output_path, print_table, write_json

    from specserve.cli.workloads import workload_path

    # a tree outside the checkout's folder would look for ../shared beside itself: every run reads these prompts
    os.environ.setdefault("SPECSERVE_WORKLOADS", str(workload_path()))
    runs = []
    for i in range(args.rounds):
        for tree in args.trees:
            print(f"=== round {i + 1}: {tree}", flush=True)
            runs.append({"round": i + 1, "tree": str(tree), **run_tree(tree.resolve(), args)})
    columns = list(dict.fromkeys(k for run in runs for k in run))  # every key, in first-seen order
    print_table(runs, columns)
    write_json(output_path(args.output, f"ab_trees_{args.measure.replace('-', '_')}.json"),
               {"measure": args.measure, "trees": [str(t) for t in args.trees], "runs": runs})


if __name__ == "__main__":
    main()
