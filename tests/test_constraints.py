"""Constrained output in-process: grammar masks, JSON schemas, and speculation under a grammar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.engine.constraints import (
    Constraint,
    GrammarCompiler,
    GrammarSource,
    masked_on_device,
    masked_on_host,
)
from specserve.engine.generate import run_task
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Chunk, Result, Task
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain

GREEDY = SamplingParams(temperature=0.0)
NO_SPEC = SpecParams(n_max=0)
YES_NO = GrammarSource("gbnf", 'root ::= " yes" | " no"')
REPEATING = "a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c"
# Letters a-e only: the ngram drafts' " f g h" are forbidden, so verification must reject them.
LETTERS = GrammarSource("gbnf", 'root ::= (" " [a-e] | ",")+')
PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


@pytest.fixture(scope="module")
def runner(smollm_path: Path) -> LocalRunner:
    return LocalRunner(smollm_path, n_seqs=2, n_ctx=256, device="cpu", progress=False)


@pytest.fixture(scope="module")
def tokenizer(runner: LocalRunner) -> Tokenizer:
    return Tokenizer.from_gguf(runner.gguf)


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(tokenizer)
    assert compiler.warm()
    return compiler


@pytest.fixture(scope="module")
def scheduler(runner: LocalRunner, tokenizer: Tokenizer) -> Scheduler:
    return Scheduler(runner, tokenizer, chain_factory=lambda s, slot: build_chain(s, None, seq=slot),
                     adaptive_drafts=False)  # (drafts must be made: the tests compare with and without)


def run(scheduler: Scheduler, tokenizer: Tokenizer, prompt: str, constraint: Constraint | None,
        n_predict: int = 24, spec: SpecParams = NO_SPEC, sampling: SamplingParams = GREEDY) -> tuple[str, Result]:
    task = Task(tokenizer.encode(prompt), sampling, spec, n_predict=n_predict, constraint=constraint)
    text = ""
    for event in run_task(scheduler, task):
        if isinstance(event, Chunk):
            text += event.text
        else:
            return text, event
    raise AssertionError("no result")


def allowed(constraint: Constraint, draft: list[int], vocab: int) -> torch.Tensor:
    """Which tokens each row allows, as booleans [rows, vocab]."""
    return torch.isfinite(constraint.apply(torch.zeros(len(draft) + 1, vocab), draft))


def check_person(value: Any) -> None:
    """PERSON's constraints, checked by hand (no jsonschema package here)."""
    assert isinstance(value, dict) and {"name", "age"} <= value.keys()
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150


def test_gbnf_gives_an_allowed_string(scheduler: Scheduler, tokenizer: Tokenizer,
                                      grammars: GrammarCompiler) -> None:
    text, result = run(scheduler, tokenizer, "Is the sky blue? Answer yes or no:", grammars.compile(YES_NO))
    assert text in (" yes", " no")
    assert result.stop_type == "eos"  # the grammar is complete: generation stops without another step


def test_json_schema_output_validates(scheduler: Scheduler, tokenizer: Tokenizer,
                                      grammars: GrammarCompiler) -> None:
    text, result = run(scheduler, tokenizer, "Write a JSON object describing a person:\n",
                       grammars.compile(GrammarSource.json_schema(PERSON)), n_predict=48)
    assert result.stop_type == "eos", text
    check_person(json.loads(text))


def test_end_of_generation_only_where_the_grammar_accepts(tokenizer: Tokenizer, grammars: GrammarCompiler) -> None:
    constraint = grammars.compile(GrammarSource("gbnf", 'root ::= "a"+'))
    a = tokenizer.encode("a", add_special=False)
    assert len(a) == 1
    eog = sorted(tokenizer.eog_ids)
    start = allowed(constraint, [], tokenizer.vocab_size)[0]
    assert start[a[0]] and not start[eog].any()
    assert constraint.advance(a) == a and not constraint.done
    after = allowed(constraint, [], tokenizer.vocab_size)[0]
    assert after[a[0]] and after[eog].all()
    assert constraint.advance([eog[0]]) == [eog[0]] and constraint.done


def test_draft_masks_walk_and_roll_back(tokenizer: Tokenizer, grammars: GrammarCompiler) -> None:
    constraint = grammars.compile(LETTERS)
    vocab = tokenizer.vocab_size
    good = tokenizer.encode(" a b", add_special=False)
    bad = tokenizer.encode(" f", add_special=False)
    before = allowed(constraint, [], vocab)
    rows = allowed(constraint, [*good, *bad, *good], vocab)
    assert torch.equal(allowed(constraint, [], vocab), before)  # the matcher is back where it was
    assert torch.equal(rows[0], before[0])
    assert all(rows[i][t] for i, t in enumerate(good))
    assert not rows[len(good)][bad[0]]  # the forbidden draft token is masked at its own row: never accepted


@pytest.mark.parametrize("vocab", [70, 64, 40])  # wider logits than the mask (padding ids), equal, narrower
def test_host_and_device_masking_agree(vocab: int) -> None:
    words = torch.tensor([[0x0000_0005, -1], [-(2**31), 0x1]], dtype=torch.int32)  # bits 0, 2 | 31, 32
    rows = torch.randn(2, vocab)
    host, device = masked_on_host(rows, words), masked_on_device(rows, words)
    assert torch.equal(host, device)
    finite = torch.isfinite(host)
    assert finite[0, :3].tolist() == [True, False, True] and finite[0, 32:min(vocab, 64)].all()
    assert finite[1].nonzero().flatten().tolist() == [31, 32][: 2 if vocab > 32 else 1]
    assert not finite[:, 64:].any()
    assert torch.equal(host[finite], rows[finite])


def test_invalid_grammars_name_the_problem(grammars: GrammarCompiler) -> None:
    with pytest.raises(SpecserveError, match="invalid grammar: .*Rule 'nope' not found"):
        grammars.compile(GrammarSource("gbnf", "root ::= nope"))
    with pytest.raises(SpecserveError, match="invalid grammar: .*No 'root' rule"):
        grammars.compile(GrammarSource("gbnf", 'answer ::= "x"'))
    with pytest.raises(SpecserveError, match="invalid grammar: "):
        grammars.compile(GrammarSource("gbnf", 'root ::= ("a"'))
    with pytest.raises(SpecserveError, match="invalid json_schema: Invalid type: wrong"):
        grammars.compile(GrammarSource.json_schema({"type": "wrong"}))
    with pytest.raises(SpecserveError, match="invalid json_schema: .*does not exist"):
        grammars.compile(GrammarSource.json_schema({"$ref": "#/$defs/missing"}))


def test_compiled_grammars_are_cached_and_states_separate(tokenizer: Tokenizer, grammars: GrammarCompiler) -> None:
    first = grammars.compile(YES_NO)
    n_cached = len(grammars._cache)
    second = grammars.compile(YES_NO)
    assert len(grammars._cache) == n_cached and YES_NO in grammars._cache
    yes = tokenizer.encode(" yes", add_special=False)
    assert first.advance(yes) == yes and first.done
    assert not second.done and allowed(second, [], tokenizer.vocab_size)[0][yes[0]]


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-suffix"])
def test_speculation_under_a_grammar_changes_nothing(scheduler: Scheduler, tokenizer: Tokenizer,
                                                     grammars: GrammarCompiler, spec_type: str) -> None:
    plain, _ = run(scheduler, tokenizer, REPEATING, grammars.compile(LETTERS))
    spec = SpecParams(type=spec_type, n_max=8, ngram_size_n=2)
    text, result = run(scheduler, tokenizer, REPEATING, grammars.compile(LETTERS), spec=spec)
    assert text == plain
    assert set(text) <= set(" abcde,")
    # Drafts were made and some were rejected (the history's f g h is forbidden).
    assert 0 < result.draft_n_accepted < result.draft_n


@pytest.mark.slow  # a second runner takes ~11 s to load here; the ngram tests cover the same verify path
def test_draft_model_under_a_grammar_changes_nothing(runner: LocalRunner, tokenizer: Tokenizer,
                                                      grammars: GrammarCompiler, smollm_path: Path) -> None:
    # The target as its own draft model (p_min 0: it drafts every time); its " f g h" drafts are forbidden.
    draft = LocalRunner(smollm_path, n_seqs=2, n_ctx=256, device="cpu", progress=False)
    sched = Scheduler(runner, tokenizer, chain_factory=lambda s, slot: build_chain(s, draft, seq=slot),
                      adaptive_drafts=False)
    plain, _ = run(sched, tokenizer, REPEATING, grammars.compile(LETTERS), n_predict=12)
    text, result = run(sched, tokenizer, REPEATING, grammars.compile(LETTERS), n_predict=12,
                       spec=SpecParams(n_max=4, p_min=0.0))
    assert text == plain and set(text) <= set(" abcde,")
    assert 0 < result.draft_n_accepted < result.draft_n


def test_sampled_speculation_under_a_grammar_changes_nothing(scheduler: Scheduler, tokenizer: Tokenizer,
                                                             grammars: GrammarCompiler) -> None:
    sampling = SamplingParams(temperature=0.8, seed=7)
    plain, _ = run(scheduler, tokenizer, REPEATING, grammars.compile(LETTERS), sampling=sampling)
    spec = SpecParams(type="ngram-simple", n_max=8, ngram_size_n=2)
    text, result = run(scheduler, tokenizer, REPEATING, grammars.compile(LETTERS), spec=spec, sampling=sampling)
    assert text == plain and set(text) <= set(" abcde,")
    assert result.draft_n > 0


def test_unconstrained_tasks_do_no_mask_work(scheduler: Scheduler, tokenizer: Tokenizer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("mask work for a task without a constraint")

    monkeypatch.setattr(Constraint, "apply", refuse)
    monkeypatch.setattr(Constraint, "advance", refuse)
    text, result = run(scheduler, tokenizer, REPEATING, None, n_predict=8,
                       spec=SpecParams(type="ngram-simple", n_max=8, ngram_size_n=2))
    assert result.n_predicted == 8 and text
