"""Experiment (kernel_notes.md v13): drafting policies replayed offline over dumped greedy outputs.

generate()'s speculative loop runs against a fake device that answers every step with the true greedy
tokens (dump_greedy.py's JSON), so the loop takes the same decisions as on the GPU; each pass is then
costed with a step time per row count (an H200 bench's `step_ms_by_rows`) and a GPU idle per transition
(V: a verify step, C: a chained plain step; host_trace.py's medians). Prints, per policy, the modeled
speedup over plain decoding, the forwards and the rows verified:

- ngram-suffix as it is (a k-token match drafts k + 3), with the measured idle and with the idle a
  StepSwitch would leave (step_switch.py);
- other draft lengths for short matches (k = 1: 2, 3 or 4 tokens);
- two candidates verified in one step (a tree of the latest occurrence's copy and a short copy from the
  next occurrence with another first token), outside generate(): the rows it would cost, not built.

Runs on the CPU: python benchmarks/experiments/replay_drafts.py benchmarks/results/greedy/greedy_gguf_128.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import numpy as np
import torch

from specserve.engine.generate import generate
from specserve.engine.host_copy import PendingTokens
from specserve.engine.sampling import Sampler, SamplingParams
from specserve.speculative.base import Chain, SpecParams
from specserve.speculative.ngram_suffix import TAIL, NgramSuffix

STEP_MS = {1: 1.124, 2: 1.182, 4: 1.249, 8: 1.411, 9: 1.733, 16: 1.966, 17: 2.992}  # H200, gguf (stop 17)
IDLE_MS = {"V>V": 0.050, "V>C": 0.082, "C>C": 0.010, "C>V": 0.056}  # host_trace.py, a fast-host lease
IDLE_SWITCH_MS = {"V>V": 0.025, "V>C": 0.020, "C>C": 0.010, "C>V": 0.020}  # launches armed ahead (estimate)


def step_ms(rows: int) -> float:
    """Linear between the measured row counts."""
    known = sorted(STEP_MS)
    for lo, hi in zip(known, known[1:], strict=False):
        if lo <= rows <= hi:
            return STEP_MS[lo] + (STEP_MS[hi] - STEP_MS[lo]) * (rows - lo) / (hi - lo)
    raise ValueError(f"no step time for {rows} rows")


class ReplayRunner:
    """What generate() needs of a LocalRunner, answering with the true greedy continuation `text`;
    logs each step's rows (0: a chained step)."""

    device = torch.device("cpu")
    n_ctx = 4096
    n_seqs = 1

    def __init__(self, text: list[int], vocab: int):
        self.text, self.vocab = text, vocab
        self.seq_len = [0]
        self.steps: list[int] = []

    def draft_limit(self, n_max: int) -> int:
        return min(n_max, 15)  # packed weights: 16 rows a step

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        self.seq_len[seq] = n_keep

    def forward(self, batch) -> torch.Tensor:  # noqa: ANN001 - a prompt's Batch
        last = batch.positions[-1]
        logits = torch.zeros(1, self.vocab)
        logits[0, self.text[last + 1]] = 1.0
        self.seq_len[0] = last + 1
        return logits

    def step_argmax(self, seq: int, tokens: list[int], position: int) -> PendingTokens:
        self.steps.append(len(tokens))
        self.seq_len[seq] = position + len(tokens)
        return PendingTokens(np.array(self.text[position + 1:position + 1 + len(tokens)]))

    def greedy_step(self) -> Callable[[int, int, int | None], torch.Tensor]:
        def step(seq: int, position: int, start: int | None = None) -> torch.Tensor:
            self.steps.append(0)
            self.seq_len[seq] = position + 1
            return torch.tensor([self.text[position + 1] if position + 1 < len(self.text) else 0])

        return step


class SuffixWithLengths(NgramSuffix):
    """ngram-suffix with the draft length of a k-token match given by `length(k)`."""

    def __init__(self, params: SpecParams, length: Callable[[int], int]):
        super().__init__(params)
        self.length = length

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        if self._index.unindexed(history) > TAIL:
            self._index.update(history)
        match = self._index.longest_match(history, last_sampled)
        if match is None:
            return []
        k, end = match
        n = min(n_max, self.size_m, self.length(k))
        draft = history[end + 1:end + 1 + n]
        if len(draft) < n and end + 1 + len(draft) == len(history):
            draft.append(last_sampled)
        return draft


def pass_ms(steps: list[int], idle: dict[str, float]) -> float:
    total, prev = 0.0, None
    for rows in steps:
        kind = "C" if rows == 0 else "V"
        total += step_ms(max(rows, 1)) + (idle[f"{prev}>{kind}"] if prev else 0.0)
        prev = kind
    return total


def replay(items: list[dict[str, list[int]]], n: int, chain: Callable[[], Chain | None]) -> list[list[int]]:
    """Each prompt's steps (rows; 0 for a chained step) when generating its n greedy tokens."""
    eog = {it["output"][-1] for it in items if len(it["output"]) < n}
    out = []
    for it in items:
        runner = ReplayRunner(it["prompt"] + it["output"], 1 + max(it["prompt"] + it["output"]))
        tokens = list(generate(runner, it["prompt"], n, Sampler(SamplingParams(temperature=0)),  # type: ignore[arg-type]
                               is_eog=lambda t: t in eog, speculator=chain()))
        assert tokens == it["output"][:n], "the replay left the greedy text"
        out.append(runner.steps)
    return out


def accepted(draft: list[int], truth: list[int]) -> int:
    return next((i for i, t in enumerate(draft) if i >= len(truth) or t != truth[i]), len(draft))


def occurrences(h: list[int], longest: int = 12) -> list[tuple[int, int]]:
    """(k, end) of every earlier run matching h's last k tokens (k <= longest), longest and latest first."""
    found = []
    for end in range(len(h) - 2, -1, -1):
        k = 0
        while k < longest and end - k >= 0 and h[end - k] == h[len(h) - 1 - k]:
            k += 1
        if k:
            found.append((k, end))
    return sorted(found, key=lambda x: (-x[0], -x[1]))


def tree_pass(prompt: list[int], output: list[int], n: int, second: int) -> tuple[float, int]:
    """Modeled ms and forwards of a loop that verifies the latest occurrence's copy (k + 3 tokens) and,
    when another occurrence continues differently, its copy's first `second` tokens as a second branch
    (rows: 1 + both); a position without any occurrence takes a chained step. Simpler than generate()."""
    h, j, ms, forwards = [*prompt, output[0]], 1, 0.0, 0
    while j < min(n, len(output)):
        branches: list[list[int]] = []
        for k, end in occurrences(h):
            copy = h[end + 1:end + 1 + min(15, k + 3)]
            if copy and all(copy[0] != b[0] for b in branches):
                branches.append(copy if not branches else copy[:second])
            if len(branches) == (2 if second else 1):
                break
        truth = output[j:]
        if not branches:
            ms, take = ms + step_ms(1) + IDLE_MS["C>C"], 1
        else:
            rows = 1 + sum(map(len, branches))
            right = max(accepted(b, truth) for b in branches)
            ms, take = ms + step_ms(min(rows, 17)) + IDLE_MS["V>V"], right + 1
        forwards += 1
        take = min(take, len(output) - j)
        h += output[j:j + take]
        j += take
    return ms, forwards


def main(path: str, category: str = "code_edit", n: int = 128) -> None:
    with open(path) as f:
        items = json.load(f)[category]
    plain = sum(pass_ms(s, IDLE_MS) for s in replay(items, n, lambda: None))
    params = SpecParams(type="ngram-suffix")
    rows: list[tuple[str, list[list[int]], dict[str, float]]] = []
    now = replay(items, n, lambda: Chain([NgramSuffix(params)]))
    rows += [("ngram-suffix (k + 3)", now, IDLE_MS),
             ("ngram-suffix, idle with launches armed ahead", now, IDLE_SWITCH_MS)]
    for k1 in (2, 3):
        def lengths(k: int, k1: int = k1) -> int:
            return k1 if k == 1 else k + 3

        steps = replay(items, n, lambda lengths=lengths: Chain([SuffixWithLengths(params, lengths)]))
        rows.append((f"k = 1 drafts {k1}, else k + 3", steps, IDLE_MS))
    for label, steps, idle in rows:
        flat = [r for s in steps for r in s]
        print(f"{label:48s} x{plain / sum(pass_ms(s, idle) for s in steps):.3f}  forwards {len(flat):4d}  "
              f"chained {flat.count(0):4d}  verified rows {sum(flat):4d}")
    for second in (0, 2, 15):
        ms, forwards = map(sum, zip(*(tree_pass(it["prompt"], it["output"], n, second) for it in items), strict=True))
        print(f"{'tree, second branch of ' + str(second) + ' tokens (no generate())':48s} x{plain / ms:.3f}  "
              f"forwards {forwards:4d}")


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *(int(a) for a in sys.argv[3:4]))
