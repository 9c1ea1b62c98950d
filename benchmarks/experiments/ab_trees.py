"""Experiment helper: one tree's greedy code-edit rates, without and with ngram-suffix, for A/B runs of two
package trees in one lease (host speed differs from lease to lease by more than host-side changes).

Prints one JSON line. Run on a CUDA machine with the model, alternating the trees, e.g.:
for i in 1 2; do PYTHONPATH=old_tree python3 benchmarks/experiments/ab_trees.py old;
  PYTHONPATH=$PWD python3 benchmarks/experiments/ab_trees.py new; done
"""

from __future__ import annotations

import json
import sys

from host_gaps import CHAINS, load_code_edits

import specserve
from specserve.bench import greedy_decode_rate


def main(label: str) -> None:
    session, prompts = load_code_edits("gguf")
    tok = session.tokenizer
    res: dict[str, object] = {"tree": label, "where": specserve.__file__}
    outputs = {}
    for name, factory in CHAINS.items():
        rate, _, outputs[name] = greedy_decode_rate(session.runner, prompts, 128, tok.is_eog, factory, repeat=5)
        res[name] = round(rate, 1)
    res["x"] = round(res["ngram-suffix"] / res["none"], 3)  # type: ignore[operator]
    res["identical"] = outputs["none"] == outputs["ngram-suffix"]
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
