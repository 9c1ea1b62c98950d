"""Plain greedy decoding through GreedyChain (token fed back on the device, steps queued ahead)
gives what step-by-step decoding gives: the same tokens, stop reason and kept KV length."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specserve.engine.generate import GenerationStats, generate
from specserve.engine.runner import LocalRunner
from specserve.engine.sampling import Sampler, SamplingParams

PROMPT = [1, 504, 3458, 314, 4234, 28, 9175, 30, 2193, 253, 655, 28]


class ScriptedDrafts:
    """Drafts from a known greedy continuation, right, wrong at the first token or wrong later,
    by a fixed pattern over positions (and none at some), so generation with overlap walks every
    branch: verify with nothing queued, a first token guessed wrong or right by the queued step,
    then verified or not."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int = 1000):
        self.text = prompt + reference
        self.vocab = vocab  # wrong guesses stay token ids
        self.n_prompt = len(prompt)
        self.accepted: list[int] = []  # what accept() heard after each draft
        self.right: list[int] = []  # how many leading tokens of each draft were right
        self.drafted: list[int] = []
        self.prepared: list[int] = []  # history lengths prepare() saw

    def begin(self, prompt: list[int]) -> None:
        pass

    def prepare(self, history: list[int]) -> None:
        assert history == self.text[:len(history)]  # only evaluated tokens, never a draft
        self.prepared.append(len(history))

    def draft(self, history: list[int], last_sampled: int, n_max: int, n_min: int = 0) -> list[int]:
        at = len(history) + 1  # where the draft's first token goes in self.text
        kind = (at * 2654435761 >> 8) % 6
        truth = self.text[at:at + min(n_max, 1 + at % 6)]
        if kind >= 3 or not truth:
            draft = []
        elif kind == 1:  # wrong first token
            draft = [(truth[0] + 1) % self.vocab, *truth[1:]]
        elif kind == 2 and len(truth) > 2:  # wrong third token
            draft = [*truth[:2], (truth[2] + 1) % self.vocab, *truth[3:]]
        else:
            draft = truth
        self.drafted.append(len(draft))
        if draft:
            self.right.append(next((i for i, t in enumerate(draft) if t != self.text[at + i]), len(draft)))
        return draft

    def accept(self, n_accepted: int) -> None:
        self.accepted.append(n_accepted)

    def end(self) -> None:
        pass


def greedy(runner: LocalRunner, n: int, step_by_step: bool,
           is_eog: Callable[[int], bool] = lambda t: False) -> tuple[list[int], GenerationStats, int]:
    stats = GenerationStats()
    tokens = list(generate(runner, PROMPT, n, Sampler(SamplingParams(temperature=0)), is_eog=is_eog,
                           stats=stats, overlap=not step_by_step))
    return tokens, stats, runner.seq_len[0]


@pytest.mark.parametrize("n", [1, 2, 3, 20])
def test_chained_matches_step_by_step(smollm_runner: LocalRunner, n: int) -> None:
    ref, ref_stats, ref_kv = greedy(smollm_runner, n, step_by_step=True)
    got, stats, kv = greedy(smollm_runner, n, step_by_step=False)
    assert got == ref and len(got) == n
    assert kv == ref_kv == len(PROMPT) + n - 1  # every token but the last was evaluated
    assert stats.stop_reason == ref_stats.stop_reason == "length"
    assert stats.target_forwards == ref_stats.target_forwards == n - 1


def test_chained_stops_at_end_of_generation(smollm_runner: LocalRunner) -> None:
    ref, _, _ = greedy(smollm_runner, 12, step_by_step=True)
    eog = ref[5]
    first = ref.index(eog)
    got, stats, kv = greedy(smollm_runner, 12, step_by_step=False, is_eog=lambda t: t == eog)
    assert got == ref[:first + 1]
    assert stats.stop_reason == "eog"
    assert kv == len(PROMPT) + first  # a step queued past the end-of-generation token is not kept


def test_chained_stops_at_full_context(smollm_path) -> None:
    runner = LocalRunner(smollm_path, n_ctx=len(PROMPT) + 5, device="cpu", progress=False)
    ref, ref_stats, ref_kv = greedy(runner, 50, step_by_step=True)
    got, stats, kv = greedy(runner, 50, step_by_step=False)
    assert got == ref and len(got) == 6  # the prompt's token, then one per free position
    assert stats.stop_reason == ref_stats.stop_reason == "context"
    assert kv == ref_kv == runner.n_ctx


def test_chained_consumer_stops_early(smollm_runner: LocalRunner) -> None:
    """A consumer that stops reading (a stop string, a closed stream) leaves a consistent cache."""
    ref, _, _ = greedy(smollm_runner, 10, step_by_step=True)
    gen = generate(smollm_runner, PROMPT, 10, Sampler(SamplingParams(temperature=0)))
    got = [next(gen) for _ in range(4)]
    gen.close()
    assert got == ref[:4]
    assert smollm_runner.seq_len[0] == len(PROMPT) + 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
@pytest.mark.parametrize("weight_format", ["float", "q8"])
def test_chained_graph_replays_match_step_by_step(weight_format: str) -> None:
    """On the GPU the chain is one graph replay per step (argmax and feedback captured with it), and
    a chain that restarts after verify steps (its first step uploads the token in its own graph) too."""
    import dataclasses

    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=128, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=96, vocab_size=300)
    runner = LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=3),
                                      n_ctx=256, weight_format=weight_format)
    runner.warmup(2)
    assert runner.graphs is not None
    prompt = [(7 * i + 1) % cfg.vocab_size for i in range(9)]
    for n in (2, 60):
        tokens = {}
        for step_by_step in (True, False):
            tokens[step_by_step] = list(generate(runner, prompt, n, Sampler(SamplingParams(temperature=0)),
                                                 overlap=not step_by_step))
            assert runner.seq_len[0] == len(prompt) + n - 1
        assert tokens[True] == tokens[False]
        spec = ScriptedDrafts(prompt, tokens[True], vocab=cfg.vocab_size)
        stats = GenerationStats()
        got = list(generate(runner, prompt, n, Sampler(SamplingParams(temperature=0)), speculator=spec,
                            stats=stats))
        assert got == tokens[True]
        assert spec.accepted == spec.right
        if n == 60:
            assert stats.draft_accepted > 0 and 0 in spec.drafted  # verify steps, and chained stretches after them


@pytest.mark.parametrize("n", [1, 2, 5, 40])
def test_speculative_overlap_matches_step_by_step(smollm_runner: LocalRunner, n: int) -> None:
    """Greedy speculative decoding with chained stretches gives step-by-step greedy's tokens and KV
    length, and the speculator hears how many of each draft were right."""
    ref, _, ref_kv = greedy(smollm_runner, n, step_by_step=True)
    spec = ScriptedDrafts(PROMPT, ref)
    stats = GenerationStats()
    got = list(generate(smollm_runner, PROMPT, n, Sampler(SamplingParams(temperature=0)), speculator=spec,
                        stats=stats))
    assert got == ref
    assert smollm_runner.seq_len[0] == ref_kv
    assert stats.target_forwards + stats.draft_accepted == n - 1  # each token: a step's or an accepted draft
    assert spec.accepted == spec.right  # every draft is answered once, with how much of it was right
    assert spec.prepared == sorted(spec.prepared)  # the history only grows
    if n == 40:
        assert stats.draft_accepted > 0 and stats.target_forwards < n - 1
        assert 0 in spec.accepted and max(spec.accepted) > 1


def test_speculative_overlap_consumer_stops_early(smollm_runner: LocalRunner) -> None:
    ref, _, _ = greedy(smollm_runner, 30, step_by_step=True)
    gen = generate(smollm_runner, PROMPT, 30, Sampler(SamplingParams(temperature=0)),
                   speculator=ScriptedDrafts(PROMPT, ref))
    got = [next(gen) for _ in range(13)]
    gen.close()
    assert got == ref[:13]
    # the tokens before the last one handed out were evaluated; a verify step may have kept more
    assert len(PROMPT) + 12 <= smollm_runner.seq_len[0] <= len(PROMPT) + 29
    again = list(generate(smollm_runner, PROMPT, 30, Sampler(SamplingParams(temperature=0)),
                          speculator=ScriptedDrafts(PROMPT, ref)))
    assert again == ref


def test_speculative_overlap_stops_at_full_context(smollm_path) -> None:
    runner = LocalRunner(smollm_path, n_ctx=len(PROMPT) + 9, device="cpu", progress=False)
    ref, ref_stats, ref_kv = greedy(runner, 50, step_by_step=True)
    stats = GenerationStats()
    got = list(generate(runner, PROMPT, 50, Sampler(SamplingParams(temperature=0)),
                        speculator=ScriptedDrafts(PROMPT, ref), stats=stats))
    assert got == ref and len(got) == 10
    assert stats.stop_reason == ref_stats.stop_reason == "context"
    assert runner.seq_len[0] == ref_kv == runner.n_ctx


def test_speculative_overlap_stops_at_end_of_generation(smollm_runner: LocalRunner) -> None:
    ref, _, _ = greedy(smollm_runner, 30, step_by_step=True)
    eog = ref[7]
    first = ref.index(eog)
    stats = GenerationStats()
    got = list(generate(smollm_runner, PROMPT, 30, Sampler(SamplingParams(temperature=0)), is_eog=lambda t: t == eog,
                        speculator=ScriptedDrafts(PROMPT, ref), stats=stats))
    assert got == ref[:first + 1] and stats.stop_reason == "eog"
    assert len(PROMPT) + first <= smollm_runner.seq_len[0] <= len(PROMPT) + 30  # every token before it evaluated
